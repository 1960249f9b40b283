"""Amazon Bedrock batch inference through the whole pipeline (build -> submit -> deferred wait ->
merge), on PostgreSQL and DuckDB, with the run staged on S3 (moto).

The batch server speaks Bedrock's control plane (``serve --dialect bedrock``: SigV4-signed calls,
jobs reading their input from S3 and writing ``*.jsonl.out`` and ``manifest.json.out`` back);
the connection's dialect is ``bedrock``. Every terminal status lands every row with its status.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects.bedrock import SUBMIT_TIME_MARGIN, BedrockDialect
from airflow_batch_provider.exceptions import BatchFailedError, ConfigurationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.submission import StateStore, SubmitState
from tests.fixtures.reliability import MESSAGES, Pipeline, partly_done, rows_of, seed_texts
from tests.fixtures.s3 import S3Staging, cut_object_reads

ROWS = 30
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "dialect": "bedrock"}


@pytest.fixture
def s3_pipeline(wh_pipeline: Pipeline, s3_staging: S3Staging) -> Pipeline:
    """The warehouse pipeline with its runs staged in the test's bucket."""
    wh_pipeline.staging_root = s3_staging.path("staging")
    return wh_pipeline


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Any:
    server = batch_server(dialect="bedrock", **config)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    return server


def job_objects(s3: S3Staging, batch_id: str) -> list[str]:
    return [k for k in s3.keys(prefix="") if f"/output/{batch_id}/" in k]


async def test_partially_completed_lands_every_row(
    batch_server: Any, s3_pipeline: Pipeline, s3_staging: S3Staging, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, faults={"line_failure_rate": 0.3})
    seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    record = await s3_pipeline.run("mixed", "answers", build=BUILD, submit={"on_partial_failure": "succeed"})
    failures = server.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS
    assert record.event is not None and record.event["status"] == "partial", record.event
    (batch_id,) = record.event["batch_ids"]
    job = BatchApiHook().get_batch(batch_id)
    assert job.raw["status"] == "PartiallyCompleted" and job.raw["errorRecordCount"] == failures
    assert job.raw["modelId"] == "echo-1" and job.raw["modelInvocationType"] == "Converse"
    # The job read {recordId, modelInput} lines from the run's staging; staging keeps the canonical one.
    (uploaded,) = [k for k in s3_staging.keys(prefix="") if "/vendor/" in k and "/input/" in k]
    lines = [orjson.loads(x) for x in s3_staging.read(uploaded).splitlines()]
    assert len(lines) == ROWS and all(set(x) == {"recordId", "modelInput"} for x in lines)
    assert lines[0]["modelInput"]["messages"][0]["content"] == [{"text": "question 0"}]
    assert sorted(k.rsplit("/", 1)[1] for k in job_objects(s3_staging, batch_id)) == [
        "manifest.json.out",
        "shard-00000.jsonl.out",
    ]
    rows = rows_of(s3_pipeline)
    statuses = [s for s, _, _ in rows.values()]
    assert len(rows) == ROWS and statuses.count("failed") == failures
    assert statuses.count("succeeded") == ROWS - failures
    assert all(
        content == f"echo: question {k - 1}" for k, (s, _, content) in rows.items() if s == "succeeded"
    )
    assert {code for s, code, _ in rows.values() if s == "failed"} == {"http_500"}
    usage = s3_pipeline.warehouse.rows(
        "SELECT MIN(prompt_tokens), MIN(completion_tokens) FROM answers WHERE status = 'succeeded'"
    )
    assert usage[0][0] > 0 and usage[0][1] > 0


async def test_completed_and_failed_jobs(
    batch_server: Any, s3_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch)
    seed_texts(s3_pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await s3_pipeline.run("completed", "answers", build=BUILD)
    assert record.event is not None and record.event["status"] == "success", record.event
    (batch_id,) = record.event["batch_ids"]
    assert BatchApiHook().get_batch(batch_id).raw["status"] == "Completed"
    assert {s for s, _, _ in rows_of(s3_pipeline).values()} == {"succeeded"}

    server.set_faults(fail_validation=True)
    record = await s3_pipeline.run("failed", "failed_answers", build=BUILD)
    assert isinstance(record.submit_error, BatchFailedError), record.submit_error
    assert record.event is not None and record.event["status"] == "failed"
    (batch_id,) = record.event["batch_ids"]
    assert BatchApiHook().get_batch(batch_id).raw["status"] == "Failed"
    statuses = s3_pipeline.warehouse.rows("SELECT DISTINCT status FROM failed_answers")
    assert statuses == [("failed",)]


@pytest.mark.parametrize(
    ("how", "status", "vendor"), [("expire", "expired", "Expired"), ("stop", "cancelled", "Stopped")]
)
async def test_expired_and_stopped_keep_what_was_answered(
    batch_server: Any,
    s3_pipeline: Pipeline,
    s3_staging: S3Staging,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    status: str,
    vendor: str,
) -> None:
    server = serve(batch_server, monkeypatch, line_seconds=50, chunk_size=5)
    seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        partly_done(batch_id, ROWS)
        if how == "expire":
            server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)  # StopModelInvocationJob

    record = await s3_pipeline.run(f"stop-{how}", "answers", build=BUILD, before_wait=interrupt)
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    (batch_id,) = record.event["batch_ids"]
    job = BatchApiHook().get_batch(batch_id)
    assert job.raw["status"] == vendor
    rows = rows_of(s3_pipeline)
    succeeded = [k for k, (s, _, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _, _) in rows.items() if s == status]
    # The .out file holds the records that ran; Bedrock writes none for the others, which take
    # the job's end as their status.
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS and succeeded and stopped
    assert len(succeeded) == job.raw["processedRecordCount"]


async def test_crash_between_create_and_record_adopts_the_job_found_by_name(
    batch_server: Any, s3_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = s3_pipeline.build("crash", **BUILD)
    real_write = StateStore.write

    class Crash(Exception):
        pass

    keys: list[str] = []
    intents: list[datetime] = []

    def crash_when_recording_id(self: StateStore, state: SubmitState) -> None:
        if state.batch_id:
            keys.append(state.key)
            raise Crash(state.batch_id)
        assert state.intent_at is not None
        intents.append(state.intent_at)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", crash_when_recording_id)
    with pytest.raises(Crash) as crashed:
        s3_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            s3_pipeline.context("submit", "crash")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    created = str(crashed.value)
    hook = BatchApiHook()
    # The job's name and its clientRequestToken are the shard's idempotency key.
    job = hook.get_batch(created)
    assert job.raw["jobName"] == job.raw["clientRequestToken"] == keys[0]
    lookups = spy_filters(monkeypatch)
    result = s3_pipeline.submit_op(manifest, wait_for_completion=False).execute(
        s3_pipeline.context("submit", "crash")
    )
    assert result["batch_ids"] == [created]
    assert [b.id for b in hook.list_batches()] == [created]
    # The lookup asked Bedrock for the key's jobs submitted since the intent, less the margin.
    assert [p["nameContains"] for p in lookups] == [keys[0]]
    assert submit_time_after(lookups[0]) == (intents[0] - SUBMIT_TIME_MARGIN).replace(microsecond=0)


def spy_filters(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The listing filters the orphan lookups send (``BedrockDialect.filter_params``' answers)."""
    sent: list[dict[str, Any]] = []
    real = BedrockDialect.filter_params

    def spy(self: BedrockDialect, metadata: Any, **kwargs: Any) -> dict[str, Any]:
        params = real(self, metadata, **kwargs)
        sent.append(params)
        return params

    monkeypatch.setattr(BedrockDialect, "filter_params", spy)
    return sent


def submit_time_after(params: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(params["submitTimeAfter"]).replace("Z", "+00:00"))


async def test_a_failed_job_is_replaced_by_a_job_of_a_new_name_and_token(
    batch_server: Any, s3_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, faults={"fail_validation": True})
    seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = s3_pipeline.build("again", **BUILD)
    record = await s3_pipeline.submit_and_wait(manifest, "again")
    assert record.event is not None and record.event["status"] == "failed", record.event
    (failed,) = record.event["batch_ids"]
    hook = BatchApiHook()
    key = hook.get_batch(failed).raw["jobName"]
    server.set_faults(fail_validation=False)

    # The replacement's create is made, then the task dies before recording its id.
    real_write = StateStore.write

    class Crash(Exception):
        pass

    def crash_when_recording_id(self: StateStore, state: SubmitState) -> None:
        if state.batch_id and state.batch_id != failed:
            raise Crash(state.batch_id)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", crash_when_recording_id)
    with pytest.raises(Crash) as crashed:
        s3_pipeline.submit_op(manifest, wait_for_completion=False, resubmit_failed=True).execute(
            s3_pipeline.context("submit", "again")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    replacement = str(crashed.value)
    job = hook.get_batch(replacement).raw
    # A new job: its own name and token (the first's would have answered with the failed job).
    assert replacement != failed
    assert job["jobName"] == job["clientRequestToken"] == f"{key}-r1"
    # The next try finds the replacement by the shard's key (nameContains) and adopts it.
    lookups = spy_filters(monkeypatch)
    record = await s3_pipeline.submit_and_wait(manifest, "again", resubmit_failed=True)
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batch_ids"] == [replacement]
    assert [p["nameContains"] for p in lookups] == [key]
    assert {b.id: b.raw["status"] for b in hook.list_batches()} == {
        failed: "Failed",
        replacement: "Completed",
    }
    merged = s3_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


def test_a_local_staging_is_refused_before_anything_is_written(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(3)])
    manifest = wh_pipeline.build("local", **BUILD)
    with pytest.raises(ConfigurationError, match=r"s3://.*staging_root") as refused:
        wh_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            wh_pipeline.context("submit", "local")
        )
    assert "file://" in str(refused.value)
    assert server.stats()["counters"].get("batches_created", 0) == 0


def test_a_shard_under_the_jobs_minimum_is_refused_before_any_job(
    batch_server: Any, s3_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="bedrock")
    conn = orjson.loads(server.connection_json())
    conn["extra"]["min_records_per_job"] = 5
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", orjson.dumps(conn).decode())
    seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i}" for i in range(7)])
    manifest = s3_pipeline.build("small", **{**BUILD, "max_lines": 5})
    with pytest.raises(
        ConfigurationError, match=r"shard 1 .*2 record\(s\) but Bedrock runs a batch job of at least 5"
    ):
        s3_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            s3_pipeline.context("submit", "small")
        )
    assert server.stats()["counters"].get("batches_created", 0) == 0


async def test_throttling_5xx_and_dropped_s3_reads_are_survived(
    batch_server: Any,
    s3_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 429s (ThrottlingException), 500s and 503s on every kind of call, the create included (a 5xx
    # may have made the job, which is then looked for by name before any retry), and the
    # results' S3 reads cut mid-object (resumed at the byte reached).
    faults = {"rate_429": 0.12, "rate_500": 0.12, "rate_503": 0.12, "retry_after": 0.05}
    server = serve(batch_server, monkeypatch, faults=faults, validate_seconds=2000, finalize_seconds=2000)
    cuts = cut_object_reads(monkeypatch)
    rows = seed_texts(s3_pipeline.warehouse, "tickets", [f"ticket {i}" for i in range(ROWS)])
    record = await s3_pipeline.run("faults", "answers", build={**BUILD, "max_lines": 10})
    counters = server.stats()["counters"]
    server.set_faults(rate_429=0, rate_500=0, rate_503=0)
    out = capsys.readouterr().out
    assert record.submit_error is None, record.submit_error
    assert record.event is not None and record.event["status"] == "success", record.event
    assert min(counters.get(f"status_{code}", 0) for code in (429, 500, 503)) > 0, counters
    assert out.count("create failed ambiguously") >= 1
    assert any(offset > 0 for offset in cuts), cuts  # a read resumed past the start of its object
    got = dict(s3_pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert s3_pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {text}" for i, text in rows}
    # Whatever failed ambiguously never paid twice: one job per shard.
    assert len(record.manifest["shards"]) == 3
    assert len(list(BatchApiHook().list_batches())) == 3


def test_an_encoded_input_over_the_file_limit_is_refused_before_its_job(
    batch_server: Any, s3_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="bedrock")
    conn = orjson.loads(server.connection_json())
    conn["extra"]["max_bytes_per_file"] = 2000
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", orjson.dumps(conn).decode())
    seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i} " + "x" * 300 for i in range(8)])
    # Built for a looser limit (shards of ~2.7 KB), submitted through the connection's 2,000 bytes.
    manifest = s3_pipeline.build("big", **BUILD)
    with pytest.raises(ConfigurationError, match=r"bytes but a Bedrock input file takes at most 2,000"):
        s3_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            s3_pipeline.context("submit", "big")
        )
    assert server.stats()["counters"].get("batches_created", 0) == 0


@pytest.mark.parametrize("invocation_type", ["native", "auto"])
async def test_a_llama_run_with_native_bodies_lands_every_row(
    batch_server: Any,
    s3_pipeline: Pipeline,
    s3_staging: S3Staging,
    monkeypatch: pytest.MonkeyPatch,
    invocation_type: str,
) -> None:
    server = batch_server(dialect="bedrock")
    conn = orjson.loads(server.connection_json())
    conn["extra"]["invocation_type"] = invocation_type
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", orjson.dumps(conn).decode())
    rows = seed_texts(s3_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    model = "us.meta.llama3-2-3b-instruct-v1:0"
    record = await s3_pipeline.run("llama", "answers", build={**BUILD, "model": model})
    assert record.event is not None and record.event["status"] == "success", record.event
    (batch_id,) = record.event["batch_ids"]
    job = BatchApiHook().get_batch(batch_id).raw
    # An InvokeModel job: no modelInvocationType sent, the records are Llama 3 prompts.
    assert job["modelId"] == model and job["modelInvocationType"] == "InvokeModel"
    (uploaded,) = [k for k in s3_staging.keys(prefix="") if "/vendor/" in k and "/input/" in k]
    first = orjson.loads(s3_staging.read(uploaded).splitlines()[0])["modelInput"]
    assert first["prompt"].startswith("<|begin_of_text|>") and "question 0" in first["prompt"]
    (out,) = [k for k in job_objects(s3_staging, batch_id) if k.endswith(".jsonl.out")]
    answer = orjson.loads(s3_staging.read(out).splitlines()[0])["modelOutput"]
    assert {"generation", "prompt_token_count", "generation_token_count", "stop_reason"} <= set(answer)
    got = dict(s3_pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert got == {i: f"echo: {text}" for i, text in rows}
    usage = s3_pipeline.warehouse.rows(
        "SELECT MIN(prompt_tokens), MIN(completion_tokens) FROM answers WHERE status = 'succeeded'"
    )
    assert usage[0][0] > 0 and usage[0][1] > 0
