"""BatchTrigger and the sync wait against a real misbehaving server (tests/fixtures/hostile.py).

A vendor that drips its answers must not keep a watch alive past its deadline: the watch
ends ``timeout`` within one poll interval of it. A key echoed back in a 200 batch object
never reaches the trigger event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson
import pytest

from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.waiting import wait_batches
from tests.fixtures.hook import openai_batch
from tests.fixtures.hostile import Exchange, HostileServer, drip, reply, sequence

SECRET = "sk-hostile-trigger-key-5551234"
# Each read comes quickly (50 ms apart), the whole answer takes ~15 s: only a deadline per
# call and per poll can stop it.
SLOW = drip(orjson.dumps(openai_batch("b1")), 0.05)
# A generous bound on the whole watch, so a regression fails instead of hanging the suite.
GUARD = 20.0


@pytest.fixture
def hostile_conn(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Point ``batch_api_default`` at a hostile server."""

    def point(server: HostileServer, **extra: Any) -> None:
        conn = {
            "conn_type": "batch_api",
            "host": server.base_url,
            "password": SECRET,
            "extra": {"dialect": "openai", **extra},
        }
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))

    return point


async def watch(trigger: BatchTrigger) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [event.payload async for event in trigger.run()]

    return await asyncio.wait_for(run(), GUARD)


@pytest.mark.parametrize("seen_before", [False, True], ids=["never-read", "read-once"])
async def test_dripping_vendor_ends_the_watch_as_timeout(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None], seen_before: bool
) -> None:
    # The hook's own limits (a 10 s deadline per call, 3 retries) would let one poll run ~40 s;
    # the trigger's deadline is 1 s away and it polls every 0.5 s.
    api = hostile_server()
    api.route("/v1/batches/b1", sequence(reply(200, openai_batch("b1")), SLOW) if seen_before else SLOW)
    hostile_conn(api, timeout=10, max_retries=3)
    trigger = BatchTrigger(
        batch_ids=["b1"],
        submitted_at=datetime.now(timezone.utc).isoformat(),
        timeout=1.0,
        poll_interval=0.5,
        max_consecutive_errors=1,
    )
    events = await watch(trigger)
    assert [(e["status"], e["termination_reason"]) for e in events] == [("timeout", "deadline_exceeded")]
    if seen_before:
        # The last state read decides the event's batches.
        assert events[0]["batches"][0]["state"] == "in_progress"


async def test_retry_after_past_the_deadline_is_not_slept(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None]
) -> None:
    # The vendor asks for five minutes; the deadline is 1 s away.
    api = hostile_server()
    api.route("/v1/batches/b1", reply(429, {"error": {"message": "busy"}}, Retry_After="300"))
    hostile_conn(api, max_retries=0)
    trigger = BatchTrigger(
        batch_ids=["b1"], submitted_at=datetime.now(timezone.utc).isoformat(), timeout=1.0, poll_interval=0.2
    )
    events = await watch(trigger)
    assert [e["status"] for e in events] == ["timeout"]


def echo_key(ex: Exchange) -> None:
    auth = ex.request.headers.get("authorization", "")
    errors = {"object": "list", "data": [{"code": "bad", "message": f"rejected {auth}", "line": 1}]}
    ex.respond(200, openai_batch("b1", "failed", errors=errors))


async def test_key_echoed_by_the_vendor_never_reaches_the_event(
    hostile_server: Callable[[], HostileServer],
    hostile_conn: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", echo_key)
    hostile_conn(api)
    with caplog.at_level(logging.INFO):
        events = await watch(BatchTrigger(batch_ids=["b1"], poll_interval=0.05))
    assert [e["status"] for e in events] == ["failed"]
    text = json.dumps(events)
    assert "rejected Bearer ***" in text
    assert SECRET not in text
    assert SECRET not in caplog.text


def test_sync_wait_ends_as_timeout_past_a_dripping_poll(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None]
) -> None:
    # Each attempt is cut at the hook's 0.5 s deadline; past the trigger deadline the wait
    # reports timeout rather than spending its error budget.
    api = hostile_server()
    api.route("/v1/batches/b1", SLOW)
    hostile_conn(api, timeout=0.5, max_retries=0)
    with BatchApiHook() as hook:
        event = wait_batches(
            hook,
            ["b1"],
            deadline=datetime.now(timezone.utc) + timedelta(seconds=0.2),
            poll_interval=5.0,
            max_consecutive_errors=0,
            log=logging.getLogger(__name__),
        )
    assert (event["status"], event["termination_reason"]) == ("timeout", "deadline_exceeded")


# ---- one bad listing item fails only itself (issue #23, point 1) --------------------------------
WAITED = ["b1", "b2", "b3"]
# Batches nobody here waits on, each unreadable in its own way (a vendor's normal day).
STRANGERS: list[Any] = [
    openai_batch("other-1", metadata=5),
    openai_batch("other-2", created_at=1e20),
    openai_batch("other-3", "queued"),
    openai_batch("other-4", request_counts="two"),
    5,
    "x",
    [openai_batch("other-5")],
    {**openai_batch("other-6"), "id": 6},
]


def serve(api: HostileServer, status_of: Callable[[str, int], Any], strangers: list[Any] = STRANGERS) -> None:
    """A one-page listing of the waited batches among ``strangers``, and a get for each waited
    batch (a trigger that asks alone reads by id); ``status_of(id, n)`` is the status of a waited
    batch at the n-th read of it."""
    reads: dict[str, int] = {}

    def state(batch_id: str) -> dict[str, Any]:
        reads[batch_id] = reads.get(batch_id, 0) + 1
        return openai_batch(batch_id, status_of(batch_id, reads[batch_id]))

    def page(ex: Exchange) -> None:
        items = [state(b) for b in WAITED]
        ex.respond(
            200, {"object": "list", "data": [*strangers[:4], *items, *strangers[4:]], "has_more": False}
        )

    api.route("GET /v1/batches", page)
    for batch_id in WAITED:
        api.route(f"GET /v1/batches/{batch_id}", lambda ex, b=batch_id: ex.respond(200, state(b)))


class Together(BatchTrigger):
    """A trigger that polls at once: triggers started together share their first cycle."""

    def start_delay(self) -> float:
        return 0.0


async def watch_all(batch_ids: list[str], **kwargs: Any) -> list[dict[str, Any]]:
    triggers = [Together(batch_ids=[b], poll_interval=0.05, **kwargs) for b in batch_ids]
    return list(await asyncio.gather(*(watch(t) for t in triggers)))


async def test_unreadable_items_of_batches_nobody_waits_on_are_skipped(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None]
) -> None:
    api = hostile_server()
    serve(api, lambda b, n: "completed" if n > 1 else "in_progress")
    hostile_conn(api)
    # No error tolerated: a stranger's item reaching these watches would end them as error.
    events = await watch_all(WAITED, max_consecutive_errors=0)
    assert [e[0]["status"] for e in events] == ["success"] * 3
    assert all(len(e) == 1 for e in events)
    # The strangers were seen (and skipped) by every listing.
    assert any(s.path == "/v1/batches" for s in api.requests)


async def test_an_unknown_status_of_a_waited_batch_is_its_own_read_error(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None]
) -> None:
    # b2 is "queued" (a status the vendor added) at the first two listings, then completes;
    # its poll loop tolerates two errors in a row. b1 and b3 tolerate none.
    api = hostile_server()

    def status_of(batch_id: str, n: int) -> str:
        if batch_id == "b2":
            return "queued" if n <= 2 else "completed"
        return "completed" if n > 1 else "in_progress"

    serve(api, status_of)
    hostile_conn(api)
    quiet = asyncio.gather(
        watch_all(["b1", "b3"], max_consecutive_errors=0), watch_all(["b2"], max_consecutive_errors=2)
    )
    pair, (b2,) = await quiet
    assert [e[0]["status"] for e in pair] == ["success", "success"]
    assert b2[0]["status"] == "success"


async def test_a_waited_batch_that_stays_unreadable_ends_as_error_on_its_budget(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None]
) -> None:
    api = hostile_server()

    def status_of(batch_id: str, n: int) -> str:
        return "queued" if batch_id == "b2" else ("completed" if n > 2 else "in_progress")

    serve(api, status_of)
    hostile_conn(api)
    events = await watch_all(WAITED, max_consecutive_errors=1)
    assert [e[0]["status"] for e in events] == ["success", "error", "success"]
    # Judged by its poll loop: the budget spent, the message names the status.
    assert "after 2 consecutive errors" in events[1][0]["message"]
    assert "queued" in events[1][0]["message"]


@pytest.mark.parametrize(
    "fields", [{"metadata": 5}, {"created_at": 1e20}, {"status": "queued"}, {"request_counts": []}], ids=repr
)
async def test_an_unreadable_get_is_a_read_error_judged_by_the_poll_loop(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None], fields: dict[str, Any]
) -> None:
    # One trigger alone reads by id; the first answer is unreadable, the second completed.
    api = hostile_server()
    api.route(
        "/v1/batches/b1",
        sequence(reply(200, {**openai_batch("b1"), **fields}), reply(200, openai_batch("b1", "completed"))),
    )
    hostile_conn(api)
    events = await watch(BatchTrigger(batch_ids=["b1"], poll_interval=0.05, max_consecutive_errors=1))
    assert [e["status"] for e in events] == ["success"]


# ---- listings end (issue #23, point 2) -----------------------------------------------------------


@pytest.mark.parametrize("short", [False, True], ids=["empty-pages", "short-pages"])
async def test_a_listing_that_says_more_forever_falls_back_to_gets(
    hostile_server: Callable[[], HostileServer], hostile_conn: Callable[..., None], short: bool
) -> None:
    # Every page is empty (or holds one batch nobody waits on) and names a new cursor; the
    # waited batches are only shown by id, completed.
    api = hostile_server()
    pages = [0]

    def endless(ex: Exchange) -> None:
        pages[0] += 1
        data = [openai_batch(f"stranger-{pages[0]}")] if short else []
        ex.respond(200, {"object": "list", "data": data, "has_more": True, "last_id": f"cursor-{pages[0]}"})

    api.route("GET /v1/batches", endless)
    for batch_id in WAITED:
        api.route(f"GET /v1/batches/{batch_id}", reply(200, openai_batch(batch_id, "completed")))
    hostile_conn(api)
    events = await watch_all(WAITED, max_consecutive_errors=0)
    assert [e[0]["status"] for e in events] == ["success"] * 3
    # Each cycle lists a few pages (its budget counts pages: here 3), then gets what it did not see.
    gets = [s for s in api.requests if s.path != "/v1/batches"]
    assert sorted({s.path for s in gets}) == [f"/v1/batches/{b}" for b in WAITED]
    cycles = sum(1 for s in api.requests if s.path == "/v1/batches" and "after=" not in s.target)
    assert pages[0] <= 3 * cycles, (pages[0], cycles)
