"""BatchTrigger: watch one or many batches from the triggerer until one terminal outcome.

Async all the way down: the batches are read with the hook's async httpx client, never a
sync call or a thread. The trigger's kwargs are primitives only (ids, connection id, clock
values, intervals) and never a secret; the hook reads the connection itself. The deadline
is an absolute time computed from the submit time, so a triggerer restart (which rebuilds
the trigger from its kwargs) keeps it instead of starting the clock again. Triggers of one
connection share their polling (:mod:`airflow_batch_provider.triggers.shared_poll`): each keeps
its own poll loop, one poller per connection reads their batches.
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
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.hooks.transport import shared_transport
from airflow_batch_provider.ids import check_id
from airflow_batch_provider.models import Batch, to_utc
from airflow_batch_provider.triggers.shared_poll import (
    PollerKey,
    SharedPoller,
    calls_per_minute,
    get_poller,
    settings_fingerprint,
    shared_polling_enabled,
    turn_gate,
)
from airflow_batch_provider.waiting import (
    POLL_ERRORS,
    acancel_batches,
    aread_batches,
    await_batches,
    deadline_from,
    until_deadline,
)

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.waiting import WaitingTask

log = logging.getLogger(__name__)

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
        batch_conn_id: str = DEFAULT_CONN_ID,
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
        # Checked here too: a trigger may be built by hand, and its ids go into URLs with the key.
        self.batch_ids = [check_id(str(b), "batch_ids") for b in batch_ids]
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
        self._poller: SharedPoller | None = None

    @classmethod
    def for_task(
        cls,
        task: WaitingTask,
        batch_ids: Sequence[str],
        *,
        submitted_at: str | None,
        timeout: float | None,
    ) -> BatchTrigger:
        """The trigger a task defers to, built from the task's wait settings (sensor and submit alike).

        :param task: the deferring task; its connection, dialect, intervals, error budget and
            ``cancel_on_kill`` become the trigger's.
        :param batch_ids: the batches to watch.
        :param submitted_at: when they were submitted (ISO-8601); the timeout counts from here.
        :param timeout: seconds after ``submitted_at`` to give up, or None.
        """
        return cls(
            batch_ids=batch_ids,
            batch_conn_id=task.batch_conn_id,
            dialect=task.dialect,
            submitted_at=submitted_at,
            timeout=timeout,
            poll_interval=task.poll_interval,
            max_poll_interval=task.max_poll_interval,
            max_consecutive_errors=task.max_consecutive_errors,
            cancel_on_kill=task.cancel_on_kill,
        )

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

    async def _poll(self, hook: BatchApiHook, after: float | None = None) -> list[Batch]:
        """Read the batches: now (``after`` None), or as the next poll once the loop decided to
        wait ``after`` seconds (with shared polling: when they change, or at the deadline)."""
        if self._poller is None:
            return await aread_batches(hook, self.batch_ids)
        if after is None:
            return await self._poller.read(self)
        deadline = self.deadline_at
        # Watch until just after the deadline (as the loop's own sleep would end), or for good.
        now = datetime.now(timezone.utc)
        deadline_in = None if deadline is None else until_deadline(math.inf, deadline, now)
        return await self._poller.read_after(self, after, deadline_in)

    async def _join_shared_polling(self, lease: _HookLease) -> SharedPoller | None:
        """The connection's shared poller, joined; None when this trigger polls on its own.

        Settings that cannot be read are not judged here: the first poll reads them again and
        reports the error the way a trigger always has.
        """
        try:
            settings = await lease.hook.aget_settings()
        except POLL_ERRORS:
            return None
        # Joining costs a little CPU: triggers whose start delays ended together (or that waited
        # together for the connection) join a few a turn.
        await turn_gate().enter()
        if not shared_polling_enabled(settings):
            return None
        key = PollerKey(type(self), self.batch_conn_id, self.dialect, settings_fingerprint(settings))

        def make() -> tuple[BatchApiHook, Any]:
            # The poller holds a lease of the triggers' hook: no connection lookup or client of its own.
            lease.users += 1
            return lease.hook, lambda: _release_lease(lease)

        poller = get_poller(key, make, calls_per_minute(settings))
        poller.join(
            self,
            self.batch_ids,
            self.poll_interval,
            backoff=self.backoff,
            max_poll_interval=self.max_poll_interval,
        )
        return poller

    async def _leave_shared_polling(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            await poller.leave(self)

    # ---- the loop (its decisions live in airflow_batch_provider.waiting) -------------------
    async def run(self) -> AsyncIterator[TriggerEvent]:
        freeze_triggerer_heap()
        self._lease = self._lease_hook()
        hook = self._lease.hook
        try:
            await asyncio.sleep(self.start_delay())
            self._poller = await self._join_shared_polling(self._lease)
            event = await await_batches(
                hook,
                self.batch_ids,
                deadline=self.deadline_at,
                submitted_at=to_utc(self.submitted_at),
                poll_interval=self.poll_interval,
                max_poll_interval=self.max_poll_interval,
                backoff=self.backoff,
                max_consecutive_errors=self.max_consecutive_errors,
                log=self.log,
                read=lambda: self._poll(hook),
                read_after=(lambda seconds: self._poll(hook, seconds)) if self._poller is not None else None,
            )
            yield TriggerEvent(event)
        finally:
            await self._leave_shared_polling()
            await self._release_hook()

    async def cleanup(self) -> None:
        """Release the HTTP client when the trigger leaves this triggerer (never cancels work)."""
        await self._leave_shared_polling()
        await self._release_hook()

    async def on_kill(self) -> None:
        """A user killed the deferred task: cancel the batches that are still running."""
        if not self.cancel_on_kill:
            self.log.info("Task killed; leaving batch(es) %s running (cancel_on_kill=False)", self.batch_ids)
            return
        # run() has closed its client by now (its finally ran when it was cancelled).
        hook = self._new_hook()
        try:
            await acancel_batches(hook, self.batch_ids, log=self.log)
        finally:
            await _close(hook)


async def _close(hook: Any) -> None:
    aclose = getattr(hook, "aclose", None)
    if aclose is not None:
        # Closing a client must never mask the outcome being reported.
        with contextlib.suppress(Exception):
            await aclose()
