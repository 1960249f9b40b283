"""The waiting module: the poll loop's decisions (no I/O) and the sync and async drivers that share them."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from airflow_batch_provider.exceptions import (
    BatchApiNotFoundError,
    BatchApiQuotaError,
    BatchApiRateLimitError,
)
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Batch, BatchState, RequestCounts
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.waiting import MAX_RETRY_AFTER, PollLoop, wait_batches

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
LOG = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parents[1] / "airflow_batch_provider"


def running(completed: int = 0) -> Batch:
    return Batch(
        id="b1", state=BatchState.IN_PROGRESS, request_counts=RequestCounts(total=4, completed=completed)
    )


def test_interval_backs_off_while_nothing_changes_and_resets_on_progress() -> None:
    loop = PollLoop(["b1"], poll_interval=10.0, max_poll_interval=30.0, backoff=2.0)
    sleeps = [loop.polled([running(c)], NOW).sleep for c in (0, 0, 0, 0, 1)]
    assert sleeps == [10.0, 20.0, 30.0, 30.0, 10.0]


def test_unchanged_polls_are_not_decided_again_but_the_deadline_still_ends_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import airflow_batch_provider.waiting as waiting

    decided: list[datetime | None] = []
    real = waiting.decide

    def counting(batches: Any, *, deadline: datetime | None = None, now: datetime | None = None) -> Any:
        decided.append(now)
        return real(batches, deadline=deadline, now=now)

    monkeypatch.setattr(waiting, "decide", counting)
    loop = PollLoop(["b1"], deadline=NOW + timedelta(seconds=60), poll_interval=10.0, backoff=2.0)
    steps = [loop.polled([running(0)], NOW + timedelta(seconds=s)) for s in (0, 10, 30)]
    assert [s.sleep for s in steps] == [10.0, 20.0, pytest.approx(30.01)]
    assert [s.info is not None for s in steps] == [True, False, False]
    # Progress is decided (and logged); unchanged states are not, until the deadline has passed.
    assert loop.polled([running(1)], NOW + timedelta(seconds=40)).info is not None
    assert loop.polled([running(1)], NOW + timedelta(seconds=50)).event is None
    ended = loop.polled([running(1)], NOW + timedelta(seconds=60))
    assert ended.event is not None and ended.event["status"] == "timeout"
    assert decided == [NOW, NOW + timedelta(seconds=40), NOW + timedelta(seconds=60)]


def test_sleep_and_poll_are_clipped_at_the_deadline() -> None:
    loop = PollLoop(["b1"], deadline=NOW + timedelta(seconds=5), poll_interval=30.0)
    assert loop.polled([running()], NOW).sleep == pytest.approx(5.01)
    # A poll may run until the deadline plus one interval (at least a second).
    assert loop.budget(NOW) == pytest.approx(35.0)
    assert PollLoop(["b1"], deadline=NOW, poll_interval=0.1).budget(NOW + timedelta(seconds=9)) == 1.0


def test_retry_after_is_capped_then_clipped_at_the_deadline() -> None:
    loop = PollLoop(["b1"], poll_interval=1.0)
    step = loop.failed(BatchApiRateLimitError("busy", status_code=429, retry_after=3600.0), NOW)
    assert (step.event, step.sleep) == (None, MAX_RETRY_AFTER)
    near = PollLoop(["b1"], deadline=NOW + timedelta(seconds=60), poll_interval=1.0)
    assert near.failed(BatchApiRateLimitError("busy", status_code=429, retry_after=3600.0), NOW).sleep == (
        pytest.approx(60.01)
    )


def test_deadline_is_judged_before_the_error_budget() -> None:
    loop = PollLoop(["b1"], deadline=NOW, max_consecutive_errors=0)
    step = loop.failed(httpx.ReadTimeout("slow"), NOW + timedelta(seconds=1))
    assert step.event is not None
    assert (step.event["status"], step.event["termination_reason"]) == ("timeout", "deadline_exceeded")


def test_error_budget_counts_errors_in_a_row_only() -> None:
    loop = PollLoop(["b1", "b2"], max_consecutive_errors=1)
    assert loop.failed(httpx.ConnectError("down"), NOW).event is None
    loop.polled([running()], NOW)  # a good poll clears the count
    assert loop.failed(httpx.ConnectError("down"), NOW).event is None
    event = loop.failed(httpx.ConnectError("down"), NOW).event
    assert event is not None
    assert event["status"] == "error"
    assert "batch(es) b1, b2 after 2 consecutive errors" in event["message"]


@pytest.mark.parametrize(
    "exc",
    [BatchApiQuotaError("out of quota", status_code=429), BatchApiNotFoundError("gone", status_code=404)],
)
def test_errors_no_retry_cures_end_the_watch_at_once(exc: Exception) -> None:
    step = PollLoop(["b1"], max_consecutive_errors=99).failed(exc, NOW)
    assert step.fatal
    assert step.event is not None and step.event["status"] == "error"


# ---- the two drivers take the same decisions ------------------------------------------------
def script() -> Iterator[httpx.Response]:
    """What the vendor answers, poll after poll."""

    def batch(completed: int) -> httpx.Response:
        body = {"id": "b1", "status": "in_progress", "request_counts": {"total": 4, "completed": completed}}
        return httpx.Response(200, json=body)

    busy = httpx.Response(503, json={"error": {"message": "busy"}})
    yield batch(0)
    yield batch(0)
    yield busy
    yield httpx.Response(429, headers={"retry-after": "1000"}, json={"error": {"message": "slow down"}})
    yield batch(1)
    yield from (busy, busy, busy)


def scripted() -> Callable[[httpx.Request], httpx.Response]:
    answers = script()
    return lambda request: next(answers)


@pytest.fixture
def mock_conn(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = {"conn_type": "batch_api", "host": "http://mock/v1", "extra": {"max_retries": 0}}
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))


SETTINGS: dict[str, Any] = {"poll_interval": 10.0, "max_poll_interval": 100.0, "max_consecutive_errors": 2}
EXPECTED_SLEEPS = [10.0, 15.0, 15.0, MAX_RETRY_AFTER, 10.0, 10.0, 10.0]


def test_sync_and_async_loops_make_the_same_decisions(
    mock_conn: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept_sync: list[float] = []
    with BatchApiHook(transport=httpx.MockTransport(scripted())) as hook:
        sync_event = wait_batches(hook, ["b1"], deadline=None, log=LOG, sleep=slept_sync.append, **SETTINGS)

    handler = scripted()

    class MockTrigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            return BatchApiHook(self.batch_conn_id, async_transport=httpx.MockTransport(handler))

    slept_async: list[float] = []
    real_sleep = asyncio.sleep

    async def record_sleep(seconds: float) -> None:
        slept_async.append(seconds)
        await real_sleep(0)

    async def watch() -> list[dict[str, Any]]:
        return [event.payload async for event in MockTrigger(batch_ids=["b1"], **SETTINGS).run()]

    # The trigger's own loop: with shared polling (tests/triggers/test_shared_poll.py) a watch
    # between changes is paced by the connection's poller, not by the trigger's sleeps.
    extra = {"max_retries": 0, "shared_polling": False}
    conn = {"conn_type": "batch_api", "host": "http://mock/v1", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    monkeypatch.setattr(asyncio, "sleep", record_sleep)
    async_events = asyncio.run(watch())

    assert slept_sync == EXPECTED_SLEEPS
    assert slept_async[1:] == EXPECTED_SLEEPS  # the first is the trigger's start spread
    assert async_events == [sync_event]
    assert "gave up polling batch(es) b1 after 3 consecutive errors" in sync_event["message"]


def test_no_operator_imports_from_the_sensors_package() -> None:
    for path in sorted((PACKAGE / "operators").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
        assert not [m for m in imported if m.startswith("airflow_batch_provider.sensors")], path.name


def test_an_unknown_status_is_judged_within_the_error_budget() -> None:
    from airflow_batch_provider.exceptions import UnknownBatchStatusError

    loop = PollLoop(["b1"], poll_interval=10.0, max_consecutive_errors=1)
    unknown = UnknownBatchStatusError("batch b1 reported unknown status 'queued'")
    first = loop.failed(unknown, NOW)
    # Tolerated once (a vendor's new state may pass), then the watch ends as error, never success.
    assert first.event is None and not first.fatal and first.sleep == 10.0
    second = loop.failed(unknown, NOW)
    assert second.event is not None and second.event["status"] == "error"
    assert "after 2 consecutive errors" in second.event["message"] and "queued" in second.event["message"]
