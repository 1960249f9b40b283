"""Triggerer restart while waiting: the trigger is rebuilt from its stored kwargs on a new triggerer.

A triggerer that dies cancels its triggers' ``run()``; another triggerer rebuilds each trigger
from the kwargs in the metadata database (``serialize()``) and starts it again. The rebuilt
trigger must keep the deadline counted from the submit time (not from its own start) and
finish the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timezone
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.waiting import deadline_from
from tests.fixtures.reliability import MESSAGES, Pipeline, first_event, rebuild_trigger, seed_texts

ROWS = 30


async def wait_for_state(batch_id: str, wanted: str) -> None:
    hook = BatchApiHook()
    for _ in range(1000):
        if (await hook.aget_batch(batch_id)).state.value == wanted:
            await hook.aclose()
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} never reached {wanted}")


async def kill_triggerer(trigger: Any, batch_id: str) -> None:
    """Run a trigger until its batch is in progress, then stop it the way a dying triggerer does."""
    task = asyncio.create_task(first_event(trigger))
    await wait_for_state(batch_id, "in_progress")
    await asyncio.sleep(0.2)  # a few polls
    assert not task.done(), "the trigger ended before the restart"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await trigger.cleanup()


async def test_rebuilt_trigger_keeps_deadline_and_completes(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ~1.5 s of work: the first triggerer sees the batch running and dies in the middle of it.
    server = batch_server(dialect="openai", line_seconds=50, chunk_size=5)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    rows = seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(ROWS)])
    manifest = pipeline.build("restart", table="tickets", key_columns="id", messages=MESSAGES)
    op = pipeline.submit_op(manifest, timeout=3600)
    ctx = pipeline.context("submit", "restart")
    with pytest.raises(TaskDeferred) as info:
        op.execute(ctx)
    deferred = info.value
    stored = deferred.trigger.serialize()  # what the metadata database holds
    submission = ctx["ti"].xcom["return_value"]
    original_deadline = deadline_from(submission["submitted_at"], 3600)

    first = rebuild_trigger(deferred.trigger)
    await kill_triggerer(first, submission["batch_ids"][0])
    # The restart really happened while waiting: the batch is still running.
    assert not BatchApiHook().get_batch(submission["batch_ids"][0]).is_terminal

    second = rebuild_trigger(deferred.trigger)
    assert second is not first and second.serialize() == stored
    assert second.deadline_at == first.deadline_at == original_deadline
    event = await first_event(second)
    assert event["status"] == "success", event
    result = getattr(op, deferred.method_name)(ctx, event, **deferred.kwargs)
    summary = pipeline.merge(result, manifest, "answers")
    assert summary["counts"]["succeeded"] == ROWS
    assert dict(pipeline.warehouse.rows("SELECT id, content FROM answers")) == {
        i: f"echo: {t}" for i, t in rows
    }
    assert len(list(BatchApiHook().list_batches())) == 1


async def test_rebuilt_trigger_after_the_deadline_times_out_at_once(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clock is the submit time's: a trigger rebuilt after the deadline passed does not start
    a new wait; it reports ``timeout`` on its first poll (counted at the server)."""
    server = batch_server(dialect="openai", faults={"stall_batches": True})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(5)])
    manifest = pipeline.build("restart-late", table="tickets", key_columns="id", messages=MESSAGES)
    op = pipeline.submit_op(manifest, timeout=3.0)
    ctx = pipeline.context("submit", "restart-late")
    with pytest.raises(TaskDeferred) as info:
        op.execute(ctx)
    deferred = info.value
    batch_id = ctx["ti"].xcom["return_value"]["batch_ids"][0]
    first = rebuild_trigger(deferred.trigger)
    await kill_triggerer(first, batch_id)
    # The triggerer stays down past the deadline.
    deadline = first.deadline_at
    assert deadline is not None
    while _now() <= deadline:
        await asyncio.sleep(0.05)
    before = server.stats()["counters"]["requests"]
    second = rebuild_trigger(deferred.trigger)
    event = await first_event(second)
    polls = server.stats()["counters"]["requests"] - before
    assert event["status"] == "timeout" and event["termination_reason"] == "deadline_exceeded", event
    assert polls == 1, f"the rebuilt trigger polled {polls} times; it should stop at its first poll"


def _now() -> datetime:
    return datetime.now(timezone.utc)


async def test_resume_with_the_event_alone_keeps_the_submission(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``airflow dags test`` resumes a deferred task with ``{"event": ...}`` only (its inline
    trigger drops the deferral kwargs): the submission comes back from the XCom pushed before
    deferring, so the merge still gets the batch ids and shards."""
    from tests.fixtures.airflow import RecordingTaskInstance

    class PullingTaskInstance(RecordingTaskInstance):
        def xcom_pull(self, task_ids: str, key: str, map_indexes: int) -> Any:
            assert (task_ids, key, map_indexes) == (self.task_id, "return_value", self.map_index)
            return self.xcom.get(key)

    server = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(12)])
    manifest = pipeline.build("resume", table="tickets", key_columns="id", messages=MESSAGES, max_lines=5)
    op = pipeline.submit_op(manifest)
    ctx = {"ti": PullingTaskInstance("reliability", "submit", "resume")}
    with pytest.raises(TaskDeferred) as info:
        op.execute(ctx)  # type: ignore[arg-type]
    event = await first_event(rebuild_trigger(info.value.trigger))
    result = op.execute_complete(ctx, event)  # type: ignore[arg-type]
    assert [b["shard"] for b in result["batches"]] == [0, 1, 2] and result["outcome"]["status"] == "success"
    summary = pipeline.merge(result, manifest, "answers")
    assert summary["counts"]["succeeded"] == 12
