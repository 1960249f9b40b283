"""QueueRoomTrigger: serialisation, the room decision, and its three events against a live server."""

from __future__ import annotations

import asyncio
import importlib
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.enqueued import QUEUE_TAG, Ledger, queue_tag
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Batch, BatchState
from airflow_batch_provider.triggers.queue import QueueRoomTrigger, room_ready
from tests.fixtures.airflow import write_batch_jsonl


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Batches stay validating (enqueued) for ~100 s unless forced on.
    server = batch_server(validate_seconds=100_000)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    return server


def tagged_batch(tmp_path: Path, tokens: int, model: str = "m") -> str:
    """A batch carrying a ledger entry."""
    hook = BatchApiHook()
    file_id = hook.upload_file(write_batch_jsonl(tmp_path / f"in-{tokens}.jsonl", 2))
    batch = hook.create_batch(
        input_file_id=file_id, endpoint="/v1/chat/completions", metadata={QUEUE_TAG: queue_tag(tokens, model)}
    )
    return batch.id


def rebuild(trigger: QueueRoomTrigger) -> QueueRoomTrigger:
    classpath, kwargs = trigger.serialize()
    module, name = classpath.rsplit(".", 1)
    rebuilt: QueueRoomTrigger = getattr(importlib.import_module(module), name)(
        **json.loads(json.dumps(kwargs))
    )
    return rebuilt


async def event_of(trigger: QueueRoomTrigger) -> dict[str, Any]:
    events = [event.payload async for event in trigger.run()]
    assert len(events) == 1, events
    return events[0]


def test_serialise_round_trip_keeps_primitives() -> None:
    trigger = QueueRoomTrigger(
        model="gpt-4o",
        need=10,
        cap=100,
        watch_ids=["b1"],
        started="2026-01-01T00:00:00+00:00",
        poll_interval=3,
    )
    again = rebuild(trigger)
    assert again.serialize() == trigger.serialize()
    assert again.need == 10 and again.cap == 100 and again.watch_ids == ["b1"] and again.model == "gpt-4o"


def test_room_needs_the_shard_to_fit_and_no_own_batch_validating() -> None:
    listed = [Batch(id="a", state=BatchState.VALIDATING), Batch(id="b", state=BatchState.IN_PROGRESS)]
    ledger = Ledger("m", 60, {b.id: b for b in listed})
    assert room_ready(ledger, 40, 100, [])
    assert not room_ready(ledger, 41, 100, [])
    assert not room_ready(ledger, 0, 100, ["a"])
    assert room_ready(ledger, 0, 100, ["b", "unknown"])


async def test_ready_once_an_earlier_batch_finishes(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = serve(batch_server, monkeypatch)
    held = tagged_batch(tmp_path, 70)
    tagged_batch(tmp_path, 500, model="another")  # another model's queue
    trigger = rebuild(QueueRoomTrigger(model="m", need=40, cap=100, started="s", poll_interval=0.02))
    task = asyncio.create_task(event_of(trigger))
    await asyncio.sleep(0.3)
    assert not task.done()  # 70 + 40 > 100
    server.force(held, "complete")
    event = await asyncio.wait_for(task, 30)
    assert event["status"] == "ready" and event["held"] == 0 and event["started"] == "s"
    assert event["model"] == "m" and event["cap"] == 100


async def test_timeout_at_the_deadline(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    serve(batch_server, monkeypatch)
    tagged_batch(tmp_path, 100)
    deadline = (datetime.now(timezone.utc) + timedelta(seconds=0.3)).isoformat()
    event = await asyncio.wait_for(
        event_of(QueueRoomTrigger(model="m", need=1, cap=100, deadline=deadline, poll_interval=0.05)), 30
    )
    assert event["status"] == "timeout" and event["deadline"] == deadline


async def test_error_after_the_tolerated_listing_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing listens there: every listing is a connection error.
    conn = {
        "conn_type": "batch_api",
        "host": "http://127.0.0.1:9/v1",
        "password": "sk-x",
        "extra": {"max_retries": 0},
    }
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    event = await asyncio.wait_for(
        event_of(QueueRoomTrigger(cap=10, poll_interval=0.01, max_consecutive_errors=1)), 60
    )
    assert event["status"] == "error" and "cannot read the batches" in event["message"]


async def test_a_killed_task_cancels_the_batches_it_created(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    serve(batch_server, monkeypatch)
    created = tagged_batch(tmp_path, 10)
    await rebuild(QueueRoomTrigger(cap=10, created_ids=[created], cancel_on_kill=False)).on_kill()
    assert BatchApiHook().get_batch(created).state is BatchState.VALIDATING
    await rebuild(QueueRoomTrigger(cap=10, created_ids=[created])).on_kill()
    assert BatchApiHook().get_batch(created).state in (BatchState.CANCELLING, BatchState.CANCELLED)
