"""Example 6 -- support ticket triage with BigQuery as the warehouse, both ways.

The tickets are read from a BigQuery table (the query's result is read page by page, never
held whole) and the answers are merged back into BigQuery: the results are loaded into a
staging table with a free load job (newline-delimited JSON), and one ``MERGE`` writes one row
per ticket, updating the rows of an earlier run instead of adding to them.

    support_tickets (BigQuery) --build_requests--> batch JSONL in staging
                               --submit----------> one batch per shard (idempotent on retries)
                               --wait------------> deferred to the triggerer: no worker slot held
                               --merge-----------> ticket_triage (BigQuery): ticket_id, category,
                                                   urgency, summary, status, tokens..., one row per ticket

What it shows:

* a connection of type ``bigquery`` (the ``bigquery`` extra): its schema field is the default
  dataset (where the results table and the merge's short-lived staging tables live), its password
  a service-account key in JSON (or none: Application Default Credentials), its extras
  ``project`` and ``location``;
* structured output parsed into typed columns (``STRING``), tickets without a body landing as
  ``rejected`` rows, usage counts as ``INT64``;
* re-running the DAG upserts by ``ticket_id``: no duplicates.

Connections: ``bigquery_warehouse`` and ``batch_api_default`` (change the ids below or through
the environment variables named there).
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

# Deployment settings (operator arguments that are not templated): edit, or set the variables.
BIGQUERY_CONN_ID = os.environ.get("BATCH_EXAMPLES_BIGQUERY_CONN_ID", "bigquery_warehouse")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))
MAX_LINES = int(os.environ.get("BATCH_EXAMPLES_MAX_LINES", "50000"))

TRIAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["billing", "bug", "account", "shipping", "other"]},
        "urgency": {"type": "string", "enum": ["low", "medium", "high", "critical"]},
        "summary": {"type": "string", "description": "one sentence, at most 20 words"},
    },
    "required": ["category", "urgency", "summary"],
    "additionalProperties": False,
}

with DAG(
    dag_id="bigquery_ticket_triage",
    description="Classify BigQuery support tickets with an LLM batch and MERGE the answers into BigQuery",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example", "bigquery"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={
        "source_table": Param("support_tickets", type="string", description="tickets to triage"),
        "results_table": Param("ticket_triage", type="string", description="where the answers land"),
        "model": Param("gpt-4o-mini", type="string", description="the vendor's model name"),
    },
) as dag:
    build_requests = SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id=BIGQUERY_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        # Unqualified: the connection's default dataset.
        sql="SELECT ticket_id, subject, body FROM `{{ params.source_table }}` ORDER BY ticket_id",
        key_columns="ticket_id",
        messages=[
            {"role": "system", "content": "Triage the support ticket. Answer with JSON only."},
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

    submit = SubmitBatchOperator(
        task_id="submit",
        source=build_requests.output,
        batch_conn_id=BATCH_CONN_ID,
        metadata={"dag": "{{ dag.dag_id }}", "run": "{{ run_id }}"},
    )

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
        conn_id=BIGQUERY_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        target_table="{{ params.results_table }}",
        batches=submit.output,
        output_schema=TRIAGE_SCHEMA,
    )

    build_requests >> submit >> wait >> merge
