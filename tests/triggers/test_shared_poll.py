"""Shared polling: the triggers of one connection read their batches with one listing per cycle.

The vendor is an ``httpx.MockTransport`` that counts every call; nothing here asserts a time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.triggers import batch as trigger_module
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.triggers.shared_poll import CallLimiter, pollers

SECRET = "sk-shared-poll-secret-777"


class Vendor:
    """A vendor of ``count`` batches that stay ``in_progress`` for ``rounds`` listings.

    :param hidden: ids the listing never shows (only a get by id does).
    :param list_faults: answers given to the first listings instead of a page.
    """

    def __init__(
        self, count: int, rounds: int = 2, hidden: frozenset[str] = frozenset(), list_faults: Any = ()
    ) -> None:
        self.ids = [f"batch_{i:05d}" for i in range(count)]
        self.rounds = rounds
        self.hidden = hidden
        self.list_faults = list(list_faults)
        self.calls: list[str] = []
        self.got: list[str] = []
        self.listings = 0

    def batch(self, batch_id: str) -> dict[str, Any]:
        status = "completed" if self.listings > self.rounds or self.rounds == 0 else "in_progress"
        return {"id": batch_id, "status": status, "request_counts": {"total": 1, "completed": 1, "failed": 0}}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/batches":
            self.calls.append("list")
            if self.list_faults:
                return self.list_faults.pop(0)
            if request.url.params.get("after") is None:
                self.listings += 1
            # Newest first, paged with ``after`` like OpenAI.
            ordered = [b for b in reversed(self.ids) if b not in self.hidden]
            after = request.url.params.get("after")
            start = ordered.index(after) + 1 if after else 0
            limit = int(request.url.params.get("limit", 20))
            page = ordered[start : start + limit]
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [self.batch(b) for b in page],
                    "last_id": page[-1] if page else None,
                    "has_more": start + limit < len(ordered),
                },
            )
        batch_id = path.rsplit("/", 1)[-1]
        self.calls.append("get")
        self.got.append(batch_id)
        if batch_id not in self.ids:
            return httpx.Response(404, json={"error": {"message": f"no batch {batch_id}"}})
        return httpx.Response(200, json=self.batch(batch_id))


@pytest.fixture
def vendor(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[Vendor, type[BatchTrigger]]]:
    """A mock vendor behind ``batch_api_default`` and a trigger class that reads it."""

    def make(
        count: int, extra: dict[str, Any] | None = None, **kwargs: Any
    ) -> tuple[Vendor, type[BatchTrigger]]:
        api = Vendor(count, **kwargs)
        conn = {
            "conn_type": "batch_api",
            "host": "http://mock/v1",
            "password": SECRET,
            "extra": {"max_retries": 0, **(extra or {})},
        }
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))

        class MockTrigger(BatchTrigger):
            def _new_hook(self) -> BatchApiHook:
                return BatchApiHook(self.batch_conn_id, async_transport=httpx.MockTransport(api))

            def start_delay(self) -> float:
                # All ask at once, so the calls each cycle makes are known exactly.
                return 0.0

        return api, MockTrigger

    return make


async def statuses(triggers: list[BatchTrigger]) -> list[str]:
    async def one(trigger: BatchTrigger) -> str:
        return [event.payload async for event in trigger.run()][0]["status"]

    return list(await asyncio.gather(*(one(t) for t in triggers)))


async def test_triggers_of_one_connection_cost_one_listing_per_cycle(vendor: Any) -> None:
    # 150 batches: two pages of 100 per cycle, three cycles (in progress, in progress, completed).
    api, MockTrigger = vendor(150)
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.2) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 150
    # One trigger per batch polling on its own would have made 3 x 150 gets; shared, each round
    # of polls costs the two pages (on a busy machine a round's triggers may ask in two cycles).
    assert "get" not in api.calls
    assert len(api.calls) <= 3 * 2 * 2, api.calls
    assert not pollers()


async def test_one_trigger_watching_many_batches_lists_them(vendor: Any) -> None:
    api, MockTrigger = vendor(10)
    assert await statuses([MockTrigger(batch_ids=api.ids, poll_interval=0.05)]) == ["success"]
    assert api.calls == ["list"] * 3


async def test_a_batch_missing_from_the_listing_is_read_by_id(vendor: Any) -> None:
    api, MockTrigger = vendor(20, hidden=frozenset({"batch_00003"}))
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.2) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 20
    # Each listing reads the one page; the hidden batch alone is read by id, once per poll of its
    # trigger (which on a busy machine may ask a cycle after the others).
    assert set(api.got) == {"batch_00003"} and api.calls[:2] == ["list", "get"]
    assert api.calls.count("list") <= 3 * api.calls.count("get"), api.calls


async def test_a_failing_listing_falls_back_to_gets(vendor: Any) -> None:
    failure = httpx.Response(500, json={"error": {"message": "listing is down"}})
    api, MockTrigger = vendor(4, rounds=0, list_faults=[failure])
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.05) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 4
    assert api.calls == ["list"] + ["get"] * 4


async def test_a_rate_limited_listing_backs_off_instead_of_getting_each(vendor: Any) -> None:
    limited = httpx.Response(429, headers={"retry-after": "0.2"}, json={"error": {"message": "slow down"}})
    api, MockTrigger = vendor(4, rounds=0, list_faults=[limited])
    triggers = [MockTrigger(batch_ids=[b], poll_interval=1.0) for b in api.ids]
    # The error reaches every trigger's own poll loop (one tolerated error each, retried after
    # the longer of the Retry-After and the interval), then one listing serves them all.
    assert await statuses(triggers) == ["success"] * 4
    assert api.calls == ["list", "list"]


async def test_leaving_triggers_clean_up_and_the_last_one_stops_the_poller(vendor: Any) -> None:
    api, MockTrigger = vendor(3, rounds=10**6)
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.01) for b in api.ids]
    tasks = [asyncio.create_task(statuses([t])) for t in triggers]
    while api.listings < 2:
        await asyncio.sleep(0.01)
    (poller,) = pollers().values()
    assert poller.members == 3
    # The triggerer reassigns one trigger: its task is cancelled, then cleanup() runs.
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    await triggers[0].cleanup()
    assert poller.members == 2
    # The poller never waits for the batch of the trigger that left again.
    assert api.ids[0] not in poller._waiting
    for task in tasks[1:]:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert not pollers() and poller._task is None
    assert not trigger_module._LEASES.get(asyncio.get_running_loop())
    assert poller.hook._aclient is None  # the last lease out closed the client


async def test_every_call_passes_the_connection_ceiling(vendor: Any) -> None:
    api, MockTrigger = vendor(30, extra={"poll_calls_per_minute": 6000})
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.2) for b in api.ids]
    seen: list[Any] = []
    real_read = trigger_module.SharedPoller.read

    async def read(self: Any, batch_ids: Any) -> Any:
        seen.append(self)
        return await real_read(self, batch_ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trigger_module.SharedPoller, "read", read)
        assert await statuses(triggers) == ["success"] * 30
    poller = seen[0]
    # Three rounds of one page each (90 gets polling per trigger), every one through the limiter.
    assert poller.limiter.per_minute == 6000 and poller.limiter.calls == len(api.calls) <= 3 * 2
    assert SECRET not in repr(poller.key)


async def test_opting_out_brings_back_one_poll_per_trigger(vendor: Any) -> None:
    api, MockTrigger = vendor(5, rounds=0, extra={"shared_polling": "false"})
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.05) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 5
    assert api.calls == ["get"] * 5


async def test_the_limiter_never_lets_a_minute_hold_more_than_the_ceiling() -> None:
    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    limiter = CallLimiter(60, clock=lambda: clock[0], sleep=sleep)
    starts = []
    for _ in range(500):
        await limiter.acquire()
        starts.append(clock[0])
    assert limiter.calls == 500
    # Any 60 s window: at most 60 calls (a burst first, then the pace).
    assert max(sum(1 for t in starts if s <= t < s + 60) for s in starts) <= 60
