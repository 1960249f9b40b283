"""Example 6 -- Snowflake in, Snowflake out: the sentiment of support tickets through an LLM batch.

The source rows are read from Snowflake through the provider's ``SnowflakeHook`` with a streaming
cursor (the connector's result batches, fetched ``fetchmany`` at a time, never ``fetchall``); the
answers land in a Snowflake table: the results are staged as JSONL chunks PUT on a temporary
internal stage and loaded with one ``COPY INTO``, then written by key in one transaction
(``UPDATE`` then ``INSERT``), one row per ticket.

    support_tickets --build_requests--> batch JSONL in staging
                    --submit----------> one batch per shard
                    --wait------------> deferred to the triggerer
                    --merge-----------> TICKET_SENTIMENT (TICKET_ID, "sentiment", "reason",
                                        "status", tokens, ...) in Snowflake

What it shows:
* a Snowflake connection used for both ends (``snowflake_default``: account, login, password,
  ``schema``; extras ``database``, ``warehouse``, ``role``);
* structured output parsed into typed columns (``sentiment``, ``reason``), the raw answers and
  usage beside them; the ``embedding`` column of an embeddings run would be a ``VARIANT`` array;
* a re-run writes the same rows again instead of adding any (Snowflake declares primary keys but
  does not enforce them; the merge upserts by key itself).

Connections: ``snowflake_default`` (type ``snowflake``) and ``batch_api_default``. Sample data:
``python -m airflow_batch_provider.demo seed --conn-id snowflake_default``.
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

SNOWFLAKE_CONN_ID = os.environ.get("BATCH_EXAMPLES_SNOWFLAKE_CONN_ID", "snowflake_default")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))

SENTIMENT_SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative", "angry"]},
        "reason": {"type": "string", "description": "a few words"},
    },
    "required": ["sentiment", "reason"],
    "additionalProperties": False,
}

with DAG(
    dag_id="snowflake_ticket_sentiment",
    description="Rate the sentiment of Snowflake support tickets with an LLM batch, land it in Snowflake",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example", "snowflake"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={
        "source_table": Param("support_tickets", type="string", description="tickets to rate"),
        # Upper case, so that it can be queried unquoted (the merge quotes every name it writes).
        "results_table": Param("TICKET_SENTIMENT", type="string", description="where the answers land"),
        "model": Param("gpt-4o-mini", type="string", description="the vendor's model name"),
    },
) as dag:
    build_requests = SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id=SNOWFLAKE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        sql="SELECT ticket_id, subject, body FROM {{ params.source_table }} ORDER BY ticket_id",
        # Snowflake names unquoted columns in upper case, and so does the query result.
        key_columns="TICKET_ID",
        messages=[
            {"role": "system", "content": "Rate the customer's sentiment. Answer with JSON only."},
            {"role": "user", "content": "Subject: {{ SUBJECT }}\n\n{{ BODY }}"},
        ],
        body={
            "temperature": 0,
            "max_tokens": 60,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "sentiment", "strict": True, "schema": SENTIMENT_SCHEMA},
            },
        },
        model="{{ params.model }}",
    )

    submit = SubmitBatchOperator(task_id="submit", source=build_requests.output, batch_conn_id=BATCH_CONN_ID)

    wait = BatchSensor(
        task_id="wait",
        batch_ids=submit.output,
        batch_conn_id=BATCH_CONN_ID,
        deferrable=True,
        poll_interval=POLL_INTERVAL,
        timeout=int(timedelta(hours=26).total_seconds()),
        on_partial_failure="succeed",
    )

    merge = MergeBatchResultsOperator(
        task_id="merge",
        conn_id=SNOWFLAKE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        target_table="{{ params.results_table }}",
        batches=submit.output,
        output_schema=SENTIMENT_SCHEMA,
    )

    wait >> merge
