"""Triggerer restart on a real Airflow: the triggerer process is SIGKILLed while two mapped submits
are deferred, a new triggerer process adopts their triggers, and the run completes.

The batches stall at the server until the new triggerer owns both triggers, so the restart
certainly happens while waiting. The run must finish without a second batch being created,
with the triggers' stored kwargs (and so their deadline) unchanged, and every row merged.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.reliability import DAGS, seed_texts

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

DAG_ID = "reliability_triggerer_restart"
ROWS = 20


def deferred_submits(cluster: Any, run_id: str) -> dict[int, dict[str, Any]]:
    """The mapped submit instances that are deferred right now, by map index."""
    return {
        ti["map_index"]: ti
        for ti in cluster.task_instances(DAG_ID, run_id)
        if ti["task_id"] == "submit" and ti["state"] == "deferred" and ti.get("triggerer_job")
    }


def wait_for(what: str, check: Any, cluster: Any, timeout: float = 180) -> Any:
    return cluster.wait_until(what, check, timeout=timeout)


def stored_triggers(cluster: Any) -> dict[int, tuple[int | None, str]]:
    """``{trigger id: (triggerer id, decrypted kwargs JSON)}`` from the deployment's metadata DB."""
    return dict(cluster.stored_triggers())


def kwarg(text: str, name: str) -> str:
    """One string kwarg out of the serialised kwargs JSON (serde nests the dict one level)."""
    found = re.search(rf'"{name}": "([^"]+)"', text)
    assert found, f"no {name} in {text[:500]}"
    return found.group(1)


def restart_triggerer(cluster: Any) -> int:
    """SIGKILL the triggerer's process group and start a new triggerer; returns the old pid."""
    old = int(cluster.processes["triggerer"].pid)
    cluster.kill("triggerer")
    cluster.restart("triggerer")
    return old


def test_triggerer_killed_while_waiting_is_replaced_and_the_run_completes(
    batch_server: Any,
    pg_warehouse: Any,
    airflow_cluster_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = batch_server(dialect="openai", faults={"stall_batches": True})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    rows = seed_texts(pg_warehouse, "tickets", [f"ticket {i}" for i in range(ROWS)])
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAGS / "reliability_pipeline.py", dags)
    cluster = airflow_cluster_factory(
        dags,
        env={
            "AIRFLOW_CONN_BATCH_API_DEFAULT": server.connection_json(),
            "AIRFLOW_CONN_WH_POSTGRES": os.environ["AIRFLOW_CONN_WH_POSTGRES"],
            "REL_DAG_ID": DAG_ID,
            "REL_STAGING": f"file://{tmp_path}/staging",
            "REL_MAX_LINES": "10",
            "REL_POLL_INTERVAL": "1",
            "REL_WAIT_TIMEOUT": "3600",
            # A dead triggerer's triggers go to a live one once its heartbeat is this old.
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "5",
        },
    )
    cluster.wait_for_dag(DAG_ID)
    run_id = cluster.trigger(DAG_ID)

    before = wait_for(
        "both submits deferred", lambda: len(s := deferred_submits(cluster, run_id)) == 2 and s, cluster
    )
    old_jobs = {i: ti["triggerer_job"]["id"] for i, ti in before.items()}
    stored_before = stored_triggers(cluster)
    assert len(stored_before) == 2
    batches = list(BatchApiHook().list_batches())
    assert len(batches) == 2 and all(not b.is_terminal for b in batches)

    restart_triggerer(cluster)

    def adopted() -> dict[int, dict[str, Any]] | None:
        now = deferred_submits(cluster, run_id)
        moved = len(now) == 2 and all(now[i]["triggerer_job"]["id"] != old_jobs[i] for i in now)
        return now if moved else None

    after = wait_for("the new triggerer to adopt both triggers", adopted, cluster)
    # Same trigger rows, same stored kwargs (batch ids, submitted_at, deadline), new owner.
    assert {i: ti["trigger"]["id"] for i, ti in after.items()} == {
        i: ti["trigger"]["id"] for i, ti in before.items()
    }
    stored_after = stored_triggers(cluster)
    assert {t: kw for t, (_, kw) in stored_after.items()} == {t: kw for t, (_, kw) in stored_before.items()}
    assert all(stored_after[t][0] != stored_before[t][0] for t in stored_after)
    for _, text in stored_after.values():
        submitted = datetime.fromisoformat(kwarg(text, "submitted_at"))
        assert datetime.fromisoformat(kwarg(text, "deadline")) == submitted + timedelta(seconds=3600)
    for batch in batches:
        server.force(batch.id, "resume")
    result = cluster.wait_for_run(DAG_ID, run_id, timeout=240)
    assert result.state == "success", (result.seen, cluster.diagnostics())
    new_jobs = sorted(ti["triggerer_job"]["id"] for ti in after.values())
    print(f"\n[reliability] real triggerer restart: triggerer jobs {sorted(old_jobs.values())} -> {new_jobs}")
    # Nothing paid twice, every row merged.
    assert sorted(b.id for b in BatchApiHook().list_batches()) == sorted(b.id for b in batches)
    got = dict(pg_warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert got == {i: f"echo: {t}" for i, t in rows}
    with contextlib.suppress(Exception):
        server.set_faults(stall_batches=False)
