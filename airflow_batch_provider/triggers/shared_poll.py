"""Shared polling: the BatchTriggers of one connection in one triggerer read their batches together.

One poll per batch per interval does not scale: 10,000 waiting batches at a 10 s interval are
60,000 vendor calls a minute and more CPU than one core has. Here every trigger keeps its own
:class:`~airflow_batch_provider.waiting.PollLoop` (interval, backoff, Retry-After, error budget,
deadline, outcome: nothing about a trigger's decisions changes), but its *read* is served by one
:class:`SharedPoller` per connection and event loop:

* a trigger that wants its batches registers a future per batch id and waits;
* the poller gathers the ids wanted within a short window, then reads them in one *cycle*: it
  lists batches newest first (one call per page for up to a page of batches) until every wanted
  id has been seen or the page budget is spent, then gets the ids the listing did not show one
  by one (a few at a time);
* every vendor call of the poller (pages, gets, the hook's own retries) passes one
  :class:`CallLimiter`: at most ``poll_calls_per_minute`` calls in any minute per connection;
* an error reaches the triggers whose batches it concerns, and each trigger's own PollLoop judges
  it as it judges its own poll's error today (so a Retry-After or a backoff is honoured by the
  PollLoop's decisions, as before). A listing that fails for a transient reason, a rate limit
  included, falls back to gets (after a rate limit the first get goes alone: if it is refused
  too, the others get its answer without a call); out of quota, auth and the like fail the cycle.
* a listed item that does not parse (a vendor's new status or field) fails only its own batch:
  the read error of a trigger waiting on it, skipped and counted for anyone else. A listing
  ends: its budget counts pages, however empty, and past it the ids not seen are read by id.
* triggers that wake together (their sleeps ended while the collector or a busy machine held the
  loop) join and read a few per turn of the loop (:class:`TurnGate`), not all in one turn.

The poller is keyed by the trigger class, the connection id, the dialect and a fingerprint of the
resolved settings (a digest: a key never shows a secret), so a rotated key gets a poller of its
own. The first trigger in starts it, the last one out (a finished, cancelled or reassigned
trigger) stops it and releases its HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from airflow_batch_provider.exceptions import (
    BatchApiBadRequestError,
    BatchApiNotFoundError,
    BatchApiQuotaError,
    BatchApiRateLimitError,
)
from airflow_batch_provider.models import Batch
from airflow_batch_provider.waiting import POLL_ERRORS, TRANSIENT_ERRORS

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook, BatchApiSettings

log = logging.getLogger(__name__)

# The poller keeps its own clock: a test that fast-forwards a trigger's waits by patching
# ``asyncio.sleep`` (to check the trigger's decisions) leaves the poller's pacing alone.
_sleep = asyncio.sleep

#: Default ceiling of vendor calls per minute per connection (``[batch_provider] poll_calls_per_minute``).
DEFAULT_CALLS_PER_MINUTE = 600
# Calls allowed back to back before the ceiling's pace applies (a small burst keeps a short cycle
# quick); the pace is lowered by as much, so no minute ever holds more than the ceiling.
MAX_BURST = 10
# How long the poller waits at least for more triggers to ask before it reads: a fraction of the
# shortest poll interval among its triggers, and not longer than this (see ``_gather_window``).
MAX_GATHER = 0.5
GATHER_FRACTION = 0.05
# Pages a listing reads at least beyond what the registered batches fill, for other batches in between.
SLACK_PAGES = 2
# Triggers a listing wakes before it lets them run (each judges its batches and maybe logs).
WAKE_CHUNK = 16
# A read is answered from a state seen less than this fraction of the trigger's poll interval ago.
FRESH_FRACTION = 0.5
# Listed batches settled per turn of the event loop (a page may hold thousands).
SETTLE_SLICE = 500
# Batches read by id at once when the listing did not show them.
GET_CONCURRENCY = 8
# Triggers let on per turn of the event loop when they wake to poll (see ``TurnGate``).
ADMIT_PER_TURN = 32


def _flag(value: Any) -> bool | None:
    """A boolean from a connection extra (``true``, ``"false"``, ``0``...), or None when unset."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def shared_polling_enabled(settings: BatchApiSettings) -> bool:
    """Whether triggers of this connection share their polling.

    The connection extra ``shared_polling`` wins over ``[batch_provider] shared_polling``
    (default True); False brings back one poll per trigger per interval.
    """
    own = _flag(settings.extra.get("shared_polling"))
    if own is not None:
        return own
    from airflow.sdk.configuration import conf

    try:
        return bool(conf.getboolean("batch_provider", "shared_polling", fallback=True))
    except Exception as exc:
        # A typo in a tuning knob must not fail every trigger.
        log.warning("[batch_provider] shared_polling is not a boolean (%s); sharing anyway", exc)
        return True


def calls_per_minute(settings: BatchApiSettings) -> int | None:
    """The connection's ceiling of vendor calls per minute (None: no ceiling).

    The connection extra ``poll_calls_per_minute`` wins over ``[batch_provider]
    poll_calls_per_minute`` (default 600); 0 turns the ceiling off.
    """
    value: Any = settings.extra.get("poll_calls_per_minute")
    if value in (None, ""):
        from airflow.sdk.configuration import conf

        value = conf.get("batch_provider", "poll_calls_per_minute", fallback=None)
    if value in (None, ""):
        return DEFAULT_CALLS_PER_MINUTE
    try:
        ceiling = int(float(value))
    except (TypeError, ValueError):
        log.warning("poll_calls_per_minute %r is not a number; using %d", value, DEFAULT_CALLS_PER_MINUTE)
        return DEFAULT_CALLS_PER_MINUTE
    return ceiling if ceiling > 0 else None


def settings_fingerprint(settings: BatchApiSettings) -> str:
    """A digest of what the vendor sees of a connection (URL, key, headers, extras): no secret in it."""
    material = orjson.dumps(
        [settings.base_url, settings.dialect.name, settings.api_key, dict(settings.headers), settings.extra],
        option=orjson.OPT_SORT_KEYS,
        default=str,
    )
    return hashlib.sha256(material).hexdigest()[:16]


class CallLimiter:
    """At most ``per_minute`` calls in any 60 s, in bursts of at most ``burst``.

    A token bucket holding ``burst`` tokens, refilled at ``(per_minute - burst) / 60`` a second:
    in any window of 60 s at most ``burst + (per_minute - burst) = per_minute`` calls start.

    :param per_minute: the ceiling (None: no ceiling, calls are only counted).
    :param clock: monotonic seconds (tests pass a fake clock).
    :param sleep: how to wait (tests pass one that advances the fake clock).
    """

    def __init__(
        self,
        per_minute: int | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self.sleep = sleep
        self.calls = 0
        self.burst = max(1, min(MAX_BURST, (per_minute or 0) // 10))
        self.rate = max(((per_minute or 0) - self.burst) / 60.0, (per_minute or 0) / 600.0)
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        """Wait until a call may start, then count it."""
        # One waiter at a time: calls start in the order they asked.
        async with self._lock:
            while True:
                now = self.clock()
                wait = 0.0
                if self.per_minute is not None:
                    self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
                    self._stamp = now
                    # (A hair under one token is one: float rounding must not make a wait of 0 s.)
                    if self._tokens < 1.0 - 1e-9:
                        wait = max(wait, (1.0 - self._tokens) / self.rate)
                if wait <= 0:
                    break
                await self.sleep(wait)
            if self.per_minute is not None:
                self._tokens -= 1.0
            self.calls += 1

    async def on_request(self, request: httpx.Request) -> None:
        """An httpx request event hook: every request of the client waits its turn."""
        await self.acquire()


class TurnGate:
    """Lets at most ``per_turn`` waiters go on per turn of the event loop, in the order they came.

    The event loop runs, in one turn, every callback that came due since the last: after anything
    held the loop (a full garbage collection of 10,000 triggers' heap takes ~1 s; a busy machine
    takes the CPU away as long), every trigger whose sleep ended meanwhile would run its poll step
    in that one turn (10,000 triggers starting within 10 s: hundreds of steps, ~100 ms). Behind
    the gate they go on a few dozen a turn, with the loop's other work between them.

    :param per_turn: waiters let on per turn (default ``ADMIT_PER_TURN``).
    """

    def __init__(self, per_turn: int | None = None) -> None:
        self.per_turn = max(1, per_turn or ADMIT_PER_TURN)
        self.turns = 0  # turns in which the gate let someone on (tests count them)
        self._queue: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def enter(self) -> None:
        """Wait for this caller's turn (the next turn at the earliest)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if not self._queue:
            self._loop = loop
            loop.call_soon(self._admit)
        self._queue.append(future)
        # A caller cancelled while queued is skipped by ``_admit``.
        await future

    def _admit(self) -> None:
        admitted = 0
        while self._queue and admitted < self.per_turn:
            future = self._queue.popleft()
            if not future.done():
                future.set_result(None)
                admitted += 1
        self.turns += 1
        if self._queue and self._loop is not None:
            # Queued after the callers just woken: they run in the next turn, the next few in the one after.
            self._loop.call_soon(self._admit)


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnGate] = weakref.WeakKeyDictionary()


def turn_gate() -> TurnGate:
    """The running loop's gate, shared by every trigger of the loop."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = TurnGate()
    return gate


@dataclass
class _Member:
    """A joined trigger: its batches, how old a state may be to answer it, when it was last answered,
    what it was given then, whether its last read failed, and its pace (interval, backoff, longest)."""

    batch_ids: tuple[str, ...]
    max_age: float
    backoff: float = 1.0
    max_interval: float = math.inf
    read_at: float = 0.0
    given: tuple[Batch, ...] = ()
    failed: bool = True  # (no read yet: the first one is a plain read)


@dataclass(frozen=True)
class PollerKey:
    """What a poller is shared by; its repr shows a digest of the settings, never a secret."""

    trigger_class: type
    conn_id: str
    dialect: str | None
    fingerprint: str


class SharedPoller:
    """Reads the batches of every registered trigger of one connection, in cycles.

    A cycle lists batches newest first until it has seen every registered batch (or spent its
    page budget), keeps the last state seen of each, and gets by id the wanted batches the
    listing did not show. A trigger's read is answered at once from a state seen less than half
    its poll interval ago (the cycle another trigger caused a moment before read it too), else
    by the next cycle.

    :param key: what the poller is shared by.
    :param hook: the hook it reads with (a lease of the triggers' shared hook).
    :param limiter: the connection's ceiling of calls.
    :param release: called once when the poller stops (releases the hook's lease).
    :param unregister: called once when the last trigger leaves (takes the poller out of the registry).
    """

    def __init__(
        self,
        key: PollerKey,
        hook: BatchApiHook,
        limiter: CallLimiter,
        release: Callable[[], Awaitable[None]],
        unregister: Callable[[], None] = lambda: None,
    ) -> None:
        self.key = key
        self.hook = hook
        self.limiter = limiter
        self._release = release
        self._unregister = unregister
        self._members: dict[object, _Member] = {}
        self._registered: dict[str, int] = {}  # batch id -> triggers watching it
        # Batch id -> last state, and when it was read. A listing that shows a batch unchanged
        # gives back the same Batch (see ``Dialect.listed_batch``), so a cycle over thousands of
        # waiting batches allocates no long-lived objects: the collector's full passes stay rare.
        self._seen: dict[str, Batch] = {}
        self._seen_at: dict[str, float] = {}
        self._waiting: dict[str, list[asyncio.Future[Batch]]] = {}
        # Batch id -> the futures of triggers watching it for news (see ``read_after``).
        self._watchers: dict[str, list[asyncio.Future[None]]] = {}
        self._wakeup = asyncio.Event()
        self._last_cycle = -math.inf
        self._quiet = 0  # cycles in a row in which no batch changed
        self._pace: tuple[float, float, float] | None = None  # shortest interval, backoff, longest
        self._changed = False
        self._task: asyncio.Task[None] | None = None
        self._can_list = True
        self._installed = False
        self.cycles = 0
        self.list_pages = 0
        self.gets = 0
        self.refreshed = 0  # states of registered batches read from the vendor
        self.unreadable = 0  # listed items that did not parse, of batches no trigger here waits on
        self.skipped = 0  # listed items of other batches, not parsed

    # ---- membership ------------------------------------------------------------------------
    def join(
        self,
        member: object,
        batch_ids: Sequence[str],
        poll_interval: float,
        *,
        backoff: float = 1.0,
        max_poll_interval: float | None = None,
    ) -> None:
        """Register a trigger's batches and its pace (``poll_interval``, ``backoff`` after a poll
        that saw no change, up to ``max_poll_interval``): the poller's own cycles, which serve
        watching triggers, keep the fastest pace among its triggers."""
        ids = tuple(batch_ids)
        longest = max(poll_interval, max_poll_interval) if max_poll_interval is not None else math.inf
        entry = self._members[member] = _Member(
            ids, poll_interval * FRESH_FRACTION, max(backoff, 1.0), longest
        )
        if self._pace is not None:
            # Joining can only make the pace faster: no walk over every member (10,000 joining).
            shortest, least_backoff, longest_cap = self._pace
            self._pace = (
                min(shortest, poll_interval),
                min(least_backoff, entry.backoff),
                min(longest_cap, entry.max_interval),
            )
        # A faster member may watch at once (its first read answered from a state just seen, so no
        # read wakes the poller): the schedule is recomputed now, not after the slower pace's wait.
        self._wakeup.set()
        for batch_id in ids:
            self._registered[batch_id] = self._registered.get(batch_id, 0) + 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"shared-poll {self.key}")

    async def leave(self, member: object) -> bool:
        """Unregister a trigger; the last one out stops the poller. Returns whether it stopped."""
        entry = self._members.pop(member, None)
        self._pace = None
        for batch_id in entry.batch_ids if entry else ():
            left = self._registered.get(batch_id, 1) - 1
            if left > 0:
                self._registered[batch_id] = left
            else:
                self._registered.pop(batch_id, None)
                self._seen.pop(batch_id, None)
                self._seen_at.pop(batch_id, None)
        if self._members:
            return False
        # Out of the registry before any await: a trigger joining meanwhile gets a new poller
        # rather than this one, half stopped.
        self._unregister()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._installed:
            # The hook outlives this poller when triggers still hold it: take the ceiling off.
            client = await self.hook.aget_conn()
            hooks = client.event_hooks
            with contextlib.suppress(ValueError):
                hooks.get("request", []).remove(self.limiter.on_request)
            client.event_hooks = hooks
            self._installed = False
        await self._release()
        return True

    @property
    def members(self) -> int:
        return len(self._members)

    # ---- what a trigger calls ----------------------------------------------------------------
    async def read(self, member: object) -> list[Batch]:
        """A joined trigger's batches, read by the next cycle; the first error among them is raised.

        States a cycle read for other triggers less than half this trigger's poll interval ago, and
        after the states it was last given, answer at once.
        """
        # Triggers waking together (their sleeps ended while something else held the loop) go on a
        # few a turn.
        await turn_gate().enter()
        entry = self._members[member]
        batch_ids = entry.batch_ids
        oldest = max(time.monotonic() - entry.max_age, entry.read_at)
        seen_at = self._seen_at
        if all(seen_at.get(b, -math.inf) > oldest for b in batch_ids):
            entry.read_at = max(seen_at[b] for b in batch_ids)
            batches = [self._seen[b] for b in batch_ids]
            entry.given, entry.failed = tuple(batches), False
            return batches
        loop = asyncio.get_running_loop()
        futures = []
        for batch_id in batch_ids:
            future: asyncio.Future[Batch] = loop.create_future()
            self._waiting.setdefault(batch_id, []).append(future)
            futures.append(future)
        self._wakeup.set()
        entry.failed = True  # until the read succeeds
        try:
            batches = [await futures[0]] if len(futures) == 1 else list(await asyncio.gather(*futures))
            # What it was given now is not news to it at its next read.
            entry.read_at = time.monotonic()
            entry.given, entry.failed = tuple(batches), False
            return batches
        finally:
            # Cancelled (a trigger leaving, a poll budget spent) or failed on one id: the others
            # are no longer wanted by this trigger.
            for batch_id, future in zip(batch_ids, futures, strict=True):
                if future.cancel() or future.cancelled():
                    _discard(self._waiting, batch_id, future)

    async def read_after(self, member: object, sleep: float, deadline_in: float | None) -> list[Batch]:
        """A joined trigger's next read, once its poll loop decided to wait ``sleep`` seconds.

        After a read that succeeded, the trigger is not woken each interval to be told that
        nothing changed: it waits until a cycle (the poller's own, at the pace of its fastest
        trigger) shows one of its batches changed or fails for them, or until ``deadline_in``
        seconds have passed (its deadline), then reads. After a failed read it waits ``sleep``
        (the loop's retry wait: interval, backoff, Retry-After) and reads, as it always has.
        10,000 waiting batches then cost their listing each cycle, not 10,000 wake-ups.
        """
        entry = self._members[member]
        if entry.failed:
            await asyncio.sleep(sleep)
            return await self.read(member)
        if not self._news(entry):
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if not self._watchers:
                # The first watcher: the poller's own cycles are now due (none were before).
                self._wakeup.set()
            for batch_id in entry.batch_ids:
                self._watchers.setdefault(batch_id, []).append(future)
            # (A cycle's error for its batches is this read's error.)
            deadline = asyncio.timeout(deadline_in)
            try:
                async with deadline:
                    await future
            except TimeoutError:
                if not deadline.expired():
                    entry.failed = True
                    raise
            except BaseException:
                entry.failed = True
                raise
            finally:
                future.cancel()
                for batch_id in entry.batch_ids:
                    _discard(self._watchers, batch_id, future)
        return await self.read(member)

    def _news(self, entry: _Member) -> bool:
        """Whether a batch of ``entry`` changed since it was last given them."""
        seen = self._seen
        return len(entry.given) != len(entry.batch_ids) or any(
            seen.get(b) is not g for b, g in zip(entry.batch_ids, entry.given, strict=True)
        )

    # ---- settling the futures ---------------------------------------------------------------
    def _settle(self, batch_id: str, batch: Batch | None = None, error: BaseException | None = None) -> int:
        """Answer the triggers reading ``batch_id``, and wake those watching it if it changed or
        failed; returns how many were woken."""
        woken = 0
        if batch is not None and batch_id in self._registered:
            self.refreshed += 1
            if self._seen.get(batch_id) is not batch:
                # A listing gives back the known Batch while the vendor's object is unchanged
                # (``Dialect.listed_batch``): another object is news for the watchers.
                self._changed = True
                woken = self._notify(batch_id)
            self._seen[batch_id] = batch
            self._seen_at[batch_id] = time.monotonic()
        elif error is not None:
            woken = self._notify(batch_id, error)
        waiters = self._waiting.pop(batch_id, None)
        if not waiters:
            return woken
        for future in waiters:
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(batch)  # type: ignore[arg-type]
        return woken + len(waiters)

    def _notify(self, batch_id: str, error: BaseException | None = None) -> int:
        """Wake the triggers watching ``batch_id`` (with the cycle's error for it, if any)."""
        watchers = self._watchers.pop(batch_id, ())
        for future in watchers:
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(None)
        return len(watchers)

    # ---- the cycles -----------------------------------------------------------------------------
    def _gather_window(self) -> float:
        """How long to let more triggers ask before a cycle: a little of the shortest interval."""
        return min(MAX_GATHER, self._members_pace()[0] * GATHER_FRACTION)

    def _members_pace(self) -> tuple[float, float, float]:
        """The shortest poll interval, smallest backoff and shortest longest interval of the members."""
        if self._pace is None:
            # Computed once per change of membership, not per cycle (10,000 members: ~5 ms).
            members = self._members.values()
            self._pace = (
                min((m.max_age / FRESH_FRACTION for m in members), default=MAX_GATHER),
                min((m.backoff for m in members), default=1.0),
                min((m.max_interval for m in members), default=math.inf),
            )
        return self._pace

    def _watch_interval(self) -> float:
        """The pace of the cycles that serve watching triggers: the fastest trigger's interval,
        backed off by its factor for each cycle in a row that changed nothing (as its own poll
        loop would), up to its longest interval."""
        shortest, backoff, longest = self._members_pace()
        if backoff <= 1.0 or self._quiet == 0:
            return shortest
        cap = max(longest, shortest)
        try:
            return min(shortest * backoff ** min(self._quiet, 64), cap)
        except OverflowError:
            # A large backoff overflows a float long before 64 quiet cycles: it is long past the cap.
            return cap

    async def _due(self) -> None:
        """Return when a cycle is due: a trigger asked to read, or watching triggers' pace has come."""
        while not self._waiting:
            delay = self._last_cycle + self._watch_interval() - time.monotonic() if self._watchers else None
            if delay is not None and delay <= 0:
                return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wakeup.wait()

    async def _run(self) -> None:
        while True:
            await self._due()
            # Let the triggers asking about now join this cycle (they wake on the same clock).
            await _sleep(self._gather_window())
            self._changed = False
            # The pace counts from a cycle's start: a cycle that takes longer than the interval
            # (a long listing under the ceiling of calls) is followed by the next one at once.
            self._last_cycle = time.monotonic()
            try:
                await self._cycle()
            except Exception as exc:
                # A bug must not strand the waiting triggers: each gets the error (and fails as
                # its own poll would have).
                log.exception("Shared polling of %s failed", self.key)
                for batch_id in {*self._waiting, *self._watchers}:
                    self._settle(batch_id, error=exc)
            self._quiet = 0 if self._changed else self._quiet + 1

    async def _install_limiter(self) -> None:
        if not self._installed:
            client = await self.hook.aget_conn()
            hooks = client.event_hooks
            hooks.setdefault("request", []).append(self.limiter.on_request)
            client.event_hooks = hooks
            self._installed = True

    def page_budget(self, page_size: int) -> int:
        """Pages a cycle may list to refresh every registered batch: as many as they fill, plus a
        little for other batches in between (see ``_list`` for when it goes on past that)."""
        return math.ceil(len(self._registered) / page_size) + SLACK_PAGES

    async def _cycle(self) -> None:
        await self._install_limiter()
        self.cycles += 1
        # Batches a trigger is reading now, and those watched for news.
        wanted = {*self._waiting, *self._watchers}
        dialect = (await self.hook.aget_settings()).dialect
        probe = False
        if self._can_list and dialect.lists_batches and len(self._registered.keys() | wanted) > 1:
            try:
                await self._list(wanted, dialect.list_page_size)
            except BatchApiQuotaError as exc:
                # Out of quota: a get per batch would be refused the same way.
                self._fail(wanted, exc)
                return
            except BatchApiRateLimitError as exc:
                # The listing may be limited apart from reads by id: the rest are read by id, the
                # first alone (a 429 to it answers the others without a call), every call under
                # the connection's ceiling. No trigger spends its error budget on the listing.
                log.info("Listing batches is rate limited (%s); reading the rest one by one", exc)
                probe = True
            except (BatchApiNotFoundError, BatchApiBadRequestError) as exc:
                log.warning("Listing batches is refused (%s); reading them one by one from now on", exc)
                self._can_list = False
            except TRANSIENT_ERRORS as exc:
                log.info("Listing batches failed (%s); reading the rest one by one", exc)
            except POLL_ERRORS as exc:
                # Auth, quota, a broken connection: a get per batch would fail the same way.
                self._fail(wanted, exc)
                return
        await self._get_each(wanted, probe=probe)

    async def _list(self, wanted: set[str], page_size: int) -> None:
        """List newest first until every registered and wanted id has been seen or the budget is spent.

        The budget counts pages (an empty or short page is a page): a listing that says "more"
        forever ends. ``wanted`` is left holding the wanted ids the listing did not show; they
        are read by id. A listed item that does not parse fails only its own batch: for a batch
        a trigger waits on, it is that read's error (judged by the trigger's poll loop, like any
        unreadable answer). The items of batches no trigger here waits on are not parsed at
        all: skipped and counted (``skipped``), whatever they hold.
        """
        unseen = set(self._registered) | wanted
        budget = self.page_budget(page_size)
        pages = 0
        # Only the batches of this poller's triggers are parsed: a page of thousands of other
        # batches costs a look at each id, not a model each (nor the collector's time for them).
        listing = self.hook.alist_batch_pages(page_size=page_size, known=self._seen, wanted=_Wanted(self))
        async with contextlib.aclosing(listing):  # type: ignore[type-var]
            async for page in listing:
                pages += 1
                self.list_pages += 1
                woken = 0
                for done, batch in enumerate(page.batches, 1):
                    if batch.id in unseen:
                        unseen.discard(batch.id)
                        wanted.discard(batch.id)
                    # A trigger that asked after the cycle began is answered too when its batch shows up.
                    woken += self._settle(batch.id, batch)
                    if woken >= WAKE_CHUNK or done % SETTLE_SLICE == 0:
                        # The woken triggers run before the listing goes on, and a page of
                        # thousands of batches is settled a slice per turn: the loop is never
                        # held by all of them at once.
                        woken = 0
                        await _sleep(0)
                for item in page.unreadable:
                    if item.batch_id is not None and item.batch_id in unseen:
                        unseen.discard(item.batch_id)
                        wanted.discard(item.batch_id)
                        self._settle(item.batch_id, error=item.error)
                    else:
                        self.unreadable += 1
                self.skipped += page.skipped
                if not unseen:
                    return
                # Past the pages the registered batches fill, go on only while a get for each
                # wanted batch still missing would cost more calls than the paging so far (a
                # listing never costs more than twice the gets it replaces).
                if pages >= budget and pages >= len(wanted):
                    return

    async def _get_each(self, wanted: set[str], *, probe: bool = False) -> None:
        """Read by id the wanted batches the listing did not show, a few at a time.

        :param probe: read the first alone (after a rate-limited listing): if it is refused too,
            the others get its error without a call.
        """
        todo = [b for b in wanted if b in self._waiting or b in self._watchers]
        limit = asyncio.Semaphore(GET_CONCURRENCY)
        stop: list[BaseException] = []

        async def one(batch_id: str) -> None:
            async with limit:
                if stop:
                    self._settle(batch_id, error=stop[0])
                    return
                self.gets += 1
                try:
                    batch = await self.hook.aget_batch(batch_id)
                except POLL_ERRORS as exc:
                    if isinstance(exc, BatchApiRateLimitError):
                        # The rest would be refused too: they get the same answer, no call.
                        stop.append(exc)
                    self._settle(batch_id, error=exc)
                else:
                    # Unchanged, it is the known Batch (as a listing gives it): no news to watchers.
                    known = self._seen.get(batch_id)
                    self._settle(batch_id, known if known is not None and known.raw == batch.raw else batch)

        if probe and todo:
            await one(todo.pop())
        await asyncio.gather(*(one(b) for b in todo))

    def _fail(self, wanted: set[str], exc: BaseException) -> None:
        for batch_id in wanted:
            self._settle(batch_id, error=exc)


class _Wanted:
    """The batch ids a poller's listing parses: those of its triggers, as they are at each look."""

    def __init__(self, poller: SharedPoller) -> None:
        self.poller = poller

    def __contains__(self, batch_id: object) -> bool:
        poller = self.poller
        return batch_id in poller._registered or batch_id in poller._waiting


def _discard(futures: dict[str, list[Any]], batch_id: str, future: asyncio.Future[Any]) -> None:
    """Take ``future`` out of ``batch_id``'s list (reads waiting, or watchers); an emptied list goes."""
    waiting = futures.get(batch_id)
    if waiting is None:
        return
    with contextlib.suppress(ValueError):
        waiting.remove(future)
    if not waiting:
        del futures[batch_id]


# ---- the registry: one poller per key and event loop -----------------------------------------
_POLLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[PollerKey, SharedPoller]] = (
    weakref.WeakKeyDictionary()
)


def pollers() -> Mapping[PollerKey, SharedPoller]:
    """The running loop's pollers (for tests and benchmarks)."""
    return _POLLERS.get(asyncio.get_running_loop(), {})


def get_poller(
    key: PollerKey,
    make: Callable[[], tuple[BatchApiHook, Callable[[], Awaitable[None]]]],
    per_minute: int | None,
) -> SharedPoller:
    """The loop's poller for ``key``; ``make`` gives a hook and its release when one must start."""
    loop = asyncio.get_running_loop()
    registry = _POLLERS.setdefault(loop, {})
    poller = registry.get(key)
    if poller is None:
        hook, release = make()

        def unregister() -> None:
            if registry.get(key) is poller:
                del registry[key]
            if not registry:
                _POLLERS.pop(loop, None)

        poller = registry[key] = SharedPoller(key, hook, CallLimiter(per_minute), release, unregister)
    return poller
