"""Example 3 -- embed a product catalogue through a batch and land the vectors in a table.

Each product's description becomes one ``/v1/embeddings`` request; the batch runs at the
vendor's batch price, the sensor waits in the triggerer, and the merge writes one row per
product with its vector in the ``embedding`` column (JSON array; cast it to ``vector`` for
pgvector or to ``FLOAT[]`` in DuckDB for similarity search).

    products --build_requests--> embeddings JSONL --submit--> batch --wait--> merge --> product_embeddings

What it shows: the build's ``input_column`` mode (no prompt template: the column's text is
the input), the embeddings endpoint chosen automatically, ``dimensions`` passed through the
request body, and a re-run that upserts the same rows instead of duplicating them.
Connections as in example 1.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG, Param

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.sensors.batch import BatchSensor

WAREHOUSE_CONN_ID = os.environ.get("BATCH_EXAMPLES_WAREHOUSE_CONN_ID", "warehouse")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))
DIMENSIONS = 64

with DAG(
    dag_id="catalogue_embeddings",
    description="Embed product descriptions with an LLM batch and store the vectors",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={
        "source_table": Param("products", type="string", description="the catalogue"),
        "results_table": Param("product_embeddings", type="string", description="where vectors land"),
        "model": Param("text-embedding-3-small", type="string"),
        "category": Param("", type="string", description="embed one category only (empty: all)"),
    },
) as dag:
    build_requests = SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        sql=(
            "SELECT product_id, description FROM {{ params.source_table }}"
            "{% if params.category %} WHERE category = '{{ params.category }}'{% endif %}"
            " ORDER BY product_id"
        ),
        key_columns="product_id",
        input_column="description",
        body={"dimensions": DIMENSIONS, "encoding_format": "float"},
        model="{{ params.model }}",
    )

    submit = SubmitBatchOperator(
        task_id="submit",
        source=build_requests.output,
        batch_conn_id=BATCH_CONN_ID,
    )

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
        target_table="{{ params.results_table }}",
        batches=submit.output,
        input_price_per_1m=0.01,
    )

    build_requests >> submit >> wait >> merge
