"""Retry policy of the batch API client: which failures to retry and how long to wait.

The rules follow the vendors' own SDKs: connection errors, timeouts, 408, 409, 429 and
5xx are retried a bounded number of times; a ``retry-after-ms`` or ``retry-after``
header (seconds or an HTTP date) is honoured up to a cap, otherwise the wait is an
exponential backoff with full jitter.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from airflow_batch_provider.hooks.connection_form import DEFAULT_MAX_RETRIES

# Statuses worth another try: the server asked us to come back (408, 429), a concurrent
# change conflicted (409), or the server or a proxy in front of it broke (5xx).
RETRYABLE_STATUS = frozenset({408, 409, 429})

# Statuses by which the server says it refused the request without acting on it, so
# repeating even a non-idempotent POST cannot create a duplicate.
REFUSED_STATUS = frozenset({408, 429})

# Transport errors raised before a single byte of the request left this machine: the
# request cannot have reached the server.
NOT_SENT_ERRORS: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

# Every transport failure worth retrying for an idempotent request.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError,)


def is_retryable_status(status_code: int) -> bool:
    """Whether an HTTP status is worth another try."""
    return status_code in RETRYABLE_STATUS or status_code >= 500


@dataclass(frozen=True)
class RetryPolicy:
    """How many times and how long to retry a failed call.

    :param max_retries: retries after the first attempt (0 disables retrying).
    :param backoff_initial: first backoff ceiling in seconds; doubles every retry.
    :param backoff_max: largest backoff ceiling in seconds.
    :param retry_after_max: largest wait taken from a ``Retry-After`` header; a longer
        request is capped to this (the next attempt will be told again if it is too early).
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    backoff_initial: float = 0.5
    backoff_max: float = 8.0
    retry_after_max: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_initial < 0 or self.backoff_max < 0 or self.retry_after_max < 0:
            raise ValueError("backoff_initial, backoff_max and retry_after_max must be >= 0")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], max_retries: int | None = None) -> RetryPolicy:
        """Build the policy from connection extras; an explicit ``max_retries`` wins."""
        default = cls()

        def number(key: str, fallback: float) -> float:
            value = extra.get(key)
            if value in (None, ""):
                return fallback
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ValueError(f"connection extra {key!r} must be a number, got {value!r}") from None

        retries = max_retries if max_retries is not None else int(number("max_retries", default.max_retries))
        return cls(
            max_retries=retries,
            backoff_initial=number("backoff_initial", default.backoff_initial),
            backoff_max=number("backoff_max", default.backoff_max),
            retry_after_max=number("retry_after_max", default.retry_after_max),
        )

    def backoff(self, retry: int) -> float:
        """Full-jitter exponential backoff for the ``retry``-th retry (0-based)."""
        ceiling = min(self.backoff_max, self.backoff_initial * (2**retry))
        # Full jitter spreads clients that failed together, so they do not retry together.
        return random.uniform(0, ceiling)

    def delay(self, retry: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait before the next attempt: the server's word if it gave one, else backoff."""
        if response is not None:
            asked = retry_after_seconds(response.headers)
            if asked is not None:
                return min(asked, self.retry_after_max)
        return self.backoff(retry)

    def settle_delay(self, retry: int, response: httpx.Response | None = None) -> float:
        """How long to let an ambiguous create settle before looking for the batch it may have made.

        Never less than ``backoff_max``: after a read timeout the vendor is often still creating
        the batch, and a listing taken a jittered fraction of a second later would miss it.
        """
        return max(self.delay(retry, response), self.backoff_max)


# A Retry-After asking for longer than this is not a plan but garbage (or a hostile server).
MAX_RETRY_AFTER_HEADER = 86_400.0


def _sane_wait(seconds: float) -> float | None:
    """``seconds`` if it is a usable wait (finite, not negative, at most a day), else None."""
    if math.isfinite(seconds) and 0.0 <= seconds <= MAX_RETRY_AFTER_HEADER:
        return seconds
    return None


def retry_after_seconds(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """Seconds asked by ``retry-after-ms`` or ``retry-after`` (seconds or HTTP date), else None.

    A value that is not a usable wait (``nan``, ``inf``, negative, over a day, text) counts as
    absent, so the caller falls back to its own backoff; a past HTTP date means "now" (0).
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    millis = lowered.get("retry-after-ms")
    if millis is not None:
        try:
            asked = _sane_wait(float(millis) / 1000.0)
        except ValueError:
            asked = None
        if asked is not None:
            return asked
    value = lowered.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return _sane_wait(float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    current = now or datetime.now(timezone.utc)
    return _sane_wait(max((when - current).total_seconds(), 0.0))
