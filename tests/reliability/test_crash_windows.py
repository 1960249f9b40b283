"""Crash windows: a task process SIGKILLed at the worst moment, then retried.

* submit killed after the batch was created but before its id reached the state file:
  the retry finds the orphan by its metadata and re-attaches; one batch per shard exists.
* the same window under real Airflow (``airflow dags test``, retried by Airflow), once with the
  state in Airflow's task state store and no state file the retry can see, once as Airflow
  without a task state store (state files in shared staging): one batch per shard either way.
* merge killed half way through loading results, or after its upsert but before commit:
  the table is untouched by the dead attempt, the retry writes every key exactly once.
"""

from __future__ import annotations

import os
import re
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.submission import KEY_NAME, STATE_RETENTION, RunIdentity, StateStore
from tests.fixtures.reliability import DAGS, MESSAGES, Pipeline, kill_in_window, seed_texts

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


def assert_one_batch_per_shard(identity: RunIdentity, shards: int, orphan: str) -> dict[str, list[str]]:
    """Exactly one batch per shard at the server, and shard 1's is the orphan the retry adopted."""
    by_key = batches_by_key()
    assert {k: len(v) for k, v in by_key.items()} == {identity.key(s): 1 for s in range(shards)}, by_key
    assert by_key[identity.key(1)] == [orphan]
    return by_key


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
    by_key = assert_one_batch_per_shard(identity, 3, orphan)
    assert record.submission is not None
    assert sorted(b["batch_id"] for b in record.submission["batches"]) == sorted(sum(by_key.values(), []))
    summary = pipeline.merge(record.submission, manifest, "answers")
    assert summary["counts"]["succeeded"] == ROWS
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]


def _airflow_rows(query: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(Path(os.environ["AIRFLOW_HOME"]) / "airflow.db")
    try:
        return conn.execute(query, args).fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["task_state_store", "older_airflow_files"])
def test_submit_retried_by_airflow_after_crash_between_create_and_record(
    server: Any, pipeline: Pipeline, airflow_dags_test: Any, tmp_path: Path, mode: str
) -> None:
    """A real Airflow retry re-attaches: via the task state store when Airflow has one, even though
    each try writes its state path on a disk of its own; via the shared state files when it has none."""
    seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(ROWS)])
    manifest = pipeline.build("crash-airflow", **BUILD)
    assert len(manifest["shards"]) == 3
    state_root = tmp_path / "state"
    dag_id = f"crash_retry_{mode}"
    older = mode == "older_airflow_files"
    result = airflow_dags_test(
        (DAGS / "crash_retry_submit.py").read_text(),
        dag_id,
        env={
            "CRASH_DAG_ID": dag_id,
            "CRASH_SOURCE": str(manifest["manifest_path"]),
            # With a task state store, each try gets its own state directory (a worker's own disk):
            # only the store can carry the first try's records to the second.
            "CRASH_STATE_PATH": str(state_root / ("shared" if older else "try-{{ ti.try_number }}")),
            "CRASH_AFTER_CREATE": "1",
            "CRASH_OLDER_AIRFLOW": "1" if older else "0",
        },
    )
    assert result.ok, result.tail()
    died = re.findall(r"CRASH-WINDOW created (\S+), dying", result.output)
    assert len(died) == 1, result.tail()
    (run_id, state, tries), *others = _airflow_rows(
        "SELECT run_id, state, try_number FROM task_instance WHERE dag_id = ?", dag_id
    )
    assert not others and (state, tries) == ("success", 2)
    identity = RunIdentity(dag_id, "submit", run_id)
    by_key = assert_one_batch_per_shard(identity, 3, died[0])

    state_files = sorted(state_root.glob("**/*.json"))
    rows = _airflow_rows("SELECT key, value, expires_at FROM task_state_store WHERE dag_id = ?", dag_id)
    if older:
        assert rows == []
        recorded = {orjson.loads(f.read_bytes())["key"]: orjson.loads(f.read_bytes()) for f in state_files}
    else:
        assert state_files == [], "with a task state store no state file is written"
        recorded = {key: orjson.loads(value) for key, value, _ in rows}
        expiry = {datetime.fromisoformat(str(e)).replace(tzinfo=timezone.utc) for _, _, e in rows}
        soon, late = (datetime.now(timezone.utc) + STATE_RETENTION + timedelta(days=d) for d in (-1, 1))
        assert all(soon < e < late for e in expiry), expiry
    assert {k: r["batch_id"] for k, r in recorded.items()} == {k: v[0] for k, v in by_key.items()}


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
