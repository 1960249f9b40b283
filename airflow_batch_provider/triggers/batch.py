"""BatchTrigger: watch one or many batches from the triggerer until one terminal outcome.

Async all the way down: the batches are read with the hook's async httpx client, never a
sync call or a thread. The trigger's kwargs are primitives only (ids, connection id, clock
values, intervals) and never a secret; the hook reads the connection itself. The deadline
is an absolute time computed from the submit time, so a triggerer restart (which rebuilds
the trigger from its kwargs) keeps it instead of starting the clock again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
import weakref
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import httpx
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_batch_provider.exceptions import (
    BatchApiConnectionError,
    BatchApiError,
    BatchApiQuotaError,
    BatchApiRateLimitError,
    BatchApiResponseError,
    BatchApiServerError,
    BatchProviderError,
)
from airflow_batch_provider.hooks._http import shared_transport
from airflow_batch_provider.models import Batch, to_utc
from airflow_batch_provider.outcome import (
    deadline_event_after_error,
    decide,
    error_event,
    progress_key,
    progress_line,
)

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook

log = logging.getLogger(__name__)

# Errors worth another poll: the vendor or the network may recover. Anything else (401, 404,
# 400, an unknown status) will not get better by asking again, so it ends the watch at once.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    BatchApiRateLimitError,
    BatchApiServerError,
    BatchApiConnectionError,
    BatchApiResponseError,
    httpx.TransportError,
    asyncio.TimeoutError,
)
# A Retry-After longer than this is capped: a trigger must not go silent for an hour on one header.
MAX_RETRY_AFTER = 300.0
# How long on_kill may spend cancelling one batch (the triggerer bounds the whole call too).
CANCEL_TIMEOUT = 20.0
# A poll in flight may run past the deadline by one poll interval, and never by less than this
# (a poll needs a moment even when the interval is tiny or the deadline has already passed).
MIN_POLL_GRACE = 1.0
# A triggerer that restarts starts all its triggers at once; each waits a stable fraction of
# its poll interval (at most this) before its first poll, so they do not all poll together.
MAX_START_SPREAD = 10.0


# Triggers of one event loop that read the same connection share one hook: one connection
# lookup (in a triggerer, a round trip to the API server) and one client instead of one per
# trigger, which also cuts each trigger's tracked objects by a quarter (73 -> 54). A hook
# older than this is not handed to new triggers, so a rotated key reaches them within minutes
# (a trigger keeps the hook it started with, as it would keep its own).
SHARED_HOOK_MAX_AGE = 300.0


@dataclass(eq=False)
class _HookLease:
    key: tuple[Any, ...]
    hook: BatchApiHook
    created: float
    users: int = 0


_LEASES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], _HookLease]] = (
    weakref.WeakKeyDictionary()
)


async def _release_lease(lease: _HookLease) -> None:
    """One user fewer; the last one closes the hook's client."""
    lease.users -= 1
    if lease.users > 0:
        return
    leases = _LEASES.get(asyncio.get_running_loop(), {})
    if leases.get(lease.key) is lease:
        del leases[lease.key]
    await _close(lease.hook)


_HEAP_FROZEN = False


def freeze_triggerer_heap() -> bool:
    """``gc.freeze()`` once per process when ``[batch_provider] triggerer_gc_freeze`` is on.

    A full garbage collection walks every object of the triggerer, most of them Airflow's
    own modules (~195k objects, 100+ ms on a small machine), and the event loop, with every
    trigger on it, waits meanwhile. Freezing moves what exists now (imports, and whatever is
    alive) out of the collector's reach, so later full collections walk only newer objects.
    It changes the whole process (cyclic garbage that exists now is never freed), so it is
    off unless the deployment asks for it. ``gc.freeze()`` itself is a constant-time list
    splice: no collection runs here. Returns whether this call froze the heap.
    """
    global _HEAP_FROZEN
    if _HEAP_FROZEN:
        return False
    from airflow.sdk.configuration import conf

    try:
        wanted = conf.getboolean("batch_provider", "triggerer_gc_freeze", fallback=False)
    except Exception as exc:
        # A typo in a tuning knob must not fail every trigger: say so once and leave it off.
        _HEAP_FROZEN = True
        log.warning("[batch_provider] triggerer_gc_freeze is not a boolean (%s); leaving it off", exc)
        return False
    if not wanted:
        return False
    _HEAP_FROZEN = True
    gc.freeze()
    return True


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
    return min(wait, max((deadline - now).total_seconds(), 0.0) + 0.01)


class BatchTrigger(BaseTrigger):
    """Poll batches until they all complete, one ends badly, or the deadline passes.

    Yields exactly one event (see :mod:`airflow_batch_provider.outcome`):
    ``{status, batch_ids, batches, message, termination_reason, counts}``.

    :param batch_ids: the batches to watch.
    :param batch_conn_id: the ``batch_api`` connection to read them with.
    :param dialect: the dialect name, overriding the connection's.
    :param submitted_at: when the batches were submitted (ISO-8601 or epoch seconds); the
        timeout counts from here and the progress log reports elapsed time from here.
    :param timeout: seconds after ``submitted_at`` to give up with a ``timeout`` event.
    :param deadline: an absolute deadline (ISO-8601 or epoch seconds); wins over ``timeout``.
    :param poll_interval: seconds between polls while something changes.
    :param max_poll_interval: the longest wait between polls once nothing changes.
    :param backoff: factor applied to the interval after a poll that saw no change.
    :param max_consecutive_errors: transient polling errors tolerated in a row; the next one
        ends the watch with an ``error`` event.
    :param cancel_on_kill: cancel the batches when a user kills the deferred task.
    """

    def __init__(
        self,
        *,
        batch_ids: Sequence[str],
        batch_conn_id: str = "batch_api_default",
        dialect: str | None = None,
        submitted_at: str | float | None = None,
        timeout: float | None = None,
        deadline: str | float | None = None,
        poll_interval: float = 30.0,
        max_poll_interval: float = 600.0,
        backoff: float = 1.5,
        max_consecutive_errors: int = 5,
        cancel_on_kill: bool = True,
    ) -> None:
        super().__init__()
        if not batch_ids:
            raise ValueError("BatchTrigger needs at least one batch id")
        self.batch_ids = [str(b) for b in batch_ids]
        self.batch_conn_id = batch_conn_id
        self.dialect = dialect
        started = to_utc(submitted_at)
        self.submitted_at = started.isoformat() if started else None
        self.timeout = float(timeout) if timeout is not None else None
        absolute = to_utc(deadline) if deadline is not None else deadline_from(started, self.timeout)
        self.deadline = absolute.isoformat() if absolute else None
        self.poll_interval = max(float(poll_interval), 0.0)
        self.max_poll_interval = max(float(max_poll_interval), self.poll_interval)
        self.backoff = max(float(backoff), 1.0)
        self.max_consecutive_errors = int(max_consecutive_errors)
        self.cancel_on_kill = bool(cancel_on_kill)
        self._lease: _HookLease | None = None
        self._last: list[Batch] = []

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "batch_ids": list(self.batch_ids),
                "batch_conn_id": self.batch_conn_id,
                "dialect": self.dialect,
                "submitted_at": self.submitted_at,
                "timeout": self.timeout,
                "deadline": self.deadline,
                "poll_interval": self.poll_interval,
                "max_poll_interval": self.max_poll_interval,
                "backoff": self.backoff,
                "max_consecutive_errors": self.max_consecutive_errors,
                "cancel_on_kill": self.cancel_on_kill,
            },
        )

    # ---- helpers -----------------------------------------------------------------------
    @property
    def deadline_at(self) -> datetime | None:
        return to_utc(self.deadline)

    def _new_hook(self) -> BatchApiHook:
        from airflow_batch_provider.hooks.batch import BatchApiHook

        return BatchApiHook(
            self.batch_conn_id,
            dialect=self.dialect,
            async_transport=shared_transport(),
        )

    def _lease_hook(self) -> _HookLease:
        """The loop's shared hook for this connection (see ``SHARED_HOOK_MAX_AGE``)."""
        leases = _LEASES.setdefault(asyncio.get_running_loop(), {})
        # The class is part of the key: a subclass may build its hook differently.
        key = (type(self), self.batch_conn_id, self.dialect)
        lease = leases.get(key)
        now = time.monotonic()
        if lease is None or now - lease.created > SHARED_HOOK_MAX_AGE:
            # An older lease stays with the triggers holding it and closes with the last of them.
            lease = leases[key] = _HookLease(key, self._new_hook(), now)
        lease.users += 1
        return lease

    async def _release_hook(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await _release_lease(lease)

    def start_delay(self) -> float:
        """Seconds to wait before the first poll: a stable spread in ``[0, poll_interval)``."""
        fraction = zlib.crc32(",".join(self.batch_ids).encode()) / 0xFFFFFFFF
        return fraction * min(self.poll_interval, MAX_START_SPREAD)

    def _elapsed(self, now: datetime) -> float | None:
        start = to_utc(self.submitted_at)
        return (now - start).total_seconds() if start else None

    async def _poll(self, hook: BatchApiHook) -> list[Batch]:
        results = await asyncio.gather(*(hook.aget_batch(b) for b in self.batch_ids), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, Batch)]

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> AsyncIterator[TriggerEvent]:
        freeze_triggerer_heap()
        self._lease = self._lease_hook()
        hook = self._lease.hook
        interval = self.poll_interval
        errors = 0
        last_key: tuple[Any, ...] | None = None
        deadline = self.deadline_at
        try:
            await asyncio.sleep(self.start_delay())
            while True:
                now = datetime.now(timezone.utc)
                try:
                    # A slow or dripping vendor must not hold the trigger past its deadline: the
                    # poll in flight is given up (a TimeoutError, transient) once its budget is spent.
                    async with asyncio.timeout(poll_budget(deadline, self.poll_interval, now)):
                        batches = await self._poll(hook)
                except BatchApiQuotaError as exc:
                    # Out of quota: no wait refills it, so the watch ends now (before the
                    # transient clause, which would take it for a rate limit).
                    yield TriggerEvent(error_event(self.batch_ids, f"cannot poll batch(es): {exc}"))
                    return
                except TRANSIENT_ERRORS as exc:
                    # The poll may have taken a while: judge the deadline at the time it ended.
                    now = datetime.now(timezone.utc)
                    errors += 1
                    ended = deadline_event_after_error(
                        self._last, self.batch_ids, deadline=deadline, now=now, error=exc
                    )
                    if ended is not None:
                        yield TriggerEvent(ended)
                        return
                    if errors > self.max_consecutive_errors:
                        yield TriggerEvent(
                            error_event(
                                self.batch_ids,
                                f"gave up polling batch(es) {', '.join(self.batch_ids)} after {errors} "
                                f"consecutive errors; last: {exc}",
                            )
                        )
                        return
                    wait = max(retry_after_of(exc) or 0.0, interval)
                    wait = until_deadline(min(wait, MAX_RETRY_AFTER), deadline, now)
                    self.log.warning(
                        "Polling batch(es) failed (%d of %d tolerated in a row), retrying in %.1fs: %s",
                        errors,
                        self.max_consecutive_errors,
                        wait,
                        exc,
                    )
                    await asyncio.sleep(wait)
                    continue
                except (BatchProviderError, ValueError) as exc:
                    # Not transient (auth, not found, unknown status, unreadable config): stop now.
                    kind = type(exc).__name__
                    yield TriggerEvent(
                        error_event(
                            self.batch_ids,
                            f"cannot poll batch(es) {', '.join(self.batch_ids)}: {kind}: {exc}",
                        )
                    )
                    return
                errors = 0
                self._last = batches
                now = datetime.now(timezone.utc)
                outcome = decide(batches, deadline=deadline, now=now)
                if outcome.is_terminal:
                    self.log.info("Batch watch ended (%s): %s", outcome.status, outcome.message)
                    yield TriggerEvent(outcome.event(self.batch_ids))
                    return
                key = progress_key(batches)
                if key != last_key:
                    self.log.info(progress_line(batches, self._elapsed(now)))
                    last_key = key
                    interval = self.poll_interval
                else:
                    interval = min(interval * self.backoff, self.max_poll_interval)
                # Wake at the deadline rather than oversleeping it by a long backoff.
                await asyncio.sleep(until_deadline(interval, deadline, now))
        finally:
            await self._release_hook()

    async def cleanup(self) -> None:
        """Release the HTTP client when the trigger leaves this triggerer (never cancels work)."""
        await self._release_hook()

    async def on_kill(self) -> None:
        """A user killed the deferred task: cancel the batches that are still running."""
        if not self.cancel_on_kill:
            self.log.info("Task killed; leaving batch(es) %s running (cancel_on_kill=False)", self.batch_ids)
            return
        # run() has closed its client by now (its finally ran when it was cancelled).
        hook = self._new_hook()
        try:
            await cancel_batches(hook, self.batch_ids, log=self.log)
        finally:
            await _close(hook)


async def cancel_batches(hook: BatchApiHook, batch_ids: Sequence[str], *, log: Any) -> list[str]:
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


async def _close(hook: Any) -> None:
    aclose = getattr(hook, "aclose", None)
    if aclose is not None:
        # Closing a client must never mask the outcome being reported.
        with contextlib.suppress(Exception):
            await aclose()
