"""The example DAGs: they import cleanly, and each one runs to success under ``airflow dags test``.

Each warehouse kind (DuckDB file, PostgreSQL schema on the machine's server) gets the sample
tables seeded by :mod:`airflow_batch_provider.demo`, two local batch servers (a healthy one,
and one failing a fifth of the lines for the retry example), and one subprocess that runs all
five examples through Airflow's own ``dags test`` command (see ``tests/e2e/dags_test_runner``).
The tests then check the rows that landed, not only the task states.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e.dags_test_runner import run_in_subprocess
from tests.fixtures.server import FAST_TIME_SCALE

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags_examples"
EXAMPLES = {
    "support_ticket_triage": DAGS / "support_ticket_triage.py",
    "support_ticket_triage_sharded": DAGS / "support_ticket_triage_sharded.py",
    "catalogue_embeddings": DAGS / "catalogue_embeddings.py",
    "jsonl_batch_roundtrip": DAGS / "jsonl_batch_roundtrip.py",
    "triage_with_retries": DAGS / "triage_with_retries.py",
    "bigquery_ticket_triage": DAGS / "bigquery_ticket_triage.py",
    "ticket_urgency_producer": DAGS / "ticket_urgency_asset.py",
    "ticket_urgency_report": DAGS / "ticket_urgency_asset.py",
    "snowflake_ticket_sentiment": DAGS / "snowflake_ticket_sentiment.py",
}
# Examples for one warehouse of their own, run by their own tests (tests/e2e/test_bigquery_pipeline.py,
# test_snowflake_ticket_sentiment below), not in the DuckDB/PostgreSQL runs.
OWN_WAREHOUSE = {"bigquery_ticket_triage", "snowflake_ticket_sentiment"}
TICKETS = 300
PRODUCTS = 200
EMPTY_BODIES = TICKETS // 97  # tickets with no body: rejected by the build, by design
SHARD_LINES = 100
LINE_FAILURE_RATE = 0.2
RUN_TIMEOUT = 420


def test_dagbag_imports_every_example_without_errors_or_warnings() -> None:
    from airflow.dag_processing.dagbag import DagBag

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == set(EXAMPLES)
    # Warnings raised while a file was parsed (what the UI shows as DAG warnings).
    assert bag.captured_warnings == {}
    ours = [w for w in caught if str(DAGS) in str(w.filename) or "airflow_batch_provider" in str(w.filename)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    for dag_id, dag in bag.dags.items():
        assert dag.doc_md and len(dag.doc_md) > 200, f"{dag_id} needs a docstring saying what it shows"
        assert "llm-batch" in dag.tags
        assert dag.params, f"{dag_id} has no params"


@dataclass
class ExampleRuns:
    """One warehouse with the sample data and the outcome of every example run against it."""

    kind: str
    results: dict[str, Any]
    query: Any
    roundtrip_output: Path
    log: str

    def run(self, dag_id: str) -> dict[str, Any]:
        result: dict[str, Any] | None = self.results.get(dag_id)
        assert result is not None, f"{dag_id} did not run on {self.kind}:\n{self.log[-5000:]}"
        assert result["ok"], f"{dag_id} failed on {self.kind}: {result['error']}\n{self.log[-8000:]}"
        assert all(s in ("success", "skipped") for s in result["tasks"].values()), result["tasks"]
        return result


def _duckdb_query(path: Path) -> Any:
    import duckdb

    def query(sql: str) -> list[tuple[Any, ...]]:
        with duckdb.connect(str(path), read_only=True) as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]

    return query


def run_plan(plan: list[dict[str, Any]], work: Path, extra_env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Run ``plan`` through ``tests/e2e/dags_test_runner`` in a subprocess: (results, log)."""
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW_BATCH_STAGING_ROOT": f"file://{work / 'staging'}",
            "BATCH_EXAMPLES_POLL_INTERVAL": "0.5",
            **extra_env,
        }
    )
    results, log = run_in_subprocess(plan, work, env, RUN_TIMEOUT)
    (work / "runner.log").write_text(log)
    return results, log


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def example_runs(
    request: pytest.FixtureRequest, airflow_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExampleRuns]:
    from airflow_batch_provider.demo import seed_warehouse
    from airflow_batch_provider.server.background import BackgroundServer
    from airflow_batch_provider.server.config import FaultConfig, ServerConfig

    kind = request.param
    work = tmp_path_factory.mktemp(f"examples-{kind}")
    cleanup: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        if kind == "duckdb":
            pytest.importorskip("duckdb_provider")
            path = work / "warehouse.duckdb"
            warehouse = {"conn_type": "duckdb", "host": str(path)}
            query = _duckdb_query(path)
        else:
            psycopg = pytest.importorskip("psycopg")
            from tests.fixtures.warehouse import PG_DB, PG_HOST, PG_PORT, PG_USER, postgres_connection

            schema = f"abp_examples_{uuid.uuid4().hex[:10]}"
            try:
                admin = psycopg.connect(
                    host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_DB, autocommit=True
                )
            except psycopg.OperationalError as exc:  # pragma: no cover - depends on the machine
                pytest.skip(f"PostgreSQL is not reachable: {exc}")
            admin.execute(f'CREATE SCHEMA "{schema}"')

            def drop() -> None:
                admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                admin.close()

            cleanup.append(drop)
            warehouse = postgres_connection(schema)

            def query(sql: str) -> list[tuple[Any, ...]]:
                with psycopg.connect(
                    host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_DB, options=f"-c search_path={schema}"
                ) as conn:
                    return [tuple(r) for r in conn.execute(sql).fetchall()]

        try:
            warehouse_json = orjson.dumps(warehouse).decode()
            mp.setenv("AIRFLOW_CONN_WAREHOUSE", warehouse_json)
            counts = seed_warehouse("warehouse", tickets=TICKETS, products=PRODUCTS)
            assert counts == {"support_tickets": TICKETS, "products": PRODUCTS}

            healthy = BackgroundServer(
                ServerConfig(port=0, data_dir=work / "server", time_scale=FAST_TIME_SCALE)
            ).start()
            cleanup.append(healthy.stop)
            flaky = BackgroundServer(
                ServerConfig(
                    port=0,
                    data_dir=work / "flaky-server",
                    time_scale=FAST_TIME_SCALE,
                    faults=FaultConfig(line_failure_rate=LINE_FAILURE_RATE),
                )
            ).start()
            cleanup.append(flaky.stop)

            def connection(server: BackgroundServer) -> str:
                spec = {"conn_type": "batch_api", "host": server.base_url, "password": "sk-test"}
                return orjson.dumps({**spec, "extra": {"dialect": "openai"}}).decode()

            roundtrip_output = work / "roundtrip-results.jsonl"
            plan = [
                {"dag_id": dag_id, "dag_file": str(path), "conf": {}, "env": {}}
                for dag_id, path in EXAMPLES.items()
                if dag_id not in OWN_WAREHOUSE
            ]
            by_id = {p["dag_id"]: p for p in plan}
            by_id["jsonl_batch_roundtrip"]["conf"] = {"output_path": str(roundtrip_output)}
            by_id["triage_with_retries"]["env"] = {"AIRFLOW_CONN_BATCH_API_DEFAULT": connection(flaky)}
            results, log = run_plan(
                plan,
                work,
                {
                    "AIRFLOW_CONN_WAREHOUSE": warehouse_json,
                    "AIRFLOW_CONN_BATCH_API_DEFAULT": connection(healthy),
                    "BATCH_EXAMPLES_MAX_LINES": str(SHARD_LINES),
                },
            )
            yield ExampleRuns(kind, results, query, roundtrip_output, log)
        finally:
            for step in reversed(cleanup):
                step()


def _status_counts(runs: ExampleRuns, table: str) -> dict[str, int]:
    return {str(s): int(n) for s, n in runs.query(f"SELECT status, COUNT(*) FROM {table} GROUP BY status")}


def test_support_ticket_triage(example_runs: ExampleRuns) -> None:
    run = example_runs.run("support_ticket_triage")
    assert run["tasks"]["wait"] == "success"
    assert _status_counts(example_runs, "ticket_triage") == {
        "succeeded": TICKETS - EMPTY_BODIES,
        "rejected": EMPTY_BODIES,
    }
    # Every ticket has exactly one row, joined on its id; answers parsed into typed columns.
    joined = example_runs.query(
        "SELECT t.ticket_id, r.status, r.category, r.urgency, r.summary, r.prompt_tokens, t.body "
        "FROM support_tickets t JOIN ticket_triage r ON r.ticket_id = t.ticket_id ORDER BY t.ticket_id"
    )
    assert [row[0] for row in joined] == list(range(1, TICKETS + 1))
    for ticket_id, status, category, urgency, summary, prompt_tokens, body in joined:
        if body is None:
            assert status == "rejected", ticket_id
            continue
        assert status == "succeeded", ticket_id
        assert category in {"billing", "bug", "account", "shipping", "feature_request", "other"}
        assert urgency in {"low", "medium", "high", "critical"}
        assert summary and prompt_tokens > 0
    merge = run["xcom"]["merge"]
    assert merge["counts"]["succeeded"] == TICKETS - EMPTY_BODIES
    assert merge["cost"] > 0


def test_support_ticket_triage_sharded(example_runs: ExampleRuns) -> None:
    run = example_runs.run("support_ticket_triage_sharded")
    shards = -(-(TICKETS - EMPTY_BODIES) // SHARD_LINES)
    mapped = sorted(t for t in run["tasks"] if t.startswith("submit_shard["))
    assert mapped == [f"submit_shard[{i}]" for i in range(shards)]
    assert _status_counts(example_runs, "ticket_triage_sharded") == {
        "succeeded": TICKETS - EMPTY_BODIES,
        "rejected": EMPTY_BODIES,
    }
    batches = example_runs.query(
        "SELECT COUNT(DISTINCT batch_id) FROM ticket_triage_sharded WHERE status = 'succeeded'"
    )
    assert batches == [(shards,)]
    assert run["xcom"]["report"]["batches"] == shards


def test_catalogue_embeddings(example_runs: ExampleRuns) -> None:
    example_runs.run("catalogue_embeddings")
    assert _status_counts(example_runs, "product_embeddings") == {"succeeded": PRODUCTS}
    rows = example_runs.query("SELECT product_id, embedding FROM product_embeddings ORDER BY product_id")
    assert [r[0] for r in rows] == list(range(1, PRODUCTS + 1))
    for _, embedding in rows:
        vector = json.loads(embedding) if isinstance(embedding, str) else embedding
        assert len(vector) == 64 and all(isinstance(x, float) for x in vector)


def test_jsonl_batch_roundtrip(example_runs: ExampleRuns) -> None:
    run = example_runs.run("jsonl_batch_roundtrip")
    source = [json.loads(line) for line in (DAGS / "data" / "faq_requests.jsonl").read_text().splitlines()]
    results = [json.loads(line) for line in example_runs.roundtrip_output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(s["custom_id"] for s in source)
    assert all(r["ok"] and r["content"] and r["completion_tokens"] > 0 for r in results)
    assert run["xcom"]["write_results"] == {
        "output_path": f"file://{example_runs.roundtrip_output}",
        "ok": len(source),
        "error": 0,
    }


def test_triage_with_retries(example_runs: ExampleRuns) -> None:
    run = example_runs.run("triage_with_retries")
    first = run["xcom"]["merge_1"]
    assert first["counts"]["failed"] > 0, "the flaky server should have failed some lines"
    assert first["resubmit_lines"] == first["counts"]["failed"]
    assert run["tasks"]["submit_2"] == "success"
    final = _status_counts(example_runs, "ticket_triage_retried")
    assert sum(final.values()) == TICKETS
    assert final["rejected"] == EMPTY_BODIES
    # Each attempt only retried what was still failing, so the failures shrank.
    assert final.get("failed", 0) < first["counts"]["failed"]
    assert final["succeeded"] > first["counts"]["succeeded"]
    assert run["xcom"]["summary"] == final


def test_ticket_urgency_asset(example_runs: ExampleRuns) -> None:
    """The producer merges with its asset outlet; a manual run of the consumer sees no event.

    The scheduled path (event -> consumer run reading the extra) needs a scheduler: see
    tests/e2e/test_assets_and_links.py.
    """
    merged = example_runs.run("ticket_urgency_producer")["xcom"]["merge"]
    assert merged["rows_written"] == TICKETS
    assert merged["counts"]["succeeded"] == TICKETS - EMPTY_BODIES
    assert example_runs.run("ticket_urgency_report")["xcom"]["summarise"] == {"events": 0, "merges": []}


def test_snowflake_ticket_sentiment(snowflake_warehouse: Any, airflow_db: str, tmp_path: Path) -> None:
    """The Snowflake example, end to end against fakesnow: build (streamed read) -> submit ->
    deferred wait -> merge (stage + COPY INTO, upsert) lands every ticket exactly once, and a
    second run adds nothing."""
    from airflow_batch_provider.demo import seed_warehouse
    from airflow_batch_provider.server.background import BackgroundServer
    from airflow_batch_provider.server.config import ServerConfig
    from tests.fixtures.snowflake import snowflake_connection

    tickets = 120  # one without a body: a rejected row
    seed_warehouse(snowflake_warehouse.conn_id, tickets=tickets, products=1)
    server = BackgroundServer(
        ServerConfig(port=0, data_dir=tmp_path / "server", time_scale=FAST_TIME_SCALE)
    ).start()
    try:
        dag_file = str(EXAMPLES["snowflake_ticket_sentiment"])
        plan = [{"dag_id": "snowflake_ticket_sentiment", "dag_file": dag_file, "conf": {}, "env": {}}] * 2
        port = snowflake_connection_port(snowflake_warehouse)
        results, log = run_plan(
            plan,
            tmp_path,
            {
                "AIRFLOW_CONN_SNOWFLAKE_DEFAULT": orjson.dumps(
                    snowflake_connection(port, snowflake_warehouse.schema)
                ).decode(),
                "AIRFLOW_CONN_BATCH_API_DEFAULT": orjson.dumps(
                    {"conn_type": "batch_api", "host": server.base_url, "password": "sk-test"}
                ).decode(),
                # The runner makes the connector speak HTTP to the emulator (tests/fixtures/snowflake.py).
                "BATCH_TEST_SNOWFLAKE_HTTP": "1",
            },
        )
    finally:
        server.stop()
    run = ExampleRuns("snowflake", results, snowflake_warehouse.rows, tmp_path, log)
    result = run.run("snowflake_ticket_sentiment")
    assert result["tasks"]["wait"] == "success"
    empty = tickets // 97
    statuses = _status_counts(run, "ticket_sentiment")
    assert statuses == {"succeeded": tickets - empty, **({"rejected": empty} if empty else {})}
    rows = snowflake_warehouse.rows(
        "SELECT ticket_id, COUNT(*), MIN(status), MIN(sentiment), MIN(prompt_tokens) FROM ticket_sentiment "
        "GROUP BY ticket_id"
    )
    assert sorted(r[0] for r in rows) == list(range(1, tickets + 1))
    for _, count, status, sentiment, prompt_tokens in rows:
        assert count == 1
        if status == "succeeded":
            assert sentiment in {"positive", "neutral", "negative", "angry"} and prompt_tokens > 0
        else:
            assert status == "rejected" and sentiment is None


def snowflake_connection_port(warehouse: Any) -> int:
    """The emulator's port, from the warehouse's connection."""
    from airflow.sdk import BaseHook

    return int(BaseHook.get_connection(warehouse.conn_id).extra_dejson["port"])
