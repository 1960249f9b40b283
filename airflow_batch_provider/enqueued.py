"""The enqueued-token ledger: how many input tokens this connection has in the vendor's queue.

OpenAI and Azure OpenAI cap the input tokens an organisation (or deployment) may have enqueued
per model; a batch past the cap is refused at create or fails with ``token_limit_exceeded``.
A queue-aware submit (``max_enqueued_tokens``) creates shards only while its ledger says they fit.

**Where the ledger lives: at the vendor.** Every batch a queue-aware submit creates carries the
metadata pair ``airflow_enqueued = "<estimated input tokens>:<model>"``. The ledger of a
(connection, model) is the sum of that pair over the connection's batches that are still
enqueued (validating, in progress, finalizing, cancelling), read by listing the batches newest
first back to :data:`LEDGER_HORIZON`. No state is kept anywhere else, so every task of every run,
on any worker, reads the same ledger, and a finished batch leaves it by itself.

Limits: a batch without the pair (made by another tool, or by a submit without
``max_enqueued_tokens``) is invisible to the ledger, as is another user's batch under the same
organisation key; the vendor then refuses or fails a batch the ledger thought would fit, and the
submit waits and creates it again (see :mod:`airflow_batch_provider.operators.submit`). The
sizes are the build's estimates (exact o200k counts where available), not the vendor's own count.
A dialect whose batches carry no metadata (``supports_metadata`` False: xAI and Gemini keep only
the idempotency key, in the batch name; Anthropic nothing) cannot keep a ledger.

The arithmetic here does no I/O; :func:`read_ledger` and :func:`aread_ledger` list the batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import Batch, BatchState

if TYPE_CHECKING:
    from airflow_batch_provider.dialects.base import Dialect
    from airflow_batch_provider.hooks.batch import BatchApiHook

#: The metadata key of a batch's ledger entry: ``"<input tokens>:<model>"``.
QUEUE_TAG = "airflow_enqueued"
#: States in which a batch's tokens are enqueued (cancelling: the vendor has not let go yet).
ENQUEUED_STATES = frozenset(
    {BatchState.VALIDATING, BatchState.IN_PROGRESS, BatchState.FINALIZING, BatchState.CANCELLING}
)
#: Batches created longer ago than this are not read: past any completion window (24h) plus
#: the vendor's finalizing, none is still enqueued.
LEDGER_HORIZON = timedelta(hours=48)


def queue_tag(tokens: int, model: str | None) -> str:
    """The ledger entry of a batch of ``tokens`` estimated input tokens for ``model``."""
    return f"{int(tokens)}:{model or ''}"


def parse_queue_tag(value: str | None) -> tuple[int, str] | None:
    """``(tokens, model)`` of a ledger entry, or None when it is not one."""
    if not value:
        return None
    tokens, sep, model = value.partition(":")
    if not sep or not tokens.isdigit():
        return None
    return int(tokens), model


@dataclass(frozen=True)
class Ledger:
    """The enqueued tokens of one model, read from the vendor's batches.

    :param model: the model ("" for lines naming none).
    :param tokens: the sum of the enqueued batches' entries.
    :param batches: every batch read (enqueued or not) by id: a submit judges its own batches by
        them without reading each again.
    """

    model: str
    tokens: int = 0
    batches: dict[str, Batch] = field(default_factory=dict)

    def fits(self, tokens: int, cap: int) -> bool:
        """Whether a batch of ``tokens`` may be created now under ``cap``."""
        return self.tokens + tokens <= cap


def tally(batches: Iterable[Batch], dialect: Dialect, model: str) -> Ledger:
    """The ledger of ``model`` over ``batches`` (already read; those without an entry count 0)."""
    tokens = 0
    read: dict[str, Batch] = {}
    for batch in batches:
        read[batch.id] = batch
        entry = parse_queue_tag(dialect.metadata_of(batch).get(QUEUE_TAG))
        if entry is not None and entry[1] == model and batch.state in ENQUEUED_STATES:
            tokens += entry[0]
    return Ledger(model, tokens, read)


def check_ledger_dialect(dialect: Dialect) -> None:
    """A queue-aware submit needs batches that carry tags (its ledger entries)."""
    if not dialect.supports_metadata or dialect.orphan_lookup != "tags":
        raise ConfigurationError(
            f"max_enqueued_tokens needs batches that carry metadata; {dialect.label}'s batches "
            "carry none, so the submit cannot keep its enqueued-token ledger"
        )
    if dialect.submission_mode == "object_store":
        # Their jobs' labels/tags hold the run's identity only (Vertex labels cannot even hold an
        # entry's "tokens:model"): without this refusal the cap would be silently ignored.
        raise ConfigurationError(
            f"max_enqueued_tokens needs batches that carry metadata; {dialect.label}'s jobs are "
            "created from object storage and do not carry the enqueued-token ledger's entry"
        )


def check_shard_fits(index: int, tokens: int, cap: int) -> None:
    """A shard larger than the cap alone can never be created: fail before any upload."""
    if tokens > cap:
        raise ConfigurationError(
            f"shard {index} holds an estimated {tokens:,} input tokens, more than max_enqueued_tokens "
            f"({cap:,}) allows in the queue at once, so it could never be created; build smaller "
            "shards (max_lines / max_bytes) or raise the cap"
        )


def _recent(batch: Batch, since: datetime) -> bool:
    return batch.created_at is None or batch.created_at >= since


def read_ledger(hook: BatchApiHook, model: str, now: datetime) -> Ledger:
    """List the connection's batches back to :data:`LEDGER_HORIZON` and tally ``model``'s entries."""
    since = now - LEDGER_HORIZON
    read: list[Batch] = []
    for batch in hook.list_batches():
        if not _recent(batch, since):
            break  # newest first: the rest are older still
        read.append(batch)
    return tally(read, hook.dialect, model)


async def aread_ledger(hook: BatchApiHook, model: str, now: datetime) -> Ledger:
    """Async twin of :func:`read_ledger` (the trigger's)."""
    since = now - LEDGER_HORIZON
    read: list[Batch] = []
    batches = hook.alist_batches()
    try:
        async for batch in batches:
            if not _recent(batch, since):
                break
            read.append(batch)
    finally:
        await batches.aclose()  # type: ignore[attr-defined]
    dialect = (await hook.aget_settings()).dialect
    return tally(read, dialect, model)
