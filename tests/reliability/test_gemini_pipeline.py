"""Gemini API Batch Mode through the whole pipeline (build -> submit -> deferred wait -> merge), on
PostgreSQL and DuckDB.

The batch server speaks the Gemini API (``serve --dialect gemini``: the resumable upload, the model
on the create's path, batches as operations, one responses file); the connection's dialect is
``gemini``. Every terminal outcome lands every row with its status; ``test_every_vendor.py`` checks
the results table against every other vendor's.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects.gemini import GeminiDialect
from airflow_batch_provider.exceptions import BatchFailedError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.staging import resolve_path
from airflow_batch_provider.submission import StateStore, SubmitState
from tests.fixtures.reliability import MESSAGES, Pipeline, rows_of, seed_texts

ROWS = 30
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES}


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Any:
    server = batch_server(dialect="gemini", **config)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    return server


async def test_completed_with_mixed_rows_lands_every_row(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, faults={"line_failure_rate": 0.3})
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    record = await wh_pipeline.run("mixed", "answers", build=BUILD, submit={"on_partial_failure": "succeed"})
    failures = server.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS
    assert record.event is not None and record.event["status"] == "partial", record.event
    assert record.submit_error is None
    # The create named the build's model on its path; the uploaded lines are Gemini's {key, request}.
    (batch_id,) = record.event["batch_ids"]
    hook = BatchApiHook()
    batch = hook.get_batch(batch_id)
    assert batch.raw["metadata"]["model"] == "models/echo-1"
    assert batch.raw["metadata"]["state"] == "BATCH_STATE_SUCCEEDED"
    assert batch.raw["metadata"]["batchStats"]["failedRequestCount"] == str(failures)
    uploaded = list(hook.iter_file_lines(batch.input_file_id or ""))
    assert len(uploaded) == ROWS and all(set(line) == {"key", "request"} for line in uploaded)
    assert all(set(line["request"]) == {"contents"} for line in uploaded)
    # Staging still holds the canonical line.
    shard = resolve_path(record.manifest["staging_path"]) / "shard-00000.jsonl"
    assert orjson.loads(shard.read_bytes().splitlines()[0])["url"] == "/v1/chat/completions"
    rows = rows_of(wh_pipeline)
    statuses = [s for s, _, _ in rows.values()]
    assert len(rows) == ROWS and statuses.count("failed") == failures
    assert statuses.count("succeeded") == ROWS - failures
    assert all(
        content == f"echo: question {key - 1}" for key, (s, _, content) in rows.items() if s == "succeeded"
    )
    # A failed request is a line of the responses file with Google's status name as its code.
    assert {code for s, code, _ in rows.values() if s == "failed"} == {"INTERNAL"}
    usage = wh_pipeline.warehouse.rows(
        "SELECT MIN(prompt_tokens), MIN(completion_tokens) FROM answers WHERE status = 'succeeded'"
    )
    assert usage[0][0] > 0 and usage[0][1] > 0


async def test_failed_batch_fails_the_task_and_every_row(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, faults={"fail_validation": True})
    seed_texts(wh_pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await wh_pipeline.run("failed", "answers", build=BUILD)
    assert isinstance(record.submit_error, BatchFailedError), record.submit_error
    assert record.event is not None and record.event["status"] == "failed"
    rows = rows_of(wh_pipeline)
    assert len(rows) == ROWS and {s for s, _, _ in rows.values()} == {"failed"}


def _partly_done(batch_id: str, at_least: int = 5) -> None:
    hook = BatchApiHook()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = hook.get_batch(batch_id).request_counts.completed
        if done >= at_least:
            assert done < ROWS, f"batch {batch_id} finished before it could be interrupted"
            return
        time.sleep(0.02)
    raise AssertionError(f"batch {batch_id} made no progress")


@pytest.mark.parametrize(("how", "status"), [("expire", "expired"), ("cancel", "cancelled")])
async def test_expired_and_cancelled_keep_what_was_answered(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, how: str, status: str
) -> None:
    server = serve(batch_server, monkeypatch, line_seconds=50, chunk_size=5)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        _partly_done(batch_id)
        if how == "expire":
            server.force(batch_id, "expire")  # the batch ends BATCH_STATE_EXPIRED
        else:
            BatchApiHook().cancel_batch(batch_id)  # POST /v1beta/batches/{id}:cancel

    record = await wh_pipeline.run(f"stop-{how}", "answers", build=BUILD, before_wait=interrupt)
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    (batch_id,) = record.event["batch_ids"]
    state = {"expired": "BATCH_STATE_EXPIRED", "cancelled": "BATCH_STATE_CANCELLED"}[status]
    assert BatchApiHook().get_batch(batch_id).raw["metadata"]["state"] == state
    rows = rows_of(wh_pipeline)
    succeeded = [k for k, (s, _, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _, _) in rows.items() if s == status]
    # The responses file holds what was answered; the rest has the batch's end as its status.
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS and succeeded and stopped


async def test_control_plane_faults_a_dropped_upload_and_a_dropped_download(
    batch_server: Any,
    wh_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 429s, 500s and 503s on every kind of call from the first one, the create included (a 429
    # is retried; a 5xx may have created the batch, which is then looked for by its display
    # name), an upload dropped half way (resumed from the offset the server holds) and the
    # responses file dropped half way (read again from where it stopped).
    faults = {"rate_429": 0.12, "rate_500": 0.12, "rate_503": 0.12, "retry_after": 0.05, "drop_rate": 0.5}
    server = serve(batch_server, monkeypatch, faults=faults, validate_seconds=2000, finalize_seconds=2000)
    rows = seed_texts(wh_pipeline.warehouse, "tickets", [f"ticket {i}" for i in range(ROWS)])
    record = await wh_pipeline.run("faults", "answers", build={**BUILD, "max_lines": 10})
    counters = server.stats()["counters"]
    server.set_faults(rate_429=0, rate_500=0, rate_503=0, drop_rate=0)
    out = capsys.readouterr().out
    assert record.submit_error is None, record.submit_error
    assert record.event is not None and record.event["status"] == "success", record.event
    assert min(counters.get(f"status_{code}", 0) for code in (429, 500, 503)) > 0, counters
    assert counters.get("drop", 0) >= 2, counters
    assert "resuming from there" in out
    # A 5xx on a create was looked for by its display name before any retry.
    assert out.count("create failed ambiguously") >= 1
    got = dict(wh_pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert wh_pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {text}" for i, text in rows}
    # Whatever failed ambiguously never paid twice: one batch per shard.
    assert len(record.manifest["shards"]) == 3
    assert len(list(BatchApiHook().list_batches())) == 3


async def test_crash_between_create_and_record_adopts_the_batch_found_by_display_name(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = wh_pipeline.build("crash", **BUILD)
    real_write = StateStore.write

    class Crash(Exception):
        pass

    keys: list[str] = []

    def crash_when_recording_id(self: StateStore, state: SubmitState) -> None:
        if state.batch_id:
            keys.append(state.key)
            raise Crash(state.batch_id)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", crash_when_recording_id)
    with pytest.raises(Crash) as crashed:
        wh_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            wh_pipeline.context("submit", "crash")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    created = str(crashed.value)
    hook = BatchApiHook()
    # The batch carries the shard's idempotency key as its display name.
    assert hook.get_batch(created).raw["metadata"]["displayName"] == keys[0]
    # A newer batch of another run must not be taken for it.
    decoy_file = hook.upload_file(resolve_path(manifest["staging_path"]) / "shard-00000.jsonl")
    hook.create_batch(
        input_file_id=decoy_file,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "another-run"},
        model="echo-1",
    )
    listings: list[dict[str, Any]] = []
    real_params = GeminiDialect.list_params

    def spy(self: GeminiDialect, limit: int | None = None) -> dict[str, Any]:
        listings.append(real_params(self, limit))
        return real_params(self, limit)

    monkeypatch.setattr(GeminiDialect, "list_params", spy)
    record = await wh_pipeline.submit_and_wait(manifest, "crash")
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batch_ids"] == [created]
    # The retry scanned the listing (it has no filter) and created nothing.
    assert listings and all(set(p) == {"pageSize"} for p in listings)
    assert len(list(hook.list_batches())) == 2
    merged = wh_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


async def test_embeddings_run_through_async_batch_embed_content(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, faults={"line_failure_rate": 0.2})
    seed_texts(wh_pipeline.warehouse, "docs", [f"document {i}" for i in range(ROWS)])
    build = {"table": "docs", "key_columns": "id", "input_column": "text", "model": "echo-embed"}
    record = await wh_pipeline.run("emb", "vectors", build=build, submit={"on_partial_failure": "succeed"})
    failures = server.stats()["counters"]["line_failures"]
    assert record.event is not None and record.event["status"] in ("completed", "partial"), record.event
    (batch_id,) = record.event["batch_ids"]
    hook = BatchApiHook()
    batch = hook.get_batch(batch_id)
    # Created with the embeddings method: its metadata type says so, and the lines are EmbedContentRequests.
    assert batch.endpoint == "/v1/embeddings"
    assert batch.raw["metadata"]["@type"].endswith(".EmbedContentBatch")
    uploaded = list(hook.iter_file_lines(batch.input_file_id or ""))
    assert uploaded[0]["request"] == {
        "content": {"parts": [{"text": uploaded[0]["request"]["content"]["parts"][0]["text"]}]}
    }
    q = wh_pipeline.warehouse.quote
    rows = wh_pipeline.warehouse.rows(f"SELECT id, status, embedding FROM {q('vectors')} ORDER BY id")
    assert len(rows) == ROWS
    statuses = [r[1] for r in rows]
    assert statuses.count("failed") == failures and statuses.count("succeeded") == ROWS - failures
    for _, status, embedding in rows:
        if status == "succeeded":
            vector = embedding if isinstance(embedding, list) else orjson.loads(embedding)
            assert len(vector) > 0 and all(isinstance(v, float) for v in vector)


def test_what_an_embed_content_request_cannot_carry_is_refused_by_name() -> None:
    dialect = GeminiDialect()
    line = {"custom_id": "k", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}
    assert dialect.unsupported(line) is None
    assert dialect.encode_line({**line, "body": {"input": ["x"], "dimensions": 4}}) == {
        "key": "k",
        "request": {"content": {"parts": [{"text": "x"}]}, "outputDimensionality": 4},
    }
    for body, named in (
        ({"input": ["a", "b"]}, "one non-empty text"),
        ({"input": [1, 2, 3]}, "one non-empty text"),
        ({"input": "x", "encoding_format": "base64"}, "encoding_format='base64'"),
        ({"input": "x", "user": "u"}, "user not supported"),
        ({"input": "x", "dimensions": 0}, "dimensions=0"),
    ):
        assert named in (dialect.unsupported({**line, "body": body}) or ""), body
    assert dialect.create_path("gemini-embedding-001", "/v1/embeddings") == (
        "models/gemini-embedding-001:asyncBatchEmbedContent"
    )
    ok = dialect.parse_result_line(
        {"key": "k", "response": {"embedding": {"values": [0.5, -0.5]}, "tokenCount": "3"}}, "output"
    )
    assert ok.ok and ok.body == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.5]}],
        "model": None,
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    bad = dialect.parse_result_line({"key": "k", "response": {"embedding": {"values": ["x"]}}}, "output")
    assert not bad.ok and bad.error is not None and bad.error.code == "invalid_output"
