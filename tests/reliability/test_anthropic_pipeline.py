"""Anthropic through the whole pipeline (build -> submit -> deferred wait -> merge), on PostgreSQL and DuckDB.

The batch server speaks Anthropic (``serve --dialect anthropic``: requests inline in the create,
``processing_status``, one results stream); the connection's dialect is ``anthropic`` and its
extra ``request_defaults`` gives every line the ``max_tokens`` Anthropic requires. Every
terminal outcome lands every row with its status; the results table has OpenAI's columns.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider.exceptions import (
    AmbiguousOrphanError,
    BatchFailedError,
    EmptyBatchError,
    JsonlValidationError,
)
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.transport import FileBody
from airflow_batch_provider.staging import resolve_path
from airflow_batch_provider.submission import StateStore, SubmitState
from tests.fixtures.reliability import MESSAGES, Pipeline, rows_of, seed_texts

ROWS = 30
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES}


def serve(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, dialect: str = "anthropic", **config: Any
) -> Any:
    server = batch_server(dialect=dialect, **config)
    conn = json.loads(server.connection_json())
    if dialect == "anthropic":
        conn["extra"]["request_defaults"] = {"max_tokens": 64}
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
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
    # The requests went inline in the create call: nothing was uploaded.
    assert server.stats()["counters"].get("files_uploaded", 0) == 0
    (batch_id,) = record.event["batch_ids"]
    batch = BatchApiHook().get_batch(batch_id)
    assert batch.raw["processing_status"] == "ended" and batch.raw["request_counts"]["errored"] == failures
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
    assert {code for s, code, _ in rows.values() if s == "failed"} == {"api_error"}


async def test_every_request_errored_fails_the_task_as_all_lines_failed(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Anthropic has no failed batch: one whose every request errored ends, and fails the task.
    serve(batch_server, monkeypatch, faults={"line_failure_rate": 1.0})
    seed_texts(wh_pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await wh_pipeline.run("failed", "answers", build=BUILD)
    assert isinstance(record.submit_error, BatchFailedError), record.submit_error
    assert record.event is not None and record.event["status"] == "failed", record.event
    assert record.event["termination_reason"] == "all_lines_failed"
    rows = rows_of(wh_pipeline)
    assert len(rows) == ROWS and {s for s, _, _ in rows.values()} == {"failed"}


@pytest.mark.parametrize(("how", "status"), [("expire", "expired"), ("cancel", "cancelled")])
async def test_every_request_expired_or_canceled_ends_expired_or_cancelled(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, how: str, status: str
) -> None:
    server = serve(batch_server, monkeypatch, faults={"stall_batches": True})
    seed_texts(wh_pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])

    def stop(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        assert _answered(server, batch_id) == 0
        if how == "expire":
            server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)  # POST /v1/messages/batches/{id}/cancel

    record = await wh_pipeline.run(f"all-{how}", "answers", build=BUILD, before_wait=stop)
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    rows = rows_of(wh_pipeline)
    assert len(rows) == ROWS and {s for s, _, _ in rows.values()} == {status}
    assert {code for _, code, _ in rows.values()} == {f"batch_{status}"}


def _answered(server: Any, batch_id: str) -> int:
    """Requests the server has answered so far (Anthropic's own counts stay 0 until the end, so
    the test reads the in-process server's record)."""
    state = server._server._server.config.app.state.server
    counts = state.engine.get(batch_id)["request_counts"]
    return int(counts["completed"]) + int(counts["failed"])


def _partly_done(server: Any, batch_id: str, at_least: int = 5) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = _answered(server, batch_id)
        if done >= at_least:
            assert done < ROWS, f"batch {batch_id} finished before it could be interrupted"
            return
        time.sleep(0.02)
    raise AssertionError(f"batch {batch_id} made no progress")


@pytest.mark.parametrize(("how", "status"), [("expire", "expired"), ("cancel", "cancelled")])
async def test_stopped_mid_way_completes_with_what_was_answered(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, how: str, status: str
) -> None:
    server = serve(batch_server, monkeypatch, line_seconds=50, chunk_size=5)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        _partly_done(server, batch_id)
        if how == "expire":
            server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)

    record = await wh_pipeline.run(
        f"stop-{how}", "answers", build=BUILD, before_wait=interrupt, submit={"on_partial_failure": "succeed"}
    )
    rows = rows_of(wh_pipeline)
    succeeded = [k for k, (s, _, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _, _) in rows.items() if s == status]
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS and succeeded and stopped
    # Some requests answered: the batch ended "completed" with per-row statuses, not all-stopped.
    assert record.event is not None and record.event["status"] == "partial", record.event
    assert {rows[k][1] for k in stopped} == {f"batch_{status}"}


async def test_control_plane_faults_and_a_dropped_results_stream(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 429s, 500s and 503s on every kind of call from the first one, the create included (a 429
    # is retried; a 5xx may have created the batch, which is then looked for by its time and
    # request count), and the results stream dropped half way.
    faults = {"rate_429": 0.12, "rate_500": 0.12, "rate_503": 0.12, "retry_after": 0.05, "drop_rate": 0.5}
    server = serve(batch_server, monkeypatch, faults=faults, validate_seconds=2000, finalize_seconds=2000)
    rows = seed_texts(pipeline.warehouse, "tickets", [f"ticket {i}" for i in range(ROWS)])
    record = await pipeline.run("faults", "answers", build={**BUILD, "max_lines": 10})
    counters = server.stats()["counters"]
    server.set_faults(rate_429=0, rate_500=0, rate_503=0, drop_rate=0)
    ambiguous = capsys.readouterr().out.count("create failed ambiguously")
    assert record.submit_error is None, record.submit_error
    assert record.event is not None and record.event["status"] == "success", record.event
    assert min(counters.get(f"status_{code}", 0) for code in (429, 500, 503)) > 0, counters
    assert counters.get("drop", 0) >= 1, counters
    got = dict(pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {text}" for i, text in rows}
    # Ambiguous creates happened and never paid twice: one batch per shard.
    assert ambiguous >= 1
    assert len(record.manifest["shards"]) == 3
    assert len(list(BatchApiHook().list_batches())) == 3


class Crash(Exception):
    pass


def _crash_when_recording_id(monkeypatch: pytest.MonkeyPatch) -> Any:
    real_write = StateStore.write

    def write(self: StateStore, state: SubmitState) -> None:
        if state.batch_id:
            raise Crash(state.batch_id)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", write)
    return real_write


def _inline_batch(requests: int, prefix: str) -> str:
    """A batch of another run, created straight through the hook."""
    body = {
        "requests": [
            {
                "custom_id": f"{prefix}{i}",
                "params": {
                    "model": "echo-1",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "x"}],
                },
            }
            for i in range(requests)
        ]
    }
    path = Path(f"/tmp/abp-decoy-{prefix}-{time.monotonic_ns()}.json")
    path.write_bytes(orjson.dumps(body))
    try:
        return (
            BatchApiHook()
            .create_batch(
                endpoint="/v1/chat/completions",
                inline=FileBody(path, filename="decoy", size=path.stat().st_size),
            )
            .id
        )
    finally:
        path.unlink()


async def test_crash_between_create_and_record_adopts_the_one_batch_with_its_count(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = pipeline.build("crash", **BUILD)
    real_write = _crash_when_recording_id(monkeypatch)
    with pytest.raises(Crash) as crashed:
        pipeline.submit_op(manifest, wait_for_completion=False).execute(pipeline.context("submit", "crash"))
    monkeypatch.setattr(StateStore, "write", real_write)
    created = str(crashed.value)
    # Batches of other runs made since, with other request counts, are not taken for it.
    decoys = {_inline_batch(ROWS - 1, "a"), _inline_batch(ROWS + 1, "b")}
    record = await pipeline.submit_and_wait(manifest, "crash")
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batch_ids"] == [created]
    # The retry created nothing.
    assert {b.id for b in BatchApiHook().list_batches()} == {created, *decoys}
    merged = pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


async def test_crash_window_refuses_to_guess_between_batches_of_the_same_count(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = pipeline.build("twins", **BUILD)
    real_write = _crash_when_recording_id(monkeypatch)
    with pytest.raises(Crash) as crashed:
        pipeline.submit_op(manifest, wait_for_completion=False).execute(pipeline.context("submit", "twins"))
    monkeypatch.setattr(StateStore, "write", real_write)
    twin = _inline_batch(ROWS, "t")  # another run's batch, the same size, in the same window
    with pytest.raises(AmbiguousOrphanError) as refused:
        pipeline.submit_op(manifest, wait_for_completion=False).execute(pipeline.context("submit", "twins"))
    message = str(refused.value)
    assert str(crashed.value) in message and twin in message and "record its id" in message
    # Nothing was created or guessed.
    assert len(list(BatchApiHook().list_batches())) == 2


async def test_crash_before_the_create_submits_once(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The intent is durable but the create was never sent: the retry finds nothing and creates.
    serve(batch_server, monkeypatch)
    seed_texts(pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = pipeline.build("early", **BUILD)

    def no_create(self: BatchApiHook, **kwargs: Any) -> Any:
        raise Crash("before the create")

    real_create = BatchApiHook.create_batch
    monkeypatch.setattr(BatchApiHook, "create_batch", no_create)
    with pytest.raises(Crash):
        pipeline.submit_op(manifest, wait_for_completion=False).execute(pipeline.context("submit", "early"))
    monkeypatch.setattr(BatchApiHook, "create_batch", real_create)
    assert list(BatchApiHook().list_batches()) == []
    record = await pipeline.submit_and_wait(manifest, "early")
    assert record.event is not None and record.event["status"] == "success", record.event
    assert len(list(BatchApiHook().list_batches())) == 1


async def test_a_line_without_max_tokens_fails_the_submit_before_anything_is_sent(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="anthropic")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())  # no request_defaults
    seed_texts(pipeline.warehouse, "tickets", ["a", "b"])
    manifest = pipeline.build("no-tokens", **BUILD)  # built for OpenAI's shape: no max_tokens needed
    with pytest.raises(JsonlValidationError, match="line 1: max_tokens is required by Anthropic"):
        pipeline.submit_op(manifest, wait_for_completion=False).execute(
            pipeline.context("submit", "no-tokens")
        )
    assert server.stats()["counters"].get("batches_created", 0) == 0
    # A build for the Anthropic connection rejects such rows by name instead.
    with pytest.raises(EmptyBatchError, match=r"all 2 row\(s\) rejected \(unsupported: 2\)"):
        pipeline.build("no-tokens-2", batch_conn_id="batch_api_default", **BUILD)
    # ... and with the connection's request_defaults the same build writes every row.
    serve(batch_server, monkeypatch)
    assert pipeline.build("no-tokens-3", batch_conn_id="batch_api_default", **BUILD)["rows_written"] == 2


async def test_each_shards_create_names_the_earlier_shards_batches_as_not_its_own(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shards of one build have the same size: an ambiguous create of shard 2 must not look like
    # shard 1's batch, so each create tells the hook which batches are the other shards'.
    serve(batch_server, monkeypatch)
    seed_texts(pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = pipeline.build("shards", **{**BUILD, "max_lines": 10})
    seen: list[list[str]] = []
    real_create = BatchApiHook.create_batch

    def spy(self: BatchApiHook, **kwargs: Any) -> Any:
        seen.append(list(kwargs.get("not_these") or []))
        return real_create(self, **kwargs)

    monkeypatch.setattr(BatchApiHook, "create_batch", spy)
    result = pipeline.submit_op(manifest, wait_for_completion=False).execute(
        pipeline.context("submit", "shards")
    )
    ids = result["batch_ids"]
    assert len(ids) == 3 and seen == [[], ids[:1], ids[:2]]
