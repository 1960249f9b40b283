"""Vertex AI batch prediction through the whole pipeline (build -> submit -> deferred wait -> merge),
on PostgreSQL and DuckDB, with the run staged on Cloud Storage (the GCS emulator).

The batch server speaks Vertex AI's control plane (``serve --dialect vertex``: a Google bearer
token, ``batchPredictionJobs`` reading their input from gs:// and writing
``prediction-model-*/predictions.jsonl`` back); the connection's dialect is ``vertex``, its token
traded for a service-account key at a local token endpoint. Every terminal state lands every row
with its status.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.dialects.vertex import VertexDialect
from airflow_batch_provider.exceptions import BatchFailedError, ConfigurationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.objects import plain_uri
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.submission import (
    FINGERPRINT_NAME,
    KEY_NAME,
    RunIdentity,
    StateStore,
    SubmitState,
    batch_metadata,
)
from tests.fixtures.gcs import GcsStaging
from tests.fixtures.reliability import MESSAGES, Pipeline, partly_done, rows_of, seed_texts
from tests.fixtures.s3 import cut_object_reads

ROWS = 30
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "dialect": "vertex"}


@pytest.fixture
def gs_pipeline(wh_pipeline: Pipeline, gcs_staging: GcsStaging, google_key: Any) -> Pipeline:
    """The warehouse pipeline with its runs staged in the test's bucket (and the Google key the
    connection trades for a token, set up before the test's loop runs)."""
    wh_pipeline.staging_root = gcs_staging.path("staging")
    return wh_pipeline


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Any:
    server = batch_server(dialect="vertex", api_key="ya29.pipeline", **config)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    return server


def predictions(gcs: GcsStaging) -> list[str]:
    return [k for k in gcs.keys(prefix="") if "/prediction-model-" in k]


async def test_partially_succeeded_lands_every_row(
    batch_server: Any, gs_pipeline: Pipeline, gcs_staging: GcsStaging, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, faults={"line_failure_rate": 0.3})
    seed_texts(gs_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    record = await gs_pipeline.run("mixed", "answers", build=BUILD, submit={"on_partial_failure": "succeed"})
    failures = server.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS
    assert record.event is not None and record.event["status"] == "partial", record.event
    (batch_id,) = record.event["batch_ids"]
    job = BatchApiHook().get_batch(batch_id)
    assert job.raw["state"] == "JOB_STATE_PARTIALLY_SUCCEEDED"
    assert job.raw["completionStats"]["failedCount"] == str(failures)
    assert job.raw["model"] == "publishers/google/models/echo-1"
    assert job.raw["labels"]["airflow_batch_key"] == job.raw["displayName"]
    # The job read {key, request} lines from the run's staging; staging keeps the canonical one.
    (uploaded,) = [k for k in gcs_staging.keys(prefix="") if "/vendor/" in k and "/output/" not in k]
    lines = [orjson.loads(x) for x in gcs_staging.read(uploaded).splitlines()]
    assert len(lines) == ROWS and all(set(x) == {"key", "request"} for x in lines)
    assert lines[0]["request"]["contents"] == [{"role": "user", "parts": [{"text": "question 0"}]}]
    (written,) = predictions(gcs_staging)
    assert written.endswith("/predictions.jsonl") and "/output/prediction-model-" in written
    rows = rows_of(gs_pipeline)
    statuses = [s for s, _, _ in rows.values()]
    assert len(rows) == ROWS and statuses.count("failed") == failures
    assert statuses.count("succeeded") == ROWS - failures
    assert all(
        content == f"echo: question {k - 1}" for k, (s, _, content) in rows.items() if s == "succeeded"
    )
    assert {code for s, code, _ in rows.values() if s == "failed"} == {"request_failed"}
    usage = gs_pipeline.warehouse.rows(
        "SELECT MIN(prompt_tokens), MIN(completion_tokens) FROM answers WHERE status = 'succeeded'"
    )
    assert usage[0][0] > 0 and usage[0][1] > 0


async def test_succeeded_and_failed_jobs(
    batch_server: Any, gs_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch)
    seed_texts(gs_pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await gs_pipeline.run("succeeded", "answers", build=BUILD)
    assert record.event is not None and record.event["status"] == "success", record.event
    (batch_id,) = record.event["batch_ids"]
    assert BatchApiHook().get_batch(batch_id).raw["state"] == "JOB_STATE_SUCCEEDED"
    assert {s for s, _, _ in rows_of(gs_pipeline).values()} == {"succeeded"}

    server.set_faults(fail_validation=True)
    record = await gs_pipeline.run("failed", "failed_answers", build=BUILD)
    assert isinstance(record.submit_error, BatchFailedError), record.submit_error
    assert record.event is not None and record.event["status"] == "failed"
    (batch_id,) = record.event["batch_ids"]
    assert BatchApiHook().get_batch(batch_id).raw["state"] == "JOB_STATE_FAILED"
    statuses = gs_pipeline.warehouse.rows("SELECT DISTINCT status FROM failed_answers")
    assert statuses == [("failed",)]


@pytest.mark.parametrize(
    ("how", "status", "vendor"),
    [("expire", "expired", "JOB_STATE_EXPIRED"), ("cancel", "cancelled", "JOB_STATE_CANCELLED")],
)
async def test_expired_and_cancelled_keep_what_was_answered(
    batch_server: Any,
    gs_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    status: str,
    vendor: str,
) -> None:
    server = serve(batch_server, monkeypatch, line_seconds=50, chunk_size=5)
    seed_texts(gs_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        partly_done(batch_id, ROWS)
        if how == "expire":
            server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)  # POST batchPredictionJobs/{id}:cancel

    record = await gs_pipeline.run(f"stop-{how}", "answers", build=BUILD, before_wait=interrupt)
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    (batch_id,) = record.event["batch_ids"]
    assert BatchApiHook().get_batch(batch_id).raw["state"] == vendor
    rows = rows_of(gs_pipeline)
    succeeded = [k for k, (s, _, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _, _) in rows.items() if s == status]
    # The predictions hold what was answered; the rest has the job's end as its status.
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS and succeeded and stopped


async def test_control_plane_faults_and_a_dropped_download(
    batch_server: Any,
    gs_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 429s, 500s and 503s on every control-plane call, the create included (a 5xx may have
    # created the job, which is then looked for by its label), and every predictions object's
    # first read cut after 2 KB (read again from the byte it reached).
    faults = {"rate_429": 0.12, "rate_500": 0.12, "rate_503": 0.12, "retry_after": 0.05}
    server = serve(batch_server, monkeypatch, faults=faults, validate_seconds=2000, finalize_seconds=2000)
    rows = seed_texts(gs_pipeline.warehouse, "tickets", [f"ticket {i}" for i in range(ROWS)])
    cuts = cut_object_reads(monkeypatch)
    record = await gs_pipeline.run("faults", "answers", build={**BUILD, "max_lines": 10})
    counters = server.stats()["counters"]
    server.set_faults(rate_429=0, rate_500=0, rate_503=0)
    out = capsys.readouterr().out
    assert record.submit_error is None, record.submit_error
    assert record.event is not None and record.event["status"] == "success", record.event
    assert min(counters.get(f"status_{code}", 0) for code in (429, 500, 503)) > 0, counters
    assert cuts and any(offset > 0 for offset in cuts), cuts
    assert "resuming there" in out
    got = dict(gs_pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert gs_pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {text}" for i, text in rows}
    # Whatever failed ambiguously never paid twice: one job per shard.
    assert len(record.manifest["shards"]) == 3
    assert len(list(BatchApiHook().list_batches())) == 3


async def test_crash_between_create_and_record_adopts_the_job_found_by_label(
    batch_server: Any, gs_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(gs_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = gs_pipeline.build("crash", **BUILD)
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
        gs_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            gs_pipeline.context("submit", "crash")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    created = str(crashed.value)
    hook = BatchApiHook()
    job = hook.get_batch(created)
    assert job.raw["labels"]["airflow_batch_key"] == keys[0] == job.raw["displayName"]
    listings: list[dict[str, Any]] = []
    real_filter = VertexDialect.filter_params

    def spy(self: VertexDialect, metadata: Any, **kwargs: Any) -> dict[str, Any]:
        found = real_filter(self, metadata, **kwargs)
        listings.append(found)
        return found

    monkeypatch.setattr(VertexDialect, "filter_params", spy)
    record = await gs_pipeline.submit_and_wait(manifest, "crash")
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batch_ids"] == [created]
    # The retry asked the listing for the job's label, server-side, and created nothing.
    assert listings and all(p == {"filter": f'labels.airflow_batch_key="{keys[0]}"'} for p in listings)
    assert len(list(hook.list_batches())) == 1
    merged = gs_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


async def test_a_job_with_the_key_but_another_fingerprint_is_not_adopted(
    batch_server: Any, gs_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The crash window: the intent is durable, the create never happened. A job carrying the
    # shard's key label but another fingerprint label (made from another version of the shard)
    # is what the listing finds: it is not this shard's, so a new job is created.
    serve(batch_server, monkeypatch)
    seed_texts(gs_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = gs_pipeline.build("foreign", **BUILD)
    real_write = StateStore.write
    intents: list[SubmitState] = []

    class Crash(Exception):
        pass

    def crash_after_the_intent(self: StateStore, state: SubmitState) -> None:
        real_write(self, state)
        if not state.batch_id:
            intents.append(state.model_copy())
            raise Crash(state.key)

    monkeypatch.setattr(StateStore, "write", crash_after_the_intent)
    with pytest.raises(Crash):
        gs_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            gs_pipeline.context("submit", "foreign")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    (intent,) = intents
    hook = BatchApiHook()
    assert list(hook.list_batches()) == []
    other = "0" * 64
    stale = hook.create_batch(
        input_file_id=str(intent.input_file_id),
        output_uri=str(intent.input_file_id).rsplit("/input/", 1)[0] + "/stale-output/",
        endpoint="/v1/chat/completions",
        metadata={KEY_NAME: intent.key, FINGERPRINT_NAME: other},
        name=intent.key,
        model=intent.model,
    )
    assert stale.raw["labels"] == {KEY_NAME: intent.key, FINGERPRINT_NAME: other[:63]}
    record = await gs_pipeline.submit_and_wait(manifest, "foreign")
    assert record.event is not None and record.event["status"] == "success", record.event
    (created,) = record.event["batch_ids"]
    assert created != stale.id
    labels = hook.get_batch(created).raw["labels"]
    assert labels[KEY_NAME] == intent.key and labels[FINGERPRINT_NAME] == intent.fingerprint[:63]
    assert sorted(b.id for b in hook.list_batches()) == sorted([stale.id, created])
    merged = gs_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


class LoseCreateAnswer(httpx.HTTPTransport):
    """Sends every request; the first create's answer is lost after Vertex AI made the job."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST" and request.url.path.endswith("/batchPredictionJobs") and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def test_a_create_whose_answer_is_lost_is_found_by_its_labels(
    batch_server: Any, gcs_staging: GcsStaging, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run id (capitals, colons) is no label and the fingerprint is one cut to 63 characters:
    # the job is looked for by the labels it was sent with, so it is found, not created twice.
    serve(batch_server, monkeypatch)
    transport = LoseCreateAnswer()
    hook = BatchApiHook(retry_policy=RetryPolicy(max_retries=1, backoff_initial=0.001), transport=transport)
    source = gcs_staging.path("lost", "input", "shard-00000.jsonl")
    source.write_bytes(
        orjson.dumps({"key": "1", "request": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}})
        + b"\n"
    )
    identity = RunIdentity("tickets", "submit", "manual__2026-12-04T06:00:00+00:00")
    metadata = batch_metadata(identity, shard=0, fingerprint="a" * 64, dialect=VertexDialect())
    job = hook.create_batch(
        input_file_id=plain_uri(source),
        output_uri=plain_uri(gcs_staging.path("lost", "output")) + "/",
        endpoint="/v1/chat/completions",
        metadata=metadata,
        name=identity.key(0),
        model="echo-1",
    )
    assert transport.lost == 1
    assert [b.id for b in hook.list_batches()] == [job.id]
    assert job.raw["labels"][FINGERPRINT_NAME] == "a" * 63


def test_a_local_staging_is_refused_before_any_job(
    batch_server: Any, wh_pipeline: Pipeline, google_key: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(wh_pipeline.warehouse, "tickets", ["q"])
    with pytest.raises(ConfigurationError, match="gs://"):
        manifest = wh_pipeline.build("local", **BUILD)
        wh_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            wh_pipeline.context("submit", "local")
        )
    assert list(BatchApiHook().list_batches()) == []
