"""Waiting for batches: the one home of the poll loop, below the sensor, the trigger and submit.

:class:`PollLoop` holds every decision of a watch and does no I/O (it is fed what a poll
returned, or the error it raised, and the time): the interval and its backoff, the error
budget, the Retry-After cap and the deadline. Two drivers feed it, side by side and named
the way the hook names its pairs: :func:`wait_batches` on a worker (sync) and
:func:`await_batches` in the triggerer (async all the way down). The terminal event itself is
judged by :func:`airflow_batch_provider.outcome.decide`; :func:`apply_outcome_policy` turns it
into a task's result or failure for the sensor and the submit operator alike.

The module imports no Airflow at run time: operators hand it their hook, logger and context.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx
import orjson

from airflow_batch_provider.exceptions import (
    BatchApiConnectionError,
    BatchApiError,
    BatchApiQuotaError,
    BatchApiRateLimitError,
    BatchApiResponseError,
    BatchApiServerError,
    BatchFailedError,
    BatchProviderError,
    BatchQuotaExceededError,
    ConfigurationError,
    PartialFailureError,
)
from airflow_batch_provider.ids import check_id
from airflow_batch_provider.models import Batch, to_utc
from airflow_batch_provider.outcome import (
    FAILURE_STATUSES,
    QUOTA_REASON,
    ParsedEvent,
    deadline_event_after_error,
    decide,
    error_event,
    parse_event,
    progress_key,
    progress_line,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_batch_provider.hooks.batch import BatchApiHook

# Errors worth another poll: the vendor or the network may recover. An answer that does not
# parse is one of them (BatchApiResponseError), an unknown batch status included
# (UnknownBatchStatusError): a vendor's new status is often a brief state the next poll no
# longer shows, and one that stays ends the watch as error once the error budget is spent.
# Anything else (401, 404, 400) will not get better by asking again: it ends the watch at once.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    BatchApiRateLimitError,
    BatchApiServerError,
    BatchApiConnectionError,
    BatchApiResponseError,
    httpx.TransportError,
    asyncio.TimeoutError,
)
# What a poll may raise that the loop judges (anything else propagates as a bug would).
POLL_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, BatchProviderError, ValueError)
# A Retry-After longer than this is capped: a watch must not go silent for an hour on one header.
MAX_RETRY_AFTER = 300.0
# How long cancelling one batch may take from the triggerer (its on_kill is bounded too).
CANCEL_TIMEOUT = 20.0
# A poll in flight may run past the deadline by one poll interval, and never by less than this
# (a poll needs a moment even when the interval is tiny or the deadline has already passed).
MIN_POLL_GRACE = 1.0
# Below this, a wake-up just after the deadline (so the deadline is judged, not overslept).
DEADLINE_SLACK = 0.01

PartialPolicy = Literal["succeed", "fail"]
PARTIAL_POLICIES = ("succeed", "fail")
#: XCom key under which the outcome (status, counts, batches) is pushed, also when the task fails.
OUTCOME_XCOM_KEY = "batch_outcome"


class WaitingTask(Protocol):
    """The wait settings a task that watches batches carries (the sensor and submit both do)."""

    batch_conn_id: str
    dialect: str | None
    poll_interval: float
    max_poll_interval: float
    max_consecutive_errors: int
    cancel_on_kill: bool


# ---- clock arithmetic (pure) ---------------------------------------------------------------
def deadline_from(
    submitted_at: str | float | datetime | None, timeout: float | timedelta | None
) -> datetime | None:
    """The absolute deadline ``submitted_at + timeout`` (aware UTC), or None when either is missing."""
    start = to_utc(submitted_at)
    if start is None or timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return start + timedelta(seconds=seconds)


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds the server asked us to wait (``Retry-After``), when the error carries a usable one."""
    value = getattr(exc, "retry_after", None)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return max(float(value), 0.0)


def poll_budget(deadline: datetime | None, poll_interval: float, now: datetime) -> float | None:
    """How long one poll may take: until the deadline plus one poll interval (None: no deadline)."""
    if deadline is None:
        return None
    return max((deadline - now).total_seconds(), 0.0) + max(poll_interval, MIN_POLL_GRACE)


def until_deadline(wait: float, deadline: datetime | None, now: datetime) -> float:
    """``wait``, shortened to wake just after the deadline rather than oversleep it."""
    if deadline is None:
        return wait
    return min(wait, max((deadline - now).total_seconds(), 0.0) + DEADLINE_SLACK)


# ---- the loop's decisions (no I/O, no clock) -----------------------------------------------
@dataclass(frozen=True)
class Step:
    """What a watch does next.

    :param event: the terminal event to end with, or None to poll again after ``sleep``.
    :param sleep: seconds to wait before the next poll.
    :param info: a line worth logging at INFO (progress, or how the watch ended).
    :param warning: a line worth logging at WARNING (a tolerated polling error).
    :param fatal: the poll raised an error no retry cures (quota, auth, not found): a worker
        fails with that error itself; the triggerer ends with ``event`` (an ``error`` event).
    """

    event: dict[str, Any] | None = None
    sleep: float = 0.0
    info: str | None = None
    warning: str | None = None
    fatal: bool = False


@dataclass
class PollLoop:
    """The decisions of one watch: fed each poll's batches or error and the time, says what next.

    :param batch_ids: the batches watched.
    :param deadline: when the watch gives up with ``timeout`` (aware), or None.
    :param submitted_at: when the batches were submitted; progress lines report time since.
    :param poll_interval: seconds between polls while something changes.
    :param max_poll_interval: the longest wait once nothing changes.
    :param backoff: factor applied to the interval after a poll that saw no change.
    :param max_consecutive_errors: transient polling errors tolerated in a row.
    """

    batch_ids: Sequence[str]
    deadline: datetime | None = None
    submitted_at: datetime | None = None
    poll_interval: float = 30.0
    max_poll_interval: float = 600.0
    backoff: float = 1.5
    max_consecutive_errors: int = 5
    interval: float = field(init=False)
    errors: int = field(init=False, default=0)
    last: Sequence[Batch] = field(init=False, default=())
    last_key: tuple[Any, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.interval = self.poll_interval

    def budget(self, now: datetime) -> float | None:
        """How long the next poll may take before it is given up (None: as long as it needs)."""
        return poll_budget(self.deadline, self.poll_interval, now)

    def polled(self, batches: Sequence[Batch], now: datetime) -> Step:
        """A poll read every batch at ``now``."""
        self.errors = 0
        self.last = batches
        key = progress_key(batches)
        if key == self.last_key and (self.deadline is None or now < self.deadline):
            # The same states and counts as the last poll, which decided "running": only the
            # deadline could change that. Thousands of triggers polling unchanged batches each
            # interval skip the outcome's sums and its progress line.
            self.interval = min(self.interval * self.backoff, self.max_poll_interval)
            return Step(sleep=until_deadline(self.interval, self.deadline, now))
        outcome = decide(batches, deadline=self.deadline, now=now)
        if outcome.is_terminal:
            return Step(
                event=outcome.event(self.batch_ids),
                info=f"Batch watch ended ({outcome.status}): {outcome.message}",
            )
        info = None
        if key != self.last_key:
            elapsed = (now - self.submitted_at).total_seconds() if self.submitted_at else None
            info = progress_line(batches, elapsed)
            self.last_key = key
            self.interval = self.poll_interval
        else:
            self.interval = min(self.interval * self.backoff, self.max_poll_interval)
        # Wake at the deadline rather than oversleeping it by a long backoff.
        return Step(sleep=until_deadline(self.interval, self.deadline, now), info=info)

    def failed(self, exc: BaseException, now: datetime) -> Step:
        """A poll that ended at ``now`` raised ``exc`` (one of :data:`POLL_ERRORS`)."""
        ids = ", ".join(self.batch_ids)
        if isinstance(exc, BatchApiQuotaError):
            # Out of quota: no wait refills it (checked first: it is also a rate limit).
            return Step(event=error_event(self.batch_ids, f"cannot poll batch(es): {exc}"), fatal=True)
        if not isinstance(exc, TRANSIENT_ERRORS):
            # Not transient (auth, not found, unreadable config): stop now.
            message = f"cannot poll batch(es) {ids}: {type(exc).__name__}: {exc}"
            return Step(event=error_event(self.batch_ids, message), fatal=True)
        self.errors += 1
        # The deadline is judged when the poll ended, and before the error budget: past the
        # deadline the answer is timeout, not error.
        ended = deadline_event_after_error(
            self.last, self.batch_ids, deadline=self.deadline, now=now, error=exc
        )
        if ended is not None:
            return Step(event=ended)
        if self.errors > self.max_consecutive_errors:
            message = f"gave up polling batch(es) {ids} after {self.errors} consecutive errors; last: {exc}"
            return Step(event=error_event(self.batch_ids, message))
        wait = min(max(retry_after_of(exc) or 0.0, self.interval), MAX_RETRY_AFTER)
        wait = until_deadline(wait, self.deadline, now)
        warning = (
            f"Polling batch(es) failed ({self.errors} of {self.max_consecutive_errors} tolerated "
            f"in a row), retrying in {wait:.1f}s: {exc}"
        )
        return Step(sleep=wait, warning=warning)


def _report(step: Step, log: Any) -> None:
    if step.info is not None:
        log.info("%s", step.info)
    if step.warning is not None:
        log.warning("%s", step.warning)


def _now() -> datetime:
    return datetime.now(timezone.utc)


# ---- reading the batches: sync / async ------------------------------------------------------
def read_batches(hook: BatchApiHook, batch_ids: Sequence[str]) -> list[Batch]:
    """Read every batch, one after the other."""
    return [hook.get_batch(b) for b in batch_ids]


async def aread_batches(hook: BatchApiHook, batch_ids: Sequence[str]) -> list[Batch]:
    """Read every batch concurrently; the first error is raised."""
    results = await asyncio.gather(*(hook.aget_batch(b) for b in batch_ids), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, Batch)]


# ---- the two drivers ------------------------------------------------------------------------
def wait_batches(
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
    """Poll on a worker until a terminal outcome; returns the event (same shape as the trigger's).

    An error no retry cures (quota, auth, not found) is raised as it came.
    """
    loop = PollLoop(
        batch_ids, deadline, submitted_at, poll_interval, max_poll_interval, backoff, max_consecutive_errors
    )
    while True:
        try:
            batches = read_batches(hook, batch_ids)
        except POLL_ERRORS as exc:
            step = loop.failed(exc, _now())
            if step.fatal:
                raise
        else:
            step = loop.polled(batches, _now())
        _report(step, log)
        if step.event is not None:
            return step.event
        sleep(step.sleep)


async def await_batches(
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
    read: Callable[[], Awaitable[list[Batch]]] | None = None,
    read_after: Callable[[float], Awaitable[list[Batch]]] | None = None,
) -> dict[str, Any]:
    """Poll from the event loop until a terminal outcome; returns the event, never raises a poll error.

    A poll in flight is given up once its budget (the deadline plus one poll interval) is spent,
    so a slow or dripping vendor cannot hold the watch past its deadline.

    :param read: reads the batches (default: :func:`aread_batches` with ``hook``).
    :param read_after: reads the batches after the first poll, given the seconds the loop decided
        to wait (default: sleep that long, then ``read``). Shared polling passes one that wakes the
        watch only when its batches change, an error comes, or the deadline is near.
    """
    loop = PollLoop(
        batch_ids, deadline, submitted_at, poll_interval, max_poll_interval, backoff, max_consecutive_errors
    )
    poll = read or (lambda: aread_batches(hook, batch_ids))
    step: Step | None = None
    while True:
        try:
            # The budget covers the wait too when ``read_after`` waits: it ends by the deadline.
            async with asyncio.timeout(loop.budget(_now())):
                batches = await (poll() if step is None or read_after is None else read_after(step.sleep))
        except POLL_ERRORS as exc:
            step = loop.failed(exc, _now())
        else:
            step = loop.polled(batches, _now())
        _report(step, log)
        if step.event is not None:
            return step.event
        if read_after is None:
            await asyncio.sleep(step.sleep)


def terminal_event_now(hook: BatchApiHook, batch_ids: Sequence[str], *, log: Any) -> dict[str, Any] | None:
    """The terminal event if every batch has already finished, else None (then defer).

    Looked at once before deferring: a trigger that fires within seconds of the deferral
    races Airflow's own bookkeeping of the deferring try, and a finished batch needs no
    trigger at all. A transient error here is not a failure: the trigger polls anyway.
    """
    try:
        batches = read_batches(hook, batch_ids)
    except BatchApiQuotaError:
        raise  # out of quota: no wait cures it (a rate limit is transient, this is not)
    except TRANSIENT_ERRORS as exc:
        log.info("Could not read the batches before deferring (%s); the trigger will", exc)
        return None
    outcome = decide(batches)
    return outcome.event(batch_ids) if outcome.is_terminal else None


# ---- cancelling: sync / async ---------------------------------------------------------------
def cancel_batches(hook: BatchApiHook, batch_ids: Sequence[str], *, log: Any) -> list[str]:
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


async def acancel_batches(hook: BatchApiHook, batch_ids: Sequence[str], *, log: Any) -> list[str]:
    """Cancel every batch that is not already terminal; returns the ids a cancel was sent for."""

    async def one(batch_id: str) -> str | None:
        try:
            batch = await asyncio.wait_for(hook.aget_batch(batch_id), CANCEL_TIMEOUT)
            if batch.is_terminal:
                return None
            await asyncio.wait_for(hook.acancel_batch(batch_id), CANCEL_TIMEOUT)
            log.info("Cancelled batch %s", batch_id)
            return batch_id
        except (BatchApiError, httpx.HTTPError, asyncio.TimeoutError) as exc:
            log.warning("Could not cancel batch %s: %s", batch_id, exc)
            return None

    done = await asyncio.gather(*(one(b) for b in batch_ids))
    return [b for b in done if b]


# ---- what operators hand in and get back ----------------------------------------------------
def batch_ids_and_deadline(value: Any) -> tuple[list[str], str | None]:
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
    # ``batch_ids`` may come from ``dag_run.conf``: anyone who can trigger a run chooses it, and
    # each id is placed in a URL sent with the key. Refused here, before any call.
    return [check_id(v, "batch_ids") for v in value], submitted_at


def check_partial_policy(on_partial_failure: str) -> None:
    """Refuse an ``on_partial_failure`` value that is not one of :data:`PARTIAL_POLICIES`."""
    if on_partial_failure not in PARTIAL_POLICIES:
        raise ConfigurationError(
            f"on_partial_failure must be one of {PARTIAL_POLICIES}, got {on_partial_failure!r}"
        )


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
        cancelled = cancel_batches(hook_factory(), parsed.batch_ids, log=log)
        log.warning("Timed out; cancelled batch(es): %s", ", ".join(cancelled) or "none still running")
    if parsed.termination_reason == QUOTA_REASON:
        raise BatchQuotaExceededError(
            f"batch wait ended {parsed.status}: {parsed.message} (a quota error: wait for running "
            "batches to finish or raise the quota before submitting again)"
        )
    if parsed.status in FAILURE_STATUSES:
        raise BatchFailedError(f"batch wait ended {parsed.status}: {parsed.message}")
    if parsed.status == "partial":
        if on_partial_failure == "fail":
            raise PartialFailureError(f"{parsed.message} (on_partial_failure='fail')")
        log.warning("Partial success: %s", parsed.message)
    else:
        log.info("%s", parsed.message)
    return result
