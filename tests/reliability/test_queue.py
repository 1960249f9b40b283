"""Queue-aware submission (#27 section 3) through the real pipeline, on PostgreSQL and DuckDB.

The local server enforces a real enqueued-token limit per model (``max_enqueued_tokens``), in
both of the vendors' forms: a create refused at once (Azure) or a batch created and then failed
with ``token_limit_exceeded`` (OpenAI). A submit with the same ``max_enqueued_tokens`` creates
shards while its ledger has room, defers to ``QueueRoomTrigger`` until earlier batches finish,
and creates the rest; a batch the server refused or failed for its limit is created again after
waiting, never landed as failed rows; past ``queue_timeout`` it fails saying why.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.exceptions import ConfigurationError, EnqueuedTokenTimeoutError
from tests.fixtures.reliability import (
    DAGS,
    MESSAGES,
    Pipeline,
    drive,
    foreign_batch,
    foreign_bodies,
    seed_texts,
    task_states,
)

ROWS = 12
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "max_lines": 3}  # four shards


def serve(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any] | None = None, **config: Any
) -> Any:
    server = batch_server(**config)
    connect(server, monkeypatch, extra)
    return server


def connect(server: Any, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any] | None = None) -> None:
    """Point the default connection at ``server``, with ``extra`` added to its extras."""
    conn = json.loads(server.connection_json())
    conn["extra"].update(extra or {})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))


def seed(pipeline: Pipeline) -> None:
    seed_texts(pipeline.warehouse, "tickets", [f"where is my order number {i}?" for i in range(1, ROWS + 1)])


def shard_tokens(manifest: dict[str, Any]) -> list[int]:
    return [int(s["input_tokens"]) for s in manifest["shards"]]


async def test_shards_over_the_cap_wait_for_earlier_batches_and_never_pass_it(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, figures: Any
) -> None:
    seed(wh_pipeline)
    manifest = wh_pipeline.build("sizes", **BUILD)
    sizes = shard_tokens(manifest)
    assert len(sizes) == 4 and min(sizes) * 3 > max(sizes) * 2
    cap = 2 * max(sizes)  # two shards fit at once, three never
    server = serve(batch_server, monkeypatch, max_enqueued_tokens=cap, enqueued_limit_form="refuse")
    result, deferred_to = await drive(wh_pipeline, manifest, "queued", max_enqueued_tokens=cap)
    # It waited for room (deferred, no worker slot) before the rest, then for the batches.
    assert deferred_to.count("QueueRoomTrigger") >= 2
    assert result["outcome"]["status"] == "success" and len(result["batch_ids"]) == 4
    counters = server.stats()["counters"]
    # From the server's own records: never more than the cap enqueued, never refused, four creates.
    assert 0 < counters["enqueued_tokens_peak"] <= cap
    assert counters.get("enqueued_limit_refused", 0) == 0 and counters["batches_created"] == 4
    figures(
        "queue-aware submit (4 shards, cap of 2)",
        cap=cap,
        shard_tokens=sizes,
        peak_enqueued=counters["enqueued_tokens_peak"],
        queue_waits=deferred_to.count("QueueRoomTrigger"),
        requests=counters["requests"],
    )
    merged = await _merge(wh_pipeline, result, manifest)
    assert merged == {"succeeded": ROWS}


@pytest.mark.parametrize("form", ["refuse", "fail"])
async def test_a_create_refused_or_a_batch_failed_for_the_queue_limit_is_created_again(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    seed(wh_pipeline)
    manifest = wh_pipeline.build("sizes", **BUILD)
    total = sum(shard_tokens(manifest))
    server = serve(batch_server, monkeypatch, max_enqueued_tokens=total, enqueued_limit_form=form)
    # Another user of the key fills the queue; the submit's ledger cannot see that batch.
    foreign_batch(server, ROWS, model="echo-1")
    # A batch failed for the queue limit is created again even where other failures are not.
    result, deferred_to = await drive(
        wh_pipeline, manifest, f"again-{form}", max_enqueued_tokens=total, resubmit_failed=False
    )
    counters = server.stats()["counters"]
    assert counters[f"enqueued_limit_{'refused' if form == 'refuse' else 'failed'}"] >= 1
    assert "QueueRoomTrigger" in deferred_to
    assert result["outcome"]["status"] == "success" and len(result["batch_ids"]) == 4
    assert counters["enqueued_tokens_peak"] <= total
    # Wait, then create again: no row lands failed for the queue limit.
    assert await _merge(wh_pipeline, result, manifest) == {"succeeded": ROWS}


async def test_no_room_before_the_queue_timeout_fails_saying_why(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(wh_pipeline)
    manifest = wh_pipeline.build("sizes", **BUILD)
    total = sum(shard_tokens(manifest))
    server = serve(batch_server, monkeypatch, max_enqueued_tokens=total, enqueued_limit_form="refuse")
    foreign_batch(server, ROWS, model="echo-1", fault="stall")  # holds the queue for good
    with pytest.raises(
        EnqueuedTokenTimeoutError, match="no room for the next shard under max_enqueued_tokens"
    ):
        await drive(wh_pipeline, manifest, "deadline", max_enqueued_tokens=total, queue_timeout=1.0)
    assert server.stats()["counters"]["enqueued_limit_refused"] >= 1


async def test_a_shard_larger_than_the_cap_fails_before_any_upload(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(wh_pipeline)
    manifest = wh_pipeline.build("sizes", **BUILD)
    server = serve(batch_server, monkeypatch)
    cap = max(shard_tokens(manifest)) - 1
    with pytest.raises(ConfigurationError, match="more than max_enqueued_tokens"):
        await drive(wh_pipeline, manifest, "too-big", max_enqueued_tokens=cap)
    assert server.stats()["counters"].get("files_uploaded", 0) == 0


async def _merge(pipeline: Pipeline, result: Any, manifest: Any) -> dict[str, int]:
    import asyncio

    await asyncio.to_thread(pipeline.merge, result, manifest, "answers")
    return dict(pipeline.status_counts("answers"))


@pytest.mark.parametrize("deferrable", [True, False])
async def test_another_runs_batches_are_in_the_ledger(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, deferrable: bool
) -> None:
    seed(wh_pipeline)
    manifest = wh_pipeline.build("first", **BUILD)
    total = sum(shard_tokens(manifest))
    server = serve(batch_server, monkeypatch, max_enqueued_tokens=total, enqueued_limit_form="fail")
    # Run one fills the queue and returns without waiting (another task, another worker).
    first, waited = await drive(
        wh_pipeline, manifest, "first", max_enqueued_tokens=total, wait_for_completion=False
    )
    assert len(first["batch_ids"]) == 4 and waited.count("QueueRoomTrigger") == 1  # until validated
    # Run two reads run one's entries from the vendor's listing and waits for them to finish,
    # deferred or (deferrable=False) polling on its worker; its cap is the connection's extra.
    second_manifest = wh_pipeline.build("second", **BUILD)
    connect(server, monkeypatch, {"max_enqueued_tokens": str(total)})
    second, deferred_to = await drive(wh_pipeline, second_manifest, "second", deferrable=deferrable)
    assert ("QueueRoomTrigger" in deferred_to) is deferrable
    assert second["outcome"]["status"] == "success" and len(second["batch_ids"]) == 4
    counters = server.stats()["counters"]
    assert counters["enqueued_tokens_peak"] <= total and counters.get("enqueued_limit_failed", 0) == 0
    assert counters["batches_created"] == 8


@pytest.mark.slow
def test_airflow_dags_test_mapped_submits_wait_out_a_full_queue(
    batch_server: Any,
    pg_warehouse: Any,
    monkeypatch: pytest.MonkeyPatch,
    airflow_dags_test: Any,
    tmp_path: Path,
) -> None:
    """Through real Airflow: the mapped submits defer to QueueRoomTrigger, which ``airflow dags
    test`` runs from its serialised kwargs and resumes with the event alone."""
    seed_texts(pg_warehouse, "tickets", [f"where is my order number {i}?" for i in range(1, ROWS + 1)])
    # Another user fills the whole queue (the cap is its size) until a create was refused for it.
    held = foreign_bodies(ROWS, model="echo-1")[1]
    server = serve(batch_server, monkeypatch, max_enqueued_tokens=held, enqueued_limit_form="refuse")
    foreign, _ = foreign_batch(server, ROWS, model="echo-1", fault="stall")

    def free_the_queue() -> None:
        deadline = time.monotonic() + 120
        while server.stats()["counters"].get("enqueued_limit_refused", 0) < 1:
            assert time.monotonic() < deadline, "no create was refused"
            time.sleep(0.1)
        server.force(foreign, "complete")

    freer = threading.Thread(target=free_the_queue, daemon=True)
    freer.start()
    result = airflow_dags_test(
        DAGS / "reliability_pipeline.py",
        "reliability_pipeline",
        env={
            "REL_STAGING": f"file://{tmp_path}/staging",
            "REL_MAX_LINES": "4",
            "REL_MAX_ENQUEUED_TOKENS": str(held),
        },
    )
    freer.join(5)
    assert result.ok, result.tail()
    states = task_states("reliability_pipeline")
    assert states.get("merge") == ["success"] and states.get("submit") == ["success"] * 3, states
    counters = server.stats()["counters"]
    assert counters["enqueued_limit_refused"] >= 1 and counters["enqueued_tokens_peak"] <= held
    assert pg_warehouse.rows("SELECT status, COUNT(*) FROM answers GROUP BY status") == [("succeeded", ROWS)]


async def test_a_connection_extra_cap_that_is_not_a_positive_integer_is_refused(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(wh_pipeline)
    manifest = wh_pipeline.build("bad-extra", **BUILD)
    server = serve(batch_server, monkeypatch, extra={"max_enqueued_tokens": "lots"})
    with pytest.raises(ConfigurationError, match="extra max_enqueued_tokens must be a positive integer"):
        await drive(wh_pipeline, manifest, "bad-extra")
    assert server.stats()["counters"].get("files_uploaded", 0) == 0
