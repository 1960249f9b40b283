"""The reliability suite's DAG: build -> mapped deferrable submit per shard -> collect -> merge.

Configured by environment variables so one file serves every test that runs it under
``airflow dags test`` (connections come from ``AIRFLOW_CONN_*`` the test sets):

* ``REL_SOURCE_TABLE`` / ``REL_TARGET_TABLE``: the warehouse tables (connection ``wh_postgres``).
* ``REL_MAX_LINES``: lines per shard (so a small table makes several mapped submits).
* ``REL_STAGING``: the staging directory of the run.
* ``REL_POLL_INTERVAL`` / ``REL_WAIT_TIMEOUT``: the submit's wait (seconds).
* ``REL_DAG_ID``: the DAG id (so tests sharing a metadata database keep their runs apart).
* ``REL_MAX_ENQUEUED_TOKENS``: the submits' ``max_enqueued_tokens`` (queue-aware; unset: none).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from airflow.sdk import dag, task

from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator

DAG_ID = os.environ.get("REL_DAG_ID", "reliability_pipeline")


@dag(dag_id=DAG_ID, schedule=None, catchup=False, tags=["reliability"])
def reliability_pipeline() -> None:
    build = SqlToBatchJsonlOperator(
        task_id="build",
        conn_id="wh_postgres",
        table=os.environ.get("REL_SOURCE_TABLE", "tickets"),
        key_columns="id",
        messages=[{"role": "user", "content": "{{ text }}"}],
        model="echo-1",
        max_lines=int(os.environ.get("REL_MAX_LINES", "25")),
        staging_path=os.environ["REL_STAGING"] + "/{{ run_id | replace(':', '_') | replace('+', '_') }}",
    )

    @task
    def shard_indexes(manifest: dict[str, Any]) -> list[int]:
        return [int(shard["index"]) for shard in manifest["shards"]]

    submissions = SubmitBatchOperator.partial(
        task_id="submit",
        source=build.output,
        wait_for_completion=True,
        deferrable=True,
        poll_interval=float(os.environ.get("REL_POLL_INTERVAL", "0.05")),
        max_poll_interval=float(os.environ.get("REL_POLL_INTERVAL", "0.05")) * 4,
        timeout=float(os.environ["REL_WAIT_TIMEOUT"]) if os.environ.get("REL_WAIT_TIMEOUT") else None,
        max_enqueued_tokens=(
            int(os.environ["REL_MAX_ENQUEUED_TOKENS"]) if os.environ.get("REL_MAX_ENQUEUED_TOKENS") else None
        ),
    ).expand(shard=shard_indexes(build.output))

    @task
    def collect(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [dict(r) for r in results]

    @task
    def manifest_path_of(manifest: dict[str, Any]) -> str:
        # XComArg["key"] pulls an XCom *key*, not an item of the dict the build returned.
        return str(manifest["manifest_path"])

    MergeBatchResultsOperator(
        task_id="merge",
        conn_id="wh_postgres",
        target_table=os.environ.get("REL_TARGET_TABLE", "answers"),
        batches=collect(submissions.output),
        manifest_path=manifest_path_of(build.output),
    )


reliability_pipeline()
