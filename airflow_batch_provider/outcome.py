"""The one decision function: from the current batches to "still running" or a terminal outcome.

The deferrable trigger, the sensor's poke and the submit operator's synchronous wait all
call :func:`decide`, so a batch is judged the same way wherever it is watched. The
function is pure: it reads normalised ``Batch`` objects and a clock value and never does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from airflow_batch_provider.models import Batch, BatchState, RequestCounts

OutcomeStatus = Literal["running", "success", "partial", "failed", "expired", "cancelled", "timeout", "error"]

#: Every status a terminal event may carry.
TERMINAL_STATUSES: frozenset[str] = frozenset(
    {"success", "partial", "failed", "expired", "cancelled", "timeout", "error"}
)
#: The statuses that mean the batches did not complete.
FAILURE_STATUSES: frozenset[str] = frozenset({"failed", "expired", "cancelled", "timeout", "error"})

# A failed batch outranks an expired one, which outranks a cancelled one: the event names the
# most serious thing that happened, and the message lists every batch that ended badly.
_BAD_STATES: tuple[tuple[BatchState, OutcomeStatus], ...] = (
    (BatchState.FAILED, "failed"),
    (BatchState.EXPIRED, "expired"),
    (BatchState.CANCELLED, "cancelled"),
)
_MAX_ERRORS_IN_MESSAGE = 5
#: The termination reason of a batch failed by the vendor's quota (``BatchError.quota``).
QUOTA_REASON = "batch_quota_exceeded"


@dataclass(frozen=True)
class Outcome:
    """What the batches add up to right now.

    :param status: ``running`` or one of :data:`TERMINAL_STATUSES`.
    :param message: a sentence for logs and task failures naming batches, states and vendor errors.
    :param termination_reason: a stable machine-readable reason (``all_completed``,
        ``batch_failed``, ``deadline_exceeded``, ...); empty while running.
    :param batches: the batches the decision was made from.
    :param counts: request counts summed over the batches.
    """

    status: OutcomeStatus
    message: str
    termination_reason: str
    batches: tuple[Batch, ...] = field(default_factory=tuple)
    counts: RequestCounts = field(default_factory=RequestCounts)

    @property
    def is_terminal(self) -> bool:
        return self.status != "running"

    @property
    def batch_ids(self) -> list[str]:
        return [b.id for b in self.batches]

    def event(self, batch_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """The terminal event payload (see contracts.md), JSON-able.

        :param batch_ids: the ids being watched, when some could not be read (error events).
        """
        return make_event(
            status=self.status,
            batch_ids=list(batch_ids) if batch_ids is not None else self.batch_ids,
            batches=[b.summary() for b in self.batches],
            message=self.message,
            termination_reason=self.termination_reason,
            counts=self.counts,
        )


def total_counts(batches: Sequence[Batch]) -> RequestCounts:
    """Sum the request counts of several batches."""
    return RequestCounts(
        total=sum(b.request_counts.total for b in batches),
        completed=sum(b.request_counts.completed for b in batches),
        failed=sum(b.request_counts.failed for b in batches),
    )


def progress_line(batches: Sequence[Batch], elapsed_seconds: float | None = None) -> str:
    """A one-line progress report: states, completed/failed/total, percent, elapsed."""
    counts = total_counts(batches)
    states: dict[str, int] = {}
    for b in batches:
        states[b.state.value] = states.get(b.state.value, 0) + 1
    state_text = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    done = counts.completed + counts.failed
    percent = 100.0 * done / counts.total if counts.total else 0.0
    # Lines neither answered nor failed yet; a vendor that counts only at the end (every line
    # "processing" until then) shows them all here rather than a bare 0%.
    processing = f"{counts.pending} processing, " if counts.pending else ""
    text = (
        f"{len(batches)} batch(es): {state_text}; lines {counts.completed} completed, "
        f"{counts.failed} failed, {processing}{counts.total} total ({percent:.1f}%)"
    )
    if elapsed_seconds is not None:
        text += f"; elapsed {_duration(elapsed_seconds)}"
    return text


def progress_key(batches: Sequence[Batch]) -> tuple[Any, ...]:
    """What must change for a new progress line to be worth logging."""
    return tuple((b.id, b.state.value, b.request_counts.completed, b.request_counts.failed) for b in batches)


def decide(
    batches: Sequence[Batch],
    *,
    deadline: datetime | None = None,
    now: datetime | None = None,
) -> Outcome:
    """Decide whether the batches are still running or have reached a terminal outcome.

    Rules, in order: any batch failed, expired or cancelled ends the wait with that status
    (failed > expired > cancelled); all completed is ``success``, or ``partial`` when some
    lines failed, or ``failed`` when every line failed; past the deadline with work
    outstanding is ``timeout``; else ``running``.

    :param batches: the latest normalised state of every watched batch (at least one).
    :param deadline: when to give up waiting (aware datetime), or None for no deadline.
    :param now: the current time (aware); defaults to the clock, pass it for determinism.
    """
    if not batches:
        raise ValueError("decide() needs at least one batch")
    counts = total_counts(batches)
    ordered = tuple(batches)
    for state, status in _BAD_STATES:
        bad = [b for b in ordered if b.state is state]
        if bad:
            others = [b for b in ordered if b.state is not state and b.state in {s for s, _ in _BAD_STATES}]
            message = "; ".join(_describe(b) for b in bad + others)
            reason = f"batch_{status}"
            if state is BatchState.FAILED and any(e.quota for b in bad for e in b.errors):
                # The vendor's quota refused the batch (its dialect marks such errors): a quota
                # error, which resubmitting at once only repeats.
                reason = QUOTA_REASON
                message = f"a quota refused the batch: {message}"
            return Outcome(status, message, reason, ordered, counts)
    if all(b.state is BatchState.COMPLETED for b in ordered):
        if counts.failed and not counts.completed:
            # Nothing succeeded: no policy should turn that into a green task. (Vendors that never
            # report "expired", such as Doubleword, end an expired batch this way.)
            message = (
                f"{len(ordered)} batch(es) completed but all {counts.failed} line(s) failed: "
                + "; ".join(_describe(b) for b in ordered)
            )
            return Outcome("failed", message, "all_lines_failed", ordered, counts)
        if counts.failed:
            partial = [b for b in ordered if b.request_counts.failed]
            message = (
                f"{len(ordered)} batch(es) completed with {counts.failed} of {counts.total} line(s) failed: "
                + "; ".join(
                    f"batch {b.id}: {b.request_counts.failed} of {b.request_counts.total} failed"
                    for b in partial
                )
            )
            return Outcome("partial", message, "completed_with_failures", ordered, counts)
        message = (
            f"{len(ordered)} batch(es) completed: {counts.completed} of {counts.total} line(s) succeeded"
        )
        return Outcome("success", message, "all_completed", ordered, counts)
    if deadline is not None:
        current = now or datetime.now(timezone.utc)
        if current >= deadline:
            pending = [b for b in ordered if not b.is_terminal]
            message = (
                f"timed out at {deadline.isoformat()} with {len(pending)} batch(es) unfinished: "
                + ", ".join(
                    f"{b.id} ({b.state.value}, {b.request_counts.pending} line(s) pending)" for b in pending
                )
            )
            return Outcome("timeout", message, "deadline_exceeded", ordered, counts)
    return Outcome("running", progress_line(ordered), "", ordered, counts)


def make_event(
    *,
    status: str,
    batch_ids: Sequence[str],
    batches: Sequence[Mapping[str, Any]] = (),
    message: str,
    termination_reason: str,
    counts: RequestCounts | None = None,
) -> dict[str, Any]:
    """Build a terminal event payload; ``counts`` is an addition to the pinned keys."""
    counts = counts or RequestCounts()
    return {
        "status": status,
        "batch_ids": list(batch_ids),
        "batches": [dict(b) for b in batches],
        "message": message,
        "termination_reason": termination_reason,
        "counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
    }


def deadline_event_after_error(
    last: Sequence[Batch],
    batch_ids: Sequence[str],
    *,
    deadline: datetime | None,
    now: datetime,
    error: BaseException,
) -> dict[str, Any] | None:
    """The event to end with when polling failed past the deadline, else None (keep trying).

    With a last known state, that state decides; without one (a restarted trigger whose first
    polls fail) the wait still ends as ``timeout``: the deadline passed, whatever the API says.
    """
    if deadline is None or now < deadline:
        return None
    if last:
        return decide(last, deadline=deadline, now=now).event(batch_ids)
    return make_event(
        status="timeout",
        batch_ids=batch_ids,
        message=f"deadline {deadline.isoformat()} passed while the batches could not be read: {error}",
        termination_reason="deadline_exceeded",
    )


def error_event(batch_ids: Sequence[str], message: str, reason: str = "polling_error") -> dict[str, Any]:
    """The terminal event for a watch that could not be carried out (polling gave up, bad answer)."""
    return make_event(status="error", batch_ids=batch_ids, message=message, termination_reason=reason)


@dataclass(frozen=True)
class ParsedEvent:
    """A terminal event read back by an operator, checked and with its batches re-parsed."""

    status: str
    batch_ids: list[str]
    batches: list[Batch]
    message: str
    termination_reason: str
    counts: RequestCounts


def parse_event(event: Any) -> ParsedEvent:
    """Check a terminal event from the trigger; anything malformed or unknown is a ``ValueError``."""
    if not isinstance(event, Mapping):
        raise ValueError(
            f"expected a terminal batch event (a mapping), got {type(event).__name__}: {event!r}"
        )
    status = event.get("status")
    if status not in TERMINAL_STATUSES:
        raise ValueError(
            f"batch event has unknown status {status!r}; known: {', '.join(sorted(TERMINAL_STATUSES))}"
        )
    batch_ids = event.get("batch_ids")
    if not isinstance(batch_ids, list) or not all(isinstance(i, str) for i in batch_ids):
        raise ValueError(f"batch event has no list of batch_ids: {batch_ids!r}")
    raw_batches = event.get("batches") or []
    if not isinstance(raw_batches, list):
        raise ValueError("batch event 'batches' is not a list")
    batches = [Batch.model_validate(b) for b in raw_batches]
    raw_counts = event.get("counts")
    counts = (
        RequestCounts.model_validate(raw_counts) if isinstance(raw_counts, Mapping) else total_counts(batches)
    )
    return ParsedEvent(
        status=str(status),
        batch_ids=list(batch_ids),
        batches=batches,
        message=str(event.get("message") or ""),
        termination_reason=str(event.get("termination_reason") or ""),
        counts=counts,
    )


def _describe(batch: Batch) -> str:
    c = batch.request_counts
    text = f"batch {batch.id} {batch.state.value} ({c.completed} completed, {c.failed} failed of {c.total})"
    if batch.errors:
        shown = batch.errors[:_MAX_ERRORS_IN_MESSAGE]
        parts = []
        for e in shown:
            where = f" line {e.line}" if e.line is not None else ""
            parts.append(f"{e.code or 'error'}{where}: {e.message or ''}".strip())
        more = len(batch.errors) - len(shown)
        text += ": vendor errors: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
    return text


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def nothing_sent() -> dict[str, Any]:
    """The wait's outcome (shaped as every wait's return value) for a run that submitted no
    batch: an incremental build where nothing changed. Nothing to wait for; it succeeded."""
    return {
        "status": "success",
        "batch_ids": [],
        "counts": {"total": 0, "completed": 0, "failed": 0},
        "message": "no batch was submitted (the build left no line to send): nothing to wait for",
        "termination_reason": None,
        "batches": [],
    }
