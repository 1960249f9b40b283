"""Spend (#27, sections 1-2) through the real pipeline, on PostgreSQL and DuckDB.

The build counts every line's input tokens as it writes it and records them (with the worst-case
output) per shard and per run in the manifest, priced per request; submit refuses a run over its
caps before anything is uploaded, for the whole run also when one mapped task sends one shard;
the merge writes each row's cost from its actual usage, sums it per status and per run next to
the estimate, and names what priced it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.estimate import exact_counter
from airflow_batch_provider.exceptions import BudgetExceededError
from airflow_batch_provider.prices import parse_price
from airflow_batch_provider.server.backends import ECHO_ERROR_MARK
from airflow_batch_provider.staging import resolve_path
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts

ROWS = 12
FAILING = {4}
MAX_TOKENS = 64
# USD per 1M tokens of the echo model, as a user sets them in the connection extra.
PRICE = {"input": 2.0, "cached_input": 0.5, "output": 8.0, "batch_discount": 0.5}
BUILD = {
    "table": "tickets",
    "key_columns": "id",
    "messages": MESSAGES,
    "body": {"max_tokens": MAX_TOKENS},
    "max_lines": 5,  # three shards
    "batch_conn_id": "batch_api_default",
}


def _texts() -> list[str]:
    return [
        f"question {i} {ECHO_ERROR_MARK}"
        if i in FAILING
        else f"question {i}: где мой заказ? 我的订单在哪里？"
        for i in range(1, ROWS + 1)
    ]


@pytest.fixture(params=["postgres", "duckdb"])
def wh_pipeline(request: pytest.FixtureRequest, tmp_path: Path, task_context: Any) -> Pipeline:
    warehouse = request.getfixturevalue("pg_warehouse" if request.param == "postgres" else "duckdb_warehouse")
    return Pipeline(warehouse, tmp_path / "staging", task_context)


def serve(batch_server: Any, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> Any:
    server = batch_server()
    conn = json.loads(server.connection_json())
    conn["extra"].update(extra)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", json.dumps(conn))
    return server


def uploads(server: Any) -> tuple[int, int]:
    """Input files uploaded to the server, and batches created."""
    headers = server.auth_headers() or {"Authorization": "Bearer sk-test"}
    files = httpx.get(f"{server.base_url}/files", headers=headers).json()["data"]
    batches = httpx.get(f"{server.base_url}/batches", headers=headers).json()["data"]
    return len([f for f in files if f.get("purpose") == "batch"]), len(batches)


def test_the_build_records_exact_tokens_and_the_priced_worst_case_per_shard_and_run(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, prices={"echo-1": PRICE})
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    manifest = wh_pipeline.build("estimate", **BUILD)
    count = exact_counter("o200k_base")
    price = parse_price(PRICE, "p", model="echo-1", default_discount=None)
    total_tokens = 0
    for shard in manifest["shards"]:
        data = resolve_path(shard["uri"]).read_bytes()
        bodies = [orjson.loads(line)["body"] for line in data.splitlines()]
        tokens = [count(b) for b in bodies]
        # Exact o200k counts of the lines as written, per shard.
        assert shard["input_tokens"] == sum(tokens)
        assert shard["max_output_tokens"] == MAX_TOKENS * len(bodies)
        assert shard["estimated_cost"] == pytest.approx(
            sum(price.cost(t, MAX_TOKENS) for t in tokens), abs=1e-6
        )
        total_tokens += sum(tokens)
    assert len(manifest["shards"]) == 3
    estimate = manifest["estimate"]
    assert estimate["requests"] == ROWS and estimate["input_tokens"] == total_tokens
    assert estimate["max_output_tokens"] == ROWS * MAX_TOKENS
    assert estimate["counter"] == "exact o200k_base" and estimate["exact"] is True
    assert estimate["price"]["source"] == "user" and estimate["price"]["batch_discount"] == 0.5
    assert estimate["cost"] == pytest.approx(sum(s["estimated_cost"] for s in manifest["shards"]), abs=1e-6)
    # The same figures are in manifest.json, for a submit on another worker.
    on_disk = orjson.loads(resolve_path(manifest["manifest_path"]).read_bytes())
    assert on_disk["estimate"] == estimate


def test_a_pluggable_counter_and_the_heuristic_for_a_private_tokenizer(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch)
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    own = wh_pipeline.build("callable", **{**BUILD, "token_counter": lambda body: 100})
    assert own["estimate"]["input_tokens"] == 100 * ROWS
    assert own["estimate"]["counter"].startswith("callable")
    # Anthropic's tokenizer is private: the heuristic, scaled by its factor, stated as an estimate.
    guessed = wh_pipeline.build("heuristic", **{**BUILD, "dialect": "anthropic"})
    assert guessed["estimate"]["counter"] == "heuristic x1.2" and guessed["estimate"]["exact"] is False
    exact = wh_pipeline.build("exact", **BUILD)["estimate"]["input_tokens"]
    assert exact < guessed["estimate"]["input_tokens"] < 2 * exact
    # Nobody prices echo-1: unknown, never $0.
    assert guessed["estimate"]["cost"] is None and guessed["estimate"]["price"]["source"] == "unknown"


async def test_submit_refuses_a_run_over_its_caps_before_any_upload(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, prices={"echo-1": PRICE})
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    manifest = wh_pipeline.build("caps", **BUILD)
    cost = manifest["estimate"]["cost"]
    tokens = manifest["estimate"]["input_tokens"]
    with pytest.raises(BudgetExceededError) as info:
        await wh_pipeline.submit_and_wait(manifest, "caps", max_estimated_cost=cost * 0.9)
    message = str(info.value)
    assert f"${cost:,.4f}" in message and f"${cost * 0.9:,.4f}" in message and "priced by user" in message
    with pytest.raises(BudgetExceededError, match=f"{tokens:,} input tokens, over max_input_tokens=10"):
        await wh_pipeline.submit_and_wait(manifest, "caps", max_input_tokens=10)
    # A mapped submit of one small shard is checked against the whole run.
    one_shard = manifest["shards"][2]
    assert one_shard["estimated_cost"] < cost * 0.5
    with pytest.raises(BudgetExceededError, match="estimated cost"):
        await wh_pipeline.submit_and_wait(one_shard, "caps", map_index=2, max_estimated_cost=cost * 0.5)
    assert uploads(server) == (0, 0)
    # Within the caps the run goes through.
    record = await wh_pipeline.submit_and_wait(
        manifest, "caps", max_estimated_cost=cost, max_input_tokens=tokens, on_partial_failure="succeed"
    )
    assert record.submit_error is None and record.submission is not None
    assert record.submission["estimate"]["cost"] == cost
    assert uploads(server) == (3, 3)


async def test_a_cost_cap_with_an_unknown_price_refuses_unless_a_token_cap_bounds_it(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, monkeypatch, price_table="none")
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    manifest = wh_pipeline.build("unknown", **BUILD)
    assert manifest["estimate"]["cost"] is None
    with pytest.raises(
        BudgetExceededError, match="cannot be estimated .*not in prices and price_table='none'"
    ):
        await wh_pipeline.submit_and_wait(manifest, "unknown", max_estimated_cost=1000.0)
    assert uploads(server) == (0, 0)
    tokens = manifest["estimate"]["input_tokens"]
    record = await wh_pipeline.submit_and_wait(
        manifest, "unknown", max_estimated_cost=1000.0, max_input_tokens=tokens, on_partial_failure="succeed"
    )
    assert record.submit_error is None and uploads(server) == (3, 3)


async def test_a_hand_made_file_is_estimated_at_submit(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = serve(batch_server, monkeypatch, prices={"echo-1": PRICE})
    path = tmp_path / "mine.jsonl"
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "echo-1",
                "max_tokens": 1000,
                "messages": [{"role": "user", "content": "hi " * 50}],
            },
        }
        for i in range(20)
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    count = exact_counter()
    price = parse_price(PRICE, "p", model="echo-1", default_discount=None)
    expected = 20 * price.cost(count(lines[0]["body"]), 1000)
    with pytest.raises(BudgetExceededError, match=f"\\${expected:,.4f}"):
        await wh_pipeline.submit_and_wait(str(path), "hand", max_estimated_cost=expected / 2)
    assert uploads(server) == (0, 0)


async def test_the_merge_prices_every_row_and_reports_cost_per_status_next_to_the_estimate(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, prices={"echo-1": PRICE})
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    record = await wh_pipeline.run("merge", "answers", build=BUILD, submit={"on_partial_failure": "succeed"})
    assert record.merge is not None
    q = wh_pipeline.warehouse.quote
    rows = wh_pipeline.warehouse.rows(
        f"SELECT id, status, prompt_tokens, completion_tokens, cached_tokens, {q('cost')} FROM {q('answers')}"
    )
    price = parse_price(PRICE, "p", model="echo-1", default_discount=None)
    by_status: dict[str, float] = {}
    for key, status, prompt, completion, cached, cost in rows:
        expected = price.cost(prompt or 0, completion or 0, cached or 0)
        assert float(cost) == pytest.approx(expected, abs=1e-9), key
        by_status[status] = by_status.get(status, 0.0) + expected
        if status == "succeeded":
            assert cost > 0
    merge = record.merge
    assert merge["cost"] == pytest.approx(sum(by_status.values()), abs=1e-6)
    assert merge["cost_by_status"]["succeeded"] == pytest.approx(by_status["succeeded"], abs=1e-6)
    assert merge["cost_by_status"].get("failed", 0.0) == 0.0
    assert merge["price"]["source"] == "user"
    assert merge["estimate"] == record.manifest["estimate"]  # type: ignore[index]
    # The worst case bounds what was paid.
    assert merge["cost"] <= merge["estimate"]["cost"]


async def test_an_unpriced_merge_leaves_cost_null_never_zero(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, price_table="none")
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    record = await wh_pipeline.run(
        "nullcost", "answers", build=BUILD, submit={"on_partial_failure": "succeed"}
    )
    assert record.merge is not None and record.merge["cost"] is None
    assert record.merge["price"]["source"] == "unknown"
    q = wh_pipeline.warehouse.quote
    assert wh_pipeline.warehouse.rows(
        f"SELECT COUNT(*) FROM {q('answers')} WHERE {q('cost')} IS NOT NULL"
    ) == [(0,)]


async def test_a_submit_that_changes_the_model_or_the_output_cap_is_estimated_as_sent(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    dear = {**PRICE, "input": 200.0, "output": 800.0}
    server = serve(batch_server, monkeypatch, prices={"echo-1": PRICE, "echo-dear": dear})
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    manifest = wh_pipeline.build("override", **{**BUILD, "body": {}})
    # The build's lines set no output cap: its worst case is unbounded.
    assert manifest["estimate"]["cost"] is None
    # Submit's request_defaults give the cap, and its model override a dearer price: both count.
    with pytest.raises(BudgetExceededError, match="estimated cost") as info:
        await wh_pipeline.submit_and_wait(
            manifest,
            "override",
            model="echo-dear",
            request_defaults={"max_tokens": 10},
            max_estimated_cost=0.01,
        )
    tokens = manifest["estimate"]["input_tokens"]
    expected = parse_price(dear, "p", model="echo-dear", default_discount=None)
    cost = expected.rates(0)[0] * tokens + expected.rates(0)[2] * 10 * ROWS
    assert f"${cost:,.4f}" in str(info.value)
    assert uploads(server) == (0, 0)


async def test_a_resubmitted_attempt_is_capped_by_its_own_lines_not_the_first_run(
    batch_server: Any, wh_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, monkeypatch, prices={"echo-1": PRICE})
    seed_texts(wh_pipeline.warehouse, "tickets", _texts())
    record = await wh_pipeline.run(
        "first",
        "answers",
        build=BUILD,
        submit={"on_partial_failure": "succeed"},
        merge={"resubmit_failed": True},
    )
    assert record.merge is not None and record.merge["resubmit_lines"] == len(FAILING)
    attempt = record.merge["resubmit_manifest_path"]
    assert orjson.loads(resolve_path(attempt).read_bytes())["estimate"] is None
    # The failed line's own tokens: far under the first run's, which would refuse this cap.
    cap = record.manifest["estimate"]["input_tokens"] // 4  # type: ignore[index]
    retry = await wh_pipeline.submit_and_wait(
        attempt, "retry", max_input_tokens=cap, on_partial_failure="succeed"
    )
    assert retry.submission is not None
    assert retry.submission["estimate"]["requests"] == len(FAILING)
    assert 0 < retry.submission["estimate"]["input_tokens"] <= cap
