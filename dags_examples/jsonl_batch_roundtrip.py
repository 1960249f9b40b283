"""Example 4 -- a hand-made batch JSONL file in, a results JSONL file out (no warehouse).

For users who only want the batch part: any valid batch input file (one request per line,
``{"custom_id", "method", "url", "body"}``) is validated with the vendor dialect's rules,
uploaded, submitted, waited for in the triggerer, and its results are written, one line per
request, to a JSONL file: ``{"custom_id", "ok", "content", "error", ...}``.

    input_path --submit (validate + upload + create)--> batch --wait (deferred)--> results.jsonl

``input_path`` and ``output_path`` accept local paths and object-store URLs (``s3://``,
``gs://``, via Airflow's ObjectStoragePath). The default input is the small FAQ file shipped
next to this DAG; the default output goes to the provider's staging root for this run.
The submit records its state beside the output, so a retried task re-attaches to the batch
it already created. Connection: ``batch_api_default`` only.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Param, dag, get_current_context, task

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.operators.submit import SubmitBatchOperator

BATCH_CONN_ID = os.environ.get("BATCH_EXAMPLES_BATCH_CONN_ID", DEFAULT_CONN_ID)
POLL_INTERVAL = float(os.environ.get("BATCH_EXAMPLES_POLL_INTERVAL", "60"))
SAMPLE_INPUT = str(Path(__file__).parent / "data" / "faq_requests.jsonl")


@dag(
    dag_id="jsonl_batch_roundtrip",
    description="Hand-made batch JSONL -> submit -> wait -> results JSONL",
    schedule=None,
    catchup=False,
    doc_md=__doc__,
    tags=["llm-batch", "example"],
    params={
        "input_path": Param(SAMPLE_INPUT, type="string", description="batch input JSONL (path or URL)"),
        "output_path": Param("", type="string", description="results JSONL; empty: the staging root"),
    },
)
def jsonl_batch_roundtrip() -> None:
    @task
    def plan_paths(params: dict[str, Any] | None = None) -> dict[str, str]:
        """Where this run keeps its submit state and writes its results."""
        from airflow_batch_provider.operators.build import default_staging_path

        run_dir = default_staging_path(get_current_context(), "roundtrip")
        output = (params or {}).get("output_path") or f"{run_dir}/results.jsonl"
        return {"state_path": run_dir, "output_path": output}

    paths = plan_paths()

    submit = SubmitBatchOperator(
        task_id="submit",
        source="{{ params.input_path }}",
        batch_conn_id=BATCH_CONN_ID,
        state_path=paths["state_path"],
        wait_for_completion=True,
        deferrable=True,
        poll_interval=POLL_INTERVAL,
        timeout=timedelta(hours=26),
        on_partial_failure="succeed",
    )

    @task
    def write_results(submission: dict[str, Any], plan: dict[str, str]) -> dict[str, Any]:
        """Stream every result line (output and error files) into one results JSONL file."""
        import orjson

        from airflow_batch_provider import staging
        from airflow_batch_provider.hooks.batch import BatchApiHook
        from airflow_batch_provider.models import ResultLine
        from airflow_batch_provider.warehouse.rows import extract_answer, extract_usage

        def record(line: ResultLine) -> dict[str, Any]:
            content, _, finish_reason = extract_answer(line.body or {}) if line.ok else (None, None, None)
            prompt, completion, _ = extract_usage(line.body or {}) if line.ok else (None, None, None)
            return {
                "custom_id": line.custom_id,
                "ok": line.ok,
                "content": content,
                "finish_reason": finish_reason,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "error": line.error.model_dump(exclude_none=True) if line.error else None,
            }

        hook = BatchApiHook(BATCH_CONN_ID)
        target = staging.resolve_path(plan["output_path"])
        counts = {"ok": 0, "error": 0}
        with staging.atomic_writer(target) as out:
            for batch_id in submission["batch_ids"]:
                for line in hook.iter_results(batch_id):
                    counts["ok" if line.ok else "error"] += 1
                    out.write(orjson.dumps(record(line)) + b"\n")
        print(f"Wrote {sum(counts.values())} result line(s) to {target}: {counts}")
        return {"output_path": str(target), **counts}

    write_results(submit.output, paths)


jsonl_batch_roundtrip()
