"""Edge cases of BatchApiHook over httpx.MockTransport: what a live server cannot easily produce."""

from __future__ import annotations

import email.parser
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.exceptions import (
    BatchApiAuthError,
    BatchApiBadRequestError,
    BatchApiConnectionError,
    BatchApiError,
    BatchApiNotFoundError,
    BatchApiQuotaError,
    BatchApiRateLimitError,
    BatchApiResponseError,
    BatchApiServerError,
    ConfigurationError,
    JsonlValidationError,
    UnknownBatchStatusError,
)
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.settings import normalize_base_url
from airflow_batch_provider.models import BatchState
from tests.fixtures.hook import FAST, SECRET, openai_batch


def json_response(status: int, data: Any, **headers: str) -> httpx.Response:
    return httpx.Response(
        status, content=orjson.dumps(data), headers={"content-type": "application/json", **headers}
    )


class DroppingStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that sends some bytes and then loses the connection."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def __aiter__(self):  # type: ignore[override]
        for chunk in self.chunks:
            yield chunk
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


# ---- settings and connection --------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "schema", "expected"),
    [
        ("http://127.0.0.1:8000/v1", None, None, "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000", None, None, "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/", None, None, "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/v1/", None, None, "http://127.0.0.1:8000/v1"),
        ("api.example.com", 8443, "v2", "https://api.example.com:8443/v2"),
        ("https://gw.example.com/openai/v1", 9999, None, "https://gw.example.com:9999/openai/v1"),
        ("", None, None, "https://api.openai.com/v1"),
    ],
)
def test_normalize_base_url(host: str, port: int | None, schema: str | None, expected: str) -> None:
    assert normalize_base_url(host, port=port, schema=schema, default="https://api.openai.com/v1") == expected


def test_normalize_base_url_rejects_garbage() -> None:
    with pytest.raises(ConfigurationError, match="not a URL"):
        normalize_base_url("http://", default="https://api.openai.com/v1")


def test_settings_from_connection(batch_conn) -> None:
    conn_id = batch_conn(
        "batch_settings",
        host="http://127.0.0.1:9/",
        dialect="zerogpu",
        project="proj-7",
        headers={"X-Trace": "abc"},
        timeout=12,
        max_retries=5,
        backoff_initial=0.25,
    )
    hook = BatchApiHook(conn_id)
    settings = hook.get_settings()
    assert settings.base_url == "http://127.0.0.1:9/v1"
    assert hook.dialect.name == "zerogpu"
    assert settings.timeout == 12.0
    assert settings.retry.max_retries == 5
    assert settings.retry.backoff_initial == 0.25
    headers = settings.client_headers()
    assert headers["x-api-key"] == SECRET
    assert headers["x-project-id"] == "proj-7"
    assert headers["X-Trace"] == "abc"
    assert "Authorization" not in headers


def test_arguments_override_connection(batch_conn) -> None:
    conn_id = batch_conn("batch_override", dialect="zerogpu", timeout=12, max_retries=5)
    hook = BatchApiHook(conn_id, dialect="xai", timeout=3, max_retries=0)
    settings = hook.get_settings()
    assert settings.dialect.name == "xai"
    assert settings.timeout == 3.0
    assert settings.retry.max_retries == 0


def test_prefixed_and_empty_form_fields_are_read(monkeypatch) -> None:
    extra = {"extra__batch_api__dialect": "xai", "extra__batch_api__timeout": "", "project": None}
    conn = {"conn_type": "batch_api", "host": "http://h/v1", "password": "k", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_PREFIXED", json.dumps(conn))
    settings = BatchApiHook("batch_prefixed").get_settings()
    assert settings.dialect.name == "xai"
    assert settings.timeout == 60.0


def test_bad_extra_is_a_configuration_error(batch_conn) -> None:
    with pytest.raises(ConfigurationError, match="max_retries"):
        BatchApiHook(batch_conn("batch_bad", max_retries="lots")).get_settings()
    with pytest.raises(ConfigurationError, match="headers"):
        BatchApiHook(batch_conn("batch_bad2", headers="{not json")).get_settings()


@pytest.mark.parametrize("value", ["lots", 0, -5, 1.5, True, [1]])
def test_bad_download_cap_is_a_configuration_error(batch_conn, value: Any) -> None:
    with pytest.raises(ConfigurationError, match="'batch_cap'.*'max_download_bytes' must be a whole number"):
        BatchApiHook(batch_conn("batch_cap", max_download_bytes=value)).get_settings()


@pytest.mark.parametrize("value", ["yes", 1, "on"])
def test_bad_private_redirects_flag_is_a_configuration_error(batch_conn, value: Any) -> None:
    with pytest.raises(
        ConfigurationError, match="'batch_flag'.*'allow_private_redirects' must be true or false"
    ):
        BatchApiHook(batch_conn("batch_flag", allow_private_redirects=value)).get_settings()


def test_private_redirects_flag_is_read_from_the_extra(batch_conn) -> None:
    assert (
        BatchApiHook(batch_conn("batch_flag", allow_private_redirects="True"))
        .get_settings()
        .allow_private_redirects
    )
    assert (
        BatchApiHook(batch_conn("batch_flag2", allow_private_redirects=True))
        .get_settings()
        .allow_private_redirects
    )
    assert not BatchApiHook(batch_conn("batch_noflag")).get_settings().allow_private_redirects


def test_download_cap_is_read_from_the_extra(batch_conn) -> None:
    assert (
        BatchApiHook(batch_conn("batch_cap", max_download_bytes="4096")).get_settings().max_download_bytes
        == 4096
    )
    assert BatchApiHook(batch_conn("batch_nocap")).get_settings().max_download_bytes == 8 << 30


async def test_aget_settings_inside_the_event_loop(batch_conn) -> None:
    hook = BatchApiHook(batch_conn("batch_async", dialect="doubleword"))
    settings = await hook.aget_settings()
    assert settings.dialect.name == "doubleword"
    assert settings.client_headers()["Authorization"] == f"Bearer {SECRET}"


def test_openai_organization_and_project_headers(mock_hook) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return json_response(200, openai_batch())

    hook = mock_hook(handler, organization="org-1", project="proj-1")
    hook.get_batch("batch_1")
    assert seen[0].headers["authorization"] == f"Bearer {SECRET}"
    assert seen[0].headers["openai-organization"] == "org-1"
    assert seen[0].headers["openai-project"] == "proj-1"
    assert str(seen[0].url) == "http://vendor.test/v1/batches/batch_1"


# ---- secrets ---------------------------------------------------------------------------------


def test_key_never_in_repr_or_str(mock_hook) -> None:
    hook = mock_hook(lambda r: json_response(200, openai_batch()))
    settings = hook.get_settings()
    for text in (repr(hook), str(hook), repr(settings), str(settings)):
        assert SECRET not in text
    assert "api_key=***" in repr(settings)


def test_key_never_in_logs_or_errors(
    mock_hook, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return json_response(503, {"error": {"message": "busy"}})
        # A misbehaving server that echoes the Authorization header in its error body.
        return json_response(
            400,
            {"error": {"message": f"bad header {request.headers['authorization']}"}},
            **{"x-request-id": "req_9"},
        )

    hook = mock_hook(handler)
    with caplog.at_level(logging.DEBUG), pytest.raises(BatchApiBadRequestError) as info:
        hook.get_batch("batch_1")
    err = info.value
    assert SECRET not in str(err)
    assert SECRET not in repr(err)
    assert SECRET not in repr(err.body)
    assert "***" in str(err)
    assert err.request_id == "req_9"
    # Hook messages go through Airflow's structlog (stdout); httpx/httpcore debug logs through logging.
    out = capsys.readouterr()
    assert "HTTP 503; retry 1/3" in out.out + out.err
    assert SECRET not in out.out + out.err
    assert all(SECRET not in record.getMessage() for record in caplog.records)
    assert SECRET not in caplog.text


def test_key_cut_by_the_body_limit_leaves_no_fragment(mock_hook) -> None:
    """A non-JSON error body echoing the key right where the text is cut: no piece of it survives."""
    from airflow_batch_provider.hooks.transport import ERROR_BODY_LIMIT

    text = "x" * (ERROR_BODY_LIMIT - 10) + SECRET + " trailing"
    hook = mock_hook(lambda r: httpx.Response(400, text=text))
    with pytest.raises(BatchApiBadRequestError) as info:
        hook.get_batch("batch_1")
    shown = str(info.value) + repr(info.value.body)
    assert SECRET[:10] not in shown
    assert len(info.value.body) <= ERROR_BODY_LIMIT


def test_key_is_registered_with_the_secrets_masker(mock_hook) -> None:
    from airflow.sdk._shared.secrets_masker import redact as airflow_redact

    hook = mock_hook(lambda r: json_response(200, openai_batch()))
    hook.get_settings()
    assert SECRET not in str(airflow_redact(f"the key is {SECRET}"))


def test_test_connection_failure_hides_the_key(mock_hook) -> None:
    hook = mock_hook(lambda r: json_response(401, {"error": {"message": f"Incorrect API key {SECRET}"}}))
    ok, message = hook.test_connection()
    assert ok is False
    assert "API key was rejected" in message
    assert SECRET not in message


# ---- status errors -------------------------------------------------------------------------


def test_401_says_the_key_was_rejected_and_is_not_retried(mock_hook, sleeps) -> None:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return json_response(401, {"error": {"message": "invalid key"}}, **{"request-id": "req_401"})

    with pytest.raises(BatchApiAuthError, match="API key was rejected") as info:
        mock_hook(handler).get_batch("batch_1")
    assert info.value.status_code == 401
    assert info.value.request_id == "req_401"
    assert len(calls) == 1
    assert sleeps == []


def test_403_is_an_auth_error(mock_hook) -> None:
    with pytest.raises(BatchApiAuthError, match="lacks permission"):
        mock_hook(lambda r: json_response(403, {"error": "forbidden"})).list_batches().__next__()


def test_404_names_the_id(mock_hook) -> None:
    handler = lambda r: json_response(404, {"error": {"message": "No such batch"}})  # noqa: E731
    with pytest.raises(BatchApiNotFoundError, match="batch 'batch_nope' was not found") as info:
        mock_hook(handler).get_batch("batch_nope")
    assert info.value.status_code == 404
    with pytest.raises(BatchApiNotFoundError, match="file 'file-gone'"):
        mock_hook(handler).delete_file("file-gone")


def test_malformed_json_is_a_response_error(mock_hook) -> None:
    hook = mock_hook(lambda r: httpx.Response(200, content=b"{not json", headers={"x-request-id": "req_m"}))
    with pytest.raises(BatchApiResponseError, match="not JSON") as info:
        hook.get_batch("batch_1")
    assert info.value.request_id == "req_m"


def test_unknown_status_raises_never_success(mock_hook) -> None:
    hook = mock_hook(lambda r: json_response(200, openai_batch(status="paused_by_vendor")))
    with pytest.raises(UnknownBatchStatusError, match="paused_by_vendor"):
        hook.get_batch("batch_1")


# ---- retries -------------------------------------------------------------------------------


def test_429_with_retry_after_then_success(mock_hook, sleeps) -> None:
    replies = [
        json_response(429, {"error": {"message": "slow down"}}, **{"retry-after-ms": "25"}),
        json_response(429, {"error": {"message": "slow down"}}, **{"retry-after": "0.04"}),
        json_response(200, openai_batch(status="completed")),
    ]
    hook = mock_hook(lambda r: replies.pop(0))
    batch = hook.get_batch("batch_1")
    assert batch.state is BatchState.COMPLETED
    assert sleeps == [0.025, 0.04]


def test_retry_after_is_capped(mock_hook, sleeps) -> None:
    replies = [json_response(429, {}, **{"retry-after": "3600"}), json_response(200, openai_batch())]
    mock_hook(lambda r: replies.pop(0)).get_batch("batch_1")
    assert sleeps == [0.05]  # FAST.retry_after_max


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503, 504])
def test_retryable_statuses_are_retried(mock_hook, sleeps, status: int) -> None:
    replies = [json_response(status, {}), json_response(200, openai_batch())]
    mock_hook(lambda r: replies.pop(0)).get_batch("batch_1")
    assert len(sleeps) == 1
    assert 0 <= sleeps[0] <= 0.001  # full jitter under the first ceiling


def test_5xx_exhaustion_raises_server_error(mock_hook, sleeps) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return json_response(503, {"error": {"message": "overloaded"}}, **{"x-request-id": f"req_{calls}"})

    with pytest.raises(BatchApiServerError, match="overloaded") as info:
        mock_hook(handler).get_batch("batch_1")
    assert calls == 4  # first try + FAST.max_retries
    assert len(sleeps) == 3
    assert info.value.status_code == 503
    assert info.value.request_id == "req_4"


def test_429_exhaustion_raises_rate_limit_error(mock_hook, sleeps) -> None:
    with pytest.raises(BatchApiRateLimitError):
        mock_hook(lambda r: json_response(429, {})).get_batch("batch_1")


def test_400_is_not_retried(mock_hook, sleeps) -> None:
    calls = []
    handler = lambda r: calls.append(r) or json_response(400, {"error": {"message": "bad", "line": 3}})  # noqa: E731
    with pytest.raises(BatchApiBadRequestError, match="bad"):
        mock_hook(handler).get_batch("batch_1")
    assert len(calls) == 1


def test_connection_errors_are_retried_then_raise(mock_hook, sleeps) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(BatchApiConnectionError, match="the connection to http.* failed"):
        mock_hook(handler).get_batch("batch_1")
    assert calls == 4


def test_timeouts_are_retried(mock_hook, sleeps) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ReadTimeout("read timed out", request=request)
        return json_response(200, openai_batch())

    assert mock_hook(handler).get_batch("batch_1").id == "batch_1"
    assert calls == 2


def test_max_retries_zero_means_one_attempt(batch_conn) -> None:
    calls = []
    transport = httpx.MockTransport(lambda r: calls.append(r) or json_response(503, {}))
    hook = BatchApiHook(batch_conn("batch_noretry"), max_retries=0, transport=transport)
    with pytest.raises(BatchApiServerError):
        hook.get_batch("b")
    assert len(calls) == 1


# ---- create: never pay twice ---------------------------------------------------------------


class CreateServer:
    """Creates batches; can lose the answer of chosen create calls after (or before) creating."""

    def __init__(self, failures: list[str]) -> None:
        self.failures = (
            failures  # per create call: "ok", "connect", "429", "500_after", "timeout_before", ...
        )
        self.batches: list[dict[str, Any]] = []
        self.create_calls = 0
        self.list_calls = 0
        # Batches created by a request that timed out, still being written: listed from the
        # second listing on (a vendor still working, or a listing lagging behind creates).
        self.pending: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/batches":
            self.list_calls += 1
            if self.list_calls >= 2:
                self.batches.extend(self.pending)
                self.pending.clear()
            return json_response(200, {"object": "list", "data": self.batches[::-1], "has_more": False})
        assert request.method == "POST" and request.url.path == "/v1/batches"
        self.create_calls += 1
        mode = self.failures.pop(0) if self.failures else "ok"
        if mode == "connect":
            raise httpx.ConnectError("refused", request=request)
        if mode == "429":
            return json_response(429, {}, **{"retry-after-ms": "1"})
        if mode == "timeout_before":
            raise httpx.ReadTimeout("timed out", request=request)
        if mode == "500_before":
            return json_response(500, {"error": {"message": "boom"}})
        body = orjson.loads(request.content)
        batch = openai_batch(
            f"batch_{len(self.batches) + 1}",
            status="validating",
            input_file_id=body["input_file_id"],
            metadata=body.get("metadata"),
            created_at=1_736_000_000 + len(self.batches),
        )
        if mode == "timeout_slow":
            self.pending.append(batch)
            raise httpx.ReadTimeout("timed out", request=request)
        self.batches.append(batch)
        if mode == "500_after":
            return json_response(500, {"error": {"message": "boom"}})
        if mode == "drop_after":
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        return json_response(200, batch)


CREATE = {"input_file_id": "file-in", "endpoint": "/v1/chat/completions"}
META = {"airflow_batch_key": "dag.task.run.0.shard0"}


@pytest.mark.parametrize("failure", ["connect", "429"])
def test_create_retries_when_the_request_provably_did_not_land(mock_hook, sleeps, failure: str) -> None:
    server = CreateServer([failure])
    batch = mock_hook(server).create_batch(**CREATE)
    assert batch.id == "batch_1"
    assert server.create_calls == 2
    assert len(server.batches) == 1


@pytest.mark.parametrize("failure", ["500_after", "drop_after", "timeout_before", "500_before"])
def test_create_without_metadata_does_not_retry_an_ambiguous_failure(mock_hook, sleeps, failure: str) -> None:
    server = CreateServer([failure])
    with pytest.raises(BatchApiError, match="may have been created"):
        mock_hook(server).create_batch(**CREATE)
    assert server.create_calls == 1


@pytest.mark.parametrize("failure", ["500_after", "drop_after"])
def test_create_with_metadata_adopts_the_batch_a_lost_answer_created(mock_hook, sleeps, failure: str) -> None:
    server = CreateServer([failure])
    batch = mock_hook(server).create_batch(**CREATE, metadata=META)
    assert batch.id == "batch_1"
    assert batch.metadata == META
    assert server.create_calls == 1
    assert len(server.batches) == 1


@pytest.mark.parametrize("failure", ["500_before", "timeout_before"])
def test_create_with_metadata_retries_when_nothing_was_created(mock_hook, sleeps, failure: str) -> None:
    server = CreateServer([failure])
    batch = mock_hook(server).create_batch(**CREATE, metadata=META)
    assert batch.id == "batch_1"
    assert server.create_calls == 2
    assert len(server.batches) == 1


def test_create_waits_for_a_slow_vendor_before_sending_again(mock_hook, sleeps) -> None:
    """A timed-out create the vendor is still working on shows up on the second look: adopted, not re-sent."""
    server = CreateServer(["timeout_slow"])
    batch = mock_hook(server).create_batch(**CREATE, metadata=META)
    assert batch.id == "batch_1"
    assert server.create_calls == 1
    assert server.list_calls == 2
    assert len(server.batches) == 1
    # Each look waited at least the policy's backoff_max, not a jittered fraction of it.
    assert len(sleeps) == 2
    assert all(s >= FAST.backoff_max for s in sleeps)


async def test_acreate_waits_for_a_slow_vendor_before_sending_again(mock_hook, sleeps) -> None:
    server = CreateServer(["timeout_slow"])
    hook = mock_hook(server)
    async with hook:
        batch = await hook.acreate_batch(**CREATE, metadata=META)
    assert batch.id == "batch_1"
    assert server.create_calls == 1
    assert len(server.batches) == 1


def test_create_lookup_ignores_batches_of_other_files(mock_hook, sleeps) -> None:
    server = CreateServer(["ok", "500_before"])
    hook = mock_hook(server)
    hook.create_batch(input_file_id="file-other", endpoint="/v1/chat/completions", metadata=META)
    batch = hook.create_batch(**CREATE, metadata=META)
    assert batch.input_file_id == "file-in"
    assert len(server.batches) == 2


def test_create_ambiguous_failures_are_bounded(mock_hook, sleeps) -> None:
    server = CreateServer(["500_before"] * 10)
    with pytest.raises(BatchApiServerError):
        mock_hook(server).create_batch(**CREATE, metadata=META)
    assert server.create_calls == 4


async def test_acreate_with_metadata_adopts_the_lost_batch(mock_hook, sleeps) -> None:
    server = CreateServer(["drop_after"])
    hook = mock_hook(server)
    async with hook:
        batch = await hook.acreate_batch(**CREATE, metadata=META)
    assert batch.id == "batch_1"
    assert server.create_calls == 1


async def test_acreate_without_metadata_raises_on_ambiguity(mock_hook, sleeps) -> None:
    server = CreateServer(["500_after"])
    hook = mock_hook(server)
    with pytest.raises(BatchApiError, match="may have been created"):
        await hook.acreate_batch(**CREATE)
    await hook.aclose()
    assert len(server.batches) == 1


def test_create_checks_window_and_endpoint_before_calling(mock_hook) -> None:
    hook = mock_hook(lambda r: pytest.fail("no request expected"))
    with pytest.raises(ConfigurationError, match="completion_window"):
        hook.create_batch(input_file_id="f", endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(ConfigurationError, match="endpoint"):
        hook.create_batch(input_file_id="f", endpoint="/v1/images/generations")
    too_many = {f"k{i}": "v" for i in range(17)}
    with pytest.raises(ConfigurationError, match="metadata"):
        hook.create_batch(input_file_id="f", endpoint="/v1/chat/completions", metadata=too_many)


# ---- pagination ----------------------------------------------------------------------------


def test_openai_list_follows_has_more_and_after(mock_hook) -> None:
    ids = [f"batch_{i}" for i in range(7)]
    seen_params: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        seen_params.append(params)
        start = ids.index(params["after"]) + 1 if "after" in params else 0
        page = ids[start : start + int(params["limit"])]
        return json_response(
            200,
            {
                "object": "list",
                "data": [openai_batch(i) for i in page],
                "has_more": start + len(page) < len(ids),
                "last_id": page[-1] if page else None,
            },
        )

    hook = mock_hook(handler)
    assert [b.id for b in hook.list_batches(page_size=3)] == ids
    assert seen_params == [
        {"limit": "3"},
        {"limit": "3", "after": "batch_2"},
        {"limit": "3", "after": "batch_5"},
    ]
    assert [b.id for b in hook.list_batches(page_size=3, limit=4)] == ids[:4]


def test_xai_list_follows_pagination_token(mock_hook) -> None:
    pages = {
        None: ({"batches": [xai_batch("b1", "run-a"), xai_batch("b2", "run-b")], "pagination_token": "t1"}),
        "t1": ({"batches": [xai_batch("b3", "run-a")], "pagination_token": None}),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        return json_response(200, pages[request.url.params.get("pagination_token")])

    hook = mock_hook(handler, dialect="xai")
    assert [b.id for b in hook.list_batches()] == ["b1", "b2", "b3"]
    assert [b.id for b in hook.find_batches({"airflow_batch_key": "run-a"})] == ["b1", "b3"]


def xai_result(custom_id: str) -> dict[str, Any]:
    body = {"object": "chat.completion", "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
    return {"batch_request_id": custom_id, "batch_result": {"response": {"chat_get_completion": body}}}


def test_a_repeated_cursor_is_an_error_not_a_loop(mock_hook) -> None:
    hook = mock_hook(
        lambda r: json_response(200, {"batches": [xai_batch("b1", "x")], "pagination_token": "same"}),
        dialect="xai",
    )
    with pytest.raises(BatchApiResponseError, match="already returned"):
        list(hook.list_batches())


def test_a_cursor_cycle_in_results_is_an_error_not_duplicate_lines(mock_hook) -> None:
    """xAI results paging A -> B -> A: stops with an error instead of yielding the same lines forever."""
    pages = {
        None: {"results": [xai_result("r1")], "pagination_token": "A"},
        "A": {"results": [xai_result("r2")], "pagination_token": "B"},
        "B": {"results": [xai_result("r3")], "pagination_token": "A"},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/results"):
            return json_response(200, pages[request.url.params.get("pagination_token")])
        return json_response(200, xai_batch("b1", "x"))

    hook = mock_hook(handler, dialect="xai")
    seen: list[str] = []
    with pytest.raises(BatchApiResponseError, match="already returned"):
        for line in hook.iter_results("b1"):
            seen.append(line.custom_id)
    assert seen == ["r1", "r2", "r3"]


async def test_alist_and_afind(mock_hook) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        after = request.url.params.get("after")
        if after is None:
            return json_response(
                200, {"data": [openai_batch("b1", metadata={"k": "1"})], "has_more": True, "last_id": "b1"}
            )
        return json_response(200, {"data": [openai_batch("b2", metadata={"k": "2"})], "has_more": False})

    hook = mock_hook(handler)
    assert [b.id async for b in hook.alist_batches()] == ["b1", "b2"]
    assert [b.id for b in await hook.afind_batches({"k": "2"})] == ["b2"]
    assert await hook.afind_batches({}) == []
    await hook.aclose()


def xai_batch(batch_id: str, name: str, **state: int) -> dict[str, Any]:
    counts = {
        "num_requests": 2,
        "num_pending": 0,
        "num_success": 2,
        "num_error": 0,
        "num_cancelled": 0,
        **state,
    }
    return {"batch_id": batch_id, "name": name, "create_time": "2026-11-30T10:00:00Z", "state": counts}


# ---- results -------------------------------------------------------------------------------


def out_line(cid: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{cid}",
        "custom_id": cid,
        "response": {"status_code": 200, "request_id": f"req_{cid}", "body": {"answer": cid}},
        "error": None,
    }


def err_line(cid: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{cid}",
        "custom_id": cid,
        "response": None,
        "error": {"code": "invalid_request_error", "message": "bad", "param": "model"},
    }


def jsonl(lines: list[dict[str, Any]], sep: bytes = b"\n") -> bytes:
    return b"".join(orjson.dumps(line) + sep for line in lines)


def test_doubleword_results_endpoint_pages_with_skip_and_limit(mock_hook) -> None:
    items = [
        {"id": f"r{i}", "custom_id": f"c{i}", "response_body": {"n": i}, "error": None, "status": "completed"}
        for i in range(5)
    ]
    items[3] = {
        "id": "r3",
        "custom_id": "c3",
        "response_body": None,
        "error": "model overloaded",
        "status": "failed",
    }
    seen: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/results"):
            params = dict(request.url.params)
            seen.append(params)
            skip, limit = int(params["skip"]), int(params["limit"])
            body = jsonl(items[skip : skip + limit])
            more = "true" if skip + limit < len(items) else "false"
            headers = {"content-type": "application/x-ndjson", "X-Incomplete": more}
            return httpx.Response(200, content=body, headers=headers)
        return json_response(200, openai_batch("dw-1", status="completed"))

    hook = mock_hook(handler, dialect="doubleword")
    hook.get_settings()
    lines = list(hook.iter_results("dw-1", mode="results_endpoint"))
    assert [line.custom_id for line in lines] == [f"c{i}" for i in range(5)]
    assert [line.ok for line in lines] == [True, True, True, False, True]
    assert lines[3].error is not None and lines[3].error.message == "model overloaded"
    # The default page size is 1000 and the server says X-Incomplete: false: one request.
    assert seen == [{"skip": "0", "limit": "1000"}]


def test_doubleword_results_endpoint_follows_full_pages(mock_hook, monkeypatch) -> None:
    from airflow_batch_provider.dialects.doubleword import DoublewordDialect

    monkeypatch.setattr(DoublewordDialect, "results_page_size", 2)
    items = [
        {"id": f"r{i}", "custom_id": f"c{i}", "response_body": {"n": i}, "status": "completed"}
        for i in range(5)
    ]
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        skip, limit = int(request.url.params["skip"]), int(request.url.params["limit"])
        seen.append(f"{skip}:{limit}")
        return json_response(200, items[skip : skip + limit])

    hook = mock_hook(handler, dialect="doubleword")
    batch = hook.dialect.parse_batch(openai_batch("dw-2", status="completed"))
    assert [line.custom_id for line in hook.iter_results(batch, mode="results_endpoint")] == [
        f"c{i}" for i in range(5)
    ]
    # No X-Incomplete header here: the short page at 4 is not the end, the empty one at 5 is.
    assert seen == ["0:2", "2:2", "4:2", "5:2"]


def test_xai_results_page_with_pagination_token(mock_hook) -> None:
    pages = {
        None: {
            "results": [
                {
                    "batch_request_id": "a",
                    "batch_result": {"response": {"chat_get_completion": {"text": "A"}}},
                },
                {
                    "batch_request_id": "b",
                    "batch_result": {"error": {"code": "bad_request", "message": "nope"}},
                },
            ],
            "pagination_token": "p2",
        },
        "p2": {
            "results": [
                {
                    "batch_request_id": "c",
                    "batch_result": {"response": {"body": {"t": 1}, "status_code": 200}},
                }
            ]
        },
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/results"):
            return json_response(200, pages[request.url.params.get("pagination_token")])
        return json_response(200, xai_batch("xb", "run"))

    hook = mock_hook(handler, dialect="xai")
    lines = list(hook.iter_results("xb"))
    assert [(line.custom_id, line.ok) for line in lines] == [("a", True), ("b", False), ("c", True)]
    assert lines[0].body == {"text": "A"}
    assert lines[1].error is not None and lines[1].error.code == "bad_request"


def test_files_mode_reads_output_then_error_file(mock_hook) -> None:
    files = {
        "file-out": jsonl([out_line("a"), out_line("b")], sep=b"\r\n") + b"\n",
        "file-err": jsonl([err_line("c")]).rstrip(b"\n"),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        file_id = request.url.path.split("/")[-2]
        return httpx.Response(200, content=files[file_id])

    hook = mock_hook(handler)
    batch = hook.dialect.parse_batch(
        openai_batch(status="completed", output_file_id="file-out", error_file_id="file-err")
    )
    lines = list(hook.iter_results(batch))
    assert [(line.custom_id, line.ok, line.source) for line in lines] == [
        ("a", True, "output"),
        ("b", True, "output"),
        ("c", False, "error"),
    ]
    assert lines[2].error is not None and lines[2].error.param == "model"


def test_a_bad_result_line_names_the_file_and_line(mock_hook) -> None:
    content = jsonl([out_line("a")]) + b"{broken\n"
    hook = mock_hook(lambda r: httpx.Response(200, content=content))
    batch = hook.dialect.parse_batch(openai_batch(status="completed", output_file_id="file-out"))
    with pytest.raises(BatchApiResponseError, match="file 'file-out' line 2 is not valid JSON"):
        list(hook.iter_results(batch))
    hook2 = mock_hook(lambda r: httpx.Response(200, content=b'{"id": "x"}\n'))
    with pytest.raises(BatchApiResponseError, match="file 'file-out' line 1: result line has no custom_id"):
        list(hook2.iter_results(batch))


def test_a_mode_the_dialect_lacks_is_refused(mock_hook) -> None:
    hook = mock_hook(lambda r: json_response(200, {}))
    batch = hook.dialect.parse_batch(openai_batch(status="completed"))
    with pytest.raises(ConfigurationError, match="results_endpoint"):
        list(hook.iter_results(batch, mode="results_endpoint"))


# ---- streaming files -----------------------------------------------------------------------


def test_download_restarts_after_a_dropped_connection(mock_hook, sleeps, tmp_path: Path) -> None:
    content = b"x" * 5000 + b"\n" + b"y" * 5000
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return httpx.Response(200, stream=DroppingStream([content[:3000]]))
        return httpx.Response(200, content=content)

    dest = tmp_path / "out" / "result.jsonl"
    assert mock_hook(handler).download_file("file-out", dest) == len(content)
    assert dest.read_bytes() == content
    assert sorted(p.name for p in dest.parent.iterdir()) == ["result.jsonl"]


def test_download_that_keeps_dropping_leaves_nothing(mock_hook, sleeps, tmp_path: Path) -> None:
    hook = mock_hook(lambda r: httpx.Response(200, stream=DroppingStream([b"partial"])))
    dest = tmp_path / "result.jsonl"
    dest.write_bytes(b"old complete file")
    with pytest.raises(BatchApiConnectionError, match="downloading file file-out"):
        hook.download_file("file-out", dest)
    assert dest.read_bytes() == b"old complete file"
    assert [p.name for p in tmp_path.iterdir()] == ["result.jsonl"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_answers_cut_mid_body_have_a_budget_apart_from_error_answers(
    mock_hook, sleeps, asynchronous: bool
) -> None:
    # 3 error answers and 3 bodies cut off after a 200 (max_retries is 3): on one shared budget
    # the 7th attempt would never be made; a dropped body counts as a drop, an error as a retry.
    body = orjson.dumps(openai_batch("batch_1", "completed"))
    script = ["503", "drop", "500", "drop", "429", "drop", "ok"]
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        step = script[len(seen)]
        seen.append(step)
        if step == "drop":
            return httpx.Response(200, stream=DroppingStream([body[:20]]))
        if step == "ok":
            return json_response(200, orjson.loads(body))
        return json_response(int(step), {"error": {"message": "try later"}})

    hook = mock_hook(handler)
    batch = await hook.aget_batch("batch_1") if asynchronous else hook.get_batch("batch_1")
    assert batch.state is BatchState.COMPLETED and seen == script
    # A fourth drop is one too many: the error names the call and the dropped connection.
    seen.clear()
    script[:] = ["drop"] * 5
    with pytest.raises(BatchApiConnectionError, match="getting batch batch_1.*RemoteProtocolError"):
        await hook.aget_batch("batch_1") if asynchronous else hook.get_batch("batch_1")
    assert len(seen) == 4


def test_download_404_leaves_no_file(mock_hook, tmp_path: Path) -> None:
    with pytest.raises(BatchApiNotFoundError, match="file 'file-x'"):
        mock_hook(lambda r: json_response(404, {})).download_file("file-x", tmp_path / "d.jsonl")
    assert list(tmp_path.iterdir()) == []


async def test_adownload_restarts_after_a_dropped_connection(mock_hook, sleeps, tmp_path: Path) -> None:
    content = b"0123456789" * 1000
    replies = [
        httpx.Response(200, stream=DroppingStream([content[:10]])),
        httpx.Response(200, content=content),
    ]
    hook = mock_hook(lambda r: replies.pop(0))
    dest = tmp_path / "a.jsonl"
    assert await hook.adownload_file("file-out", dest) == len(content)
    assert dest.read_bytes() == content
    await hook.aclose()


def test_line_iteration_resumes_without_repeating_lines(mock_hook, sleeps) -> None:
    lines = [out_line(f"c{i}") for i in range(6)]
    content = jsonl(lines)
    cut = content.index(b"\n", content.index(b"c2")) + 10  # mid-way through line 4
    replies = [
        httpx.Response(200, stream=DroppingStream([content[:cut]])),
        httpx.Response(200, content=content),
    ]
    hook = mock_hook(lambda r: replies.pop(0))
    got = [obj["custom_id"] for obj in hook.iter_file_lines("file-out")]
    assert got == [f"c{i}" for i in range(6)]


async def test_async_line_iteration_resumes(mock_hook, sleeps) -> None:
    content = jsonl([out_line(f"c{i}") for i in range(4)])
    replies = [
        httpx.Response(200, stream=DroppingStream([content[:70]])),
        httpx.Response(200, content=content),
    ]
    hook = mock_hook(lambda r: replies.pop(0))
    got = [obj["custom_id"] async for obj in hook.aiter_file_lines("file-out")]
    assert got == ["c0", "c1", "c2", "c3"]
    await hook.aclose()


def test_non_object_line_is_an_error(mock_hook) -> None:
    hook = mock_hook(lambda r: httpx.Response(200, content=b'{"a": 1}\n\n[1, 2]\n'))
    with pytest.raises(BatchApiResponseError, match="line 3 is not a JSON object"):
        list(hook.iter_file_lines("f"))


def _multipart(request: httpx.Request) -> tuple[dict[str, str], bytes, str]:
    body = request.read()
    message = email.parser.BytesParser().parsebytes(
        b"Content-Type: " + request.headers["content-type"].encode() + b"\r\n\r\n" + body
    )
    fields: dict[str, str] = {}
    file_bytes = b""
    filename = ""
    for part in message.get_payload():  # type: ignore[union-attr]
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if name == "file":
            file_bytes = payload
            filename = part.get_filename()
        else:
            fields[name] = payload.decode()
    assert int(request.headers["content-length"]) == len(body)
    return fields, file_bytes, filename


def test_multipart_body_is_produced_in_bounded_chunks(tmp_path: Path) -> None:
    from airflow_batch_provider.hooks.transport import UPLOAD_CHUNK, MultipartUpload

    data = b"z" * (3 * UPLOAD_CHUNK + 17)
    source = tmp_path / "big.jsonl"
    source.write_bytes(data)
    upload = MultipartUpload.from_source(source, filename=None, fields={"purpose": "batch"})
    chunks = list(upload.iter_sync())
    assert max(len(c) for c in chunks) <= UPLOAD_CHUNK
    assert len(chunks) == 6  # head, four file chunks, tail
    assert sum(map(len, chunks)) == int(upload.headers["Content-Length"])


def test_multipart_refuses_a_file_that_changed_during_upload(tmp_path: Path) -> None:
    from airflow_batch_provider.hooks.transport import MultipartUpload

    source = tmp_path / "in.jsonl"
    source.write_bytes(b"12345")
    upload = MultipartUpload.from_source(source, filename=None, fields={})
    source.write_bytes(b"123")
    with pytest.raises(BatchApiError, match="changed during upload"):
        list(upload.iter_sync())


@pytest.mark.parametrize(("dialect", "fields"), [("openai", {"purpose": "batch"}), ("xai", {})])
def test_upload_sends_multipart_with_the_dialect_form(
    mock_hook, tmp_path: Path, dialect: str, fields: dict[str, str]
) -> None:
    data = b"".join(b'{"custom_id": "%d", "pad": "%s"}\n' % (i, b"z" * 1000) for i in range(3000))
    source = tmp_path / "shard-00000.jsonl"
    source.write_bytes(data)
    captured: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        captured["parsed"] = _multipart(request)
        captured["chunked"] = "transfer-encoding" in request.headers
        return json_response(200, {"id": "file-2", "object": "file"})

    hook = mock_hook(handler, dialect=dialect)
    assert hook.upload_file(source, filename="named.jsonl") == "file-2"
    got_fields, got_bytes, got_name = captured["parsed"]
    assert got_fields == fields
    assert got_bytes == data
    assert got_name == "named.jsonl"
    assert captured["chunked"] is False


async def test_aupload_sends_the_same_body(mock_hook, tmp_path: Path) -> None:
    data = b'{"custom_id": "1"}\n' * 100_000
    source = tmp_path / "in.jsonl"
    source.write_bytes(data)
    captured: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        captured["parsed"] = _multipart(request)
        return json_response(200, {"id": "file-a"})

    hook = mock_hook(handler)
    assert await hook.aupload_file(source) == "file-a"
    assert captured["parsed"][0] == {"purpose": "batch"}
    assert captured["parsed"][1] == data
    assert captured["parsed"][2] == "in.jsonl"
    await hook.aclose()


def test_upload_retry_resends_the_whole_file(mock_hook, sleeps, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"custom_id": "1"}\n' * 10)
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(_multipart(request)[1])
        if len(bodies) == 1:
            return json_response(503, {})
        return json_response(200, {"id": "file-r"})

    assert mock_hook(handler).upload_file(source) == "file-r"
    assert bodies[0] == bodies[1] == source.read_bytes()


def test_upload_missing_file_is_a_clear_error(mock_hook, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no such file"):
        mock_hook(lambda r: json_response(200, {})).upload_file(tmp_path / "missing.jsonl")


def test_upload_answer_without_id(mock_hook, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"{}\n")
    with pytest.raises(BatchApiResponseError, match="no id"):
        mock_hook(lambda r: json_response(200, {"object": "file"})).upload_file(source)


def test_upload_and_download_object_storage_path(mock_hook, tmp_path: Path) -> None:
    from airflow.sdk import ObjectStoragePath

    data = b'{"custom_id": "1"}\n'
    source = ObjectStoragePath(f"file://{tmp_path}/in.jsonl")
    source.write_bytes(data)
    captured: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            captured["parsed"] = _multipart(request)
            return json_response(200, {"id": "file-o"})
        return httpx.Response(200, content=data)

    hook = mock_hook(handler)
    assert hook.upload_file(source) == "file-o"
    assert captured["parsed"][1] == data
    assert captured["parsed"][2] == "in.jsonl"
    dest = ObjectStoragePath(f"file://{tmp_path}/out/copy.jsonl")
    assert hook.download_file("file-o", dest) == len(data)
    assert dest.read_bytes() == data


def test_cancel_with_an_empty_answer_reads_the_batch(mock_hook) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/cancel"):
            return httpx.Response(200, content=b"")
        return json_response(200, openai_batch(status="cancelling"))

    assert mock_hook(handler).cancel_batch("batch_1").state is BatchState.CANCELLING


def test_xai_cancel_uses_the_colon_path(mock_hook) -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path.decode())
        return json_response(
            200, xai_batch("xb", "n", num_pending=1) | {"cancel_time": "2026-11-30T10:00:00Z"}
        )

    assert mock_hook(handler, dialect="xai").cancel_batch("xb").state is BatchState.CANCELLING
    assert paths == ["/v1/batches/xb:cancel"]


def test_test_connection_ok(mock_hook) -> None:
    ok, message = mock_hook(lambda r: json_response(200, {"data": [], "has_more": False})).test_connection()
    assert ok is True
    assert "http://vendor.test/v1" in message


# ---- connection form -----------------------------------------------------------------------


def test_connection_form_matches_airflow_schemas() -> None:
    import json
    from importlib.resources import files

    import jsonschema

    from airflow_batch_provider.hooks.connection_form import CONN_FIELDS, UI_FIELD_BEHAVIOUR

    schema = json.loads(files("airflow").joinpath("provider.yaml.schema.json").read_text())
    conn_schema = schema["properties"]["connection-types"]["items"]
    entry = {
        "connection-type": "batch_api",
        "hook-class-name": "airflow_batch_provider.hooks.batch.BatchApiHook",
        "hook-name": BatchApiHook.hook_name,
        "conn-fields": CONN_FIELDS,
        "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
    }
    jsonschema.validate(entry, conn_schema)
    assert CONN_FIELDS["dialect"]["schema"]["enum"] == [
        "anthropic",
        "azure",
        "bedrock",
        "doubleword",
        "gemini",
        "mistral",
        "openai",
        "vertex",
        "xai",
        "zerogpu",
    ]
    behaviour_schema = json.loads(
        files("airflow").joinpath("customized_form_field_behaviours.schema.json").read_text()
    )
    jsonschema.validate(BatchApiHook.get_ui_field_behaviour(), behaviour_schema)


def test_create_lookup_failure_raises_both_reasons(mock_hook, sleeps) -> None:
    creates = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal creates
        if request.method == "POST":
            creates += 1
            return json_response(502, {"error": {"message": "bad gateway"}})
        return json_response(503, {"error": {"message": "listing is down"}})

    with pytest.raises(
        BatchApiServerError, match="bad gateway; the batch may have been created and looking"
    ) as info:
        mock_hook(handler).create_batch(**CREATE, metadata=META)
    assert "listing is down" in str(info.value)
    assert info.value.status_code == 502
    assert creates == 1


def test_xai_create_lookup_uses_the_batch_name(mock_hook, sleeps) -> None:
    batches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return json_response(200, {"batches": batches, "pagination_token": None})
        body = orjson.loads(request.content)
        batches.append(xai_batch("xb-1", body["name"], num_pending=2, num_success=0))
        raise httpx.ReadTimeout("timed out", request=request)

    batch = mock_hook(handler, dialect="xai").create_batch(**CREATE, metadata=META)
    assert batch.id == "xb-1"
    assert len(batches) == 1
    # Without a chosen name there is nothing to find the batch by: no retry.
    with pytest.raises(BatchApiConnectionError, match="may have been created"):
        mock_hook(handler, dialect="xai").create_batch(**CREATE)
    assert len(batches) == 2


async def test_async_methods_never_touch_the_sync_path(mock_hook, monkeypatch, tmp_path: Path) -> None:
    """Async twins read the connection asynchronously and only use the async client."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("sync call from an async method")

    files = {"file-out": jsonl([out_line("a")]), "file-err": jsonl([err_line("b")])}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/content"):
            return httpx.Response(200, content=files[path.split("/")[-2]])
        if path == "/v1/files" and request.method == "POST":
            return json_response(200, {"id": "file-in"})
        if path.startswith("/v1/files/"):
            return json_response(200, {"id": path.split("/")[-1], "deleted": True})
        if path == "/v1/batches" and request.method == "GET":
            return json_response(200, {"data": [openai_batch()], "has_more": False})
        done = openai_batch(status="completed", output_file_id="file-out", error_file_id="file-err")
        return json_response(200, done)

    hook = mock_hook(handler)
    hook._transport = httpx.MockTransport(forbidden)
    monkeypatch.setattr(BatchApiHook, "get_connection", classmethod(forbidden))
    monkeypatch.setattr(BatchApiHook, "get_settings", forbidden)
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"{}\n")
    async with hook:
        assert await hook.aupload_file(source) == "file-in"
        assert (await hook.aget_file("file-in"))["id"] == "file-in"
        batch = await hook.acreate_batch(**CREATE)
        assert (await hook.aget_batch(batch.id)).state is BatchState.COMPLETED
        assert [r.custom_id async for r in hook.aiter_results(batch.id)] == ["a", "b"]
        assert [b.id async for b in hook.alist_batches()] == ["batch_1"]
        assert (await hook.acancel_batch(batch.id)).id == batch.id
        assert await hook.adownload_file("file-out", tmp_path / "o.jsonl") > 0
        await hook.adelete_file("file-in")
    assert hook._aclient is None
    assert hook._client is None


async def test_concurrent_first_calls_share_one_async_client(mock_hook) -> None:
    """A trigger polling several batches at once must not build (and leak) a client per batch."""
    import asyncio

    hook = mock_hook(lambda r: json_response(200, openai_batch()))
    clients = await asyncio.gather(*(hook.aget_conn() for _ in range(5)))
    assert all(c is clients[0] for c in clients)
    await hook.aclose()


# ---- vendor conformance (issue #13) ----------------------------------------------------------


def _clamping_doubleword(items: list[dict[str, Any]], seen: list[str], *, marker: bool):
    """A Doubleword results endpoint that clamps limit to 3, with or without its X-Incomplete marker."""

    def handler(request: httpx.Request) -> httpx.Response:
        skip, limit = int(request.url.params["skip"]), min(int(request.url.params["limit"]), 3)
        seen.append(f"{skip}:{request.url.params['limit']}")
        headers = {"content-type": "application/x-ndjson"}
        if marker:
            headers["X-Incomplete"] = "true" if skip + limit < len(items) else "false"
        return httpx.Response(200, content=jsonl(items[skip : skip + limit]), headers=headers)

    return handler


@pytest.mark.parametrize("marker", [True, False])
async def test_doubleword_short_pages_are_not_the_end(mock_hook, marker: bool) -> None:
    items = [
        {"id": f"r{i}", "custom_id": f"c{i}", "response_body": {"n": i}, "status": "completed"}
        for i in range(7)
    ]
    seen: list[str] = []
    hook = mock_hook(_clamping_doubleword(items, seen, marker=marker), dialect="doubleword")
    batch = hook.dialect.parse_batch(openai_batch("dw-3", status="completed"))
    assert [line.custom_id for line in hook.iter_results(batch, mode="results_endpoint")] == [
        f"c{i}" for i in range(7)
    ]
    # With the marker the walk stops on X-Incomplete: false; without it, only an empty page ends it.
    assert seen == (["0:1000", "3:1000", "6:1000"] if marker else ["0:1000", "3:1000", "6:1000", "7:1000"])
    seen.clear()
    lines = [line.custom_id async for line in hook.aiter_results(batch, mode="results_endpoint")]
    assert lines == [f"c{i}" for i in range(7)]


def test_doubleword_result_without_custom_id_is_yielded_not_raised(mock_hook) -> None:
    items = [
        {"id": "r0", "custom_id": "c0", "response_body": {"n": 0}, "status": "completed"},
        {"id": "r1", "custom_id": None, "response_body": {"n": 1}, "status": "completed"},
    ]
    hook = mock_hook(_clamping_doubleword(items, [], marker=True), dialect="doubleword")
    batch = hook.dialect.parse_batch(openai_batch("dw-4", status="completed"))
    lines = list(hook.iter_results(batch, mode="results_endpoint"))
    assert [(line.custom_id, line.ok) for line in lines] == [("c0", True), ("", False)]
    assert lines[1].error is not None and lines[1].error.code == "missing_custom_id"


def test_openai_list_follows_has_more_past_a_short_page(mock_hook) -> None:
    # A server that clamps limit answers 2 of the 100 asked for, with has_more: the walk goes on.
    pages = {
        None: {"data": [openai_batch("b1"), openai_batch("b2")], "has_more": True, "last_id": "b2"},
        "b2": {"data": [openai_batch("b3")], "has_more": False},
    }
    hook = mock_hook(lambda r: json_response(200, pages[r.url.params.get("after")]))
    assert [b.id for b in hook.list_batches()] == ["b1", "b2", "b3"]


def test_null_request_counts_and_fields_read_as_unknown(mock_hook) -> None:
    nulls = openai_batch(status="validating", request_counts=None, errors=None, usage=None, model=None)
    nulls.update(created_at=None, in_progress_at=None, expires_at=None, output_file_id=None)
    hook = mock_hook(lambda r: json_response(200, nulls))
    batch = hook.get_batch("batch_1")
    assert batch.state is BatchState.VALIDATING and batch.request_counts.total == 0


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (
            429,
            {
                "message": "You exceeded your current quota",
                "type": "insufficient_quota",
                "code": "insufficient_quota",
            },
        ),
        (429, {"message": "quota", "type": "requests", "code": "insufficient_quota"}),
        (402, {"message": "Insufficient credits", "type": "insufficient_quota", "code": None}),
    ],
)
async def test_quota_errors_fail_at_once(mock_hook, sleeps, status: int, error: dict[str, Any]) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return json_response(status, {"error": error})

    hook = mock_hook(handler)
    with pytest.raises(BatchApiQuotaError, match="out of quota or credit") as caught:
        hook.get_batch("batch_1")
    assert isinstance(caught.value, BatchApiRateLimitError) and caught.value.status_code == status
    with pytest.raises(BatchApiQuotaError):
        await hook.aget_batch("batch_1")
    with pytest.raises(BatchApiQuotaError):
        hook.create_batch(input_file_id="f", endpoint="/v1/chat/completions", metadata={"k": "v"})
    assert len(calls) == 3 and sleeps == []


def test_a_plain_429_is_still_retried(mock_hook, sleeps) -> None:
    answers = iter(
        [json_response(429, {"error": {"code": "rate_limit_exceeded"}}), json_response(200, openai_batch())]
    )
    assert mock_hook(lambda r: next(answers)).get_batch("batch_1").id == "batch_1"
    assert len(sleeps) == 1


def test_zerogpu_connection_needs_the_project(batch_conn) -> None:
    hook = BatchApiHook(batch_conn("batch_zg", dialect="zerogpu"))
    with pytest.raises(ConfigurationError, match="'batch_zg'.*'zerogpu' needs extra 'project'"):
        hook.get_settings()
    ok, message = hook.test_connection()
    assert not ok and "needs extra 'project'" in message
    assert BatchApiHook(batch_conn("batch_zg2", dialect="zerogpu", project="p-1")).get_settings()


async def test_zerogpu_cancel_of_a_finished_batch_is_already_final(mock_hook, sleeps) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if request.url.path.endswith("/cancel"):
            return json_response(
                409, {"error": {"code": "invalid_request_error", "message": "already completed"}}
            )
        return json_response(200, openai_batch("bz", status="completed"))

    hook = mock_hook(handler, dialect="zerogpu", project="p-1")
    assert hook.cancel_batch("bz").state is BatchState.COMPLETED
    assert (await hook.acancel_batch("bz")).state is BatchState.COMPLETED
    assert calls == ["POST /v1/batches/bz/cancel", "GET /v1/batches/bz"] * 2 and sleeps == []


def test_openai_409_to_cancel_is_still_retried(mock_hook, sleeps) -> None:
    answers = iter(
        [
            json_response(409, {"error": {"message": "conflict"}}),
            json_response(200, openai_batch(status="cancelling")),
        ]
    )
    assert mock_hook(lambda r: next(answers)).cancel_batch("batch_1").state is BatchState.CANCELLING
    assert len(sleeps) == 1


async def test_upload_over_the_dialect_upload_limit_is_refused_before_sending(
    mock_hook, tmp_path: Path
) -> None:
    calls: list[str] = []
    big = tmp_path / "shard-00000.jsonl"
    with big.open("wb") as fh:
        fh.truncate(100 * 1024 * 1024 + 1)  # sparse: no disk is used, and nothing is read
    hook = mock_hook(
        lambda r: calls.append(r.url.path) or json_response(200, {"id": "f"}), dialect="zerogpu", project="p"
    )
    with pytest.raises(
        JsonlValidationError, match=r"104,857,601 bytes.*'zerogpu' uploads at most 104,857,600"
    ):
        hook.upload_file(big)
    with pytest.raises(JsonlValidationError, match="uploads at most"):
        await hook.aupload_file(big)
    assert calls == []
    # OpenAI takes files up to 200 MB: the same file is sent.
    assert (
        mock_hook(lambda r: calls.append(r.url.path) or json_response(200, {"id": "f"})).upload_file(big)
        == "f"
    )


def mistral_job(job_id: str, key: str) -> dict[str, Any]:
    return {
        "id": job_id,
        "object": "batch",
        "input_files": ["f1"],
        "metadata": {"airflow_batch_key": key},
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "errors": [],
        "status": "RUNNING",
        "created_at": 1_736_380_000,
        "total_requests": 1,
        "completed_requests": 0,
        "succeeded_requests": 0,
        "failed_requests": 0,
    }


def test_mistral_orphan_lookup_asks_the_listing_to_filter_by_metadata(mock_hook) -> None:
    # Mistral's listing filters by metadata: the lookup sends its tags as the filter (one query
    # parameter per pair, as the official SDK does) and still checks each listed job's tags.
    seen: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/batch/jobs")
        params = dict(request.url.params)
        seen.append(params)
        jobs = [mistral_job("j2", "run-a"), mistral_job("j1", "run-b")]
        return json_response(200, {"object": "list", "data": jobs, "total": 2})

    hook = mock_hook(handler, dialect="mistral")
    assert [b.id for b in hook.find_batches({"airflow_batch_key": "run-a"})] == ["j2"]
    assert seen == [{"page": "0", "page_size": "100", "airflow_batch_key": "run-a"}]
    # A plain listing sends no filter.
    seen.clear()
    assert [b.id for b in hook.list_batches()] == ["j2", "j1"]
    assert seen == [{"page": "0", "page_size": "100"}]
