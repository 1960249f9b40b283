"""Incremental and deduplicated runs (#27, sections 4-5) through the real pipeline, on PostgreSQL
and DuckDB against the local batch server.

Every results row records the ``request_hash`` of its canonical request. A build with
``skip_unchanged`` leaves out the rows already answered alike (a join in the warehouse, or a
lookup by key per batch): a second run over an unchanged table sends nothing, creates no batch
and succeeds end to end; editing 1% of the rows sends 1%. A build with ``deduplicate`` sends
each distinct request once and the merge fans its answer out to every key that asked for it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.request_hash import request_hash
from airflow_batch_provider.sensors.batch import BatchSensor
from airflow_batch_provider.server.backends import ECHO_ERROR_MARK
from airflow_batch_provider.staging import resolve_path
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts

ROWS = 100
FAILING = 7
PRICE = {"input": 2.0, "output": 8.0, "batch_discount": 0.5}


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    server = batch_server()
    conn = json.loads(server.connection_json())
    conn["extra"].update(prices={"echo-1": PRICE})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    return server


def sent(server: Any) -> tuple[int, int]:
    """Batches the server has created, and the requests in them."""
    headers = server.auth_headers() or {"Authorization": "Bearer sk-test"}
    batches = httpx.get(f"{server.base_url}/batches", headers=headers, params={"limit": 100}).json()["data"]
    return len(batches), sum(b["request_counts"]["total"] for b in batches)


def incremental(lookup: str) -> dict[str, Any]:
    return {
        "table": "tickets",
        "key_columns": "id",
        "messages": MESSAGES,
        "body": {"max_tokens": 32},
        "max_lines": 40,
        "skip_unchanged": True,
        "target_table": "answers",
        "unchanged_lookup": lookup,
    }


def keys_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    data = resolve_path(manifest["staging_path"]).joinpath("keys.jsonl").read_bytes()
    return [orjson.loads(line) for line in data.splitlines()]


def results(pipeline: Pipeline) -> dict[int, tuple[Any, ...]]:
    q = pipeline.warehouse.quote
    rows = pipeline.warehouse.rows(
        f"SELECT id, status, content, request_hash, shared_answer, merged_at, batch_id FROM {q('answers')}"
    )
    return {r[0]: r[1:] for r in rows}


async def run_empty(pipeline: Pipeline, manifest: dict[str, Any], run_id: str) -> dict[str, Any]:
    """submit -> wait (the sensor, as the DAG examples wire it) -> merge for a run with no shard."""
    op = pipeline.submit_op(manifest)
    submission = op.execute(pipeline.context("submit", run_id))
    sensor = BatchSensor(task_id="wait", batch_ids=submission, deferrable=True)
    waited = sensor.execute(pipeline.context("wait", run_id))
    assert waited["status"] == "success" and waited["batch_ids"] == []
    merged: dict[str, Any] = await asyncio.to_thread(pipeline.merge, submission, manifest, "answers")
    return {"submission": submission, "merge": merged}


@pytest.mark.parametrize("lookup", ["join", "lookup"])
async def test_a_second_run_sends_nothing_and_an_edit_of_one_percent_sends_one_percent(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, lookup: str
) -> None:
    server = serve(batch_server, monkeypatch)
    texts = [f"ticket {i}" + (f" {ECHO_ERROR_MARK}" if i == FAILING else "") for i in range(1, ROWS + 1)]
    seed_texts(wh_pipeline.warehouse, "tickets", texts)
    build = incremental(lookup)
    # Run 1: the table does not exist yet, so every row is sent.
    first = await wh_pipeline.run("r1", "answers", build=build, submit={"on_partial_failure": "succeed"})
    assert first.manifest is not None and first.manifest["rows_unchanged"] == 0
    assert sent(server) == (3, ROWS)
    before = results(wh_pipeline)
    assert len(before) == ROWS and before[FAILING][0] == "failed"
    # The table's hash of each row is the build's (keys.jsonl), of the canonical request.
    shard_lines = [
        orjson.loads(line)
        for shard in first.manifest["shards"]
        for line in resolve_path(shard["uri"]).read_bytes().splitlines()
    ]
    hashes = {int(line["custom_id"]): request_hash(line["url"], line["body"]) for line in shard_lines}
    assert {k: v[2] for k, v in before.items()} == hashes
    assert {int(r["custom_id"]): r["request_hash"] for r in keys_of(first.manifest)} == hashes

    # Run 2, nothing changed: only the failed row is sent again (it has no succeeded answer).
    second = await wh_pipeline.run("r2", "answers", build=build)
    assert second.manifest is not None
    assert (second.manifest["rows_unchanged"], second.manifest["rows_written"]) == (ROWS - 1, 1)
    assert sent(server) == (4, ROWS + 1)
    # Then the row is answered: the next run has nothing at all to send.
    wh_pipeline.warehouse.run(
        f"UPDATE {wh_pipeline.warehouse.quote('tickets')} SET text = 'ticket 7 fixed' WHERE id = {FAILING}"
    )
    await wh_pipeline.run("r3", "answers", build=build)
    assert sent(server) == (5, ROWS + 2)
    settled = results(wh_pipeline)
    assert all(v[0] == "succeeded" for v in settled.values())

    empty_manifest = wh_pipeline.build("r4", **build)
    assert empty_manifest["shards"] == [] and empty_manifest["rows_unchanged"] == ROWS
    assert empty_manifest["rows_written"] == 0 and empty_manifest["estimate"]["requests"] == 0
    empty = await run_empty(wh_pipeline, empty_manifest, "r4")
    assert empty["submission"]["batch_ids"] == [] and empty["submission"]["outcome"]["status"] == "success"
    assert sent(server) == (5, ROWS + 2)  # 0 batches, 0 requests
    assert empty["merge"]["rows_written"] == 0 and empty["merge"]["cost"] == 0
    # The merge left every row as it was (not deleted, not nulled, not re-stamped).
    assert results(wh_pipeline) == settled

    # Edit 1% of the rows: 1% is sent, and only those rows change.
    wh_pipeline.warehouse.run(
        f"UPDATE {wh_pipeline.warehouse.quote('tickets')} SET text = 'edited' WHERE id = 42"
    )
    edited = await wh_pipeline.run("r5", "answers", build=build)
    assert edited.manifest is not None and edited.manifest["rows_written"] == ROWS // 100
    assert sent(server) == (6, ROWS + 3)
    after = results(wh_pipeline)
    assert {k for k in after if after[k] != settled[k]} == {42}
    assert "edited" in after[42][1] and after[42][2] != settled[42][2]


async def test_a_deduplicated_run_sends_each_request_once_and_fans_the_answer_out(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch)
    # 30% of the rows repeat an earlier row's text.
    texts = [f"question {i % 70}" for i in range(ROWS)]
    seed_texts(wh_pipeline.warehouse, "tickets", texts)
    build = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "body": {"max_tokens": 32}}
    plain = await wh_pipeline.run("plain", "plain", build=build)
    assert plain.merge is not None and sent(server) == (1, ROWS)
    deduped = await wh_pipeline.run("dedup", "answers", build={**build, "deduplicate": True})
    manifest, merge = deduped.manifest, deduped.merge
    assert manifest is not None and merge is not None
    assert (manifest["rows_written"], manifest["rows_shared"]) == (70, 30)
    assert manifest["estimate"]["requests"] == 70
    assert sent(server) == (2, ROWS + 70)
    # Every key got an answer; the 30 repeats share the one sent for the first row that asked.
    rows = results(wh_pipeline)
    assert len(rows) == ROWS and all(v[0] == "succeeded" for v in rows.values())
    for key, (_, content, rhash, shared, _, _) in rows.items():
        first = (key - 1) % 70 + 1  # the row of the same text with the lowest id
        assert (shared is None) == (key == first)
        if shared is not None:
            assert shared == str(first) and content == rows[first][1] and rhash == rows[first][2]
    assert merge["shared_answers"] == 30 and merge["counts"]["succeeded"] == ROWS
    assert merge["orphan_results"] == 0 and merge["duplicate_results"] == 0
    # Tokens and cost are counted once per request sent: they drop by the repeated share.
    assert merge["prompt_tokens"] == pytest.approx(plain.merge["prompt_tokens"] * 0.7, rel=0.02)
    assert merge["cost"] == pytest.approx(plain.merge["cost"] * 0.7, rel=0.02)
    q = wh_pipeline.warehouse.quote
    paid = wh_pipeline.warehouse.rows(f"SELECT SUM({q('cost')}) FROM {q('answers')}")[0][0]
    assert float(paid) == pytest.approx(merge["cost"], abs=1e-9)


def test_the_request_hash_is_the_same_through_every_dialect(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_batch_provider.dialects import DIALECTS

    serve(batch_server, monkeypatch)
    seed_texts(wh_pipeline.warehouse, "tickets", [f"text {i}" for i in range(5)])
    build = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "body": {"max_tokens": 32}}
    seen: dict[str, list[str]] = {}
    for name, dialect in DIALECTS.items():
        if "/v1/chat/completions" not in dialect.endpoints:
            continue
        manifest = wh_pipeline.build(f"hash-{name}", **build, dialect=name)
        seen[name] = [r["request_hash"] for r in keys_of(manifest)]
    assert len(seen) > 2 and len({tuple(v) for v in seen.values()}) == 1
