"""Mistral through the whole pipeline (build -> submit -> deferred wait -> merge), on PostgreSQL and DuckDB.

The batch server speaks Mistral (``serve --dialect mistral``: jobs, the model on the job,
``{custom_id, body}`` lines); the connection's dialect is ``mistral``. Every terminal outcome
lands every row with its status; ``test_every_vendor.py`` checks the results table against every
other vendor's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.dialects.mistral import MistralDialect
from airflow_batch_provider.exceptions import BatchFailedError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.staging import resolve_path
from airflow_batch_provider.submission import StateStore, SubmitState
from tests.fixtures.reliability import MESSAGES, Pipeline, rows_of, seed_texts

ROWS = 30
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES}


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch, dialect: str = "mistral", **config: Any) -> Any:
    server = batch_server(dialect=dialect, **config)
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
    # The job named the build's model; the uploaded lines are Mistral's {custom_id, body}.
    (batch_id,) = record.event["batch_ids"]
    hook = BatchApiHook()
    job = hook.get_batch(batch_id)
    assert job.raw["model"] == "echo-1" and job.raw["status"] == "SUCCESS"
    uploaded = list(hook.iter_file_lines(job.input_file_id or ""))
    assert len(uploaded) == ROWS and all(set(line) == {"custom_id", "body"} for line in uploaded)
    assert not any("model" in line["body"] for line in uploaded)
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
    assert all(code for s, code, _ in rows.values() if s == "failed")


async def test_failed_job_fails_the_task_and_every_row(
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
            assert done < ROWS, f"job {batch_id} finished before it could be interrupted"
            return
        time.sleep(0.02)
    raise AssertionError(f"job {batch_id} made no progress")


@pytest.mark.parametrize(("how", "status"), [("expire", "expired"), ("cancel", "cancelled")])
async def test_timeout_exceeded_and_cancelled_keep_what_was_answered(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, how: str, status: str
) -> None:
    server = serve(batch_server, monkeypatch, line_seconds=50, chunk_size=5)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        _partly_done(batch_id)
        if how == "expire":
            server.force(batch_id, "expire")  # the job ends TIMEOUT_EXCEEDED
        else:
            BatchApiHook().cancel_batch(batch_id)  # POST /v1/batch/jobs/{id}/cancel

    record = await wh_pipeline.run(f"stop-{how}", "answers", build=BUILD, before_wait=interrupt)
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    (batch_id,) = record.event["batch_ids"]
    vendor = {"expired": "TIMEOUT_EXCEEDED", "cancelled": "CANCELLED"}[status]
    assert BatchApiHook().get_batch(batch_id).raw["status"] == vendor
    rows = rows_of(wh_pipeline)
    succeeded = [k for k, (s, _, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _, _) in rows.items() if s == status]
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS and succeeded and stopped
    assert {rows[k][1] for k in stopped} == {f"batch_{status}"}


async def test_crash_between_create_and_record_adopts_the_job_found_by_metadata(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = wh_pipeline.build("crash", **BUILD)
    real_write = StateStore.write

    class Crash(Exception):
        pass

    def crash_when_recording_id(self: StateStore, state: SubmitState) -> None:
        if state.batch_id:
            raise Crash(state.batch_id)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", crash_when_recording_id)
    with pytest.raises(Crash) as crashed:
        wh_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            wh_pipeline.context("submit", "crash")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    created = str(crashed.value)
    # A newer job of another run must not be taken for it.
    hook = BatchApiHook()
    decoy_file = hook.upload_file(resolve_path(manifest["staging_path"]) / "shard-00000.jsonl")
    hook.create_batch(
        input_file_id=decoy_file,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "another-run"},
        model="echo-1",
    )
    filters: list[dict[str, str]] = []
    real_filter = MistralDialect.filter_params

    def spy(self: MistralDialect, metadata: Any, **kwargs: Any) -> dict[str, Any]:
        filters.append(dict(metadata))
        return real_filter(self, metadata, **kwargs)

    monkeypatch.setattr(MistralDialect, "filter_params", spy)
    record = await wh_pipeline.submit_and_wait(manifest, "crash")
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batch_ids"] == [created]
    # The retry found the orphan through the listing's metadata filter, and created nothing.
    assert [set(f) for f in filters] == [{"airflow_batch_key"}]
    assert len(list(hook.list_batches())) == 2
    merged = wh_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


async def test_a_build_naming_several_models_gets_one_job_per_model(
    batch_server: Any, pg_warehouse: Any, tmp_path: Path, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Mistral job runs one model: the build writes each model's rows into shards of their own
    # (interleaved rows included), submit creates one job per shard with that model, and every
    # row is answered by the model its body named.
    serve(batch_server, monkeypatch)
    seed_texts(pg_warehouse, "tickets", [f"question {i}" for i in range(9)])
    pipeline = Pipeline(pg_warehouse, tmp_path / "staging", task_context)
    models = {1: "echo-1", 2: "echo-2", 0: "echo-3"}

    def body(row: dict[str, Any]) -> dict[str, Any]:
        return {"model": models[row["id"] % 3], "messages": [{"role": "user", "content": row["text"]}]}

    record = await pipeline.run(
        "three-models",
        "answers",
        build={"table": "tickets", "key_columns": "id", "body_callable": body, "model": None},
    )
    assert record.manifest["rows_rejected"] == 0, record.manifest
    assert [s["lines"] for s in record.manifest["shards"]] == [3, 3, 3]
    assert record.event is not None and record.event["status"] == "success", record.event
    hook = BatchApiHook()
    job_models = sorted(hook.get_batch(b).raw.get("model") for b in record.event["batch_ids"])
    assert job_models == ["echo-1", "echo-2", "echo-3"]
    q = pg_warehouse.quote
    answered = {r[0]: r[1] for r in pg_warehouse.rows(f"SELECT id, model FROM {q('answers')} ORDER BY id")}
    assert pipeline.status_counts("answers") == {"succeeded": 9}
    assert all(model.endswith(models[key % 3]) for key, model in answered.items()), answered


async def test_resubmitted_rows_of_several_models_keep_one_model_per_job(
    batch_server: Any, pg_warehouse: Any, tmp_path: Path, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The merge's resubmission gathers failed lines from every shard: a job-model vendor still
    # gets one model per shard, so attempt 2 submits (one job per model) instead of failing.
    serve(batch_server, monkeypatch, faults={"line_failure_rate": 0.5})
    seed_texts(pg_warehouse, "tickets", [f"question {i}" for i in range(30)])
    pipeline = Pipeline(pg_warehouse, tmp_path / "staging", task_context)

    def body(row: dict[str, Any]) -> dict[str, Any]:
        return {"model": f"echo-{row['id'] % 3}", "messages": [{"role": "user", "content": row["text"]}]}

    record = await pipeline.run(
        "resubmit-models",
        "answers",
        build={"table": "tickets", "key_columns": "id", "body_callable": body, "model": None},
        submit={"on_partial_failure": "succeed"},
        merge={"resubmit_failed": True},
    )
    assert record.merge is not None and record.merge["resubmit_lines"] > 0
    attempt_file = record.merge["resubmit_manifest_path"]
    attempt = staging.read_manifest(attempt_file)
    directory = staging.staging_dir_of(resolve_path(attempt_file))
    shard_models = [
        {orjson.loads(raw)["body"]["model"] for raw in (directory / s.path).read_bytes().splitlines()}
        for s in attempt.shards
    ]
    assert all(len(models) == 1 for models in shard_models), shard_models
    assert sum(s.lines for s in attempt.shards) == record.merge["resubmit_lines"]
    failed_models = {f"echo-{key % 3}" for key, row in rows_of(pipeline).items() if row[0] == "failed"}
    assert {next(iter(m)) for m in shard_models} == failed_models
    second = await pipeline.submit_and_wait(attempt_file, "resubmit-models-2")
    assert second.submit_error is None and second.event is not None, second.submit_error
    assert len(second.event["batch_ids"]) == len(attempt.shards)
