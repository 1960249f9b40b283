"""A real multi-worker Airflow: CeleryExecutor, two workers, two triggerers, driven through the REST API.

The topology is :func:`tests.fixtures.workers.celery_cluster`: api-server, scheduler,
dag-processor, two triggerers and two Celery workers (Redis broker, PostgreSQL metadata DB and
result backend), each worker in a working directory and temp folder of its own. The pipeline
is example 2 (``support_ticket_triage_sharded``: build -> one mapped submit per shard, each
deferred to a triggerer -> merge), over a ticket table cut into three shards. Staging is object
storage (an S3 bucket on a moto server, ``AIRFLOW__BATCH_PROVIDER__STAGING_ROOT=s3://...`` and
the ``aws`` connection in every component's environment); the workers share no staging folder,
and each run checks that every staged file is in the bucket and none on this machine's disk.
The runs:

* a build told to stage on a local folder fails at once, before reading a row (the executor
  may run the next task on another machine);
* plainly: every row lands once, and tasks ran on both workers;
* a worker SIGKILLed (with its task process) right after a submit created its batch at the
  server, before the task heard the batch id: the retry runs on the other worker and finds that
  batch through the intent the killed try left in Airflow's task state store (no shared disk)
  instead of paying for a second one (one batch per shard, checked at the server);
* the triggerer holding the deferred submits SIGKILLed while the batches run: the other one
  takes the same trigger rows over, whose deadline still counts from the submission.

The pipeline runs are not repeated on a shared local folder (with ``[batch_provider]
local_staging_is_shared``): a second deployment would double the module's time, and the
option's check is unit-tested in ``tests/test_staging.py``.
"""

from __future__ import annotations

import re
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.submission import RunIdentity
from tests.fixtures.e2e import (
    AirflowCluster,
    RunResult,
    TicketWarehouse,
    realtime_server_config,
    ticket_warehouse,
)
from tests.fixtures.s3 import S3Staging, new_bucket
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


# Under the module's bucket: the deployment's [batch_provider] staging_root.
STAGING_PREFIX = "batch-staging"
# What a build stages: the manifest, keys and rejects files, and its shards.
STAGED_FILES = (staging.MANIFEST_NAME, staging.KEYS_NAME, staging.REJECTS_NAME)
SHARD_FILE = re.compile(r"shard-\d+\.jsonl")
# A build whose staging path the run's conf names: a local one must fail at once on this executor.
PROBE_DAG_ID = "local_staging_probe"
PROBE_DAG = f"""
from airflow.sdk import Param, dag

from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator


@dag(
    dag_id="{PROBE_DAG_ID}", schedule=None, catchup=False, params={{"staging_path": Param("", type="string")}}
)
def local_staging_probe():
    SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id="warehouse",
        table="support_tickets",
        key_columns="ticket_id",
        messages=[{{"role": "user", "content": "{{{{ body }}}}"}}],
        model="gpt-4o-mini",
        staging_path="{{{{ params.staging_path }}}}",
        retries=0,
    )


local_staging_probe()
"""


@dataclass
class Deployment:
    cluster: AirflowCluster
    server: BatchServerHandle
    gate: BatchCreateGate
    warehouse: TicketWarehouse
    bucket: S3Staging


@pytest.fixture(scope="module")
def bucket(moto_s3: str) -> Iterator[S3Staging]:
    """A bucket of the module's own on the session's moto server, reachable from this process too."""
    with pytest.MonkeyPatch.context() as mp:
        yield new_bucket(moto_s3, mp)


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, celery_broker: str, bucket: S3Staging
) -> Iterator[Deployment]:
    """Seeded warehouse, gated local batch server and the Celery deployment staging on S3, for the module."""
    work = tmp_path_factory.mktemp("celery-deployment")
    dags = work / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "dags_examples" / f"{DAG_ID}.py", dags)
    (dags / f"{PROBE_DAG_ID}.py").write_text(PROBE_DAG)
    # A batch completes about 6 s after its create: every submit really waits in a triggerer.
    server, gate = gated_batch_server(realtime_server_config(work / "server", API_KEY, validate_seconds=4))
    try:
        with ticket_warehouse(TICKETS) as warehouse:
            env = {
                "AIRFLOW_CONN_WAREHOUSE": warehouse.connection,
                "AIRFLOW_CONN_BATCH_API_DEFAULT": server.connection_json(),
                # Every component reaches the bucket through the same aws connection.
                **bucket.env,
                "AIRFLOW__BATCH_PROVIDER__STAGING_ROOT": f"{bucket.root}/{STAGING_PREFIX}",
                "BATCH_EXAMPLES_MAX_LINES": str(MAX_LINES),
                "BATCH_EXAMPLES_POLL_INTERVAL": "2",
            }
            with celery_cluster(work / "airflow-home", dags, broker_url=celery_broker, env=env) as cluster:
                cluster.wait_for_dag(DAG_ID)
                cluster.wait_for_dag(PROBE_DAG_ID)
                yield Deployment(cluster, server, gate, warehouse, bucket)
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
    check_staged_on_s3(d, run_id)
    return batches


def check_staged_on_s3(d: Deployment, run_id: str) -> None:
    """The run staged its files in the bucket, under the staging root, and nothing on local disk."""
    built = d.cluster.xcom(DAG_ID, run_id, "build_requests")
    folder = f"{STAGING_PREFIX}/{DAG_ID}/{staging.safe_segment(run_id)}/build_requests"
    assert built["manifest_path"] == f"{d.bucket.root}/{folder}/{staging.MANIFEST_NAME}", built
    shards = [staging.shard_name(i) for i in range(SHARDS)]
    # Exactly these: no submit-state/ files either, the submits kept their state in Airflow.
    assert d.bucket.keys(folder) == sorted(f"{folder}/{name}" for name in (*STAGED_FILES, *shards))
    # Not in AIRFLOW_HOME (the default staging root), nor in a worker's working or temp folder.
    local = [
        path
        for path in d.cluster.home.rglob("*")
        if path.name in STAGED_FILES or SHARD_FILE.fullmatch(path.name) or path.name == "submit-state"
    ]
    assert local == [], local


def submits(cluster: AirflowCluster, run_id: str) -> dict[int, dict[str, Any]]:
    """The mapped submit task instances of a run, by map index."""
    instances = cluster.task_instances(DAG_ID, run_id)
    return {ti["map_index"]: ti for ti in instances if ti["task_id"] == "submit_shard"}


def test_local_staging_fails_the_build_at_once(celery: Deployment, tmp_path: Path) -> None:
    """With tasks spread over workers, a build staging on one machine's disk stops before its first row."""
    cluster = celery.cluster
    local = tmp_path / "local-staging"
    run_id = cluster.trigger(PROBE_DAG_ID, conf={"staging_path": f"file://{local}"})
    result = cluster.wait_for_run(PROBE_DAG_ID, run_id, timeout=120)
    assert result.state == "failed", result.seen
    (build,) = result.task_instances
    assert (build["state"], build["try_number"]) == ("failed", 1), build
    logs = "\n".join(cluster.task_logs(PROBE_DAG_ID, run_id, "build_requests").values())
    assert "ConfigurationError" in logs and "local_staging_is_shared" in logs, logs[-3000:]
    assert not local.exists()


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
    # The workers share no disk: the killed try's intent reached the retry through Airflow's task
    # state store, which now holds the adopted batch (and check_landed saw no submit-state/ file).
    key = RunIdentity(DAG_ID, "submit_shard", run_id, shard).key(shard)
    records = cluster.task_state(DAG_ID, run_id, "submit_shard", shard)
    assert list(records) == [key], records
    assert (records[key]["batch_id"], records[key]["input_file_id"]) == (held["id"], held["input_file_id"])
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
