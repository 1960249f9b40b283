"""End to end on a real Airflow: api-server, scheduler, dag-processor and triggerer as processes.

The DAGs are triggered through the REST API v2 (JWT from the simple auth manager) and
watched until they finish. Evidence that a deferral really ran in the triggerer process:
the task instance is seen in state ``deferred`` with the trigger's classpath and the
triggerer job that owns it, the triggerer's own log file for that task records the trigger
firing, and the task then resumes in ``execute_complete`` (its return value is in XCom).
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

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
API_KEY = "sk-e2e-" + uuid.uuid4().hex
TICKETS = 120
EMPTY_BODIES = TICKETS // 97


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A seeded PostgreSQL warehouse schema and a local batch server, as Airflow connections."""
    from airflow_batch_provider.server.background import BackgroundServer

    work = tmp_path_factory.mktemp("e2e-deployment")
    # The batch completes about 10 s after it was created.
    with (
        ticket_warehouse(TICKETS) as warehouse,
        BackgroundServer(realtime_server_config(work / "server", API_KEY, validate_seconds=8)) as server,
    ):
        env = {
            "AIRFLOW_CONN_WAREHOUSE": warehouse.connection,
            "AIRFLOW_CONN_BATCH_API_DEFAULT": orjson.dumps(
                {
                    "conn_type": "batch_api",
                    "host": server.base_url,
                    "password": API_KEY,
                    "extra": {"dialect": "openai"},
                }
            ).decode(),
            "AIRFLOW_BATCH_STAGING_ROOT": f"file://{work / 'staging'}",
            "BATCH_EXAMPLES_POLL_INTERVAL": "2",
        }
        yield {"env": env, "query": warehouse.query, "server": server}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, deployment: dict[str, Any]) -> Iterator[AirflowCluster]:
    dags = tmp_path_factory.mktemp("e2e-dags")
    shutil.copy(HERE / "dags" / "e2e_deferral_probe.py", dags)
    shutil.copy(ROOT / "dags_examples" / "support_ticket_triage.py", dags)
    with AirflowCluster(tmp_path_factory.mktemp("airflow-home"), dags, env=deployment["env"]) as running:
        yield running


def test_builtin_trigger_defers_in_the_triggerer(cluster: AirflowCluster) -> None:
    cluster.wait_for_dag("e2e_deferral_probe")
    run_id = cluster.trigger("e2e_deferral_probe")
    result = cluster.wait_for_run("e2e_deferral_probe", run_id, timeout=120)

    assert result.state == "success", (result.seen, cluster.diagnostics())
    states = result.seen[("defer", -1)]
    assert "deferred" in states and states[-1] == "success", states
    trigger = result.triggers[("defer", -1)]
    assert trigger["classpath"] == "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
    assert trigger["triggerer_job_id"] is not None
    trigger_logs = {
        name: text
        for name, text in cluster.task_logs("e2e_deferral_probe", run_id, "defer").items()
        if ".trigger." in name
    }
    assert trigger_logs, "the triggerer wrote no log for the deferred task"
    assert any("Trigger fired event" in text for text in trigger_logs.values()), trigger_logs
    xcom = cluster.client.get(
        f"/dags/e2e_deferral_probe/dagRuns/{run_id}/taskInstances/defer/xcomEntries/return_value"
    )
    assert xcom.status_code == 200, xcom.text
    assert xcom.json()["value"] == "resumed"


def test_example_1_through_the_rest_api(cluster: AirflowCluster, deployment: dict[str, Any]) -> None:
    """support_ticket_triage on real Airflow: the sensor's BatchTrigger runs in the triggerer."""
    dag_id = "support_ticket_triage"
    cluster.wait_for_dag(dag_id)
    run_id = cluster.trigger(dag_id, conf={"results_table": "ticket_triage_e2e"})
    result = cluster.wait_for_run(dag_id, run_id, timeout=240)
    assert result.state == "success", (result.seen, cluster.diagnostics())
    assert {ti["task_id"]: ti["state"] for ti in result.task_instances} == {
        "build_requests": "success",
        "submit": "success",
        "wait": "success",
        "merge": "success",
    }

    # The wait deferred, and its trigger was deserialised and run by the triggerer process.
    assert "deferred" in result.seen[("wait", -1)], result.seen
    trigger = result.triggers[("wait", -1)]
    assert trigger["classpath"] == "airflow_batch_provider.triggers.batch.BatchTrigger"
    assert trigger["triggerer_job_id"] is not None
    trigger_logs = "".join(
        text for name, text in cluster.task_logs(dag_id, run_id, "wait").items() if ".trigger." in name
    )
    assert "Trigger fired event" in trigger_logs, trigger_logs[-3000:]
    assert "Batch watch ended (success)" in trigger_logs
    # The triggerer rebuilt the trigger from its serialised kwargs: it polled the very batches
    # the submit task created (their ids are in the event it fired).
    submitted = cluster.client.get(
        f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/submit/xcomEntries/return_value"
    ).json()["value"]
    assert submitted["batch_ids"] and all(b in trigger_logs for b in submitted["batch_ids"])
    assert API_KEY not in trigger_logs
    outcome = cluster.client.get(
        f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/wait/xcomEntries/return_value"
    ).json()["value"]
    assert outcome["status"] == "success"
    assert outcome["counts"]["completed"] == TICKETS - EMPTY_BODIES

    # The rows landed: one per ticket, joined on the ticket id.
    query = deployment["query"]
    counts = dict(query("SELECT status, COUNT(*) FROM ticket_triage_e2e GROUP BY status"))
    assert counts == {"succeeded": TICKETS - EMPTY_BODIES, "rejected": EMPTY_BODIES}
    joined = query(
        "SELECT COUNT(*) FROM support_tickets t JOIN ticket_triage_e2e r ON r.ticket_id = t.ticket_id "
        "WHERE r.status <> 'succeeded' OR r.category IS NOT NULL"
    )
    assert joined == [(TICKETS,)]
