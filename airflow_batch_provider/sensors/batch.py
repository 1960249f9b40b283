"""BatchSensor: wait for batches to finish, deferring to the triggerer by default.

The sensor's poke, the submit operator's synchronous wait and the trigger all judge the
batches with :func:`airflow_batch_provider.outcome.decide`; :func:`apply_outcome_policy`
turns a terminal event into the task's result or failure for both operators.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

import orjson
from airflow.sdk import BaseSensorOperator, Context
from airflow.sdk.bases.sensor import PokeReturnValue
from airflow.sdk.exceptions import AirflowSensorTimeout

from airflow_batch_provider.exceptions import (
    BatchApiError,
    BatchApiQuotaError,
    BatchFailedError,
    ConfigurationError,
    PartialFailureError,
)
from airflow_batch_provider.models import Batch, to_utc
from airflow_batch_provider.outcome import (
    FAILURE_STATUSES,
    ParsedEvent,
    deadline_event_after_error,
    decide,
    error_event,
    parse_event,
    progress_key,
    progress_line,
)
from airflow_batch_provider.triggers.batch import (
    TRANSIENT_ERRORS,
    BatchTrigger,
    retry_after_of,
    until_deadline,
)

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook

PartialPolicy = Literal["succeed", "fail"]
PARTIAL_POLICIES = ("succeed", "fail")
#: XCom key under which the outcome (status, counts, batches) is pushed, also when the task fails.
OUTCOME_XCOM_KEY = "batch_outcome"


def normalise_batch_ids(value: Any) -> tuple[list[str], str | None]:
    """Read batch ids from what a user or an upstream XCom passes.

    Accepts one id, a list of ids, a JSON list in a string (a rendered template), or the
    submit operator's XCom ``{"batch_ids": [...], "submitted_at": ...}``. Returns the ids
    and the submit time when the value carried one.
    """
    submitted_at: str | None = None
    if isinstance(value, Mapping):
        submitted_at = value.get("submitted_at")
        value = value.get("batch_ids")
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = orjson.loads(text.replace("'", '"'))
            except orjson.JSONDecodeError:
                raise ConfigurationError(f"batch_ids {value!r} is not a JSON list of ids") from None
        else:
            value = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigurationError(f"batch_ids must be one or more non-empty id strings, got {value!r}")
    return list(value), submitted_at


def outcome_xcom(parsed: ParsedEvent) -> dict[str, Any]:
    """What the wait returns (and pushes as ``batch_outcome``): small, counts always present."""
    return {
        "status": parsed.status,
        "batch_ids": parsed.batch_ids,
        "counts": {
            "total": parsed.counts.total,
            "completed": parsed.counts.completed,
            "failed": parsed.counts.failed,
        },
        "message": parsed.message,
        "termination_reason": parsed.termination_reason,
        "batches": [
            {
                "id": b.id,
                "state": b.state.value,
                "output_file_id": b.output_file_id,
                "error_file_id": b.error_file_id,
                "request_counts": b.request_counts.model_dump(),
            }
            for b in parsed.batches
        ],
    }


def apply_outcome_policy(
    event: Any,
    *,
    on_partial_failure: str,
    cancel_on_timeout: bool,
    hook_factory: Callable[[], BatchApiHook],
    log: Any,
    context: Context | None = None,
) -> dict[str, Any]:
    """Turn a terminal event into the task's return value, or raise naming what went wrong.

    :param event: the trigger's payload (or a payload built by a synchronous wait).
    :param on_partial_failure: ``succeed`` or ``fail`` when every batch completed but lines failed.
    :param cancel_on_timeout: cancel unfinished batches on a ``timeout`` event.
    :param hook_factory: builds the hook used to cancel.
    :param log: where to report.
    :param context: the task context; when given, the outcome is pushed to XCom before failing.
    """
    try:
        parsed = parse_event(event)
    except ValueError as exc:
        raise BatchFailedError(f"invalid batch event: {exc}") from None
    result = outcome_xcom(parsed)
    if context is not None:
        context["ti"].xcom_push(key=OUTCOME_XCOM_KEY, value=result)
    if parsed.status == "timeout" and cancel_on_timeout:
        cancelled = cancel_batches_sync(hook_factory(), parsed.batch_ids, log=log)
        log.warning("Timed out; cancelled batch(es): %s", ", ".join(cancelled) or "none still running")
    if parsed.status in FAILURE_STATUSES:
        raise BatchFailedError(f"batch wait ended {parsed.status}: {parsed.message}")
    if parsed.status == "partial":
        if on_partial_failure == "fail":
            raise PartialFailureError(f"{parsed.message} (on_partial_failure='fail')")
        log.warning("Partial success: %s", parsed.message)
    else:
        log.info("%s", parsed.message)
    return result


def cancel_batches_sync(hook: BatchApiHook, batch_ids: Sequence[str], *, log: Any) -> list[str]:
    """Cancel every batch that is not terminal yet; a failure to cancel one is logged, not raised."""
    cancelled: list[str] = []
    for batch_id in batch_ids:
        try:
            if hook.get_batch(batch_id).is_terminal:
                continue
            hook.cancel_batch(batch_id)
            cancelled.append(batch_id)
            log.info("Cancelled batch %s", batch_id)
        except BatchApiError as exc:
            log.warning("Could not cancel batch %s: %s", batch_id, exc)
    return cancelled


def terminal_event_now(hook: BatchApiHook, batch_ids: Sequence[str], *, log: Any) -> dict[str, Any] | None:
    """The terminal event if every batch has already finished, else None (then defer).

    Looked at once before deferring: a trigger that fires within seconds of the deferral
    races Airflow's own bookkeeping of the deferring try, and a finished batch needs no
    trigger at all. A transient error here is not a failure: the trigger polls anyway.
    """
    try:
        batches = [hook.get_batch(b) for b in batch_ids]
    except BatchApiQuotaError:
        raise  # out of quota: no wait cures it (a rate limit is transient, this is not)
    except TRANSIENT_ERRORS as exc:
        log.info("Could not read the batches before deferring (%s); the trigger will", exc)
        return None
    outcome = decide(batches)
    return outcome.event(batch_ids) if outcome.is_terminal else None


def wait_sync(
    hook: BatchApiHook,
    batch_ids: Sequence[str],
    *,
    deadline: datetime | None,
    submitted_at: datetime | None = None,
    poll_interval: float = 30.0,
    max_poll_interval: float = 600.0,
    backoff: float = 1.5,
    max_consecutive_errors: int = 5,
    log: Any,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll on a worker until a terminal outcome; same rules and event shape as the trigger."""
    interval = poll_interval
    errors = 0
    last_key: tuple[Any, ...] | None = None
    last: list[Batch] = []
    while True:
        now = datetime.now(timezone.utc)
        try:
            batches = [hook.get_batch(b) for b in batch_ids]
        except BatchApiQuotaError:
            raise  # out of quota: no wait cures it (a rate limit is transient, this is not)
        except TRANSIENT_ERRORS as exc:
            # The failed poll may have taken a while: judge the deadline at the time it ended,
            # and before the error budget (past the deadline the answer is timeout, not error).
            now = datetime.now(timezone.utc)
            errors += 1
            ended = deadline_event_after_error(last, batch_ids, deadline=deadline, now=now, error=exc)
            if ended is not None:
                return ended
            if errors > max_consecutive_errors:
                return error_event(
                    batch_ids, f"gave up polling after {errors} consecutive errors; last: {exc}"
                )
            wait = until_deadline(min(max(retry_after_of(exc) or 0.0, interval), 300.0), deadline, now)
            log.warning(
                "Polling failed (%d of %d tolerated), retrying in %.1fs: %s",
                errors,
                max_consecutive_errors,
                wait,
                exc,
            )
            sleep(wait)
            continue
        errors = 0
        last = batches
        now = datetime.now(timezone.utc)
        outcome = decide(batches, deadline=deadline, now=now)
        if outcome.is_terminal:
            return outcome.event(batch_ids)
        key = progress_key(batches)
        if key != last_key:
            elapsed = (now - submitted_at).total_seconds() if submitted_at else None
            log.info("%s", progress_line(batches, elapsed))
            last_key = key
            interval = poll_interval
        else:
            interval = min(interval * backoff, max_poll_interval)
        sleep(until_deadline(interval, deadline, now))


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

    def __init__(
        self,
        *,
        batch_ids: Any,
        batch_conn_id: str = "batch_api_default",
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
        if on_partial_failure not in PARTIAL_POLICIES:
            raise ConfigurationError(
                f"on_partial_failure must be one of {PARTIAL_POLICIES}, got {on_partial_failure!r}"
            )
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
        ids, carried = normalise_batch_ids(self.batch_ids)
        self._ids = ids
        started = to_utc(self.submitted_at or carried) or datetime.now(timezone.utc)
        return ids, started

    def execute(self, context: Context) -> Any:
        ids, started = self._resolve()
        if not self.deferrable:
            try:
                return super().execute(context)
            except AirflowSensorTimeout:
                if self.cancel_on_timeout:
                    cancel_batches_sync(self.hook(), ids, log=self.log)
                raise
        done = terminal_event_now(self.hook(), ids, log=self.log)
        if done is not None:
            return self.execute_complete(context, done)
        self.log.info("Deferring until batch(es) %s finish", ", ".join(ids))
        self.defer(
            trigger=BatchTrigger(
                batch_ids=ids,
                batch_conn_id=self.batch_conn_id,
                dialect=self.dialect,
                submitted_at=started.isoformat(),
                timeout=float(self.timeout),
                poll_interval=self.poll_interval,
                max_poll_interval=self.max_poll_interval,
                max_consecutive_errors=self.max_consecutive_errors,
                cancel_on_kill=self.cancel_on_kill,
            ),
            method_name="execute_complete",
        )

    def poke(self, context: Context) -> bool | PokeReturnValue:
        ids = self._ids or self._resolve()[0]
        hook = self.hook()
        try:
            batches = [hook.get_batch(b) for b in ids]
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
            cancel_batches_sync(self.hook(), self._ids, log=self.log)
