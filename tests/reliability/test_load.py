"""Load: 20 DAG runs at once against one local batch server, all merging into one table.

Each run builds its own partition of the source table into 2 shards, submits them, waits in
a trigger (all 20 triggers share one event loop, as on one triggerer) and merges into the
same results table. Every row must be there exactly once with its own answer, and the server
must hold exactly one batch per shard.

The results table exists before the 20 runs start (an earlier run of partition 0 made it, and
partition 0 is merged again concurrently: an idempotent re-merge under load). Concurrent
*first* merges into a table that does not exist yet are covered by
``test_concurrent_first_merges_create_the_table_once`` (they used to race on CREATE TABLE).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.reliability import MESSAGES, Pipeline, first_event, rebuild_trigger, seed_texts

RUNS = 20
ROWS_PER_RUN = 25


async def test_twenty_concurrent_runs_account_for_every_row(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, figures: Any
) -> None:
    server = batch_server(dialect="openai", faults={"rate_429": 0.05, "retry_after": 0.05})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    rows = seed_texts(pipeline.warehouse, "tickets", [f"ticket {i}" for i in range(RUNS * ROWS_PER_RUN)])
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=RUNS)

    async def one_run(n: int) -> dict[str, Any]:
        run_id = f"load-{n:02d}"

        def build() -> dict[str, Any]:
            return pipeline.build(
                run_id,
                sql=f"SELECT id, text FROM tickets WHERE id % {RUNS} = {n}",
                key_columns="id",
                messages=MESSAGES,
                max_lines=13,
            )

        manifest = await loop.run_in_executor(pool, build)
        op = pipeline.submit_op(manifest)
        ctx = pipeline.context("submit", run_id)

        def submit() -> TaskDeferred:
            try:
                op.execute(ctx)
            except TaskDeferred as deferred:
                return deferred
            raise AssertionError("the submit did not defer")

        deferred = await loop.run_in_executor(pool, submit)
        event = await first_event(rebuild_trigger(deferred.trigger))
        result = op.execute_complete(ctx, event, **deferred.kwargs)
        summary = await loop.run_in_executor(pool, lambda: pipeline.merge(result, manifest, "answers"))
        return {
            "run": run_id,
            "event": event["status"],
            "batches": len(result["batch_ids"]),
            **summary["counts"],
        }

    warmup = await pipeline.run(
        "load-warmup",
        "answers",
        build={
            "sql": f"SELECT id, text FROM tickets WHERE id % {RUNS} = 0",
            "key_columns": "id",
            "messages": MESSAGES,
        },
    )
    assert warmup.merge is not None and warmup.merge["counts"]["succeeded"] == ROWS_PER_RUN
    try:
        outcomes = await asyncio.gather(*(one_run(n) for n in range(RUNS)))
    finally:
        pool.shutdown(wait=True)
    stats = server.stats()["counters"]
    figures(
        f"load ({RUNS} concurrent runs)",
        rows=len(rows),
        batches=stats.get("batches_created"),
        requests=stats.get("requests"),
        survived_429=stats.get("status_429", 0),
    )
    assert [o["event"] for o in outcomes] == ["success"] * RUNS, outcomes
    assert [o["succeeded"] for o in outcomes] == [ROWS_PER_RUN] * RUNS, outcomes
    assert sum(o["batches"] for o in outcomes) == 2 * RUNS
    # One batch per shard at the server (plus the warm-up's one), every row once, own answer.
    batches = list(BatchApiHook().list_batches())
    assert len(batches) == 2 * RUNS + 1 and len({b.id for b in batches}) == 2 * RUNS + 1
    assert Counter(b.state.value for b in batches) == {"completed": 2 * RUNS + 1}
    wh = pipeline.warehouse
    assert wh.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(len(rows), len(rows))]
    got = dict(wh.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert got == {i: f"echo: {t}" for i, t in rows}


async def test_concurrent_first_merges_create_the_table_once(
    batch_server: Any, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five runs finish together and merge into a results table nobody has created yet."""
    server = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    rows = seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(50)])
    done = []
    for n in range(5):
        manifest = pipeline.build(
            f"first-{n}",
            sql=f"SELECT id, text FROM tickets WHERE id % 5 = {n}",
            key_columns="id",
            messages=MESSAGES,
        )
        record = await pipeline.submit_and_wait(manifest, f"first-{n}")
        assert record.submission is not None
        done.append((record.submission, manifest))
    start = threading.Barrier(5)

    def merge_together(submission: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
        start.wait(timeout=60)  # all five reach the (missing) table at once
        return pipeline.merge(submission, manifest, "answers")

    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = [pool.submit(merge_together, sub, man) for sub, man in done]
        errors = [f.exception() for f in futures]
    assert errors == [None] * 5, errors
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [
        (len(rows), len(rows))
    ]
