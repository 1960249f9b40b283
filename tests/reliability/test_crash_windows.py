"""Crash windows: a task process SIGKILLed at the worst moment, then retried.

* submit killed after the batch was created but before its id reached the state file:
  the retry finds the orphan by its metadata and re-attaches; one batch per shard exists.
* merge killed half way through loading results, or after its upsert but before commit:
  the table is untouched by the dead attempt, the retry writes every key exactly once.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.submission import KEY_NAME, RunIdentity, StateStore
from tests.fixtures.reliability import MESSAGES, Pipeline, kill_in_window, seed_texts

ROWS = 30
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "max_lines": 10}


@pytest.fixture
def server(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    handle = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", handle.connection_json())
    return handle


def batches_by_key() -> dict[str, list[str]]:
    """Every batch at the server, grouped by the idempotency key in its metadata."""
    out: dict[str, list[str]] = {}
    for batch in BatchApiHook().list_batches():
        out.setdefault(str(batch.metadata.get(KEY_NAME)), []).append(batch.id)
    return out


async def test_submit_killed_between_create_and_record_pays_once(server: Any, pipeline: Pipeline) -> None:
    seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(ROWS)])
    manifest = pipeline.build("crash-submit", **BUILD)
    assert len(manifest["shards"]) == 3
    # Shard 0 is created and recorded; shard 1 is created, then the process dies.
    orphan = kill_in_window(
        {
            "step": "submit",
            "source": manifest,
            "dag_id": "reliability",
            "run_id": "crash-submit",
            "kill_after_create": 1,
        }
    )
    identity = RunIdentity("reliability", "submit", "crash-submit")
    store = StateStore(staging.resolve_path(manifest["staging_path"]) / "submit-state")
    recorded = store.read(identity.key(0))
    intent = store.read(identity.key(1))
    assert recorded is not None and recorded.batch_id, "shard 0 should have been recorded"
    assert intent is not None and intent.batch_id is None, (
        "the kill must land before shard 1's id is recorded"
    )
    assert store.read(identity.key(2)) is None
    assert sum(len(v) for v in batches_by_key().values()) == 2

    record = await pipeline.submit_and_wait(manifest, "crash-submit")
    assert record.submit_error is None and record.event is not None and record.event["status"] == "success"
    by_key = batches_by_key()
    # Exactly one batch per shard at the server, and the retry adopted the orphan.
    assert {k: len(v) for k, v in by_key.items()} == {identity.key(s): 1 for s in range(3)}, by_key
    assert by_key[identity.key(1)] == [orphan]
    assert record.submission is not None
    assert sorted(b["batch_id"] for b in record.submission["batches"]) == sorted(sum(by_key.values(), []))
    summary = pipeline.merge(record.submission, manifest, "answers")
    assert summary["counts"]["succeeded"] == ROWS
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]


@pytest.mark.parametrize("kill_at", ["mid_load", "before_commit"])
async def test_merge_killed_mid_write_then_retried(server: Any, pipeline: Pipeline, kill_at: str) -> None:
    rows = seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(ROWS)])
    manifest = pipeline.build("crash-merge", **BUILD)
    record = await pipeline.submit_and_wait(manifest, "crash-merge")
    assert record.submission is not None and record.event is not None and record.event["status"] == "success"
    batches = orjson.loads(orjson.dumps(record.submission))
    # An earlier complete merge of half the keys' answers must survive a killed re-merge intact:
    # make the table exist with the full result first, then kill a second merge in the window.
    first = pipeline.merge(batches, manifest, "answers")
    assert first["counts"]["succeeded"] == ROWS
    before = pipeline.warehouse.rows("SELECT id, status, content, merged_at FROM answers ORDER BY id")
    note = kill_in_window(
        {
            "step": "merge",
            "batches": batches,
            "manifest_path": manifest["manifest_path"],
            "table": "answers",
            "conn_id": pipeline.warehouse.conn_id,
            "kill_at": kill_at,
            "lines_before_kill": 5,
        }
    )
    assert note
    # The dead attempt changed nothing (its transaction died with it) ...
    assert pipeline.warehouse.rows("SELECT id, status, content, merged_at FROM answers ORDER BY id") == before
    # ... and the retry lands every key exactly once.
    again = pipeline.merge(batches, manifest, "answers")
    assert again["counts"]["succeeded"] == ROWS and again["rows_written"] == ROWS
    got = dict(pipeline.warehouse.rows("SELECT id, content FROM answers"))
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {t}" for i, t in rows}


async def test_first_merge_killed_leaves_no_table_rows(server: Any, pipeline: Pipeline) -> None:
    """A first merge killed mid-load leaves nothing half written; its retry writes every key once."""
    rows = seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(ROWS)])
    manifest = pipeline.build("crash-first", **BUILD)
    record = await pipeline.submit_and_wait(manifest, "crash-first")
    assert record.submission is not None
    batches = orjson.loads(orjson.dumps(record.submission))
    kill_in_window(
        {
            "step": "merge",
            "batches": batches,
            "manifest_path": manifest["manifest_path"],
            "table": "answers",
            "conn_id": pipeline.warehouse.conn_id,
            "kill_at": "mid_load",
            "lines_before_kill": 12,
        }
    )
    exists = pipeline.warehouse.rows("SELECT to_regclass('answers') IS NOT NULL")[0][0]
    if exists:  # the CREATE TABLE is inside the dead transaction on PostgreSQL, so normally not
        assert pipeline.warehouse.rows("SELECT COUNT(*) FROM answers") == [(0,)]
    summary = pipeline.merge(batches, manifest, "answers")
    assert summary["counts"]["succeeded"] == ROWS
    got = dict(pipeline.warehouse.rows("SELECT id, content FROM answers"))
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {t}" for i, t in rows}


@pytest.mark.parametrize("kind", ["duckdb_warehouse", "sqlite_warehouse"])
async def test_merge_killed_before_commit_on_file_databases(
    server: Any, request: pytest.FixtureRequest, tmp_path: Any, task_context: Any, kind: str
) -> None:
    """The same window on the embedded databases: a SIGKILLed writer leaves the file consistent."""
    warehouse = request.getfixturevalue(kind)
    pipe = Pipeline(warehouse, tmp_path / "staging", task_context)
    rows = seed_texts(warehouse, "tickets", [f"t{i}" for i in range(ROWS)])
    manifest = pipe.build("crash-file", **BUILD)
    record = await pipe.submit_and_wait(manifest, "crash-file")
    assert record.submission is not None
    batches = orjson.loads(orjson.dumps(record.submission))
    assert pipe.merge(batches, manifest, "answers")["counts"]["succeeded"] == ROWS
    before = warehouse.rows("SELECT id, status, content, merged_at FROM answers ORDER BY id")
    kill_in_window(
        {
            "step": "merge",
            "batches": batches,
            "manifest_path": manifest["manifest_path"],
            "table": "answers",
            "conn_id": warehouse.conn_id,
            "kill_at": "before_commit",
        }
    )
    assert warehouse.rows("SELECT id, status, content, merged_at FROM answers ORDER BY id") == before
    again = pipe.merge(batches, manifest, "answers")
    assert again["counts"]["succeeded"] == ROWS
    assert warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert dict(warehouse.rows("SELECT id, content FROM answers")) == {i: f"echo: {t}" for i, t in rows}
