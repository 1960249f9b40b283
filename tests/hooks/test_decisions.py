"""The hook's I/O-free pieces: settings, retry decisions, resumable lines, pages, the lost-create lookup.

Each is driven here directly, without a client: the sync and async hook loops only feed them.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import (
    BatchApiConnectionError,
    BatchApiResponseError,
    BatchApiServerError,
    ConfigurationError,
)
from airflow_batch_provider.hooks.attempts import AmbiguousCreate, Restarts, Retries, SendOnce
from airflow_batch_provider.hooks.create import newest_created
from airflow_batch_provider.hooks.lines import ResumableLines
from airflow_batch_provider.hooks.results import Pages
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.hooks.settings import BatchApiSettings, settings_from_connection
from airflow_batch_provider.models import Batch, BatchState

LOG = logging.getLogger(__name__)
POLICY = RetryPolicy(max_retries=2, backoff_initial=0.0, backoff_max=0.0)
SETTINGS = BatchApiSettings(
    conn_id="c", base_url="http://vendor.test/v1", dialect=get_dialect("openai"), api_key="sk-x", retry=POLICY
)
REQUEST = httpx.Request("POST", "http://vendor.test/v1/batches")


def answer(status: int) -> httpx.Response:
    response = httpx.Response(status, json={"error": {"message": "no"}}, request=REQUEST)
    response.read()
    return response


def test_settings_from_connection_fields_and_overrides() -> None:
    conn = SimpleNamespace(host="vendor.test", port=8443, schema=None, password="sk-secret")
    extra = {"extra__batch_api__dialect": "xai", "timeout": "", "headers": '{"X-Api-Token": "t"}'}
    settings = settings_from_connection("c", conn, extra, conn_type="batch_api", timeout=5.0, max_retries=1)
    assert settings.base_url == "https://vendor.test:8443/v1"
    assert settings.dialect.name == "xai" and settings.timeout == 5.0 and settings.retry.max_retries == 1
    assert set(settings.secrets) == {"sk-secret", "t"}
    with pytest.raises(ConfigurationError, match="'headers' is not a JSON object"):
        settings_from_connection("c", conn, {"headers": "{"}, conn_type="batch_api")


@pytest.mark.parametrize("decide", [Retries, SendOnce])
def test_unsent_or_refused_attempts_are_retried_by_both(decide: type[Retries]) -> None:
    retries = decide(SETTINGS, "creating", None, LOG)
    assert retries.transport_failed(httpx.ConnectError("refused")) == 0.0
    assert retries.status_failed(answer(429)) == 0.0
    with pytest.raises(BatchApiConnectionError):  # the budget (2) is spent
        retries.transport_failed(httpx.ConnectError("refused"))


def test_an_ambiguous_failure_is_retried_only_when_idempotent() -> None:
    assert Retries(SETTINGS, "getting", None, LOG).transport_failed(httpx.ReadTimeout("slow")) == 0.0
    assert Retries(SETTINGS, "getting", None, LOG).status_failed(answer(502)) == 0.0
    with pytest.raises(AmbiguousCreate) as caught:
        SendOnce(SETTINGS, "creating", None, LOG).transport_failed(httpx.ReadTimeout("slow"))
    assert isinstance(caught.value.error, BatchApiConnectionError) and caught.value.response is None
    with pytest.raises(AmbiguousCreate) as caught:
        SendOnce(SETTINGS, "creating", None, LOG).status_failed(answer(502))
    assert isinstance(caught.value.error, BatchApiServerError) and caught.value.response is not None


def test_restarts_of_a_stream_are_bounded() -> None:
    restarts = Restarts(SETTINGS, "downloading", LOG)
    assert [restarts.dropped(httpx.ReadError("drop")) for _ in range(2)] == [0.0, 0.0]
    with pytest.raises(BatchApiConnectionError, match="downloading"):
        restarts.dropped(httpx.ReadError("drop"))


def test_resumed_lines_are_given_once_in_order() -> None:
    lines = ResumableLines(SETTINGS, "file-1", LOG)
    content = b'{"n": 1}\n\n{"n": 3}\n{"n": 4}'
    lines.attempt()
    got = [*lines.feed(content[:12])]  # line 1 and the first bytes of line 3
    assert lines.dropped(httpx.ReadError("drop")) == 0.0
    lines.attempt()  # the file again from its first byte
    got += [*lines.feed(content[:5]), *lines.feed(content[5:]), *lines.end()]
    assert got == [(1, {"n": 1}), (3, {"n": 3}), (4, {"n": 4})]


def test_lenient_lines_give_the_bad_line_instead_of_raising() -> None:
    strict = ResumableLines(SETTINGS, "file-1", LOG)
    strict.attempt()
    with pytest.raises(BatchApiResponseError, match="line 1"):
        list(strict.feed(b'{"custom_id": "a", \n'))
    lenient = ResumableLines(SETTINGS, "file-1", LOG, lenient=True)
    lenient.attempt()
    [(number, bad)] = lenient.feed(b'{"custom_id": "a", \n')
    assert number == 1 and bad.custom_id == "a"


def test_pages_stop_at_the_limit_and_refuse_a_looping_cursor() -> None:
    pages = Pages("listing", {"after": None}, limit=3)
    assert pages.take([1, 2], {"after": "b"}) == [1, 2]
    pages.turn()
    assert pages.take([3, 4], {"after": "d"}) == [3] and pages.params is not None
    pages.turn()
    assert pages.params is None
    looping = Pages("listing", {"after": "a"})
    looping.take([1], {"after": "b"})
    looping.turn()
    looping.take([2], {"after": "a"})
    with pytest.raises(BatchApiResponseError, match="already returned"):
        looping.turn()
    with pytest.raises(BatchApiResponseError, match="more result lines"):
        Pages("reading", {}, most=1).take([1, 2], None)


def batch(batch_id: str, created: int | None, file_id: str | None = "file-1", **fields: Any) -> Batch:
    when = datetime.fromtimestamp(created, timezone.utc) if created is not None else None
    return Batch(id=batch_id, state=BatchState.IN_PROGRESS, input_file_id=file_id, created_at=when, **fields)


def test_newest_created_is_the_one_lookup() -> None:
    found = [
        batch("undated", None),
        batch("other-file", 300, "file-2"),
        batch("old", 100),
        batch("new", 200),
        batch("unknown-file", 150, None),
    ]

    def newest(*args: Any, **kwargs: Any) -> str | None:
        chosen = newest_created(*args, **kwargs)
        return chosen.id if chosen is not None else None

    assert newest(found, input_file_id="file-1") == "new"
    assert newest(found) == "other-file"
    assert newest(found, input_file_id="file-1", accept=lambda b: b.id != "new") == "unknown-file"
    assert newest(found[:1], input_file_id="file-1") == "undated"
    assert newest(found[1:4], input_file_id="file-3") is None  # each names another file
