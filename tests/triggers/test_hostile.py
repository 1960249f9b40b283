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
