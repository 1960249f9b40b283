"""A real multi-worker Airflow: CeleryExecutor, two workers, two triggerers, driven through the REST API.

The topology is :func:`tests.fixtures.workers.celery_cluster`: api-server, scheduler,
dag-processor, two triggerers and two Celery workers (Redis broker, PostgreSQL metadata DB and
result backend), each worker in a working directory and temp folder of its own. The pipeline
is example 2 (``support_ticket_triage_sharded``: build -> one mapped submit per shard, each
deferred to a triggerer -> merge), over a ticket table cut into three shards, staged where
every worker can read it. Three runs:

* plainly: every row lands once, and tasks ran on both workers;
* a worker SIGKILLed (with its task process) right after a submit created its batch at the
  server, before the task heard the batch id: the retry runs on the other worker and finds that
  batch instead of paying for a second one (one batch per shard, checked at the server);
* the triggerer holding the deferred submits SIGKILLed while the batches run: the other one
  takes the same trigger rows over, whose deadline still counts from the submission.
"""

from __future__ import annotations

import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.e2e import (
    AirflowCluster,
    RunResult,
    TicketWarehouse,
    realtime_server_config,
    ticket_warehouse,
)
from tests.fixtures.server import BatchServerHandle
from tests.fixtures.workers import (
    TRIGGERERS,
    WORKERS,
    BatchCreateGate,
    celery_cluster,
    gated_batch_server,
    revive,
    server_batches,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[2]
DAG_ID = "support_ticket_triage_sharded"
TICKETS = 120
MAX_LINES = 50
SHARDS = -(-TICKETS // MAX_LINES)
EMPTY_BODIES = TICKETS // 97
API_KEY = "sk-celery-" + uuid.uuid4().hex
# The example's submit waits at most this long after submission (its ``timeout``).
WAIT_TIMEOUT = timedelta(hours=26)


@dataclass
class Staging:
    """Where the workers stage files, and what else they need to reach it.

    :param root: the staging root URL (``file://`` a folder every worker sees, or ``s3://``).
    :param env: extra environment of every component (an object-store connection...).
    """

    root: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Deployment:
    cluster: AirflowCluster
    server: BatchServerHandle
    gate: BatchCreateGate
    warehouse: TicketWarehouse


# Where the workers stage files. Object storage is one more entry here: "s3" takes the module- or
# session-scoped fixture named below, which must give a Staging whose root is an s3:// URL served by
# a process the Airflow components can reach (a moto server, not an in-process mock) and whose env
# carries the AWS connection to it.
STAGING_KINDS = ["file"]


@pytest.fixture(scope="module", params=STAGING_KINDS)
def staging(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Staging:
    """A staging root both workers reach: one folder of this machine, or an object store."""
    if request.param == "s3":
        s3: Staging = request.getfixturevalue("s3_staging")
        return s3
    return Staging(f"file://{tmp_path_factory.mktemp('celery-staging')}")


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, celery_broker: str, staging: Staging
) -> Iterator[Deployment]:
    """Seeded warehouse, gated local batch server and the Celery deployment, for the module."""
    work = tmp_path_factory.mktemp("celery-deployment")
    dags = work / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "dags_examples" / f"{DAG_ID}.py", dags)
    # A batch completes about 6 s after its create: every submit really waits in a triggerer.
    server, gate = gated_batch_server(realtime_server_config(work / "server", API_KEY, validate_seconds=4))
    try:
        with ticket_warehouse(TICKETS) as warehouse:
            env = {
                "AIRFLOW_CONN_WAREHOUSE": warehouse.connection,
                "AIRFLOW_CONN_BATCH_API_DEFAULT": server.connection_json(),
                "AIRFLOW__BATCH_PROVIDER__STAGING_ROOT": staging.root,
                "BATCH_EXAMPLES_MAX_LINES": str(MAX_LINES),
                "BATCH_EXAMPLES_POLL_INTERVAL": "2",
                **staging.env,
            }
            with celery_cluster(work / "airflow-home", dags, broker_url=celery_broker, env=env) as cluster:
                cluster.wait_for_dag(DAG_ID)
                yield Deployment(cluster, server, gate, warehouse)
    finally:
        server.stop()


@pytest.fixture
def celery(deployment: Deployment) -> Iterator[Deployment]:
    """The deployment with every component running, whatever an earlier test killed."""
    revive(deployment.cluster)
    deployment.server.set_faults(stall_batches=False)
    yield deployment
    deployment.gate.release.set()
    deployment.server.set_faults(stall_batches=False)


def check_landed(d: Deployment, run_id: str, result: RunResult, table: str) -> list[dict[str, Any]]:
    """The run succeeded, made exactly one batch per shard, and every ticket's row landed once."""
    assert result.state == "success", (result.seen, d.cluster.diagnostics())
    states = Counter(ti["task_id"] for ti in result.task_instances if ti["state"] == "success")
    assert states == {
        "build_requests": 1,
        "shard_indexes": 1,
        "submit_shard": SHARDS,
        "collect": 1,
        "merge": 1,
        "report": 1,
    }
    batches = server_batches(d.server, run_id)
    assert sorted(int(b["metadata"]["airflow_shard"]) for b in batches) == list(range(SHARDS)), batches
    merged = d.cluster.xcom(DAG_ID, run_id, "merge")
    assert sorted(merged["batch_ids"]) == sorted(b["id"] for b in batches)
    query = d.warehouse.query
    assert query(f"SELECT COUNT(*), COUNT(DISTINCT ticket_id) FROM {table}") == [(TICKETS, TICKETS)]
    counts = dict(query(f"SELECT status, COUNT(*) FROM {table} GROUP BY status"))
    assert counts == {"succeeded": TICKETS - EMPTY_BODIES, "rejected": EMPTY_BODIES}
    return batches


def submits(cluster: AirflowCluster, run_id: str) -> dict[int, dict[str, Any]]:
    """The mapped submit task instances of a run, by map index."""
    instances = cluster.task_instances(DAG_ID, run_id)
    return {ti["map_index"]: ti for ti in instances if ti["task_id"] == "submit_shard"}


def test_example_runs_on_both_workers(celery: Deployment) -> None:
    cluster = celery.cluster
    run_id = cluster.trigger(DAG_ID, conf={"results_table": "triage_celery_plain"})
    result = cluster.wait_for_run(DAG_ID, run_id, timeout=300)
    check_landed(celery, run_id, result, "triage_celery_plain")

    # The mapped submits were queued together and each worker takes one task at a time.
    hosts = {
        attempt["hostname"]
        for ti in result.task_instances
        for attempt in cluster.tries(DAG_ID, run_id, ti["task_id"], ti["map_index"])
    }
    assert hosts == set(WORKERS), hosts
    # Every submit waited in a triggerer, not on a worker.
    assert all("deferred" in result.seen[("submit_shard", i)] for i in range(SHARDS)), result.seen
    assert {t["triggerer_hostname"] for t in result.triggers.values()} <= set(TRIGGERERS)


def test_worker_killed_after_submit_created_its_batch(celery: Deployment) -> None:
    cluster = celery.cluster
    run_id = f"celery_worker_killed_{uuid.uuid4().hex[:8]}"
    celery.gate.arm(run_id)
    cluster.trigger(DAG_ID, conf={"results_table": "triage_celery_worker_killed"}, run_id=run_id)
    cluster.wait_until("a submit to create its batch", celery.gate.tripped.is_set, timeout=300)
    held = celery.gate.held
    assert held is not None
    shard = int(held["metadata"]["airflow_map_index"])
    victim = submits(cluster, run_id)[shard]["hostname"]
    assert victim in WORKERS
    # The batch exists at the server; its answer has not reached the task: kill the worker now.
    cluster.kill(victim)
    celery.gate.release.set()

    result = cluster.wait_for_run(DAG_ID, run_id, timeout=300)
    batches = check_landed(celery, run_id, result, "triage_celery_worker_killed")
    tries = cluster.tries(DAG_ID, run_id, "submit_shard", shard)
    assert len(tries) == 2, tries
    survivor = next(w for w in WORKERS if w != victim)
    assert [t["hostname"] for t in tries] == [victim, survivor], tries
    assert tries[-1]["state"] == "success"
    # The retry re-attached to the batch the killed try created: no second batch for the shard,
    # and the wait's clock still starts at that batch's creation.
    assert [b["id"] for b in batches if int(b["metadata"]["airflow_shard"]) == shard] == [held["id"]]
    submitted = cluster.xcom(DAG_ID, run_id, "submit_shard", shard)
    assert submitted["batch_ids"] == [held["id"]]
    assert datetime.fromisoformat(submitted["submitted_at"]) == datetime.fromtimestamp(
        held["created_at"], timezone.utc
    )


def test_triggerer_killed_while_submits_wait(celery: Deployment) -> None:
    cluster, server = celery.cluster, celery.server
    # The batches stall at the server until the takeover is seen, so the kill lands mid-wait.
    server.set_faults(stall_batches=True)
    run_id = cluster.trigger(DAG_ID, conf={"results_table": "triage_celery_triggerer_killed"})

    def all_deferred() -> dict[int, dict[str, Any]] | None:
        now = submits(cluster, run_id)
        waiting = len(now) == SHARDS and all(
            ti["state"] == "deferred" and ti.get("triggerer_job") for ti in now.values()
        )
        return now if waiting else None

    before = cluster.wait_until("every submit to wait in a triggerer", all_deferred, timeout=300)
    owners = Counter(ti["triggerer_job"]["hostname"] for ti in before.values())
    victim = owners.most_common(1)[0][0]
    survivor = next(t for t in TRIGGERERS if t != victim)
    moved = {i: ti["trigger"]["id"] for i, ti in before.items() if ti["triggerer_job"]["hostname"] == victim}
    stored_before = cluster.stored_triggers()
    cluster.kill(victim)

    def taken_over() -> dict[int, dict[str, Any]] | None:
        now = all_deferred()
        if now is None or any(now[i]["triggerer_job"]["hostname"] != survivor for i in moved):
            return None
        return now

    after = cluster.wait_until(f"{survivor} to take the triggers of {victim} over", taken_over, timeout=120)
    # The same trigger rows, with the same stored kwargs, now owned by the other triggerer.
    assert {i: after[i]["trigger"]["id"] for i in moved} == moved
    stored_after = cluster.stored_triggers()
    for trigger_id in moved.values():
        assert stored_after[trigger_id][1] == stored_before[trigger_id][1]
        assert stored_after[trigger_id][0] != stored_before[trigger_id][0]
    batches = server_batches(server, run_id)
    created = {b["id"]: datetime.fromtimestamp(b["created_at"], timezone.utc) for b in batches}
    for i in moved:
        kwargs = cluster.trigger_kwargs(stored_after[moved[i]][1])
        (batch_id,) = kwargs["batch_ids"]
        # The deadline still counts from the batch's creation, not from the takeover.
        assert datetime.fromisoformat(kwargs["submitted_at"]) == created[batch_id]
        assert datetime.fromisoformat(kwargs["deadline"]) == created[batch_id] + WAIT_TIMEOUT

    server.set_faults(stall_batches=False)
    for batch in batches:
        server.force(batch["id"], "resume")
    result = cluster.wait_for_run(DAG_ID, run_id, timeout=300)
    check_landed(celery, run_id, result, "triage_celery_triggerer_killed")
