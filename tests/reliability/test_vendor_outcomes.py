"""Vendor outcomes through the whole pipeline: the task's documented outcome and every row's status.

The merge runs after a failed wait (as a DAG's ``trigger_rule="all_done"`` merge does), so the
table says what happened to each input row: nothing is silently missing.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from airflow_batch_provider.exceptions import BatchFailedError, PartialFailureError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.waiting import OUTCOME_XCOM_KEY
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts

ROWS = 40
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES}


@pytest.fixture
def slow_server(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A server answering 5 lines per checkpoint, ~50 ms per line: a batch is caught half done."""
    server = batch_server(dialect="openai", time_scale=0.001, line_seconds=50, chunk_size=5)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    return server


def wait_until_partly_done(batch_id: str, at_least: int = 10) -> int:
    """Poll until some (not all) lines are answered; returns how many were."""
    hook = BatchApiHook()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = hook.get_batch(batch_id)
        done = batch.request_counts.completed
        if done >= at_least:
            assert done < ROWS, f"batch {batch_id} finished before it could be interrupted"
            return done
        time.sleep(0.02)
    raise AssertionError(f"batch {batch_id} made no progress")


def table_statuses(pipeline: Pipeline) -> dict[int, tuple[str, str | None]]:
    return {
        r[0]: (r[1], r[2])
        for r in pipeline.warehouse.rows("SELECT id, status, error_code FROM answers ORDER BY id")
    }


async def test_validation_failure_fails_the_task_and_every_row(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="openai", faults={"fail_validation": True})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    seed_texts(pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await pipeline.run("validation", "answers", build=BUILD)
    assert isinstance(record.submit_error, BatchFailedError), record.submit_error
    assert record.event is not None and record.event["status"] == "failed"
    assert record.event["termination_reason"] == "batch_failed", record.event
    assert "validation failed" in str(record.submit_error)
    # The failed outcome was still published for downstream tasks before the task failed.
    assert record.xcom[OUTCOME_XCOM_KEY]["status"] == "failed"
    assert record.xcom["return_value"]["batch_ids"] == record.event["batch_ids"]
    rows = table_statuses(pipeline)
    assert len(rows) == ROWS and {s for s, _ in rows.values()} == {"failed"}, rows
    assert record.merge is not None and record.merge["counts"]["failed"] == ROWS


@pytest.mark.parametrize("how", ["expire", "cancel"])
async def test_expiry_and_cancellation_keep_partial_results(
    slow_server: Any, pipeline: Pipeline, how: str
) -> None:
    seed_texts(pipeline.warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    answered: list[int] = []

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        answered.append(wait_until_partly_done(batch_id))
        if how == "expire":
            slow_server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)

    record = await pipeline.run(f"partial-{how}", "answers", build=BUILD, before_wait=interrupt)
    status = "expired" if how == "expire" else "cancelled"
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError) and status in str(record.submit_error)
    rows = table_statuses(pipeline)
    succeeded = [k for k, (s, _) in rows.items() if s == "succeeded"]
    stopped = [k for k, (s, _) in rows.items() if s == status]
    # Every row is there once: what was answered before the stop landed, the rest says why not.
    assert len(rows) == ROWS and len(succeeded) + len(stopped) == ROWS, rows
    assert len(succeeded) >= answered[0] > 0 and len(stopped) > 0, (answered, len(succeeded))
    assert {rows[k][1] for k in stopped} == {f"batch_{status}"}
    got = dict(pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert all(got[k] == f"echo: question {k - 1}" for k in succeeded)
    assert record.merge is not None and record.merge["counts"][status] == len(stopped)


async def test_all_lines_failed_is_a_failed_task(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="openai", faults={"line_failure_rate": 1.0})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    seed_texts(pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    # Even the lenient partial policy cannot turn "nothing succeeded" into a green task.
    record = await pipeline.run(
        "all-failed", "answers", build=BUILD, submit={"on_partial_failure": "succeed"}
    )
    assert record.event is not None and record.event["status"] == "failed", record.event
    assert record.event["termination_reason"] == "all_lines_failed"
    assert isinstance(record.submit_error, BatchFailedError)
    assert not isinstance(record.submit_error, PartialFailureError)
    rows = table_statuses(pipeline)
    assert len(rows) == ROWS and {s for s, _ in rows.values()} == {"failed"}, rows
    assert all(code for _, code in rows.values()), "a failed row must carry the vendor's error code"
    assert server.stats()["counters"]["line_failures"] == ROWS


async def test_some_lines_failed_is_partial_by_policy(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="openai", faults={"line_failure_rate": 0.3})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    seed_texts(pipeline.warehouse, "tickets", [f"q{i}" for i in range(ROWS)])
    record = await pipeline.run("partial", "answers", build=BUILD, submit={"on_partial_failure": "fail"})
    failures = server.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS
    assert record.event is not None and record.event["status"] == "partial"
    assert isinstance(record.submit_error, PartialFailureError)
    counts = pipeline.status_counts("answers")
    assert counts == {"succeeded": ROWS - failures, "failed": failures}, counts
