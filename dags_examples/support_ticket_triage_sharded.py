"""Example 2 -- the ticket triage written with TaskFlow, one mapped task per shard.

The same job as ``support_ticket_triage``, shaped for tables larger than one batch: a vendor
takes at most 50,000 lines (and 200 MB) per batch file, so the build writes as many shards
as it needs, and ``.expand()`` submits and waits for each shard in its own mapped task
instance. Each mapped submit defers to the triggerer, so a thousand-shard backfill holds no
worker slots while the vendor works; a retried map index re-attaches to its own batch
instead of paying for it twice. One merge at the end writes every ticket's row.

    build_requests -> shard_indexes -> submit_shard[0..n] (deferred waits) -> collect -> merge -> report

What it shows: TaskFlow (``@dag``/``@task``) mixed with the provider's operators,
``.partial().expand()`` over the shards of a build manifest, XComArgs wiring the manifest
path and the submissions into the merge, and a summary task reading the merge's counts.

``MAX_LINES`` caps the lines per shard below the vendor's limit (set it low to see several
shards on a small table). Connections as in example 1.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import Param, dag, task

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator

WAREHOUSE_CONN_ID = os.environ.get("BATCH_EXAMPLES_WAREHOUSE_CONN_ID", "warehouse")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))
# None: the vendor's own limit (50,000 lines for OpenAI) decides how many shards there are.
MAX_LINES = (
    int(os.environ["BATCH_EXAMPLES_MAX_LINES"]) if os.environ.get("BATCH_EXAMPLES_MAX_LINES") else None
)

TRIAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {
            "type": "string",
            "enum": ["billing", "bug", "account", "shipping", "feature_request", "other"],
        },
        "urgency": {"type": "string", "enum": ["low", "medium", "high", "critical"]},
        "summary": {"type": "string"},
    },
    "required": ["category", "urgency", "summary"],
    "additionalProperties": False,
}


@dag(
    dag_id="support_ticket_triage_sharded",
    description="Ticket triage over many shards: TaskFlow and dynamic task mapping",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={
        "source_table": Param("support_tickets", type="string"),
        "results_table": Param("ticket_triage_sharded", type="string"),
        "model": Param("gpt-4o-mini", type="string"),
    },
)
def support_ticket_triage_sharded() -> None:
    build_requests = SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        table="{{ params.source_table }}",
        key_columns="ticket_id",
        messages=[
            {"role": "system", "content": "Triage this support ticket. Answer with JSON only."},
            {"role": "user", "content": "Subject: {{ subject }}\n\n{{ body }}"},
        ],
        body={
            "temperature": 0,
            "max_tokens": 200,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "ticket_triage", "strict": True, "schema": TRIAGE_SCHEMA},
            },
        },
        model="{{ params.model }}",
        max_lines=MAX_LINES,
    )

    @task
    def shard_indexes(manifest: dict[str, Any]) -> list[int]:
        """One entry per shard of the build: what the submit task is mapped over."""
        return [int(shard["index"]) for shard in manifest["shards"]]

    # One mapped task instance per shard: each uploads its file, creates its batch and waits
    # for it in the triggerer (wait_for_completion + deferrable).
    submissions = SubmitBatchOperator.partial(
        task_id="submit_shard",
        source=build_requests.output,
        batch_conn_id=BATCH_CONN_ID,
        wait_for_completion=True,
        deferrable=True,
        poll_interval=POLL_INTERVAL,
        timeout=timedelta(hours=26),
        on_partial_failure="succeed",
        max_active_tis_per_dagrun=16,
    ).expand(shard=shard_indexes(build_requests.output))

    @task
    def collect(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Gather the mapped submissions (batch id per shard) into one list for the merge."""
        return [dict(r) for r in results]

    merge = MergeBatchResultsOperator(
        task_id="merge",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        target_table="{{ params.results_table }}",
        batches=collect(submissions.output),
        # The build's return value holds the manifest's location (shard keys for the join).
        manifest_path="{{ ti.xcom_pull(task_ids='build_requests')['manifest_path'] }}",
        output_schema=TRIAGE_SCHEMA,
    )

    @task
    def report(summary: dict[str, Any]) -> dict[str, Any]:
        """Log the outcome in one line: rows per status and tokens (the merge's return value)."""
        counts = summary.get("counts", {})
        print(
            f"{summary['table']}: {summary.get('rows_written')} row(s) over {len(summary['batch_ids'])} "
            f"batch(es); " + ", ".join(f"{k}={v}" for k, v in counts.items() if v)
        )
        return {"batches": len(summary["batch_ids"]), **counts}

    report(merge.output)


support_ticket_triage_sharded()
