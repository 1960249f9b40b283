"""Example 5 -- the retry loop: merge, resubmit what failed, merge again, up to MAX_ATTEMPTS.

Vendors fail some lines of a completed batch (rate limits inside the batch, timeouts, 5xx),
and a batch can expire or be cancelled. Instead of re-running the whole job, the merge with
``resubmit_failed=True`` lands every answer it has and writes a new shard set (``attempt-2/``
beside the first manifest) holding only the lines whose status is failed, expired,
cancelled or missing. The next attempt submits exactly those lines and merges them into the
same table, upserting the rows by ticket id; after ``MAX_ATTEMPTS`` whatever still failed
stays in the table as ``failed`` with the vendor's error, and the summary says how many.

    build -> submit_1 -> merge_1 -> [anything to retry?] -> submit_2 -> merge_2 -> [..] -> submit_3 -> merge_3
                                                                                        \\-> summary

With ``BATCH_EXAMPLES_FALLBACK_CONN_ID`` set (a batch connection of any vendor dialect), the
retries go to that second vendor instead (``fallback_conn_id``, and ``fallback_model`` for its
name of the model): each merge's XCom names the connection of the next attempt
(``resubmit_conn_id``), which the next submit and merge take as their ``batch_conn_id``, and
every results row records the ``vendor``, ``batch_conn_id`` and ``model`` that answered it.

What it shows: ``resubmit_failed`` / ``max_attempts`` on the merge, ``@task.short_circuit``
to stop the loop as soon as nothing is left to retry (the remaining attempts are skipped,
not failed), ``wait_for_completion=True`` on the submit (submit and deferred wait in one
task), and a summary task that reads the final table. Connections as in example 1.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, BaseHook, Param, task

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator

WAREHOUSE_CONN_ID = os.environ.get("BATCH_EXAMPLES_WAREHOUSE_CONN_ID", "warehouse")
BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
# Optional: where attempt 2 and later go (None: the same connection as attempt 1).
FALLBACK_CONN_ID = os.environ.get("BATCH_EXAMPLES_FALLBACK_CONN_ID") or None
FALLBACK_MODEL = os.environ.get("BATCH_EXAMPLES_FALLBACK_MODEL") or None
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))
# The DAG's shape depends on it, so it is a constant rather than a run parameter.
MAX_ATTEMPTS = 3

with DAG(
    dag_id="triage_with_retries",
    description="Ticket triage that resubmits failed lines until they succeed or attempts run out",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example"],
    params={
        "source_table": Param("support_tickets", type="string"),
        "results_table": Param("ticket_triage_retried", type="string"),
        "model": Param("gpt-4o-mini", type="string"),
    },
) as dag:
    build_requests = SqlToBatchJsonlOperator(
        task_id="build_requests",
        conn_id=WAREHOUSE_CONN_ID,
        batch_conn_id=BATCH_CONN_ID,
        sql="SELECT ticket_id, subject, body FROM {{ params.source_table }}",
        key_columns="ticket_id",
        messages=[
            {"role": "system", "content": "Summarise the support ticket in one sentence."},
            {"role": "user", "content": "Subject: {{ subject }}\n\n{{ body }}"},
        ],
        body={"temperature": 0, "max_tokens": 80},
        model="{{ params.model }}",
    )

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def anything_to_retry(summary: dict[str, Any]) -> bool:
        """Continue with the next attempt only if the last merge wrote lines to resubmit."""
        print(
            f"attempt {summary['attempt']}: {summary['counts']}; "
            f"{summary['resubmit_lines']} line(s) to resubmit"
        )
        return bool(summary["resubmit"])

    source: Any = build_requests.output
    merges = []
    upstream: Any = build_requests
    batch_conn_id = BATCH_CONN_ID
    for attempt in range(1, MAX_ATTEMPTS + 1):
        submit = SubmitBatchOperator(
            task_id=f"submit_{attempt}",
            source=source,
            batch_conn_id=batch_conn_id,
            wait_for_completion=True,
            deferrable=True,
            poll_interval=POLL_INTERVAL,
            timeout=timedelta(hours=26),
            # Failed lines are this DAG's business: the batch itself completed.
            on_partial_failure="succeed",
        )
        merge = MergeBatchResultsOperator(
            task_id=f"merge_{attempt}",
            conn_id=WAREHOUSE_CONN_ID,
            batch_conn_id=batch_conn_id,
            target_table="{{ params.results_table }}",
            batches=submit.output,
            resubmit_failed=True,
            max_attempts=MAX_ATTEMPTS,
            fallback_conn_id=FALLBACK_CONN_ID,
            fallback_model=FALLBACK_MODEL,
        )
        upstream >> submit >> merge
        merges.append(merge)
        if attempt < MAX_ATTEMPTS:
            gate = anything_to_retry.override(task_id=f"retry_after_{attempt}")(merge.output)
            upstream = gate
            # The next attempt reads the manifest the merge wrote for the failed lines.
            source = f"{{{{ ti.xcom_pull(task_ids='merge_{attempt}')['resubmit_manifest_path'] }}}}"
            # ... through the connection it names (the fallback's, when one is set).
            batch_conn_id = f"{{{{ ti.xcom_pull(task_ids='merge_{attempt}')['resubmit_conn_id'] }}}}"

    @task(trigger_rule="none_failed")
    def summary(params: dict[str, Any] | None = None) -> dict[str, int]:
        """Rows per status in the final table (every input ticket has exactly one row)."""
        table = (params or {})["results_table"]
        hook = BaseHook.get_connection(WAREHOUSE_CONN_ID).get_hook()
        counts = {
            str(s): int(n)
            for s, n in hook.get_records(f"SELECT status, COUNT(*) FROM {table} GROUP BY status")
        }
        print(f"{table}: {counts}")
        return counts

    merges >> summary()
