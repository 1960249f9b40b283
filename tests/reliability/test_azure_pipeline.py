"""Azure OpenAI through the whole pipeline (build -> submit -> deferred wait -> merge), on PostgreSQL
and DuckDB.

The batch server speaks Azure (``serve --dialect azure``: ``/openai/v1`` and ``/openai?api-version``,
the key in ``api-key`` or an Entra ID bearer); the connection's dialect is ``azure``. Every
terminal outcome lands every row with its status; control-plane faults cost retries, not rows; a
crash between create and recording the id adopts the batch found by its metadata tags; a full
enqueued token quota is reported as the quota error it is. (429s, 5xx and dropped downloads:
``tests/reliability/test_control_plane.py``, parametrised over the dialects, azure among them.)
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from azure.core.credentials import AccessToken

import airflow_batch_provider.dialects.azure as azure_module
import tests.fixtures.reliability as reliability
from airflow_batch_provider.dialects.azure import AzureOpenAIDialect
from airflow_batch_provider.exceptions import BatchApiQuotaError, BatchFailedError, BatchQuotaExceededError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.staging import resolve_path
from airflow_batch_provider.submission import StateStore, SubmitState
from tests.fixtures.reliability import MESSAGES, Pipeline, drive, foreign_batch, rows_of, seed_texts

ROWS = 30
KEY = "azure-pipeline-key"
TOKEN = "entra-stand-in-token-0123456789"
API_VERSION = "2024-10-21"
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES}


def serve(
    batch_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    *,
    path: str = "v1",
    extra: dict[str, Any] | None = None,
    password: str | None = KEY,
    **config: Any,
) -> Any:
    """A server in azure mode and the default connection to it, on the v1 or the classic path."""
    server = batch_server(dialect="azure", api_key=KEY, **config)
    conn: dict[str, Any] = {
        "conn_type": "batch_api",
        "host": server.base_url if path == "v1" else server.root_url,
        "extra": {
            "dialect": "azure",
            **({"api_version": API_VERSION} if path == "classic" else {}),
            **(extra or {}),
        },
    }
    if password:
        conn["password"] = password
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    return server


@pytest.mark.parametrize("path", ["v1", "classic"])
async def test_completed_with_mixed_rows_lands_every_row(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    server = serve(batch_server, monkeypatch, path=path, faults={"line_failure_rate": 0.3})
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    record = await wh_pipeline.run("mixed", "answers", build=BUILD, submit={"on_partial_failure": "succeed"})
    failures = server.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS
    assert record.event is not None and record.event["status"] == "partial", record.event
    assert record.submit_error is None
    (batch_id,) = record.event["batch_ids"]
    hook = BatchApiHook()
    batch = hook.get_batch(batch_id)
    # The uploaded input file carries Azure's expiry: 14 days after its creation.
    uploaded = hook.get_file(batch.input_file_id or "")
    assert uploaded["expires_at"] == uploaded["created_at"] + 14 * 24 * 3600
    # Each API's own name of the endpoint in the uploaded lines: the classic API's samples
    # /chat/completions, the v1 reference /v1/chat/completions. Staging keeps the canonical one.
    wire = "/chat/completions" if path == "classic" else "/v1/chat/completions"
    assert {line["url"] for line in hook.iter_file_lines(batch.input_file_id or "")} == {wire}
    staged = (wh_pipeline.staging_root / "reliability" / "mixed").rglob("shard-*.jsonl")
    assert {orjson.loads(raw)["url"] for f in staged for raw in f.read_bytes().splitlines()} == {
        "/v1/chat/completions"
    }
    rows = rows_of(wh_pipeline)
    statuses = [s for s, _, _ in rows.values()]
    assert len(rows) == ROWS and statuses.count("failed") == failures
    assert statuses.count("succeeded") == ROWS - failures
    assert all(
        content == f"echo: question {key - 1}" for key, (s, _, content) in rows.items() if s == "succeeded"
    )


async def test_failed_batch_fails_the_task_and_every_row(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, faults={"fail_validation": True})
    seed_texts(wh_pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await wh_pipeline.run("failed", "answers", build=BUILD)
    assert isinstance(record.submit_error, BatchFailedError), record.submit_error
    assert not isinstance(record.submit_error, BatchQuotaExceededError)
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
    server = serve(batch_server, monkeypatch, path="classic", line_seconds=50, chunk_size=5)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        _partly_done(batch_id)
        if how == "expire":
            server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)  # POST /openai/batches/{id}/cancel?api-version=...

    record = await wh_pipeline.run(f"stop-{how}", "answers", build=BUILD, before_wait=interrupt)
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    rows = rows_of(wh_pipeline)
    succeeded = [k for k, (s, _, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _, _) in rows.items() if s == status]
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS and succeeded and stopped
    assert {rows[k][1] for k in stopped} == {f"batch_{status}"}


async def test_crash_between_create_and_record_adopts_the_batch_found_by_its_tags(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, path="classic")
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
    # A newer batch of another run must not be taken for it.
    hook = BatchApiHook()
    decoy_file = hook.upload_file(resolve_path(manifest["staging_path"]) / "shard-00000.jsonl")
    hook.create_batch(
        input_file_id=decoy_file,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "another-run"},
    )
    record = await wh_pipeline.submit_and_wait(manifest, "crash")
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batch_ids"] == [created]
    assert len(list(hook.list_batches())) == 2  # the retry created nothing
    merged = wh_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS


async def test_token_limit_exceeded_is_a_quota_error_at_create_and_as_a_failed_batch(
    batch_server: Any, pg_warehouse: Any, tmp_path: Path, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_texts(pg_warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    # Refused at create (some regions): a quota error at submit, not retried, nothing created.
    server = serve(batch_server, monkeypatch, extra={"headers": {"X-Batch-Fault": "token_limit"}})
    refused = Pipeline(pg_warehouse, tmp_path / "refused", task_context)
    manifest = refused.build("refused", **BUILD)
    with pytest.raises(BatchApiQuotaError, match="token_limit_exceeded"):
        refused.submit_op(manifest).execute(refused.context("submit", "refused"))
    assert server.stats()["counters"]["token_limit"] == 1
    assert list(BatchApiHook().list_batches()) == []
    # A failed batch with errors.data[].code token_limit_exceeded (other regions).
    serve(batch_server, monkeypatch, extra={"headers": {"X-Batch-Fault": "token_limit_failed"}})
    failed = Pipeline(pg_warehouse, tmp_path / "failed", task_context)
    record = await failed.run("failed", "answers", build=BUILD)
    assert record.event is not None and record.event["termination_reason"] == "batch_quota_exceeded"
    assert isinstance(record.submit_error, BatchQuotaExceededError), record.submit_error
    assert "token_limit_exceeded" in str(record.submit_error)
    rows = rows_of(failed)
    assert len(rows) == ROWS and {s for s, _, _ in rows.values()} == {"failed"}


async def test_a_queue_aware_submit_waits_out_a_create_refused_for_the_deployments_token_limit(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    manifest = wh_pipeline.build("queued", **{**BUILD, "max_lines": 10})
    total = sum(s["input_tokens"] for s in manifest["shards"])
    # Azure's form: a create over the deployment's enqueued-token limit is refused at once.
    server = serve(batch_server, monkeypatch, max_enqueued_tokens=total)
    # Another user's batch, as large as the limit: the server counts it, the ledger cannot.
    foreign_batch(server, ROWS, model="echo-1", text="question {}")
    result, deferred_to = await drive(wh_pipeline, manifest, "queued", max_enqueued_tokens=total)
    counters = server.stats()["counters"]
    assert counters["enqueued_limit_refused"] >= 1 and "QueueRoomTrigger" in deferred_to
    assert result["outcome"]["status"] == "success" and len(result["batch_ids"]) == 3
    assert counters["enqueued_tokens_peak"] <= total
    wh_pipeline.merge(result, manifest, "answers")
    assert {s for s, _, _ in rows_of(wh_pipeline).values()} == {"succeeded"}


class AsyncCredential:
    def __init__(self) -> None:
        self.calls = 0

    async def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls += 1
        return AccessToken(TOKEN, int(time.time() + 3600))


class SyncCredential:
    def __init__(self) -> None:
        self.calls = 0

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls += 1
        return AccessToken(TOKEN, int(time.time() + 3600))


async def test_entra_id_pipeline_never_puts_the_token_in_trigger_kwargs(
    batch_server: Any,
    pg_warehouse: Any,
    tmp_path: Path,
    task_context: Any,
    monkeypatch: pytest.MonkeyPatch,
    figures: Any,
) -> None:
    credentials = {True: AsyncCredential(), False: SyncCredential()}
    monkeypatch.setattr(
        azure_module, "make_credential", lambda extra, secret, *, asynchronous: credentials[asynchronous]
    )
    # The server takes only the stand-in Entra token (its key is never sent under auth entra).
    server = serve(
        batch_server,
        monkeypatch,
        path="classic",
        password="client-secret-never-sent",
        extra={"auth": "entra", "tenant_id": "tenant-1", "client_id": "app-1"},
        bearer_token=TOKEN,
    )
    serialized: list[str] = []
    real_rebuild = reliability.rebuild_trigger

    def spy(trigger: Any) -> Any:
        serialized.append(json.dumps(trigger.serialize(), default=str))
        return real_rebuild(trigger)

    monkeypatch.setattr(reliability, "rebuild_trigger", spy)
    seed_texts(pg_warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    pipeline = Pipeline(pg_warehouse, tmp_path / "entra", task_context)
    record = await pipeline.run("entra", "answers", build=BUILD)
    assert record.event is not None and record.event["status"] == "success", record.event
    assert len(rows_of(pipeline)) == ROWS
    # The deferred wait polled with the aio credential; the trigger's kwargs hold no secret.
    assert credentials[True].calls >= 1 and credentials[False].calls >= 1
    requests = server.stats()["counters"]["requests"]
    figures(
        "azure entra pipeline (30 rows, hour-long tokens)",
        api_requests=requests,
        sync_token_fetches=credentials[False].calls,
        async_token_fetches=credentials[True].calls,
    )
    # Tokens are cached: far fewer fetches than calls (one per hook and client kind at most).
    assert credentials[True].calls + credentials[False].calls < requests / 2
    assert serialized and not any(TOKEN in s or "client-secret-never-sent" in s for s in serialized)
    assert TOKEN not in json.dumps(record.xcom, default=str)


async def test_a_completed_batch_with_an_empty_error_file_merges_every_row(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Azure may name an error file with no line in it on a batch where nothing failed.
    serve(batch_server, monkeypatch)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    empty_id = BatchApiHook().upload_file(empty)
    real_parse = AzureOpenAIDialect.parse_batch

    def with_empty_error_file(self: AzureOpenAIDialect, raw: Any) -> Any:
        batch = real_parse(self, raw)
        if batch.state.value == "completed" and batch.error_file_id is None:
            batch.error_file_id = empty_id
        return batch

    monkeypatch.setattr(AzureOpenAIDialect, "parse_batch", with_empty_error_file)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    record = await wh_pipeline.run("empty-errors", "answers", build=BUILD)
    assert record.event is not None and record.event["status"] == "success", record.event
    assert record.event["batches"][0]["error_file_id"] == empty_id
    rows = rows_of(wh_pipeline)
    assert len(rows) == ROWS and {s for s, _, _ in rows.values()} == {"succeeded"}


async def test_azure_as_the_fallback_vendor_answers_the_rows_the_first_one_failed(
    batch_server: Any, pg_warehouse: Any, tmp_path: Path, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An OpenAI-dialect primary fails some rows; the merge resubmits them to an Azure connection
    # (fallback_model: the deployment), and each results row says who answered it.
    first = batch_server(dialect="openai", faults={"line_failure_rate": 0.3})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", first.connection_json())
    second = batch_server(dialect="azure", api_key=KEY)
    monkeypatch.setenv(
        "AIRFLOW_CONN_AZURE_FALLBACK",
        json.dumps(
            {
                "conn_type": "batch_api",
                "host": second.root_url,
                "password": KEY,
                "extra": {"dialect": "azure", "api_version": API_VERSION},
            }
        ),
    )
    primary = Pipeline(pg_warehouse, tmp_path / "staging", task_context)
    fallback = Pipeline(pg_warehouse, tmp_path / "staging", task_context, batch_conn_id="azure_fallback")
    seed_texts(pg_warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    resubmit = {
        "resubmit_failed": True,
        "fallback_conn_id": "azure_fallback",
        "fallback_model": "gpt-4o-batch",
    }
    record = await primary.run(
        "to-azure", "answers", build=BUILD, submit={"on_partial_failure": "succeed"}, merge=resubmit
    )
    merged = record.merge
    failures = first.stats()["counters"]["line_failures"]
    assert merged is not None and 0 < failures < ROWS and merged["resubmit_lines"] == failures
    attempt = await fallback.submit_and_wait(merged["resubmit_manifest_path"], "to-azure-2")
    assert attempt.submit_error is None and attempt.event is not None, attempt.submit_error
    final = await asyncio.to_thread(
        fallback.merge,
        attempt.submission,
        {"manifest_path": merged["resubmit_manifest_path"]},
        "answers",
        **resubmit,
    )
    assert final["counts"]["succeeded"] == failures
    q = pg_warehouse.quote
    rows = pg_warehouse.rows(f"SELECT status, vendor, batch_conn_id, model FROM {q('answers')}")
    assert len(rows) == ROWS and {r[0] for r in rows} == {"succeeded"}
    by_vendor = {(r[1], r[2], r[3]) for r in rows}
    assert by_vendor == {
        ("openai", "batch_api_default", "echo:echo-1"),
        ("azure", "azure_fallback", "echo:gpt-4o-batch"),
    }
    assert sum(1 for r in rows if r[1] == "azure") == failures
