"""Shared polling: the triggers of one connection read their batches with one listing per cycle.

The vendor is an ``httpx.MockTransport`` that counts every call; nothing here asserts a time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from airflow_batch_provider import waiting
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Batch
from airflow_batch_provider.triggers import batch as trigger_module
from airflow_batch_provider.triggers import shared_poll
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.triggers.shared_poll import CallLimiter, TurnGate, pollers

SECRET = "sk-shared-poll-secret-777"


class Vendor:
    """A vendor of ``count`` batches that stay ``in_progress`` for ``rounds`` listings.

    :param hidden: ids the listing never shows (only a get by id does).
    :param list_faults: answers given to the first listings instead of a page.
    :param get_faults: answers given to the first gets instead of the batch.
    :param always: an answer given to every call (a vendor that keeps refusing).
    """

    def __init__(
        self,
        count: int,
        rounds: int = 2,
        hidden: frozenset[str] = frozenset(),
        list_faults: Any = (),
        always: httpx.Response | None = None,
        get_faults: Any = (),
    ) -> None:
        self.always = always
        self.get_faults = list(get_faults)
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
        if self.always is not None:
            self.calls.append("list" if path == "/v1/batches" else "get")
            return self.always
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
        if self.get_faults:
            return self.get_faults.pop(0)
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


async def test_a_rate_limited_listing_falls_back_to_gets_without_spending_error_budgets(vendor: Any) -> None:
    limited = httpx.Response(429, headers={"retry-after": "0.2"}, json={"error": {"message": "slow down"}})
    api, MockTrigger = vendor(4, rounds=0, list_faults=[limited])
    # No error tolerated: a listing's 429 reaching the triggers would end every watch as error.
    triggers = [MockTrigger(batch_ids=[b], poll_interval=1.0, max_consecutive_errors=0) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 4
    # The batches are read by id instead, the first alone (it could have been refused too).
    assert api.calls == ["list"] + ["get"] * 4


async def test_a_rate_limited_listing_and_get_cost_two_calls_not_one_per_batch(vendor: Any) -> None:
    limited = httpx.Response(429, json={"error": {"message": "slow down"}})
    api, MockTrigger = vendor(6, rounds=0, list_faults=[limited], get_faults=[limited])
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.05, max_consecutive_errors=1) for b in api.ids]
    # The probing get is refused too: every trigger gets that answer (one tolerated error each),
    # without a get of its own; the next cycle lists them all.
    assert await statuses(triggers) == ["success"] * 6
    assert api.calls == ["list", "get", "list"]


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


def turn_counter() -> tuple[list[int], Callable[[], None]]:
    """A count of the event loop's turns (a callback that schedules itself for the next turn)."""
    loop = asyncio.get_running_loop()
    turns = [0]
    handle: list[asyncio.Handle] = []

    def tick() -> None:
        turns[0] += 1
        handle[:] = [loop.call_soon(tick)]

    handle.append(loop.call_soon(tick))
    return turns, lambda: handle[0].cancel()


async def test_the_gate_lets_a_few_waiters_on_per_turn_in_order() -> None:
    gate = TurnGate(per_turn=4)
    turns, stop = turn_counter()
    order: list[tuple[int, int]] = []

    async def waiter(i: int) -> None:
        await gate.enter()
        order.append((i, turns[0]))

    waiters = [asyncio.create_task(waiter(i)) for i in range(30)]
    waiters[5].cancel()  # a waiter cancelled in the queue takes no one's place
    await asyncio.gather(*waiters, return_exceptions=True)
    stop()
    assert [i for i, _ in order] == [i for i in range(30) if i != 5]
    per_turn = Counter(turn for _, turn in order)
    assert max(per_turn.values()) == 4 and len(per_turn) == 8
    assert gate.turns == 8


async def test_triggers_waking_together_join_a_few_per_turn(
    vendor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 100 triggers whose start delays end in the same turn (as after a long garbage collection):
    # without the gate all 100 join and poll in that one turn.
    monkeypatch.setattr(shared_poll, "ADMIT_PER_TURN", 8)
    api, MockTrigger = vendor(100, rounds=0)
    turns, stop = turn_counter()
    joined: list[int] = []
    real_join = shared_poll.SharedPoller.join

    def join(self: Any, member: object, batch_ids: Any, poll_interval: float, **pace: Any) -> None:
        joined.append(turns[0])
        real_join(self, member, batch_ids, poll_interval, **pace)

    monkeypatch.setattr(shared_poll.SharedPoller, "join", join)
    triggers = [MockTrigger(batch_ids=[b], poll_interval=0.2) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 100
    stop()
    assert len(joined) == 100 and max(Counter(joined).values()) <= 8


async def test_a_vendor_that_keeps_answering_429_is_waited_out_until_the_deadline(vendor: Any) -> None:
    limited = httpx.Response(429, headers={"retry-after": "0.25"}, json={"error": {"message": "slow down"}})
    api, MockTrigger = vendor(10, rounds=10**6, always=limited)
    polls: Counter[str] = Counter()

    class Counted(MockTrigger):  # type: ignore[misc, valid-type]
        async def _poll(self, hook: BatchApiHook, after: float | None = None) -> list[Batch]:
            polls[self.batch_ids[0]] += 1
            return await super()._poll(hook, after)

    deadline = time.time() + 1.0
    triggers = [
        Counted(batch_ids=[b], poll_interval=0.02, max_consecutive_errors=1000, deadline=deadline)
        for b in api.ids
    ]

    async def event(trigger: BatchTrigger) -> dict[str, Any]:
        return [e.payload async for e in trigger.run()][0]

    events = await asyncio.gather(*(event(t) for t in triggers))
    # Every trigger ends at its deadline (not on its error budget, not stuck), ...
    assert [e["termination_reason"] for e in events] == ["deadline_exceeded"] * 10
    # ... each waited the Retry-After between its polls, not its 0.02 s interval (1 s / 0.25 s
    # allows at most 4 retries after the first poll; the interval alone would allow ~50), ...
    assert 1 <= max(polls.values()) <= 6, polls
    # ... and a rate-limited listing is never followed by a get per batch (ten triggers asking
    # together would make eleven calls): at most one call per cycle, so never more than polls.
    assert len(api.calls) <= sum(polls.values()), api.calls
    assert not pollers()


async def test_a_trigger_joining_while_the_last_one_leaves_gets_a_poller_of_its_own(
    vendor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, MockTrigger = vendor(2, rounds=10**6)
    first, second = (MockTrigger(batch_ids=[b], poll_interval=0.01) for b in api.ids)
    first_task = asyncio.create_task(statuses([first]))
    while not api.calls:
        await asyncio.sleep(0.01)
    (old,) = pollers().values()
    # The leaving poller is held just before it releases its lease of the hook until the newcomer
    # has joined: the newcomer leases that same hook meanwhile and must find a poller that runs.
    joined = asyncio.Event()
    real_join = shared_poll.SharedPoller.join
    real_release = trigger_module._release_lease

    def join(self: Any, member: object, batch_ids: Any, poll_interval: float, **pace: Any) -> None:
        real_join(self, member, batch_ids, poll_interval, **pace)
        if member is second:
            joined.set()

    async def release(lease: Any) -> None:
        await joined.wait()
        await real_release(lease)

    monkeypatch.setattr(shared_poll.SharedPoller, "join", join)
    monkeypatch.setattr(trigger_module, "_release_lease", release)
    first_task.cancel()
    second_task = asyncio.create_task(statuses([second]))
    await asyncio.gather(first_task, return_exceptions=True)
    await first.cleanup()
    (new,) = pollers().values()
    assert new is not old and old._task is None and new.members == 1
    calls = len(api.calls)
    api.rounds = -1  # every batch reads completed from now on: only the new poller can tell the trigger
    assert await second_task == ["success"]
    assert len(api.calls) > calls and not pollers()
    assert not trigger_module._LEASES.get(asyncio.get_running_loop())
    assert new.hook._aclient is None  # the last lease out closed the client


# ---- watching: a trigger is woken by news, not by every cycle ---------------------------------


def counting_reads(MockTrigger: type[BatchTrigger]) -> tuple[type[BatchTrigger], Counter[str]]:
    """A trigger class counting its reads (the first, and each one after a wait) per batch."""
    reads: Counter[str] = Counter()

    class Counted(MockTrigger):  # type: ignore[misc, valid-type]
        async def _poll(self, hook: BatchApiHook, after: float | None = None) -> list[Batch]:
            reads[self.batch_ids[0]] += 1
            return await super()._poll(hook, after)

    return Counted, reads


async def test_a_watching_trigger_reads_again_only_when_its_batch_changes(vendor: Any) -> None:
    # Five listings: four show the batches in progress, unchanged; the fifth shows them completed.
    api, MockTrigger = vendor(3, rounds=4)
    Counted, reads = counting_reads(MockTrigger)
    triggers = [Counted(batch_ids=[b], poll_interval=0.02) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 3
    assert api.listings == 5 and "get" not in api.calls
    # Polling on every cycle would have read each batch five times: the first read, then the news.
    assert reads == {b: 2 for b in api.ids}


async def test_a_batch_read_by_id_is_news_only_when_it_changes(vendor: Any) -> None:
    api, MockTrigger = vendor(3, rounds=4, hidden=frozenset({"batch_00001"}))
    Counted, reads = counting_reads(MockTrigger)
    triggers = [Counted(batch_ids=[b], poll_interval=0.02) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 3
    # The hidden batch was read by id every cycle, and its trigger woken only when it completed.
    assert api.got.count("batch_00001") >= 4 and reads["batch_00001"] == 2


async def test_a_cycle_error_reaches_the_watching_triggers(
    vendor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, MockTrigger = vendor(2, rounds=3)
    limited = httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "slow down"}})
    real_batch = api.batch
    injected: list[bool] = []

    def batch(batch_id: str) -> dict[str, Any]:
        # While the first listing is answered, the next one (the first the triggers watch) is
        # set to be refused.
        if api.listings == 1 and not injected:
            injected.append(True)
            # A refused listing is followed by one get, which is refused too.
            api.list_faults.append(limited)
            api.get_faults.append(limited)
        return real_batch(batch_id)

    monkeypatch.setattr(api, "batch", batch)
    failed: list[str] = []
    real_failed = waiting.PollLoop.failed

    def failed_once(self: Any, exc: BaseException, now: Any) -> Any:
        failed.append(type(exc).__name__)
        return real_failed(self, exc, now)

    monkeypatch.setattr(waiting.PollLoop, "failed", failed_once)
    Counted, reads = counting_reads(MockTrigger)
    triggers = [Counted(batch_ids=[b], poll_interval=0.02) for b in api.ids]
    assert await statuses(triggers) == ["success"] * 2
    # Each watching trigger judged the refused cycle as its own poll's error, once.
    assert failed == ["BatchApiRateLimitError"] * 2
    assert api.calls[:4] == ["list", "list", "get", "list"] and api.calls.count("get") == 1


async def test_a_watching_trigger_ends_at_its_deadline(vendor: Any) -> None:
    api, MockTrigger = vendor(2, rounds=10**6)
    Counted, reads = counting_reads(MockTrigger)
    deadline = time.time() + 0.5
    triggers = [Counted(batch_ids=[b], poll_interval=0.02, deadline=deadline) for b in api.ids]

    async def event(trigger: BatchTrigger) -> dict[str, Any]:
        return [e.payload async for e in trigger.run()][0]

    events = await asyncio.gather(*(event(t) for t in triggers))
    assert [e["termination_reason"] for e in events] == ["deadline_exceeded"] * 2
    # The cycles went on every 0.02 s; the triggers read first, then once past their deadline.
    assert api.listings > 3 and reads == {b: 2 for b in api.ids}
    assert not pollers()


async def test_the_poller_keeps_the_fastest_pace_and_backs_off_while_nothing_changes() -> None:
    async def release() -> None:
        return None

    key = shared_poll.PollerKey(BatchTrigger, "c", None, "f")
    poller = shared_poll.SharedPoller(key, None, CallLimiter(None), release)  # type: ignore[arg-type]
    fast, slow = object(), object()
    poller.join(fast, ["a"], 10.0, backoff=1.5, max_poll_interval=100.0)
    poller.join(slow, ["b"], 20.0, backoff=2.0, max_poll_interval=50.0)
    paces = []
    for quiet in (0, 1, 2, 10):
        poller._quiet = quiet
        paces.append(poller._watch_interval())
    assert paces == [10.0, 15.0, 22.5, 50.0]
    # A faster member joining sets the pace at once; the pace is the others' again once it leaves.
    faster = object()
    poller.join(faster, ["c"], 4.0, backoff=3.0, max_poll_interval=8.0)
    poller._quiet = 0
    assert poller._watch_interval() == 4.0
    poller._quiet = 10
    assert poller._watch_interval() == 8.0
    await poller.leave(faster)
    assert poller._watch_interval() == 50.0
    await poller.leave(fast)
    assert await poller.leave(slow) and poller._task is None


async def test_a_faster_trigger_joining_watchers_sets_the_pace_at_once(vendor: Any) -> None:
    # A slow trigger watches two batches; a fast one joins for one of them just after a cycle, so
    # its first read is answered from that cycle's state and it watches at once, with no read
    # that would wake the poller. The poller's next cycle must come at the fast trigger's pace,
    # not the slow one's hour.
    api, MockTrigger = vendor(2, rounds=1)
    slow = MockTrigger(batch_ids=list(api.ids), poll_interval=3600.0, max_poll_interval=3600.0)
    slow_task = asyncio.create_task(statuses([slow]))
    while not pollers() or not next(iter(pollers().values()))._watchers:
        await asyncio.sleep(0.001)
    fast = MockTrigger(batch_ids=[api.ids[1]], poll_interval=1.0, max_poll_interval=1.0)
    # (A hang guard, not a time measured: without the fix the next cycle is an hour away.)
    assert await asyncio.wait_for(statuses([fast]), 10) == ["success"]
    assert await asyncio.wait_for(slow_task, 10) == ["success"]


async def test_a_huge_backoff_caps_the_poller_pace_instead_of_overflowing() -> None:
    # ``backoff ** quiet`` overflows a float for a large backoff after enough quiet cycles: the
    # poller's task would die there and strand every trigger of the connection.
    async def release() -> None:
        return None

    key = shared_poll.PollerKey(BatchTrigger, "c", None, "f")
    poller = shared_poll.SharedPoller(key, None, CallLimiter(None), release)  # type: ignore[arg-type]
    member = object()
    poller.join(member, ["a"], 10.0, backoff=1e6, max_poll_interval=600.0)
    poller._quiet = 60
    assert poller._watch_interval() == 600.0
    assert await poller.leave(member)


async def test_a_listing_parses_only_the_batches_its_triggers_wait_on(
    vendor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_batch_provider.dialects.base import Dialect

    # 5,000 batches on one page (the vendor ignores ``limit``); two triggers wait on two of them.
    api, MockTrigger = vendor(5_000, rounds=1)
    monkeypatch.setattr(
        api, "batch", lambda b: {"id": b, "status": "completed" if api.listings > 1 else "queued"}
    )
    real_list = Vendor.__call__

    def one_page(self: Vendor, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/batches":
            self.calls.append("list")
            self.listings += 1
            return httpx.Response(200, json={"data": [self.batch(b) for b in self.ids], "has_more": False})
        return real_list(self, request)

    monkeypatch.setattr(Vendor, "__call__", one_page)
    parsed: list[str] = []
    real_parse = Dialect.parse_batch

    def parse_batch(self: Dialect, raw: Any) -> Any:
        parsed.append(raw.get("id") if isinstance(raw, dict) else None)
        return real_parse(self, raw)

    monkeypatch.setattr(Dialect, "parse_batch", parse_batch)
    waited = [api.ids[7], api.ids[4_321]]
    trigger = MockTrigger(batch_ids=waited, poll_interval=0.05, max_consecutive_errors=1)
    # Every batch is "queued" (unknown) at the first listing: the waited ones are a read error
    # (one tolerated), the 4,998 others are not even parsed.
    assert await statuses([trigger]) == ["success"]
    assert set(parsed) == set(waited) and "get" not in api.calls
    assert len(parsed) <= len(waited) * api.listings
