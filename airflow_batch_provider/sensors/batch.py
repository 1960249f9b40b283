"""BatchSensor: wait for batches to finish, deferring to the triggerer by default.

The waiting itself (the poll loop, the outcome policy, cancelling, reading batch ids) lives
in :mod:`airflow_batch_provider.waiting`, shared with the trigger and the submit operator.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, Context
from airflow.sdk.bases.sensor import PokeReturnValue
from airflow.sdk.exceptions import AirflowSensorTimeout

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.exceptions import BatchApiQuotaError
from airflow_batch_provider.links import batch_page_links, push_batch_ids
from airflow_batch_provider.models import to_utc
from airflow_batch_provider.outcome import decide, nothing_sent, progress_line
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.waiting import (
    TRANSIENT_ERRORS,
    PartialPolicy,
    apply_outcome_policy,
    batch_ids_and_deadline,
    cancel_batches,
    check_partial_policy,
    read_batches,
    terminal_event_now,
)

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook


class BatchSensor(BaseSensorOperator):
    """Wait until batches complete; defers to :class:`BatchTrigger` unless ``deferrable=False``.

    The task succeeds when every batch completed (with failed lines, only if
    ``on_partial_failure="succeed"``) and fails naming the batch, its status and the vendor's
    errors otherwise. The outcome with its counts is returned and also pushed as XCom
    ``batch_outcome`` before a failure is raised.

    :param batch_ids: one id, a list, or the submit operator's XCom (templated).
    :param batch_conn_id: the ``batch_api`` connection (templated).
    :param dialect: dialect name overriding the connection's.
    :param submitted_at: when the batches were submitted (templated); the sensor's ``timeout``
        counts from here. Taken from the submit XCom when ``batch_ids`` is that XCom;
        otherwise the time the sensor first ran.
    :param deferrable: wait in the triggerer (default True); False uses poke/reschedule.
    :param poll_interval: seconds between status reads (the deferrable trigger backs off from it).
    :param max_poll_interval: longest wait between reads in the trigger.
    :param max_consecutive_errors: transient API errors tolerated in a row.
    :param on_partial_failure: ``succeed`` (default) or ``fail`` when lines failed in a completed batch.
    :param cancel_on_timeout: cancel the unfinished batches when the sensor times out.
    :param cancel_on_kill: cancel the batches when the task is killed.
    """

    template_fields: Sequence[str] = ("batch_ids", "batch_conn_id", "submitted_at")
    ui_color = "#e8f0fe"
    # "Batch 1".. "Batch 4": each batch's page at the vendor or on the local server (see links.py).
    operator_extra_links = batch_page_links()

    def __init__(
        self,
        *,
        batch_ids: Any,
        batch_conn_id: str = DEFAULT_CONN_ID,
        dialect: str | None = None,
        submitted_at: str | None = None,
        deferrable: bool = True,
        poll_interval: float = 30.0,
        max_poll_interval: float = 600.0,
        max_consecutive_errors: int = 5,
        on_partial_failure: PartialPolicy = "succeed",
        cancel_on_timeout: bool = False,
        cancel_on_kill: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("poke_interval", poll_interval)
        super().__init__(**kwargs)
        check_partial_policy(on_partial_failure)
        self.batch_ids = batch_ids
        self.batch_conn_id = batch_conn_id
        self.dialect = dialect
        self.submitted_at = submitted_at
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.max_consecutive_errors = max_consecutive_errors
        self.on_partial_failure = on_partial_failure
        self.cancel_on_timeout = cancel_on_timeout
        self.cancel_on_kill = cancel_on_kill
        self._ids: list[str] = []

    def hook(self) -> BatchApiHook:
        from airflow_batch_provider.hooks.batch import BatchApiHook

        return BatchApiHook(self.batch_conn_id, dialect=self.dialect)

    def _resolve(self) -> tuple[list[str], datetime]:
        ids, carried = batch_ids_and_deadline(self.batch_ids)
        self._ids = ids
        started = to_utc(self.submitted_at or carried) or datetime.now(timezone.utc)
        return ids, started

    def execute(self, context: Context) -> Any:
        if _submitted_nothing(self.batch_ids):
            # The submit of an incremental run where nothing changed: no batch to wait for.
            outcome = nothing_sent()
            self.log.info("%s", outcome["message"])
            push_batch_ids(context, [])
            return outcome
        ids, started = self._resolve()
        push_batch_ids(context, ids)
        if not self.deferrable:
            try:
                return super().execute(context)
            except AirflowSensorTimeout:
                if self.cancel_on_timeout:
                    cancel_batches(self.hook(), ids, log=self.log)
                raise
        done = terminal_event_now(self.hook(), ids, log=self.log)
        if done is not None:
            return self.execute_complete(context, done)
        self.log.info("Deferring until batch(es) %s finish", ", ".join(ids))
        self.defer(
            trigger=BatchTrigger.for_task(
                self, ids, submitted_at=started.isoformat(), timeout=float(self.timeout)
            ),
            method_name="execute_complete",
        )

    def poke(self, context: Context) -> bool | PokeReturnValue:
        ids = self._ids or self._resolve()[0]
        hook = self.hook()
        try:
            batches = read_batches(hook, ids)
        except BatchApiQuotaError:
            raise  # out of quota: no wait cures it (a rate limit is transient, this is not)
        except TRANSIENT_ERRORS as exc:
            # A transient error is one more poke; the sensor's timeout bounds how long we keep trying.
            self.log.warning("Reading batch status failed, will poke again: %s", exc)
            return False
        outcome = decide(batches)
        if not outcome.is_terminal:
            self.log.info("%s", progress_line(batches))
            return False
        result = apply_outcome_policy(
            outcome.event(ids),
            on_partial_failure=self.on_partial_failure,
            cancel_on_timeout=self.cancel_on_timeout,
            hook_factory=self.hook,
            log=self.log,
            context=context,
        )
        return PokeReturnValue(is_done=True, xcom_value=result)

    def execute_complete(self, context: Context, event: Any = None) -> dict[str, Any]:
        """Resume from the trigger: check the event and apply the outcome policy."""
        return apply_outcome_policy(
            event,
            on_partial_failure=self.on_partial_failure,
            cancel_on_timeout=self.cancel_on_timeout,
            hook_factory=self.hook,
            log=self.log,
            context=context,
        )

    def on_kill(self) -> None:
        if self.cancel_on_kill and self._ids:
            cancel_batches(self.hook(), self._ids, log=self.log)


def _submitted_nothing(value: Any) -> bool:
    """Whether ``value`` is the XCom of a submit that created no batch (``batch_ids: []``)."""
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            return False
    return isinstance(value, Mapping) and value.get("batch_ids") == [] and "manifest_path" in value
