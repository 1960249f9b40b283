"""The retry policy: which failures are retried and how long to wait."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
import pytest

from airflow_batch_provider.hooks.retry import (
    NOT_SENT_ERRORS,
    REFUSED_STATUS,
    RetryPolicy,
    is_retryable_status,
    retry_after_seconds,
)

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500"}, 1.5),
        ({"Retry-After-Ms": "20", "Retry-After": "9"}, 0.02),  # ms wins
        ({"retry-after": "7"}, 7.0),
        ({"Retry-After": "0.25"}, 0.25),
        ({"retry-after": "Mon, 30 Nov 2026 12:00:30 GMT"}, 30.0),
        ({"retry-after": "Mon, 30 Nov 2026 11:00:00 GMT"}, 0.0),  # a date in the past: go now
        ({"retry-after": "soon"}, None),
        ({"retry-after-ms": "x", "retry-after": "2"}, 2.0),
        # Not a usable wait: treated as absent, so the caller backs off on its own.
        ({"retry-after": "-3"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "NaN"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "-Infinity"}, None),
        ({"retry-after": "1e400"}, None),
        ({"retry-after": "1e12"}, None),
        ({"retry-after": "Mon, 30 Nov 2099 12:00:00 GMT"}, None),
        ({"retry-after-ms": "nan"}, None),
        ({"retry-after-ms": "inf", "retry-after": "nan"}, None),
        ({"retry-after-ms": "-5"}, None),
        ({"retry-after-ms": "nan", "retry-after": "2"}, 2.0),
        ({}, None),
    ],
)
def test_retry_after_seconds(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after_seconds(headers, now=NOW) == expected


def test_delay_honours_then_caps_retry_after() -> None:
    policy = RetryPolicy(retry_after_max=10)
    request = httpx.Request("GET", "http://x")
    assert policy.delay(0, httpx.Response(429, headers={"retry-after": "3"}, request=request)) == 3.0
    assert policy.delay(0, httpx.Response(429, headers={"retry-after": "300"}, request=request)) == 10.0


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy = RetryPolicy(backoff_initial=0.5, backoff_max=4.0)
    for retry, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        waits = [policy.backoff(retry) for _ in range(200)]
        assert all(0 <= w <= ceiling for w in waits)
        # Full jitter spreads waits over the whole range, not just near the cap.
        assert min(waits) < ceiling / 2 < max(waits)


def test_delay_without_header_is_backoff() -> None:
    policy = RetryPolicy(backoff_initial=0.1, backoff_max=0.1)
    response = httpx.Response(503, request=httpx.Request("GET", "http://x"))
    assert 0 <= policy.delay(2, response) <= 0.1


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 599])
def test_retryable_statuses(status: int) -> None:
    assert is_retryable_status(status)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_final_statuses(status: int) -> None:
    assert not is_retryable_status(status)


def test_only_provably_unsent_failures_are_safe_for_create() -> None:
    assert {408, 429} == REFUSED_STATUS
    assert httpx.ConnectError in NOT_SENT_ERRORS
    assert httpx.ReadTimeout not in NOT_SENT_ERRORS
    assert httpx.RemoteProtocolError not in NOT_SENT_ERRORS


def test_policy_from_extra() -> None:
    policy = RetryPolicy.from_extra({"max_retries": "5", "backoff_initial": 0.1, "retry_after_max": 2})
    assert policy == RetryPolicy(max_retries=5, backoff_initial=0.1, backoff_max=8.0, retry_after_max=2.0)
    assert RetryPolicy.from_extra({"max_retries": 5}, max_retries=1).max_retries == 1
    with pytest.raises(ValueError, match="backoff_max"):
        RetryPolicy.from_extra({"backoff_max": "fast"})
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
