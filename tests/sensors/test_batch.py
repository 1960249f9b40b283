"""BatchSensor: deferral, the event check, the outcome policy, poke mode, and a real ``airflow dags test``."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.bases.sensor import PokeReturnValue
from airflow.sdk.exceptions import AirflowSensorTimeout, TaskDeferred

from airflow_batch_provider.exceptions import BatchFailedError, ConfigurationError, PartialFailureError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Batch
from airflow_batch_provider.outcome import error_event
from airflow_batch_provider.sensors.batch import BatchSensor
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.waiting import batch_ids_and_deadline
from tests.fixtures.airflow import write_batch_jsonl


@pytest.fixture
def server_for(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    def start(dialect: str = "openai", **config: Any) -> Any:
        # Short real validating and finalizing phases (0.3 s each at the test time scale): batches are still
        # running when the task defers, so the trigger path is what these tests exercise.
        server = batch_server(dialect=dialect, **{"validate_seconds": 300, "finalize_seconds": 300, **config})
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
        return server

    return start


def create_batch(tmp_path: Path, lines: int = 3) -> Batch:
    hook = BatchApiHook()
    file_id = hook.upload_file(write_batch_jsonl(tmp_path / f"in-{lines}.jsonl", lines))
    return hook.create_batch(input_file_id=file_id, endpoint="/v1/chat/completions", metadata={"t": "1"})


async def defer_and_run(sensor: BatchSensor, context: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(context)
    assert info.value.method_name == "execute_complete"
    assert isinstance(info.value.trigger, BatchTrigger)
    events = [e.payload async for e in info.value.trigger.run()]
    assert len(events) == 1
    return events[0]


def test_batch_ids_forms() -> None:
    assert batch_ids_and_deadline("b1") == (["b1"], None)
    assert batch_ids_and_deadline("b1, b2") == (["b1", "b2"], None)
    assert batch_ids_and_deadline("['b1', 'b2']") == (["b1", "b2"], None)
    submit_xcom = {"batch_ids": ["b1"], "submitted_at": "2026-01-01T00:00:00+00:00", "batches": []}
    assert batch_ids_and_deadline(submit_xcom) == (["b1"], "2026-01-01T00:00:00+00:00")
    for bad in ([], "", None, [""], {"batch_ids": [1]}):
        with pytest.raises(ConfigurationError, match="batch_ids"):
            batch_ids_and_deadline(bad)


def test_defers_with_deadline_from_submit_time(
    task_context: Any, server_for: Callable[..., Any], tmp_path: Path
) -> None:
    server = server_for("openai")
    ids = [create_batch(tmp_path, lines).id for lines in (2, 3)]
    for batch_id in ids:
        server.force(batch_id, "stall")
    submitted = "2026-01-01T00:00:00+00:00"
    sensor = BatchSensor(
        task_id="wait", batch_ids={"batch_ids": ids, "submitted_at": submitted}, timeout=7200
    )
    assert sensor.deferrable is True
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(task_context(task_id="wait"))
    _, kwargs = info.value.trigger.serialize()
    assert kwargs["batch_ids"] == ids
    assert kwargs["deadline"] == "2026-01-01T02:00:00+00:00"


def test_finished_batches_need_no_deferral(
    task_context: Any, server_for: Callable[..., Any], tmp_path: Path
) -> None:
    """Batches already terminal are decided on the worker: no trigger races the deferral."""
    server_for("openai")
    batch = create_batch(tmp_path, 3)
    hook = BatchApiHook()
    while not hook.get_batch(batch.id).is_terminal:
        pass
    sensor = BatchSensor(task_id="wait", batch_ids=batch.id)
    result = sensor.execute(task_context(task_id="wait"))
    assert result["status"] == "success"
    assert result["batch_ids"] == [batch.id]


@pytest.mark.parametrize(
    "event", [None, "done", {"status": "finished", "batch_ids": ["b1"]}, {"status": "success"}]
)
def test_invalid_or_unknown_event_is_an_error(task_context: Any, event: Any) -> None:
    sensor = BatchSensor(task_id="wait", batch_ids="b1")
    with pytest.raises(BatchFailedError, match="invalid batch event"):
        sensor.execute_complete(task_context(), event)


def test_error_event_fails_with_its_message(task_context: Any) -> None:
    sensor = BatchSensor(task_id="wait", batch_ids="b1")
    with pytest.raises(BatchFailedError, match="ended error: gave up polling"):
        sensor.execute_complete(task_context(), error_event(["b1"], "gave up polling"))


async def test_failed_batch_names_batch_status_and_vendor_errors(
    server_for: Any, task_context: Any, tmp_path: Path
) -> None:
    server = server_for()
    server.set_faults(fail_validation=True)
    batch = create_batch(tmp_path)
    sensor = BatchSensor(task_id="wait", batch_ids=[batch.id], poll_interval=0.05)
    ctx = task_context()
    event = await defer_and_run(sensor, ctx)
    with pytest.raises(BatchFailedError) as info:
        sensor.execute_complete(ctx, event)
    text = str(info.value)
    assert batch.id in text and "failed" in text and "vendor errors:" in text
    assert ctx["ti"].xcom["batch_outcome"]["status"] == "failed"


@pytest.mark.parametrize("policy", ["succeed", "fail"])
async def test_partial_failure_policy_keeps_counts(
    server_for: Any, task_context: Any, tmp_path: Path, policy: str
) -> None:
    server = server_for()
    server.set_faults(line_failure_rate=0.5)
    batch = create_batch(tmp_path, 10)
    sensor = BatchSensor(task_id="wait", batch_ids=batch.id, poll_interval=0.05, on_partial_failure=policy)
    ctx = task_context()
    event = await defer_and_run(sensor, ctx)
    assert event["status"] == "partial"
    if policy == "fail":
        with pytest.raises(PartialFailureError):
            sensor.execute_complete(ctx, event)
        counts = ctx["ti"].xcom["batch_outcome"]["counts"]
    else:
        counts = sensor.execute_complete(ctx, event)["counts"]
    assert counts["total"] == 10 and 0 < counts["failed"] < 10
    assert counts["completed"] + counts["failed"] == 10


async def test_timeout_cancels_when_asked(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server = server_for()
    server.set_faults(stall_batches=True)
    batch = create_batch(tmp_path)
    sensor = BatchSensor(
        task_id="wait", batch_ids=batch.id, poll_interval=0.05, timeout=0.3, cancel_on_timeout=True
    )
    ctx = task_context()
    event = await defer_and_run(sensor, ctx)
    assert event["status"] == "timeout"
    with pytest.raises(BatchFailedError, match="timeout"):
        sensor.execute_complete(ctx, event)
    assert BatchApiHook().get_batch(batch.id).state.value in ("cancelling", "cancelled")


def test_poke_mode_uses_the_same_decision(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server_for("xai")
    batch = create_batch(tmp_path, 4)
    sensor = BatchSensor(task_id="wait", batch_ids=batch.id, deferrable=False, poke_interval=0.05, timeout=60)
    result = sensor.execute(task_context())
    assert result["status"] == "success"
    assert result["counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert isinstance(sensor.poke(task_context()), PokeReturnValue)


def test_poke_mode_timeout_cancels(server_for: Any, task_context: Any, tmp_path: Path) -> None:
    server = server_for()
    server.set_faults(stall_batches=True)
    batch = create_batch(tmp_path)
    sensor = BatchSensor(
        task_id="wait",
        batch_ids=batch.id,
        deferrable=False,
        poke_interval=0.05,
        timeout=0.2,
        cancel_on_timeout=True,
    )
    with pytest.raises(AirflowSensorTimeout):
        sensor.execute(task_context())
    assert BatchApiHook().get_batch(batch.id).state.value in ("cancelling", "cancelled")


DAG_FILE = """
from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.sensors.batch import BatchSensor

with DAG("batch_sensor_deferral", start_date=pendulum.datetime(2026, 1, 1), schedule=None, catchup=False):
    submit = SubmitBatchOperator(task_id="submit", source={source!r})
    BatchSensor(task_id="wait", batch_ids=submit.output, deferrable=True, poll_interval=0.2, timeout=600)
"""


def test_deferrable_sensor_dag_runs_under_airflow_dags_test(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, airflow_dags_test: Any, tmp_path: Path
) -> None:
    # Slow enough that the trigger sees the batch unfinished before it completes (~1.5 s).
    server = batch_server(dialect="openai", time_scale=0.001, validate_seconds=1500)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    source = write_batch_jsonl(tmp_path / "in.jsonl", 5)
    result = airflow_dags_test(DAG_FILE.format(source=str(source)), "batch_sensor_deferral")
    assert result.ok, result.tail()
    out = result.output
    # The sensor deferred, the trigger ran from its serialised kwargs and polled the live
    # server, and the task resumed in execute_complete.
    assert "Deferring until batch(es)" in out, result.tail()
    assert "[DAG TEST] running trigger in line" in out
    assert "1 batch(es): 1 validating" in out or "1 batch(es): 1 in_progress" in out, result.tail()
    assert "Batch watch ended (success)" in out
    assert "[DAG TEST] Trigger completed" in out
    assert "1 batch(es) completed: 5 of 5 line(s) succeeded" in out
    # And the metadata database agrees: both tasks succeeded, the sensor after resuming.
    conn = sqlite3.connect(Path(os.environ["AIRFLOW_HOME"]) / "airflow.db")
    try:
        rows = dict(
            conn.execute(
                "SELECT task_id, state FROM task_instance WHERE dag_id = 'batch_sensor_deferral'"
            ).fetchall()
        )
        xcom = conn.execute(
            "SELECT value FROM xcom WHERE dag_id = 'batch_sensor_deferral' AND task_id = 'wait' "
            "AND key = 'return_value'"
        ).fetchall()
    finally:
        conn.close()
    assert rows == {"submit": "success", "wait": "success"}
    assert xcom, "the sensor pushed no outcome"
    assert [b.state.value for b in BatchApiHook().list_batches()] == ["completed"]


def test_quota_exhaustion_fails_the_poke_at_once(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, task_context: Any
) -> None:
    import json

    from airflow_batch_provider.exceptions import BatchApiQuotaError
    from airflow_batch_provider.waiting import terminal_event_now, wait_batches

    server = batch_server()
    conn = json.loads(server.connection_json())
    conn["extra"]["headers"] = {"X-Batch-Fault": "quota"}
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    sensor = BatchSensor(
        task_id="wait", batch_ids="batch_q", deferrable=False, poke_interval=0.05, timeout=60
    )
    with pytest.raises(BatchApiQuotaError, match="out of quota"):
        sensor.poke(task_context())
    hook = BatchApiHook()
    with pytest.raises(BatchApiQuotaError):
        terminal_event_now(hook, ["batch_q"], log=sensor.log)
    with pytest.raises(BatchApiQuotaError):
        wait_batches(
            hook, ["batch_q"], deadline=None, poll_interval=0.01, log=sensor.log, sleep=lambda s: None
        )
    assert server.stats()["counters"]["quota"] == 3
