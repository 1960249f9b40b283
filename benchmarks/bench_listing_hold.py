"""How long one shared-polling cycle holds the event loop when a listing page is huge.

A vendor (an in-process ``httpx.MockTransport``) answers the batch listing with one page of
``--items`` batch objects (default 190,000: ~8 MB), whatever ``limit`` asked for; a trigger
waits on two of those batches (completed) and reads them through the shared poller. A monitor task
sleeps ``--tick`` seconds in a loop and records how late it wakes: the longest lateness is the
longest time one step held the loop. Printed: the page's bytes, the longest hold, the number of
monitor wake-ups during the watch, and what the watches ended with.

Usage: python benchmarks/bench_listing_hold.py [--items 190000] [--tick 0.001] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import httpx
import orjson


def page(items: int) -> bytes:
    """One listing page of ``items`` completed batches (ids ``b0000000``...)."""
    data = [{"id": f"b{i:07d}", "status": "completed"} for i in range(items)]
    return orjson.dumps({"object": "list", "data": data, "has_more": False})


async def measure(items: int, tick: float) -> dict[str, Any]:
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.triggers.batch import BatchTrigger

    body = page(items)
    calls = {"list": 0, "get": 0}

    def vendor(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/batches":
            calls["list"] += 1
            return httpx.Response(200, content=body, headers={"content-type": "application/json"})
        calls["get"] += 1
        batch_id = request.url.path.rsplit("/", 1)[-1]
        return httpx.Response(200, json={"id": batch_id, "status": "completed"})

    class Trigger(BatchTrigger):
        def _new_hook(self) -> BatchApiHook:
            return BatchApiHook(self.batch_conn_id, async_transport=httpx.MockTransport(vendor))

        def start_delay(self) -> float:
            return 0.0

    worst = 0.0
    wakeups = 0
    done = asyncio.Event()

    async def monitor() -> None:
        nonlocal worst, wakeups
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(tick)
            worst = max(worst, time.perf_counter() - start - tick)
            wakeups += 1

    async def watch(batch_ids: list[str]) -> str:
        trigger = Trigger(batch_ids=batch_ids, poll_interval=0.05, max_consecutive_errors=0)
        events = [event.payload async for event in trigger.run()]
        return str(events[0]["status"])

    watcher = asyncio.create_task(monitor())
    await asyncio.sleep(tick * 5)
    started = time.perf_counter()
    # One trigger watching two batches: its poller lists them (one page), as triggers sharing
    # a connection do.
    statuses = [await watch(["b0000001", f"b{items - 1:07d}"])]
    elapsed = time.perf_counter() - started
    done.set()
    await watcher
    return {
        "items": items,
        "page_bytes": len(body),
        "longest_hold_ms": round(worst * 1000, 1),
        "monitor_wakeups": wakeups,
        "watch_s": round(elapsed, 2),
        "statuses": statuses,
        "calls": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=190_000)
    parser.add_argument("--tick", type=float, default=0.001)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    conn = {"conn_type": "batch_api", "host": "http://vendor/v1", "password": "sk-bench", "extra": {}}
    os.environ.setdefault("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    result = asyncio.run(measure(args.items, args.tick))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")


if __name__ == "__main__":
    main()
