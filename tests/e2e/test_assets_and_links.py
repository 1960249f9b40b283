"""End to end on a real Airflow: the merge's asset event reaches a consumer DAG, and the batch links.

``dags_examples/ticket_urgency_asset.py`` runs on the standalone deployment (scheduler,
dag-processor, triggerer, api-server): the producer's merge has the results table as its
outlet; the scheduler then starts the consumer DAG (scheduled on that asset), whose task
returns the event's extra, read here through the REST API. The submit and wait tasks' extra
links ("Batch 1", ...) are read through the REST API's extra-links endpoint: the connection
points at the local batch server, so each link is that server's page of the batch.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.fixtures.e2e import AirflowCluster, realtime_server_config, ticket_warehouse

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(480)]

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-e2e-" + uuid.uuid4().hex
TICKETS = 60
EMPTY_BODIES = TICKETS // 97
PRODUCER, CONSUMER = "ticket_urgency_producer", "ticket_urgency_report"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from airflow_batch_provider.assets import results_table_uri
    from airflow_batch_provider.server.background import BackgroundServer

    work = tmp_path_factory.mktemp("e2e-assets")
    with (
        ticket_warehouse(TICKETS) as warehouse,
        BackgroundServer(realtime_server_config(work / "server", API_KEY, validate_seconds=3)) as server,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("AIRFLOW_CONN_WAREHOUSE", warehouse.connection)
        uri = results_table_uri("warehouse", "ticket_urgency", schema=warehouse.schema)
        env = {
            "AIRFLOW_CONN_WAREHOUSE": warehouse.connection,
            # No local_server flag: the links find the local server by its /health answer.
            "AIRFLOW_CONN_BATCH_API_DEFAULT": orjson.dumps(
                {"conn_type": "batch_api", "host": server.base_url, "password": API_KEY}
            ).decode(),
            "AIRFLOW_BATCH_STAGING_ROOT": f"file://{work / 'staging'}",
            "BATCH_EXAMPLES_POLL_INTERVAL": "2",
            "BATCH_EXAMPLES_URGENCY_URI": uri,
        }
        yield {"env": env, "uri": uri, "server": server, "query": warehouse.query}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, deployment: dict[str, Any]) -> Iterator[AirflowCluster]:
    dags = tmp_path_factory.mktemp("e2e-asset-dags")
    shutil.copy(ROOT / "dags_examples" / "ticket_urgency_asset.py", dags)
    with AirflowCluster(tmp_path_factory.mktemp("airflow-home"), dags, env=deployment["env"]) as running:
        yield running


@pytest.fixture(scope="module")
def producer_run(cluster: AirflowCluster) -> str:
    cluster.wait_for_dag(PRODUCER)
    cluster.wait_for_dag(CONSUMER)
    # The consumer must be unpaused before the event, or the scheduler starts no run for it.
    response = cluster.client.patch(f"/dags/{CONSUMER}", json={"is_paused": False})
    assert response.status_code == 200, response.text
    run_id = cluster.trigger(PRODUCER)
    result = cluster.wait_for_run(PRODUCER, run_id, timeout=240)
    assert result.state == "success", (result.seen, cluster.diagnostics())
    return run_id


def test_the_merge_event_extra_reaches_the_consumer_dag(
    cluster: AirflowCluster, deployment: dict[str, Any], producer_run: str
) -> None:
    merged = cluster.xcom(PRODUCER, producer_run, "merge")
    assert merged["rows_written"] == TICKETS

    # The asset event the merge recorded, with its extra, as the REST API shows it.
    events = cluster.client.get("/assets/events", params={"source_dag_id": PRODUCER}).json()["asset_events"]
    assert [e["uri"] for e in events] == [deployment["uri"]], events
    extra = events[0]["extra"]
    assert extra["counts"] == merged["counts"] and extra["batch_ids"] == merged["batch_ids"]
    assert extra["total_tokens"] == merged["total_tokens"] > 0 and extra["cost"] == merged["cost"]
    assert extra["table"] == "ticket_urgency" and extra["rows_written"] == TICKETS

    # The scheduler created the consumer's run from the event, and its task read the extra.
    def consumer_run() -> dict[str, Any] | None:
        runs = cluster.client.get(f"/dags/{CONSUMER}/dagRuns").json()["dag_runs"]
        return runs[0] if runs else None

    run = cluster.wait_until("the asset-triggered consumer run", consumer_run, timeout=120)
    assert run["run_type"] == "asset_triggered", run
    result = cluster.wait_for_run(CONSUMER, run["dag_run_id"], timeout=120)
    assert result.state == "success", (result.seen, cluster.diagnostics())
    seen = cluster.xcom(CONSUMER, run["dag_run_id"], "summarise")
    assert seen["events"] == 1
    (figures,) = seen["merges"]
    assert figures["source"] == f"{PRODUCER}/{producer_run}"
    assert {k: figures[k] for k in extra} == extra
    assert figures["counts"]["succeeded"] == TICKETS - EMPTY_BODIES


@pytest.mark.parametrize("task_id", ["submit", "wait"])
def test_batch_links_through_the_rest_api(
    cluster: AirflowCluster, deployment: dict[str, Any], producer_run: str, task_id: str
) -> None:
    batch_ids = cluster.xcom(PRODUCER, producer_run, "submit")["batch_ids"]
    response = cluster.client.get(f"/dags/{PRODUCER}/dagRuns/{producer_run}/taskInstances/{task_id}/links")
    assert response.status_code == 200, response.text
    links = response.json()["extra_links"]
    origin = deployment["server"].root_url
    expected = [f"{origin}/ui/batches/{b}" for b in batch_ids]
    assert set(links) == {"Batch 1", "Batch 2", "Batch 3", "Batch 4"}
    assert [links[f"Batch {i + 1}"] for i in range(len(expected))] == expected
    assert all(links[f"Batch {i}"] is None for i in range(len(expected) + 1, 5))
    assert API_KEY not in response.text
