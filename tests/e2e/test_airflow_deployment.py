"""End to end on a real Airflow: api-server, scheduler, dag-processor and triggerer as processes.

The DAGs are triggered through the REST API v2 (JWT from the simple auth manager) and
watched until they finish. Evidence that a deferral really ran in the triggerer process:
the task instance is seen in state ``deferred`` with the trigger's classpath and the
triggerer job that owns it, the triggerer's own log file for that task records the trigger
firing, and the task then resumes in ``execute_complete`` (its return value is in XCom).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.e2e import AirflowCluster

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(420)]

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowCluster]:
    dags = tmp_path_factory.mktemp("e2e-dags")
    shutil.copy(HERE / "dags" / "e2e_deferral_probe.py", dags)
    with AirflowCluster(tmp_path_factory.mktemp("airflow-home"), dags) as running:
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
