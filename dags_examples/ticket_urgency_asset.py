"""Example 6 -- a results table as an Airflow asset: a consumer DAG runs when the answers land.

Two DAGs. ``ticket_urgency_producer`` rates the urgency of every support ticket through an LLM
batch and merges the answers into a results table; the merge has that table as its outlet, so
each merge records an asset event whose extra carries what landed:

    {"table": ..., "rows_written": ..., "counts": {"succeeded": ..., "failed": ..., ...},
     "prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ..., "cost": ...,
     "batch_ids": [...], "attempt": 1, ...}

``ticket_urgency_report`` is scheduled on that asset (``schedule=[RESULTS]``): the scheduler
starts it after each merge, and its task reads the event's extra from
``triggering_asset_events`` -- here to check the share of answered tickets, and to hand the
figures on (its XCom) to whatever reports them.

The asset's URI follows the warehouse provider's convention
(``postgres://host:port/database/schema/table``), built with
:func:`airflow_batch_provider.assets.table_uri`, so it is the same asset other providers'
operators and OpenLineage name for that table. ``results_table_asset(conn_id, table)`` builds it
from the connection instead (a connection lookup at every parse).

The submit and wait tasks show a link per batch ("Batch 1", ...) to the vendor's console, or
to the local batch server's page when the connection points at ``airflow-batch serve``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, Asset, Param, task

from airflow_batch_provider.assets import table_uri
from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.sensors.batch import BatchSensor

WAREHOUSE_CONN_ID = os.environ.get("BATCH_EXAMPLES_WAREHOUSE_CONN_ID", "warehouse")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))
# The asset names one table, so the table is a deployment setting here, not a run parameter.
RESULTS_TABLE = os.environ.get("BATCH_EXAMPLES_URGENCY_TABLE", "ticket_urgency")
RESULTS = Asset(
    name="ticket_urgency_results",
    uri=os.environ.get("BATCH_EXAMPLES_URGENCY_URI")
    or table_uri("postgres", host="warehouse.example.internal", database="analytics", table=RESULTS_TABLE),
)

with DAG(
    dag_id="ticket_urgency_producer",
    description="Rate ticket urgency with an LLM batch; the merge updates the results-table asset",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example", "assets"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={"model": Param("gpt-4o-mini", type="string", description="the vendor's model name")},
) as producer:
    build = SqlToBatchJsonlOperator(
        task_id="build",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        table="support_tickets",
        key_columns="ticket_id",
        messages=[
            {"role": "system", "content": "Rate the urgency of this ticket: low, medium, high or critical."},
            {"role": "user", "content": "{{ subject }}\n\n{{ body }}"},
        ],
        body={"temperature": 0, "max_tokens": 5},
        model="{{ params.model }}",
    )
    submit = SubmitBatchOperator(task_id="submit", source=build.output, batch_conn_id=BATCH_CONN_ID)
    wait = BatchSensor(
        task_id="wait",
        batch_ids=submit.output,
        batch_conn_id=BATCH_CONN_ID,
        poll_interval=POLL_INTERVAL,
        timeout=int(timedelta(hours=26).total_seconds()),
    )
    merge = MergeBatchResultsOperator(
        task_id="merge",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        target_table=RESULTS_TABLE,
        batches=submit.output,
        input_price_per_1m=0.075,
        output_price_per_1m=0.30,
        # The event of this outlet gets the merge's figures as its extra.
        outlets=[RESULTS],
    )
    build >> submit >> wait >> merge


with DAG(
    dag_id="ticket_urgency_report",
    description="Runs when the urgency results table is updated; reads the merge's figures",
    schedule=[RESULTS],
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example", "assets"],
    params={
        "min_answered": Param(
            0.5, type="number", minimum=0, maximum=1, description="fail below this share of answered rows"
        )
    },
) as report:

    @task
    def summarise(
        params: dict[str, Any] | None = None, triggering_asset_events: Any = None
    ) -> dict[str, Any]:
        """The figures of every merge that triggered this run; fails when too few rows were answered."""
        events = (triggering_asset_events or {}).get(RESULTS, [])
        merges = [
            {"source": f"{e.source_dag_id}/{e.source_run_id}", "timestamp": str(e.timestamp), **e.extra}
            for e in events
        ]
        for figures in merges:
            rows = int(figures.get("rows_written") or 0)
            answered = int((figures.get("counts") or {}).get("succeeded", 0))
            if rows and answered / rows < float((params or {}).get("min_answered", 0)):
                raise ValueError(f"only {answered} of {rows} rows of {figures.get('table')} were answered")
        return {"events": len(merges), "merges": merges}

    summarise()
