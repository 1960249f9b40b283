"""BatchTrigger: serialisation, deadline across restarts, transient errors, on_kill, every event."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from airflow_batch_provider.exceptions import BatchApiRateLimitError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Batch
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.waiting import retry_after_of
from tests.fixtures.airflow import write_batch_jsonl

SECRET = "sk-very-secret-key-123"


@pytest.fixture
def server_conn(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Start a server and point ``batch_api_default`` at it (optionally with connection extras)."""

    def start(dialect: str = "openai", extra: dict[str, Any] | None = None, **config: Any) -> Any:
        server = batch_server(dialect=dialect, **config)
        conn = json.loads(server.connection_json(api_key=SECRET if config.get("api_key") else None))
        conn["extra"].update(extra or {})
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
        return server

    return start


def create_batch(tmp_path: Path, lines: int = 3) -> Batch:
    hook = BatchApiHook()
    file_id = hook.upload_file(write_batch_jsonl(tmp_path / f"in-{lines}.jsonl", lines))
    return hook.create_batch(input_file_id=file_id, endpoint="/v1/chat/completions", metadata={"t": "1"})


async def events_of(trigger: BatchTrigger) -> list[dict[str, Any]]:
    return [event.payload async for event in trigger.run()]


def rebuild(trigger: BatchTrigger) -> BatchTrigger:
    """What the triggerer does after a restart: import the class path, call it with the kwargs."""
    classpath, kwargs = trigger.serialize()
    module, name = classpath.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    # The kwargs travel through the database as JSON.
    rebuilt: BatchTrigger = cls(**json.loads(json.dumps(kwargs)))
    return rebuilt


def test_serialise_round_trip_primitives_only_and_no_secret(server_conn: Any) -> None:
    server_conn(api_key=SECRET)
    trigger = BatchTrigger(
        batch_ids=["b1", "b2"],
        submitted_at="2026-01-01T00:00:00Z",
        timeout=3600,
        poll_interval=5,
        max_poll_interval=60,
        max_consecutive_errors=3,
        cancel_on_kill=False,
        dialect="xai",
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_batch_provider.triggers.batch.BatchTrigger"
    json.dumps(kwargs)  # primitives only
    assert all(isinstance(v, (str, int, float, bool, list, type(None))) for v in kwargs.values())
    assert SECRET not in repr(kwargs)
    again = rebuild(trigger)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs["deadline"] == "2026-01-01T01:00:00+00:00"


async def test_recreated_trigger_keeps_deadline_from_submit_time(server_conn: Any, tmp_path: Path) -> None:
    server = server_conn()
    server.set_faults(stall_batches=True)
    batch = create_batch(tmp_path)
    submitted = datetime.now(timezone.utc) - timedelta(minutes=10)
    trigger = BatchTrigger(
        batch_ids=[batch.id], submitted_at=submitted.isoformat(), timeout=300, poll_interval=0.05
    )
    restarted = rebuild(trigger)
    assert restarted.deadline_at == trigger.deadline_at == submitted + timedelta(seconds=300)
    # The deadline passed while the triggerer was down: the rebuilt trigger times out at once
    # instead of granting itself another five minutes.
    events = await events_of(restarted)
    assert [e["status"] for e in events] == ["timeout"]
    assert events[0]["batch_ids"] == [batch.id]
    assert events[0]["batches"][0]["state"] == "in_progress"


async def test_many_batches_one_event_each_outcome(server_conn: Any, tmp_path: Path) -> None:
    server_conn()
    ids = [create_batch(tmp_path, n).id for n in (2, 3, 4)]
    events = await events_of(BatchTrigger(batch_ids=ids, poll_interval=0.05))
    assert len(events) == 1
    event = events[0]
    assert event["status"] == "success"
    assert event["batch_ids"] == ids
    assert [b["id"] for b in event["batches"]] == ids
    assert event["counts"] == {"total": 9, "completed": 9, "failed": 0}


async def test_transient_errors_are_survived(server_conn: Any, tmp_path: Path) -> None:
    # No retries in the hook: every injected 503 reaches the trigger's own error budget.
    server = server_conn(extra={"max_retries": 0})
    batch = create_batch(tmp_path)
    server.set_faults(rate_503=0.5, retry_after=0)
    events = await events_of(BatchTrigger(batch_ids=[batch.id], poll_interval=0.02, max_consecutive_errors=2))
    assert [e["status"] for e in events] == ["success"]
    assert server.stats()["counters"].get("status_503", 0) >= 1, server.stats()


async def test_gives_up_after_too_many_consecutive_errors(server_conn: Any, tmp_path: Path) -> None:
    server = server_conn(extra={"max_retries": 0})
    batch = create_batch(tmp_path)
    server.set_faults(rate_500=1.0)
    events = await events_of(BatchTrigger(batch_ids=[batch.id], poll_interval=0.01, max_consecutive_errors=3))
    assert [e["status"] for e in events] == ["error"]
    assert "after 4 consecutive errors" in events[0]["message"]
    assert events[0]["termination_reason"] == "polling_error"


async def test_retry_after_is_honoured_while_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Edge case on a mock transport: a 429 whose Retry-After is longer than the poll interval."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCH_API_DEFAULT",
        json.dumps({"conn_type": "batch_api", "host": "http://mock/v1", "extra": {"max_retries": 1}}),
    )
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(
                429, headers={"retry-after": "0.3"}, json={"error": {"message": "slow down"}}
            )
        return httpx.Response(
            200, json={"id": "b1", "status": "completed", "request_counts": {"total": 1, "completed": 1}}
        )

    class MockTrigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            return BatchApiHook(self.batch_conn_id, async_transport=httpx.MockTransport(handler))

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def record_sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    # asyncio.sleep is patched for the hook's retry wait and the trigger's poll wait alike.
    monkeypatch.setattr(asyncio, "sleep", record_sleep)
    events = await events_of(MockTrigger(batch_ids=["b1"], poll_interval=0.01))
    assert [e["status"] for e in events] == ["success"]
    # Besides the sub-interval start spread, the one long wait is the server's Retry-After.
    assert [s for s in slept if s > 0.05] == [pytest.approx(0.3)]
    assert len(calls) == 2


def test_retry_after_carried_by_an_error_sets_the_next_wait() -> None:
    assert retry_after_of(BatchApiRateLimitError("slow down", status_code=429)) is None
    assert retry_after_of(BatchApiRateLimitError("slow down", status_code=429, retry_after=12.5)) == 12.5


async def test_retry_after_outlives_the_hooks_own_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the hook's retries spent, the 429's Retry-After still sets the trigger's next poll."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCH_API_DEFAULT",
        json.dumps({"conn_type": "batch_api", "host": "http://mock/v1", "extra": {"max_retries": 0}}),
    )
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(429, headers={"retry-after": "7"}, json={"error": {"message": "slow"}})
        return httpx.Response(
            200, json={"id": "b1", "status": "completed", "request_counts": {"total": 1, "completed": 1}}
        )

    class MockTrigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            return BatchApiHook(self.batch_conn_id, async_transport=httpx.MockTransport(handler))

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def record_sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", record_sleep)
    events = await events_of(MockTrigger(batch_ids=["b1"], poll_interval=0.01))
    assert [e["status"] for e in events] == ["success"]
    assert [s for s in slept if s > 0.05] == [pytest.approx(7.0)]
    assert len(calls) == 2


async def test_unknown_batch_is_an_error_event_at_once(server_conn: Any) -> None:
    server_conn()
    events = await events_of(BatchTrigger(batch_ids=["batch_does_not_exist"], poll_interval=0.01))
    assert [e["status"] for e in events] == ["error"]
    assert "batch_does_not_exist" in events[0]["message"]


@pytest.mark.parametrize("cancel_on_kill", [True, False])
async def test_on_kill_cancels_only_when_asked(
    server_conn: Any, tmp_path: Path, cancel_on_kill: bool
) -> None:
    server = server_conn()
    server.set_faults(stall_batches=True)
    batch = create_batch(tmp_path)
    trigger = BatchTrigger(batch_ids=[batch.id], poll_interval=0.02, cancel_on_kill=cancel_on_kill)

    # As the triggerer does on a user action: cancel the running task, then call on_kill().
    task = asyncio.create_task(events_of(trigger))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await trigger.on_kill()
    await trigger.cleanup()
    state = BatchApiHook().get_batch(batch.id).state.value
    if cancel_on_kill:
        assert state in ("cancelling", "cancelled")
    else:
        assert state == "in_progress"


async def test_rebuilt_trigger_past_its_deadline_facing_errors_reports_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a restart the first polls fail and the deadline has passed: timeout, not a polling error."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCH_API_DEFAULT",
        json.dumps({"conn_type": "batch_api", "host": "http://mock/v1", "extra": {"max_retries": 0}}),
    )

    class MockTrigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            transport = httpx.MockTransport(
                lambda r: httpx.Response(503, json={"error": {"message": "busy"}})
            )
            return BatchApiHook(self.batch_conn_id, async_transport=transport)

    real_sleep = asyncio.sleep

    async def no_sleep(seconds: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    trigger = MockTrigger(batch_ids=["b1"], submitted_at="2026-01-01T00:00:00+00:00", timeout=60)
    events = await events_of(trigger)
    assert [(e["status"], e["termination_reason"]) for e in events] == [("timeout", "deadline_exceeded")]


@pytest.fixture
def unfrozen(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test starts with a heap this module has not frozen, and leaves it unfrozen."""
    import gc

    from airflow_batch_provider.triggers import batch as trigger_module

    monkeypatch.setattr(trigger_module, "_HEAP_FROZEN", False)
    gc.unfreeze()
    yield trigger_module
    gc.unfreeze()


async def test_heap_is_frozen_once_only_when_the_deployment_asks(
    unfrozen: Any, server_conn: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    server_conn()
    batch = create_batch(tmp_path)
    # Off by default: running a trigger leaves the collector alone.
    await events_of(BatchTrigger(batch_ids=[batch.id], poll_interval=0.05))
    assert gc.get_freeze_count() == 0 and unfrozen.freeze_triggerer_heap() is False

    monkeypatch.setenv("AIRFLOW__BATCH_PROVIDER__TRIGGERER_GC_FREEZE", "True")
    real_freeze, freezes = gc.freeze, []
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze()))
    events = await events_of(BatchTrigger(batch_ids=[batch.id], poll_interval=0.05))
    assert events[0]["status"] == "success"
    assert len(freezes) == 1 and gc.get_freeze_count() > 10_000  # Airflow's modules, at least
    # Once per process: later triggers do not freeze again (their own state stays collectable).
    assert unfrozen.freeze_triggerer_heap() is False
    await events_of(BatchTrigger(batch_ids=[batch.id], poll_interval=0.05))
    assert len(freezes) == 1


async def test_triggers_of_one_connection_share_one_hook_and_release_it(
    server_conn: Any, tmp_path: Path
) -> None:
    server_conn()
    ids = [create_batch(tmp_path, n).id for n in (1, 2, 3, 4, 5)]
    built: list[BatchApiHook] = []

    class CountingTrigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            built.append(super()._new_hook())
            return built[-1]

    results = await asyncio.gather(
        *(events_of(CountingTrigger(batch_ids=[i], poll_interval=0.05)) for i in ids)
    )
    assert [r[0]["status"] for r in results] == ["success"] * 5
    # One hook (one connection lookup, one client) for the five, closed after the last one.
    assert len(built) == 1 and built[0]._aclient is None
    from airflow_batch_provider.triggers import batch as trigger_module

    assert not trigger_module._LEASES.get(asyncio.get_running_loop())


async def test_a_rotated_key_reaches_triggers_started_after_the_shared_hook_aged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_batch_provider.triggers import batch as trigger_module

    def conn(key: str) -> str:
        return json.dumps({"conn_type": "batch_api", "host": "http://mock/v1", "password": key})

    seen: dict[str, set[str]] = {"b1": set(), "b2": set()}
    release = asyncio.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        batch_id = request.url.path.rsplit("/", 1)[-1]
        seen[batch_id].add(request.headers["authorization"])
        status = "completed" if release.is_set() else "in_progress"
        return httpx.Response(
            200, json={"id": batch_id, "status": status, "request_counts": {"total": 1, "completed": 1}}
        )

    class MockTrigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            return BatchApiHook(self.batch_conn_id, async_transport=httpx.MockTransport(handler))

    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", conn("sk-old"))
    first = asyncio.create_task(events_of(MockTrigger(batch_ids=["b1"], poll_interval=0.01)))
    while not seen["b1"]:
        await asyncio.sleep(0.01)
    # The key rotates and the shared hook is older than the limit: a new trigger gets a new hook.
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", conn("sk-new"))
    monkeypatch.setattr(trigger_module, "SHARED_HOOK_MAX_AGE", 0.0)
    second = asyncio.create_task(events_of(MockTrigger(batch_ids=["b2"], poll_interval=0.01)))
    while not seen["b2"]:
        await asyncio.sleep(0.01)
    release.set()
    assert [(await first)[0]["status"], (await second)[0]["status"]] == ["success", "success"]
    assert seen == {"b1": {"Bearer sk-old"}, "b2": {"Bearer sk-new"}}
    assert not trigger_module._LEASES.get(asyncio.get_running_loop())


def test_a_bad_freeze_setting_is_ignored_not_fatal(unfrozen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setenv("AIRFLOW__BATCH_PROVIDER__TRIGGERER_GC_FREEZE", "sometimes")
    assert unfrozen.freeze_triggerer_heap() is False and gc.get_freeze_count() == 0


async def test_quota_exhaustion_ends_the_watch_at_once(server_conn: Any) -> None:
    # 429 insufficient_quota is not a rate limit: no poll budget is spent waiting for it.
    server = server_conn(extra={"headers": {"X-Batch-Fault": "quota"}})
    trigger = BatchTrigger(batch_ids=["batch_q"], poll_interval=0.01, max_consecutive_errors=5)
    events = await events_of(trigger)
    assert [e["status"] for e in events] == ["error"]
    assert "out of quota" in events[0]["message"]
    assert server.stats()["counters"]["quota"] == 1
