"""A task process that stops dead in a crash window: ``python -m tests.reliability.crash_child SPEC``.

SPEC (JSON) names the step and where to stop:

* ``{"step": "submit", "source": ..., "run_id": ..., "kill_after_create": N}``: run
  SubmitBatchOperator; right after the N-th batch (0-based) is created at the server and
  *before* its id is written to the state file, announce ``KILL-POINT`` and hang.
* ``{"step": "merge", "batches": ..., "manifest_path": ..., "table": ..., "conn_id": ...,
  "kill_at": "mid_load" | "before_commit"}``: run MergeBatchResultsOperator and hang half way
  through streaming results into the database, or after the upsert ran but before commit.

The parent test reads ``KILL-POINT`` from stdout and sends SIGKILL, so nothing in this
process (no ``finally``, no ``on_kill``, no rollback) runs: the window is as real as a lost worker.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import orjson


def hang(note: str) -> None:
    print(f"KILL-POINT {note}", flush=True)
    time.sleep(600)
    raise SystemExit("the parent never killed this process")


def run_submit(spec: dict[str, Any]) -> None:
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.operators.submit import SubmitBatchOperator
    from tests.fixtures.airflow import RecordingTaskInstance

    original = BatchApiHook.create_batch
    created: list[str] = []

    def create_then_die(self: BatchApiHook, **kwargs: Any) -> Any:
        batch = original(self, **kwargs)
        created.append(batch.id)
        if len(created) - 1 == spec["kill_after_create"]:
            hang(batch.id)
        return batch

    BatchApiHook.create_batch = create_then_die  # type: ignore[method-assign]
    op = SubmitBatchOperator(task_id="submit", source=spec["source"], wait_for_completion=False)
    op.execute({"ti": RecordingTaskInstance(spec["dag_id"], "submit", spec["run_id"])})  # type: ignore[arg-type]


def run_merge(spec: dict[str, Any]) -> None:
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
    from airflow_batch_provider.warehouse.write import ResultsWriter

    if spec["kill_at"] == "mid_load":
        original = BatchApiHook.iter_results
        seen = [0]  # result lines over every batch read so far

        def half_then_die(self: BatchApiHook, batch: Any, **kwargs: Any) -> Iterator[Any]:
            for line in original(self, batch, **kwargs):
                if seen[0] == spec["lines_before_kill"]:
                    hang(f"after {seen[0]} result lines")
                seen[0] += 1
                yield line

        BatchApiHook.iter_results = half_then_die  # type: ignore[method-assign]
    else:
        # _orphans runs after the keyed INSERT ... ON CONFLICT and before the commit.
        def die(self: ResultsWriter, *args: Any, **kwargs: Any) -> None:
            hang("upserted, not committed")

        ResultsWriter._orphans = die  # type: ignore[method-assign]
    op = MergeBatchResultsOperator(
        task_id="merge",
        target_table=spec["table"],
        conn_id=spec["conn_id"],
        batches=spec["batches"],
        manifest_path=spec["manifest_path"],
    )
    op.execute({})  # type: ignore[arg-type]


def main() -> None:
    spec = orjson.loads(sys.argv[1])
    {"submit": run_submit, "merge": run_merge}[spec["step"]](spec)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
