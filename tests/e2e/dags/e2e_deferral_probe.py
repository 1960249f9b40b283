"""A minimal deferring DAG: proves the harness's triggerer runs a built-in trigger and the task resumes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import DAG, BaseOperator, Context


class DeferOnce(BaseOperator):
    """Defers once on a timer, then returns ``"resumed"`` from ``execute_complete``.

    :param seconds: how long the trigger waits.
    """

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> None:
        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=self.seconds)), method_name="execute_complete")

    def execute_complete(self, context: Context, event: Any = None) -> str:
        return "resumed"


with DAG("e2e_deferral_probe", schedule=None, catchup=False, tags=["e2e"]):
    DeferOnce(task_id="defer", seconds=5)
