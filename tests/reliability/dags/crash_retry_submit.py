"""A submit whose first try dies between a batch create and recording its id; Airflow retries it.

Configured by environment variables so one file serves every mode the test runs under
``airflow dags test`` (the batch connection comes from ``AIRFLOW_CONN_*`` the test sets):

* ``CRASH_DAG_ID``: the DAG id (one per mode, so runs sharing a metadata database stay apart).
* ``CRASH_SOURCE``: the manifest to submit.
* ``CRASH_STATE_PATH``: the submit's ``state_path`` (templated; ``{{ ti.try_number }}`` in it gives
  each try a directory of its own, as a worker with its own disk would have).
* ``CRASH_AFTER_CREATE``: the first try dies right after this (0-based) create, before the id is
  recorded; later tries run through.
* ``CRASH_OLDER_AIRFLOW``: ``1`` hides ``task_state_store`` from the task, as Airflow before 3.3 has none.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import DAG

from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.operators.submit import SubmitBatchOperator


class WorkerLost(Exception):
    """Stands in for the worker dying between the batch create and recording its id."""


class CrashingHook(BatchApiHook):
    """A hook whose ``crash_after``-th create (0-based) returns a batch and then dies."""

    crash_after: int | None = None
    creates = 0

    def create_batch(self, **kwargs: Any) -> Any:
        batch = super().create_batch(**kwargs)
        self.creates += 1
        if self.crash_after is not None and self.creates - 1 == self.crash_after:
            print(f"CRASH-WINDOW created {batch.id}, dying before it is recorded", flush=True)
            raise WorkerLost(f"worker lost right after creating {batch.id}")
        return batch


class CrashOnFirstTrySubmit(SubmitBatchOperator):
    """The submit, dying in the crash window on its first try (and blind to the store if asked)."""

    crash_after: int | None = None

    def execute(self, context: Any) -> Any:
        self.crash_after = int(os.environ["CRASH_AFTER_CREATE"]) if context["ti"].try_number == 1 else None
        if os.environ.get("CRASH_OLDER_AIRFLOW") == "1":
            context = {k: v for k, v in context.items() if k != "task_state_store"}
        return super().execute(context)

    def hook(self) -> CrashingHook:
        hook = CrashingHook(self.batch_conn_id, dialect=self.dialect)
        hook.crash_after = self.crash_after
        return hook


with DAG(
    os.environ.get("CRASH_DAG_ID", "crash_retry_submit"),
    start_date=pendulum.datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    default_args={"retries": 1, "retry_delay": timedelta(0)},
):
    CrashOnFirstTrySubmit(
        task_id="submit",
        source=os.environ.get("CRASH_SOURCE", "unset"),
        state_path=os.environ.get("CRASH_STATE_PATH"),
        wait_for_completion=False,
    )
