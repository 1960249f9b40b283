"""BatchApiHook in dialect gemini against ``serve --dialect gemini``: the resumable upload (resumed
after a drop or a 5xx from the offset the server holds), create on the model's path, get, list,
cancel, and results read from the responses file (a dropped download resumed), sync and async.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.dialects.gemini import GeminiDialect
from airflow_batch_provider.exceptions import BatchApiAuthError, BatchApiResponseError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import BatchState
from tests.fixtures.hook import FAST

KEY = "gemini-hook-secret-123456"
MODEL = "gemini-2.5-flash"


@pytest.fixture
def live(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    def start(**config: Any) -> tuple[Any, BatchApiHook]:
        server = batch_server(dialect="gemini", api_key=KEY, **config)
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_GEMINI", server.connection_json())
        return server, BatchApiHook("batch_gemini", retry_policy=FAST)

    return start


def encoded_file(path: Path, count: int) -> bytes:
    """An uploaded (encoded) shard: canonical chat lines through the dialect's ``encode_line``."""
    dialect = GeminiDialect()
    data = b"".join(
        orjson.dumps(
            dialect.encode_line(
                {
                    "custom_id": f"row-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "messages": [{"role": "user", "content": f"say {i} " * 50}]},
                }
            )
        )
        + b"\n"
        for i in range(count)
    )
    path.write_bytes(data)
    return data


def stored(hook: BatchApiHook, file_id: str, tmp_path: Path) -> bytes:
    dest = tmp_path / f"{file_id}.got"
    hook.download_file(file_id, dest)
    return dest.read_bytes()


def test_upload_create_wait_and_read_results(live: Any, tmp_path: Path) -> None:
    server, hook = live()
    data = encoded_file(tmp_path / "in.jsonl", 8)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    assert stored(hook, file_id, tmp_path) == data
    batch = hook.create_batch(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "abp-run-s00000", "airflow_fingerprint": "f" * 64},
        model=MODEL,
    )
    assert batch.input_file_id == file_id and batch.metadata["airflow_batch_key"] == "abp-run-s00000"
    done = hook.get_batch(batch.id)
    while not done.is_terminal:
        done = hook.get_batch(batch.id)
    assert done.state is BatchState.COMPLETED and done.request_counts.completed == 8
    lines = list(hook.iter_results(done))
    assert sorted(line.custom_id for line in lines) == [f"row-{i}" for i in range(8)]
    assert all(line.ok and line.body and line.body["usage"]["prompt_tokens"] > 0 for line in lines)
    # The orphan lookup finds the batch by its display name.
    found = hook.find_created_batch({"airflow_batch_key": "abp-run-s00000"}, input_file_id=file_id)
    assert found is not None and found.id == batch.id
    assert server.stats()["counters"]["files_uploaded"] == 1


def test_a_dropped_upload_resumes_from_the_offset_the_server_holds(live: Any, tmp_path: Path) -> None:
    # The first upload command drops after half the file; the second sends only the rest.
    server, hook = live(faults={"drop_rate": 0.5})
    data = encoded_file(tmp_path / "in.jsonl", 200)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    server.set_faults(drop_rate=0)
    assert server.stats()["counters"]["drop"] == 1
    assert stored(hook, file_id, tmp_path) == data


def test_a_5xx_on_the_upload_is_retried_through_a_query(live: Any, tmp_path: Path) -> None:
    # Every third call fails (the first, the third...): the start once, then the first upload.
    server, hook = live(faults={"rate_503": 0.34, "retry_after": 0.01})
    data = encoded_file(tmp_path / "in.jsonl", 50)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    server.set_faults(rate_503=0)
    assert server.stats()["counters"]["status_503"] == 2
    assert stored(hook, file_id, tmp_path) == data


async def test_async_upload_resumes_and_cancel_answers_the_batch(live: Any, tmp_path: Path) -> None:
    server, hook = live(faults={"drop_rate": 0.5, "stall_batches": True})
    data = encoded_file(tmp_path / "in.jsonl", 100)
    file_id = await hook.aupload_file(tmp_path / "in.jsonl")
    server.set_faults(drop_rate=0)
    assert server.stats()["counters"]["drop"] == 1
    assert stored(hook, file_id, tmp_path) == data
    batch = await hook.acreate_batch(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "k"},
        model=MODEL,
    )
    # Google answers a cancel with {}: the hook reads the batch instead.
    cancelled = await hook.acancel_batch(batch.id)
    assert cancelled.id == batch.id
    listed = [b.id async for b in hook.alist_batches(page_size=1)]
    assert listed == [batch.id]


def test_a_dropped_results_download_resumes(live: Any, tmp_path: Path) -> None:
    server, hook = live()
    encoded_file(tmp_path / "in.jsonl", 300)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    batch = hook.create_batch(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "k"},
        model=MODEL,
    )
    while not batch.is_terminal:
        batch = hook.get_batch(batch.id)
    # The first read of the responses file drops half way; the second is whole.
    server.set_faults(drop_rate=0.5)
    got = list(hook.iter_results(batch))
    server.set_faults(drop_rate=0)
    assert sorted(line.custom_id for line in got) == sorted(f"row-{i}" for i in range(300))
    assert server.stats()["counters"]["drop"] == 1


def test_an_upload_session_on_another_origin_gets_neither_file_nor_key(
    batch_conn: Any, tmp_path: Path
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"X-Goog-Upload-URL": "https://elsewhere.test/up?upload_id=1"})

    conn = batch_conn("batch_gem_mock", host="http://vendor.test/v1beta", dialect="gemini")
    transport = httpx.MockTransport(handler)
    hook = BatchApiHook(conn, retry_policy=FAST, transport=transport, async_transport=transport)
    encoded_file(tmp_path / "in.jsonl", 2)
    with pytest.raises(BatchApiResponseError, match="another origin"):
        hook.upload_file(tmp_path / "in.jsonl")
    assert [str(r.url) for r in seen] == ["http://vendor.test/upload/v1beta/files"]
    start = seen[0]
    assert start.headers["X-Goog-Upload-Protocol"] == "resumable"
    assert start.headers["X-Goog-Upload-Command"] == "start"
    assert start.headers["X-Goog-Upload-Header-Content-Length"] == str((tmp_path / "in.jsonl").stat().st_size)
    assert json.loads(start.content) == {"file": {"displayName": "in.jsonl"}}


def _session_hook(batch_conn: Any, handler: Any) -> BatchApiHook:
    conn = batch_conn("batch_gem_session", host="http://vendor.test/v1beta", dialect="gemini")
    transport = httpx.MockTransport(handler)
    return BatchApiHook(conn, retry_policy=FAST, transport=transport, async_transport=transport)


SESSION = "http://vendor.test/upload/v1beta/files?upload_id=s1&upload_protocol=resumable"


def test_a_finalize_whose_answer_was_lost_is_found_final_by_the_query(
    batch_conn: Any, tmp_path: Path
) -> None:
    commands: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        command = request.headers.get("X-Goog-Upload-Command", "")
        commands.append(command)
        if command == "start":
            return httpx.Response(
                200, headers={"X-Goog-Upload-URL": SESSION, "X-Goog-Upload-Status": "active"}
            )
        if command == "upload, finalize":
            request.read()
            # The server took every byte and made the file; the answer never arrived.
            raise httpx.ReadError("connection reset", request=request)
        assert command == "query"
        return httpx.Response(
            200, headers={"X-Goog-Upload-Status": "final"}, json={"file": {"name": "files/made-1"}}
        )

    encoded_file(tmp_path / "in.jsonl", 3)
    assert _session_hook(batch_conn, handler).upload_file(tmp_path / "in.jsonl") == "made-1"
    # Not sent twice: the query said the file exists.
    assert commands == ["start", "upload, finalize", "query"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Goog-Upload-Status": "cancelled"},
        {"X-Goog-Upload-Status": "active"},
        {"X-Goog-Upload-Status": "active", "X-Goog-Upload-Size-Received": "many"},
        {"X-Goog-Upload-Status": "active", "X-Goog-Upload-Size-Received": "999999999"},
    ],
)
def test_a_query_answer_that_cannot_be_resumed_from_is_an_error(
    batch_conn: Any, tmp_path: Path, headers: dict[str, str]
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        command = request.headers.get("X-Goog-Upload-Command", "")
        if command == "start":
            return httpx.Response(200, headers={"X-Goog-Upload-URL": SESSION})
        if command == "upload, finalize":
            request.read()
            return httpx.Response(
                503, json={"error": {"code": 503, "message": "busy", "status": "UNAVAILABLE"}}
            )
        return httpx.Response(200, headers=headers)

    encoded_file(tmp_path / "in.jsonl", 3)
    with pytest.raises(BatchApiResponseError, match="cannot resume"):
        _session_hook(batch_conn, handler).upload_file(tmp_path / "in.jsonl")


def test_a_resume_sends_only_the_rest_at_its_offset(batch_conn: Any, tmp_path: Path) -> None:
    sent: list[tuple[str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        command = request.headers.get("X-Goog-Upload-Command", "")
        if command == "start":
            return httpx.Response(200, headers={"X-Goog-Upload-URL": SESSION})
        if command == "query":
            return httpx.Response(
                200, headers={"X-Goog-Upload-Status": "active", "X-Goog-Upload-Size-Received": "10"}
            )
        sent.append((request.headers["X-Goog-Upload-Offset"], request.read()))
        if len(sent) == 1:
            raise httpx.WriteError("broken pipe", request=request)
        return httpx.Response(
            200, headers={"X-Goog-Upload-Status": "final"}, json={"file": {"name": "files/f-2"}}
        )

    data = encoded_file(tmp_path / "in.jsonl", 3)
    assert _session_hook(batch_conn, handler).upload_file(tmp_path / "in.jsonl") == "f-2"
    assert sent == [("0", data), ("10", data[10:])]


def test_connection_test_reads_googles_answers(
    live: Any, batch_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, hook = live()
    ok, message = hook.test_connection()
    # An empty listing still has Gemini's shape.
    assert ok, message
    assert "dialect: yes" in message
    conn = json.loads(server.connection_json())
    conn["password"] = "wrong-key-000"
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_GEMINI_WRONG", json.dumps(conn))
    wrong = BatchApiHook("batch_gemini_wrong", retry_policy=FAST)
    # Google answers a wrong key with 400 API_KEY_INVALID: a refused key, not a bad request.
    with pytest.raises(BatchApiAuthError, match="rejected"):
        wrong.get_batch("b1")
    ok, message = wrong.test_connection()
    assert not ok and "authenticated: NO (HTTP 400)" in message
    assert "wrong-key-000" not in message


def test_a_line_with_tools_and_a_tool_turn_runs(live: Any, tmp_path: Path) -> None:
    server, hook = live()
    line = GeminiDialect().encode_line(
        {
            "custom_id": "row-t",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
                "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
                "tool_choice": "auto",
            },
        }
    )
    (tmp_path / "in.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    batch = hook.create_batch(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "t"},
        model=MODEL,
    )
    while not batch.is_terminal:
        batch = hook.get_batch(batch.id)
    assert batch.state is BatchState.COMPLETED
    (result,) = hook.iter_results(batch)
    assert result.ok and result.custom_id == "row-t"
