"""SubmitBatchOperator against the live local batch server, in every dialect."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_batch_provider.dialects import DIALECTS as REGISTERED
from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import (
    BatchApiBadRequestError,
    BatchFailedError,
    ConfigurationError,
    JsonlValidationError,
    PartialFailureError,
    StaleSubmissionStateError,
)
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Manifest, Shard
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.staging import resolve_path, write_manifest
from airflow_batch_provider.submission import KEY_NAME, RunIdentity, StateStore, SubmitState, batch_metadata
from tests.fixtures.airflow import write_batch_jsonl

# Every registered dialect (a new one is covered as soon as it is registered).
DIALECTS = sorted(REGISTERED)
FAST = {"poll_interval": 0.05, "max_poll_interval": 0.2}


@pytest.fixture
def server_for(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Start a server in a dialect and point ``batch_api_default`` at it."""

    def start(dialect: str, **config: Any) -> Any:
        # Short real validating and finalizing phases (0.3 s each at the test time scale): batches are still
        # running when the task defers, so the trigger path is what these tests exercise.
        server = batch_server(dialect=dialect, **{"validate_seconds": 300, "finalize_seconds": 300, **config})
        conn = json.loads(server.connection_json())
        if dialect == "anthropic":
            # The written lines have no max_tokens, which Anthropic requires: the connection gives it.
            conn["extra"]["request_defaults"] = {"max_tokens": 16}
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
        return server

    return start


def staged(server: Any, source: Path) -> str:
    """Where a test's hand-made JSONL is submitted from: the local file, or a copy on the server's
    object store when the dialect's jobs read object storage (``submission_mode``)."""
    if server.s3 is None:
        return str(source)
    target = server.s3.path("runs", source.parent.name, source.name)
    target.write_bytes(source.read_bytes())
    return str(target)


async def run_trigger(deferred: TaskDeferred) -> dict[str, Any]:
    """Drive the deferred trigger to its single event, as the triggerer would."""
    events = [e.payload async for e in deferred.trigger.run()]
    assert len(events) == 1
    return events[0]


async def submit_and_wait(op: SubmitBatchOperator, context: dict[str, Any], before_wait: Any = None) -> Any:
    """Execute, follow the deferral through the trigger, and resume in execute_complete."""
    with pytest.raises(TaskDeferred) as info:
        op.execute(context)
    deferred = info.value
    assert deferred.method_name == "execute_complete"
    # The ids are in XCom before the task defers.
    assert context["ti"].xcom["return_value"]["batch_ids"]
    if before_wait:
        before_wait(context["ti"].xcom["return_value"]["batch_ids"])
    event = await run_trigger(deferred)
    return event, (lambda: op.execute_complete(context, event, **(deferred.kwargs or {})))


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_success_every_dialect(
    server_for: Any, task_context: Any, tmp_path: Path, dialect: str
) -> None:
    server = server_for(dialect)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 6)
    op = SubmitBatchOperator(
        task_id="submit", source=staged(server, source), wait_for_completion=True, deferrable=True, **FAST
    )
    ctx = task_context()
    event, finish = await submit_and_wait(op, ctx)
    assert event["status"] == "success"
    result = finish()
    assert result["outcome"]["counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert result["batch_ids"] == ctx["ti"].xcom["return_value"]["batch_ids"]
    assert ctx["ti"].xcom["batch_outcome"]["status"] == "success"


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_partial_every_dialect(
    server_for: Any, task_context: Any, tmp_path: Path, dialect: str
) -> None:
    server = server_for(dialect)
    server.set_faults(line_failure_rate=0.5)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 20)
    op = SubmitBatchOperator(
        task_id="submit", source=staged(server, source), wait_for_completion=True, deferrable=True, **FAST
    )
    ctx = task_context()
    event, finish = await submit_and_wait(op, ctx)
    assert event["status"] == "partial", event["message"]
    result = finish()
    counts = result["outcome"]["counts"]
    assert counts["total"] == 20 and counts["failed"] > 0 and counts["completed"] + counts["failed"] == 20
    # The same event under on_partial_failure="fail" fails the task, with the counts still in XCom.
    strict = SubmitBatchOperator(task_id="submit", source=staged(server, source), on_partial_failure="fail")
    ctx2 = task_context()
    with pytest.raises(PartialFailureError, match="line\\(s\\) failed"):
        strict.execute_complete(ctx2, event)
    assert ctx2["ti"].xcom["batch_outcome"]["counts"] == counts


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_failed_every_dialect(server_for: Any, task_context: Any, tmp_path: Path, dialect: str) -> None:
    server = server_for(dialect)
    server.set_faults(fail_validation=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    op = SubmitBatchOperator(
        task_id="submit", source=staged(server, source), wait_for_completion=True, deferrable=True, **FAST
    )
    ctx = task_context()
    try:
        event, finish = await submit_and_wait(op, ctx)
    except BatchApiBadRequestError as exc:
        # ZeroGPU and Anthropic validate synchronously: the create itself is refused.
        assert dialect in ("zerogpu", "anthropic"), exc
        return
    assert event["status"] == "failed", event
    batch_id = event["batch_ids"][0]
    with pytest.raises(BatchFailedError) as info:
        finish()
    text = str(info.value)
    assert batch_id in text and "failed" in text
    print(text)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_expired_every_dialect(
    server_for: Any, task_context: Any, tmp_path: Path, dialect: str
) -> None:
    server = server_for(dialect)
    server.set_faults(expire_batches=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    op = SubmitBatchOperator(
        task_id="submit", source=staged(server, source), wait_for_completion=True, deferrable=True, **FAST
    )
    event, finish = await submit_and_wait(op, task_context())
    if dialect in ("doubleword", "xai"):
        # Doubleword never reports "expired", and xAI reports only counters (the lines its
        # expiry stopped end as errors): the batch completes with every line failed.
        assert (event["status"], event["termination_reason"]) == ("failed", "all_lines_failed"), event
        expected = "all 3 line\\(s\\) failed"
    else:
        assert event["status"] == "expired", event
        expected = "expired"
    with pytest.raises(BatchFailedError, match=expected):
        finish()


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_cancelled_every_dialect(
    server_for: Any, task_context: Any, tmp_path: Path, dialect: str
) -> None:
    server = server_for(dialect)
    server.set_faults(stall_batches=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    op = SubmitBatchOperator(
        task_id="submit", source=staged(server, source), wait_for_completion=True, deferrable=True, **FAST
    )

    def cancel(ids: list[str]) -> None:
        BatchApiHook().cancel_batch(ids[0])

    event, finish = await submit_and_wait(op, task_context(), before_wait=cancel)
    assert event["status"] == "cancelled", event
    with pytest.raises(BatchFailedError, match="cancelled"):
        finish()


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_timeout_every_dialect_cancels(
    server_for: Any, task_context: Any, tmp_path: Path, dialect: str
) -> None:
    server = server_for(dialect)
    server.set_faults(stall_batches=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    op = SubmitBatchOperator(
        task_id="submit",
        source=staged(server, source),
        wait_for_completion=True,
        deferrable=True,
        timeout=0.3,
        cancel_on_timeout=True,
        **FAST,
    )
    event, finish = await submit_and_wait(op, task_context())
    assert event["status"] == "timeout", event
    assert event["termination_reason"] == "deadline_exceeded"
    with pytest.raises(BatchFailedError, match="timeout"):
        finish()
    state = BatchApiHook().get_batch(event["batch_ids"][0]).state.value
    assert state in ("cancelling", "cancelled")


class CrashAfterCreate(Exception):
    """Stands in for the worker dying between the batch create and recording its id."""


def submit_crashing_after_create(
    source: Path | str, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> str:
    """Run a submit whose worker "dies" right after the create, before recording the batch id;
    returns the id of the batch it created (the state store works normally again afterwards)."""
    real_write = StateStore.write

    def crash_when_recording_id(self: StateStore, state: SubmitState) -> None:
        if state.batch_id:
            raise CrashAfterCreate(state.batch_id)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", crash_when_recording_id)
    with pytest.raises(CrashAfterCreate) as crashed:
        SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    monkeypatch.setattr(StateStore, "write", real_write)
    return str(crashed.value)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_retry_after_crash_between_create_and_record_makes_one_batch(
    server_for: Any, task_context: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dialect: str
) -> None:
    server = server_for(dialect)
    source = staged(server, write_batch_jsonl(tmp_path / "in.jsonl", 4))
    created = submit_crashing_after_create(source, task_context, monkeypatch)
    state_files = list((resolve_path(source).parent / "submit-state").glob("*.json"))
    assert len(state_files) == 1
    assert orjson.loads(state_files[0].read_bytes())["batch_id"] is None  # intent only

    # The retry (same dag/task/run/map index) finds the orphan instead of creating another batch.
    result = SubmitBatchOperator(task_id="submit", source=source).execute(task_context())
    assert result["batch_ids"] == [created]
    assert orjson.loads(state_files[0].read_bytes())["batch_id"] == created
    assert [b.id for b in BatchApiHook().list_batches()] == [created]


def test_xai_orphan_lookup_skips_a_batch_made_from_another_file(
    server_for: Any, task_context: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # xAI batches carry no tags but the name and their input_file_id: a batch of the same name
    # made from another file (newer, so it would be picked first) is not this shard's.
    server_for("xai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 4)
    created = submit_crashing_after_create(source, task_context, monkeypatch)
    hook = BatchApiHook()
    name = hook.get_batch(created).metadata["name"]
    other = hook.upload_file(write_batch_jsonl(tmp_path / "other.jsonl", 2))
    decoy = hook.create_batch(input_file_id=other, endpoint="/v1/chat/completions", name=name)
    assert decoy.input_file_id == other and decoy.metadata["name"] == name
    result = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    assert result["batch_ids"] == [created]


def test_retry_with_recorded_id_reattaches_and_new_run_submits(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    server_for("openai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 4)
    first = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    again = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    assert again["batch_ids"] == first["batch_ids"]
    assert again["submitted_at"] == first["submitted_at"]
    other_run = SubmitBatchOperator(task_id="submit", source=str(source)).execute(
        task_context(run_id="run-2")
    )
    assert other_run["batch_ids"] != first["batch_ids"]
    assert len(list(BatchApiHook().list_batches())) == 2
    # The batch carries the run identity and the idempotency key.
    metadata = BatchApiHook().get_batch(first["batch_ids"][0]).metadata
    assert metadata[KEY_NAME] == RunIdentity("dag", "submit", "run-1").key(0)
    assert metadata["airflow_dag_id"] == "dag" and metadata["airflow_run_id"] == "run-1"
    assert metadata["airflow_fingerprint"] == first["batches"][0]["fingerprint"]


def test_failed_recorded_batch_is_replaced_on_retry(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    server = server_for("openai")
    server.set_faults(stall_batches=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 2)
    first = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    server.force(first["batch_ids"][0], "fail")
    hook = BatchApiHook()
    for _ in range(500):  # the server applies the force on its next lifecycle step
        if hook.get_batch(first["batch_ids"][0]).is_terminal:
            break
        time.sleep(0.02)
    assert hook.get_batch(first["batch_ids"][0]).state.value == "failed"
    again = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    assert again["batch_ids"] != first["batch_ids"]
    state = orjson.loads(next((tmp_path / "submit-state").glob("*.json")).read_bytes())
    assert state["replaced_batch_ids"] == first["batch_ids"]


@pytest.mark.parametrize("state", ["cancelling", "cancelled", "failed", "expired"])
def test_a_dying_or_dead_recorded_batch_is_not_reattached(
    monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    """A killed task's batch is on its way out (cancelling) or gone: a cleared task replaces it."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCH_API_DEFAULT",
        orjson.dumps({"conn_type": "batch_api", "host": "http://mock/v1"}).decode(),
    )
    answer = {"id": "batch_old", "status": state, "request_counts": {"total": 2, "completed": 0, "failed": 0}}
    hook = BatchApiHook(transport=httpx.MockTransport(lambda r: httpx.Response(200, json=answer)))
    recorded = SubmitState(
        key="k", shard=0, fingerprint="f", dag_id="d", task_id="submit", run_id="r", batch_id="batch_old"
    )
    op = SubmitBatchOperator(task_id="submit", source="unused.jsonl")
    assert op._reattach(hook, recorded) is None
    # The orphan lookup skips it too: a lost create is only adopted while it can still answer.
    listing = {
        "object": "list",
        "data": [{**answer, "metadata": {"airflow_batch_key": "k"}}],
        "has_more": False,
    }
    lister = BatchApiHook(transport=httpx.MockTransport(lambda r: httpx.Response(200, json=listing)))
    assert op._find_orphan(lister, "k", "f") is None


def test_changed_shard_fails_or_is_cancelled_and_resubmitted(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    server = server_for("openai")
    server.set_faults(stall_batches=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    first = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    write_batch_jsonl(source, 4)  # the file changed between tries
    with pytest.raises(StaleSubmissionStateError, match="changed since an earlier try"):
        SubmitBatchOperator(task_id="submit", source=str(source), on_stale_state="fail").execute(
            task_context()
        )
    again = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    assert again["batch_ids"] != first["batch_ids"]
    hook = BatchApiHook()
    assert hook.get_batch(first["batch_ids"][0]).state.value in ("cancelling", "cancelled")
    assert hook.get_batch(again["batch_ids"][0]).request_counts.total in (0, 4)


def test_bad_hand_made_file_fails_naming_lines(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server_for("openai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 5)
    lines = source.read_bytes().splitlines()
    lines[1] = b'{"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}'
    lines[3] = b"{not json"
    source.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(JsonlValidationError) as info:
        SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    text = str(info.value)
    assert "line 2:" in text and "duplicate_custom_id" in text
    assert "line 4:" in text and "invalid_json" in text
    assert list(BatchApiHook().list_batches()) == []


def test_hand_made_file_mixing_models_fails_before_upload(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    # OpenAI fails a whole batch whose lines name more than one model: submit says which line.
    server_for("openai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 4, model="model-a")
    lines = source.read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"model-a"', b'"model-b"')
    source.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(
        JsonlValidationError, match=r"line 3: body.model 'model-b' differs from 'model-a' on line 1"
    ):
        SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context())
    assert list(BatchApiHook().list_batches()) == []
    # With a model override every line is sent with one model: the same file is accepted.
    result = SubmitBatchOperator(task_id="submit", source=str(source), model="model-c").execute(
        task_context()
    )
    uploaded = list(BatchApiHook().iter_file_lines(result["batches"][0]["input_file_id"]))
    assert {line["body"]["model"] for line in uploaded} == {"model-c"}


def test_model_override_rewrites_every_line(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server_for("openai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 5, model="original")
    result = SubmitBatchOperator(task_id="submit", source=str(source), model="override-7").execute(
        task_context()
    )
    uploaded = list(BatchApiHook().iter_file_lines(result["batches"][0]["input_file_id"]))
    assert [line["body"]["model"] for line in uploaded] == ["override-7"] * 5
    assert [line["custom_id"] for line in uploaded] == [f"c{i}" for i in range(5)]
    # The source file is untouched and a different model is a different fingerprint.
    assert b'"original"' in source.read_bytes()
    plain = SubmitBatchOperator(task_id="submit", source=str(source)).execute(task_context(run_id="run-2"))
    assert plain["batches"][0]["fingerprint"] != result["batches"][0]["fingerprint"]


def _staging(tmp_path: Path, shards: int = 2) -> Path:
    staging = tmp_path / "staging"
    staging.mkdir()
    entries = []
    for i in range(shards):
        path = write_batch_jsonl(staging / f"shard-{i:05d}.jsonl", 3, prefix=f"s{i}-")
        data = path.read_bytes()
        entries.append(
            Shard(
                index=i,
                path=path.name,
                lines=3,
                bytes=len(data),
                fingerprint=hashlib.sha256(data).hexdigest(),
                endpoint="/v1/chat/completions",
            )
        )
    write_manifest(
        str(staging), Manifest(endpoint="/v1/chat/completions", shards=entries, rows_written=3 * shards)
    )
    return staging


def test_manifest_submits_every_shard_or_one(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server_for("openai")
    staging = _staging(tmp_path)
    manifest = str(staging / "manifest.json")
    result = SubmitBatchOperator(task_id="submit", source={"manifest_path": manifest}).execute(task_context())
    assert [b["shard"] for b in result["batches"]] == [0, 1]
    assert len(set(result["batch_ids"])) == 2
    assert result["manifest_path"].endswith("manifest.json")
    assert len(list((staging / "submit-state").glob("*.json"))) == 2
    one = SubmitBatchOperator(task_id="submit", source=str(staging), shard=1).execute(
        task_context(task_id="mapped", map_index=1)
    )
    assert [b["shard"] for b in one["batches"]] == [1]
    with pytest.raises(ConfigurationError, match="no shard 7"):
        SubmitBatchOperator(task_id="submit", source=manifest, shard=7).execute(task_context())


def test_metadata_limits() -> None:
    identity = RunIdentity("d" * 250, "t", "r" * 600)
    meta = batch_metadata(
        identity, shard=3, fingerprint="f" * 64, dialect=get_dialect("openai"), extra={"team": "x"}
    )
    assert len(meta[KEY_NAME]) <= 64 and meta["airflow_shard"] == "3" and meta["team"] == "x"
    assert all(len(v) <= 512 for v in meta.values()) and len(meta) <= 16
    with pytest.raises(ConfigurationError, match="allows 16"):
        batch_metadata(
            identity,
            shard=0,
            fingerprint="f",
            dialect=get_dialect("openai"),
            extra={f"k{i}": "v" for i in range(15)},
        )
    with pytest.raises(ConfigurationError, match="1-64 characters"):
        batch_metadata(
            identity, shard=0, fingerprint="f", dialect=get_dialect("openai"), extra={"k" * 65: "v"}
        )
    with pytest.raises(ConfigurationError, match="reserved"):
        batch_metadata(
            identity, shard=0, fingerprint="f", dialect=get_dialect("openai"), extra={KEY_NAME: "v"}
        )
    # Fourteen user pairs fit by dropping the least important identity pairs; key and fingerprint stay.
    tight = batch_metadata(
        identity,
        shard=0,
        fingerprint="f",
        dialect=get_dialect("openai"),
        extra={f"k{i}": "v" for i in range(14)},
    )
    assert len(tight) == 16 and KEY_NAME in tight and "airflow_fingerprint" in tight


def test_on_kill_cancels_submitted_batches(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server = server_for("openai")
    server.set_faults(stall_batches=True)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    op = SubmitBatchOperator(task_id="submit", source=str(source))
    result = op.execute(task_context())
    op.on_kill()
    assert BatchApiHook().get_batch(result["batch_ids"][0]).state.value in ("cancelling", "cancelled")


def test_sync_wait_without_deferring(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server_for("xai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 4)
    op = SubmitBatchOperator(
        task_id="submit", source=str(source), wait_for_completion=True, deferrable=False, **FAST
    )
    result = op.execute(task_context())
    assert result["outcome"]["status"] == "success"
    assert result["outcome"]["counts"]["completed"] == 4


def test_build_xcom_whole_or_one_mapped_shard(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    from airflow_batch_provider.operators.build import manifest_xcom
    from airflow_batch_provider.staging import read_manifest, resolve_path

    server_for("doubleword")
    staging = _staging(tmp_path, shards=3)
    xcom = manifest_xcom(read_manifest(str(staging)), resolve_path(str(staging)))
    whole = SubmitBatchOperator(task_id="submit", source=xcom).execute(task_context())
    assert [b["shard"] for b in whole["batches"]] == [0, 1, 2]
    # .expand(source=build.output["shards"]): each mapped task gets one shard mapping.
    mapped = [
        SubmitBatchOperator(task_id="submit_shard", source=shard).execute(
            task_context(task_id="submit_shard", map_index=i)
        )
        for i, shard in enumerate(xcom["shards"])
    ]
    assert [m["batches"][0]["shard"] for m in mapped] == [0, 1, 2]
    assert all(m["manifest_path"] == xcom["manifest_path"] for m in mapped)
    # A rendered template (JSON text) of the same XCom works too and re-attaches.
    again = SubmitBatchOperator(task_id="submit", source=orjson.dumps(xcom).decode()).execute(task_context())
    assert again["batch_ids"] == whole["batch_ids"]
    assert len(list(BatchApiHook().list_batches())) == 6


SUBMIT_AND_WAIT_DAG = """
from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_batch_provider.operators.submit import SubmitBatchOperator

with DAG("submit_and_wait", start_date=pendulum.datetime(2026, 1, 1), schedule=None, catchup=False):
    SubmitBatchOperator(
        task_id="submit",
        source={source!r},
        model="echo-override",
        # The file store, pinned: this Airflow has a task state store, which "auto" would take
        # (that mode under dags test: tests/reliability/test_crash_windows.py).
        state_store="file",
        wait_for_completion=True,
        deferrable=True,
        poll_interval=0.2,
    )
"""


def test_submit_and_wait_deferrable_under_airflow_dags_test(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, airflow_dags_test: Any, tmp_path: Path
) -> None:
    server = batch_server(dialect="zerogpu", time_scale=0.001, validate_seconds=1000, finalize_seconds=1000)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    source = write_batch_jsonl(tmp_path / "in.jsonl", 4)
    result = airflow_dags_test(SUBMIT_AND_WAIT_DAG.format(source=str(source)), "submit_and_wait")
    assert result.ok, result.tail()
    assert "[DAG TEST] running trigger in line" in result.output
    assert "Batch watch ended (success)" in result.output, result.tail()
    assert "1 batch(es) completed: 4 of 4 line(s) succeeded" in result.output
    batches = list(BatchApiHook().list_batches())
    assert len(batches) == 1 and batches[0].state.value == "completed"
    # The resumed task found its submission again (passed through the deferral's kwargs).
    assert len(list((tmp_path / "submit-state").glob("*.json"))) == 1


async def test_a_hand_made_line_the_vendor_cannot_express_fails_before_any_upload(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    # Azure runs each line on body.model's deployment: a hand-made line without one is refused
    # by name at submit, for a dialect that uploads the file as it is (no encoding pass) too.
    server = server_for("azure")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    lines = source.read_bytes().splitlines()
    second = orjson.loads(lines[1])
    del second["body"]["model"]
    source.write_bytes(b"\n".join([lines[0], orjson.dumps(second), lines[2]]) + b"\n")
    op = SubmitBatchOperator(task_id="submit", source=str(source), wait_for_completion=False)
    with pytest.raises(
        JsonlValidationError,
        match=r"line 2: body.model \(the batch deployment's name\) is missing.*\[missing_model\]",
    ):
        op.execute(task_context())
    assert server.stats()["counters"].get("files_uploaded", 0) == 0
    # With a model override every line names the deployment: the same file goes.
    op = SubmitBatchOperator(task_id="submit", source=str(source), wait_for_completion=False, model="echo-1")
    assert op.execute(task_context())["batch_ids"]


@pytest.mark.parametrize("name", sorted(REGISTERED))
async def test_a_hand_made_line_without_a_model_fails_before_any_upload_unless_submit_names_one(
    server_for: Any, task_context: Any, tmp_path: Path, name: str
) -> None:
    """Line 2 names no model: every dialect refuses the file by line (a line-model vendor would
    run that line on no model; a job-model one has no model for the job), before uploading;
    submit's model= supplies it, and the same file goes."""
    server = server_for(name)
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3)
    lines = source.read_bytes().splitlines()
    second = orjson.loads(lines[1])
    del second["body"]["model"]
    source.write_bytes(b"\n".join([lines[0], orjson.dumps(second), lines[2]]) + b"\n")
    op = SubmitBatchOperator(task_id="submit", source=staged(server, source), wait_for_completion=False)
    with pytest.raises(
        JsonlValidationError, match=rf"line 2: body.model.* is missing; dialect '{name}'"
    ) as caught:
        op.execute(task_context())
    if REGISTERED[name].needs_line_model("/v1/chat/completions"):
        assert "model= on the build or the submit" in str(caught.value)
    assert server.stats()["counters"].get("files_uploaded", 0) == 0
    op = SubmitBatchOperator(
        task_id="submit", source=staged(server, source), wait_for_completion=False, model="echo-1"
    )
    assert op.execute(task_context())["batch_ids"]


async def test_a_chat_body_sent_to_embeddings_fails_before_any_upload(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    server = server_for("openai")
    source = write_batch_jsonl(tmp_path / "in.jsonl", 2)
    source.write_bytes(source.read_bytes().replace(b"/v1/chat/completions", b"/v1/embeddings"))
    op = SubmitBatchOperator(task_id="submit", source=str(source), wait_for_completion=False)
    with pytest.raises(
        JsonlValidationError, match=r"line 1: body has no 'input', which /v1/embeddings needs"
    ):
        op.execute(task_context())
    assert server.stats()["counters"].get("files_uploaded", 0) == 0
