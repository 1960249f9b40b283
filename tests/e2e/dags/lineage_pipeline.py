"""build -> submit -> wait -> merge on a warehouse table, for the OpenLineage test (tests/test_lineage.py).

Connections: ``LINEAGE_WAREHOUSE_CONN_ID`` (a PostgreSQL schema holding ``tickets``) and
``batch_api_default`` (the local batch server). The build reads with a bound parameter (the SQL
parser cannot read placeholders; the lineage must still name the table) and writes several shards.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG

from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.sensors.batch import BatchSensor

WAREHOUSE = os.environ.get("LINEAGE_WAREHOUSE_CONN_ID", "wh_postgres")
#: Batch prices per million tokens, for the merge's cost figure.
INPUT_PRICE, OUTPUT_PRICE = 0.5, 1.5

with DAG(
    "lineage_pipeline",
    start_date=pendulum.datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["test"],
):
    build = SqlToBatchJsonlOperator(
        task_id="build",
        conn_id=WAREHOUSE,
        sql="SELECT ticket_id, body FROM tickets WHERE ticket_id >= %(first)s ORDER BY ticket_id",
        parameters={"first": 1},
        key_columns="ticket_id",
        messages=[{"role": "user", "content": "Summarise: {{ body }}"}],
        model="echo-1",
        max_lines=5,
    )
    submit = SubmitBatchOperator(task_id="submit", source=build.output, state_store="file")
    wait = BatchSensor(task_id="wait", batch_ids=submit.output, poll_interval=0.2, deferrable=True)
    merge = MergeBatchResultsOperator(
        task_id="merge",
        conn_id=WAREHOUSE,
        target_table="ticket_answers",
        batches=submit.output,
        input_price_per_1m=INPUT_PRICE,
        output_price_per_1m=OUTPUT_PRICE,
    )
    build >> submit >> wait >> merge
