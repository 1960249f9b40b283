"""Example 1 -- support ticket triage with the classic operators.

A data team's nightly job: every support ticket in the warehouse is classified by an LLM
through a vendor's Batch API (half the price of synchronous calls) and the answers land in
a results table next to the ticket id, ready to join.

    support_tickets --build_requests--> batch JSONL in staging (one line per ticket)
                    --submit----------> one batch per shard (idempotent on retries)
                    --wait------------> deferred to the triggerer: no worker slot held
                    --merge-----------> ticket_triage (ticket_id, category, urgency, summary,
                                        status, tokens, ...), one row per ticket

What it shows:

* a structured-output request: ``response_format`` carries a JSON schema, and the merge
  parses each answer into typed columns (``category``, ``urgency``, ``summary``); an answer
  that does not match lands as ``invalid_output`` instead of breaking the run;
* tickets that cannot become a prompt (no body) are recorded as ``rejected`` rows, never
  dropped; lines the vendor failed are ``failed`` rows with the vendor's error;
* connection ids and every choice a user makes (tables, model, prices) are parameters.

Connections: ``warehouse`` (any common-sql database: PostgreSQL, DuckDB, Snowflake...) and
``batch_api_default`` (type ``batch_api``: base URL, API key, dialect). Change the ids below
or through the environment variables named there.
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
WAREHOUSE_CONN_ID = os.environ.get("BATCH_EXAMPLES_WAREHOUSE_CONN_ID", "warehouse")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
# The trigger polls this often at first and backs off (to 10 minutes) while nothing changes.
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))

CATEGORIES = ["billing", "bug", "account", "shipping", "feature_request", "other"]
TRIAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": CATEGORIES},
        "urgency": {"type": "string", "enum": ["low", "medium", "high", "critical"]},
        "summary": {"type": "string", "description": "one sentence, at most 20 words"},
    },
    "required": ["category", "urgency", "summary"],
    "additionalProperties": False,
}
SYSTEM_PROMPT = (
    "You triage customer support tickets. Classify the ticket into one category, rate its "
    "urgency for a support team (enterprise customers and outages are more urgent), and "
    "summarise it in one sentence. Answer with JSON only."
)

with DAG(
    dag_id="support_ticket_triage",
    description="Classify support tickets with an LLM batch and merge the answers into a table",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    params={
        "source_table": Param("support_tickets", type="string", description="tickets to triage"),
        "results_table": Param("ticket_triage", type="string", description="where the answers land"),
        "model": Param("gpt-4o-mini", type="string", description="the vendor's model name"),
        "since": Param(
            "1970-01-01", type="string", format="date", description="only tickets created on or after"
        ),
    },
) as dag:
    build_requests = SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        sql=(
            "SELECT ticket_id, subject, body, customer_tier FROM {{ params.source_table }} "
            "WHERE created_at >= '{{ params.since }}' ORDER BY ticket_id"
        ),
        key_columns="ticket_id",
        # Row templates: {{ column }} is filled from each row when the JSONL is built.
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": "Customer tier: {{ customer_tier }}\nSubject: {{ subject }}\n\n{{ body }}",
            },
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
        # Counted from submission; a batch's window is 24h, leave time to notice it expired.
        timeout=int(timedelta(hours=26).total_seconds()),
        on_partial_failure="succeed",
    )

    merge = MergeBatchResultsOperator(
        task_id="merge",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        target_table="{{ params.results_table }}",
        batches=submit.output,
        output_schema=TRIAGE_SCHEMA,
        # Batch prices per million tokens, for the cost figure in the merge's summary.
        input_price_per_1m=0.075,
        output_price_per_1m=0.30,
    )

    build_requests >> submit >> wait >> merge
