"""QueueRoomTrigger: wait in the triggerer until the vendor's queue has room for the next shard.

A queue-aware submit (``max_enqueued_tokens``) defers here when its next shard does not fit
under the cap, when the vendor refused a create for its queue limit, or while its own new
batches are still validating (a batch over the vendor's limit fails there). The trigger reads
the ledger (:mod:`airflow_batch_provider.enqueued`) with the async client every
``poll_interval`` seconds and yields one event:

* ``{"status": "ready", "held": N, "started": ...}``: ``held + need <= cap`` and none of
  ``watch_ids`` is validating; the submit resumes and creates what now fits;
* ``{"status": "timeout", ...}``: the deadline (an absolute time, kept across triggerer
  restarts) passed first;
* ``{"status": "error", "message": ...}``: the listing failed more than ``max_consecutive_errors``
  times in a row, or with an error no retry cures.

The first read comes one ``poll_interval`` after the deferral: the submit has just read the
ledger itself, and after a refused create this paces the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.enqueued import Ledger, aread_ledger
from airflow_batch_provider.ids import check_id
from airflow_batch_provider.models import BatchState, to_utc
from airflow_batch_provider.waiting import TRANSIENT_ERRORS, acancel_batches, until_deadline

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook


def room_ready(ledger: Ledger, need: int, cap: int, watch_ids: Sequence[str]) -> bool:
    """Whether the submit may resume: the next shard fits and none of its batches still validates."""
    validating = any(
        b in ledger.batches and ledger.batches[b].state is BatchState.VALIDATING for b in watch_ids
    )
    return ledger.fits(need, cap) and not validating


class QueueRoomTrigger(BaseTrigger):
    """Poll the enqueued-token ledger of one model until the next shard fits, or the deadline.

    :param batch_conn_id: the ``batch_api`` connection (its batches make the ledger).
    :param dialect: the dialect name, overriding the connection's.
    :param model: the model whose ledger is read ("" for lines naming none).
    :param need: the estimated input tokens of the next shard to create (0: only watching).
    :param cap: ``max_enqueued_tokens``.
    :param watch_ids: the submit's own new batches, waited for until none is validating.
    :param started: when the queue wait began (ISO-8601), handed back in the event.
    :param deadline: when to give up (ISO-8601), or None.
    :param poll_interval: seconds between reads.
    :param max_consecutive_errors: transient listing errors tolerated in a row.
    :param created_ids: every batch the submit has created so far, cancelled when a user kills
        the deferred task and ``cancel_on_kill`` is set (as the batch wait does).
    :param cancel_on_kill: cancel ``created_ids`` when the task is killed while waiting here.
    """

    def __init__(
        self,
        *,
        batch_conn_id: str = DEFAULT_CONN_ID,
        dialect: str | None = None,
        model: str = "",
        need: int = 0,
        cap: int,
        watch_ids: Sequence[str] = (),
        started: str | None = None,
        deadline: str | None = None,
        poll_interval: float = 30.0,
        max_consecutive_errors: int = 5,
        created_ids: Sequence[str] = (),
        cancel_on_kill: bool = True,
    ) -> None:
        super().__init__()
        self.batch_conn_id = batch_conn_id
        self.dialect = dialect
        self.model = model
        self.need = int(need)
        self.cap = int(cap)
        self.watch_ids = [str(b) for b in watch_ids]
        self.started = started
        self.deadline = deadline
        self.poll_interval = max(float(poll_interval), 0.0)
        self.max_consecutive_errors = int(max_consecutive_errors)
        self.created_ids = [check_id(str(b), "created_ids") for b in created_ids]
        self.cancel_on_kill = bool(cancel_on_kill)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "batch_conn_id": self.batch_conn_id,
                "dialect": self.dialect,
                "model": self.model,
                "need": self.need,
                "cap": self.cap,
                "watch_ids": list(self.watch_ids),
                "started": self.started,
                "deadline": self.deadline,
                "poll_interval": self.poll_interval,
                "max_consecutive_errors": self.max_consecutive_errors,
                "created_ids": list(self.created_ids),
                "cancel_on_kill": self.cancel_on_kill,
            },
        )

    def _event(self, status: str, **fields: Any) -> TriggerEvent:
        # The wait's own settings travel back: ``airflow dags test`` resumes with the event alone.
        return TriggerEvent(
            {
                "status": status,
                "model": self.model,
                "cap": self.cap,
                "started": self.started,
                "deadline": self.deadline,
                **fields,
            }
        )

    def _new_hook(self) -> BatchApiHook:
        from airflow_batch_provider.hooks.batch import BatchApiHook
        from airflow_batch_provider.hooks.transport import shared_transport

        return BatchApiHook(self.batch_conn_id, dialect=self.dialect, async_transport=shared_transport())

    async def on_kill(self) -> None:
        """A user killed the waiting task: cancel the batches it created (``cancel_on_kill``)."""
        if not self.cancel_on_kill or not self.created_ids:
            return
        hook = self._new_hook()
        try:
            await acancel_batches(hook, self.created_ids, log=self.log)
        finally:
            with contextlib.suppress(Exception):
                await hook.aclose()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self._new_hook()
        deadline = to_utc(self.deadline)
        errors = 0
        try:
            while True:
                now = datetime.now(timezone.utc)
                if deadline is not None and now >= deadline:
                    yield self._event("timeout", message=f"no room in the queue by {self.deadline}")
                    return
                await asyncio.sleep(until_deadline(self.poll_interval, deadline, now))
                try:
                    ledger = await aread_ledger(hook, self.model, datetime.now(timezone.utc))
                except TRANSIENT_ERRORS as exc:
                    errors += 1
                    if errors > self.max_consecutive_errors:
                        yield self._event("error", message=f"cannot read the batches: {exc}")
                        return
                    self.log.warning(
                        "Reading the enqueued-token ledger failed (%d in a row): %s", errors, exc
                    )
                    continue
                except Exception as exc:
                    yield self._event(
                        "error", message=f"cannot read the batches: {type(exc).__name__}: {exc}"
                    )
                    return
                errors = 0
                if room_ready(ledger, self.need, self.cap, self.watch_ids):
                    yield self._event("ready", held=ledger.tokens)
                    return
                self.log.info(
                    "Queue of %r: %d enqueued token(s); waiting for room for %d under %d",
                    self.model,
                    ledger.tokens,
                    self.need,
                    self.cap,
                )
        finally:
            with contextlib.suppress(Exception):
                await hook.aclose()
