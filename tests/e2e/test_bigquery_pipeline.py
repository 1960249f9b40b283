"""The BigQuery example end to end: build -> submit -> deferred wait -> merge, on bqemulator.

``airflow dags test`` runs ``dags_examples/bigquery_ticket_triage.py`` (through the suite's
``dags_test_runner``) against the local batch server, reading the tickets from a dataset on the
emulator and merging the answers back into it; then runs it again. Every ticket lands exactly
once, with the tickets without a body as ``rejected`` rows, and the second run adds nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e.dags_test_runner import run_in_subprocess
from tests.fixtures.server import FAST_TIME_SCALE

ROOT = Path(__file__).resolve().parents[2]
DAG_FILE = ROOT / "dags_examples" / "bigquery_ticket_triage.py"
TICKETS = 50
NO_BODY = {i for i in range(1, TICKETS + 1) if i % 10 == 0}
SHARD_LINES = 20
RUN_TIMEOUT = 300


def _seed_tickets(client: Any, dataset: str) -> None:
    from airflow_batch_provider.warehouse.loaders.bigquery_load import load_rows
    from airflow_batch_provider.warehouse.rows import Column

    rows = [
        (i, f"Ticket {i}", None if i in NO_BODY else f"My order {i} is late") for i in range(1, TICKETS + 1)
    ]
    columns = [Column("ticket_id", "integer"), Column("subject", "text"), Column("body", "text")]
    # A load job creates the table when it is missing.
    load_rows(client, f"{client.project}.{dataset}.support_tickets", columns, rows)


def _run_example(work: Path, env: dict[str, str]) -> dict[str, Any]:
    plan = [{"dag_id": "bigquery_ticket_triage", "dag_file": str(DAG_FILE), "conf": {}, "env": {}}]
    results, log = run_in_subprocess(plan, work, env, RUN_TIMEOUT)
    run: dict[str, Any] | None = results.get("bigquery_ticket_triage")
    assert run is not None and run["ok"], (run or {}).get("error") or log[-8000:]
    assert set(run["tasks"].values()) == {"success"}, run["tasks"]
    return run


@pytest.mark.slow
def test_bigquery_example_lands_every_ticket_once_and_reruns_add_nothing(
    bigquery_warehouse: Any, airflow_db: str, tmp_path: Path
) -> None:
    from airflow_batch_provider.server.background import BackgroundServer
    from airflow_batch_provider.server.config import ServerConfig

    wh = bigquery_warehouse
    client = wh.hook.get_client()
    _seed_tickets(client, wh.schema)
    server = BackgroundServer(ServerConfig(port=0, data_dir=tmp_path / "server", time_scale=FAST_TIME_SCALE))
    server.start()
    try:
        batch_api = {"conn_type": "batch_api", "host": server.base_url, "password": "sk-test"}
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
                "AIRFLOW_CONN_BIGQUERY_WAREHOUSE": os.environ[f"AIRFLOW_CONN_{wh.conn_id.upper()}"],
                "AIRFLOW_CONN_BATCH_API_DEFAULT": orjson.dumps(
                    {**batch_api, "extra": {"dialect": "openai"}}
                ).decode(),
                "AIRFLOW__CORE__DAGS_FOLDER": str(DAG_FILE.parent),
                "AIRFLOW_BATCH_STAGING_ROOT": f"file://{tmp_path / 'staging'}",
                "BATCH_EXAMPLES_POLL_INTERVAL": "0.5",
                "BATCH_EXAMPLES_MAX_LINES": str(SHARD_LINES),
            }
        )
        first = _run_example(tmp_path, env)
        assert first["xcom"]["merge"]["counts"]["succeeded"] == TICKETS - len(NO_BODY)
        q = wh.quote
        landed = wh.rows(
            f"SELECT ticket_id, status, category, urgency, summary, prompt_tokens FROM {q('ticket_triage')} "
            "ORDER BY ticket_id"
        )
        assert [r[0] for r in landed] == list(range(1, TICKETS + 1))
        for ticket_id, status, category, urgency, summary, prompt_tokens in landed:
            if ticket_id in NO_BODY:
                assert (status, category, prompt_tokens) == ("rejected", None, None), ticket_id
            else:
                assert status == "succeeded" and category and urgency and summary and prompt_tokens > 0

        second = _run_example(tmp_path, env)
        assert second["run_id"] != first["run_id"]
        assert wh.rows(
            f"SELECT status, COUNT(*) FROM {q('ticket_triage')} GROUP BY status ORDER BY status"
        ) == [
            ("rejected", len(NO_BODY)),
            ("succeeded", TICKETS - len(NO_BODY)),
        ]
    finally:
        server.stop()
        client.close()
