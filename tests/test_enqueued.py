"""The enqueued-token ledger's arithmetic: entries, the tally per model, what fits, what never can."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS, get_dialect
from airflow_batch_provider.enqueued import (
    QUEUE_TAG,
    Ledger,
    check_ledger_dialect,
    check_shard_fits,
    parse_queue_tag,
    queue_tag,
    tally,
)
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import Batch, BatchState
from airflow_batch_provider.submission import RunIdentity, batch_metadata


def batch(batch_id: str, state: str, entry: str | None, **extra: str) -> Batch:
    metadata: dict[str, Any] = dict(extra)
    if entry is not None:
        metadata[QUEUE_TAG] = entry
    return Batch(id=batch_id, state=BatchState(state), metadata=metadata)


def test_an_entry_round_trips_and_junk_is_no_entry() -> None:
    assert parse_queue_tag(queue_tag(1234, "gpt-4o")) == (1234, "gpt-4o")
    # A fine-tuned model's name holds colons: the count is before the first one.
    assert parse_queue_tag(queue_tag(5, "ft:gpt-4o:org:x")) == (5, "ft:gpt-4o:org:x")
    assert parse_queue_tag(queue_tag(7, None)) == (7, "")
    for junk in (None, "", "12", "x:gpt", "-3:gpt", "1.5:gpt"):
        assert parse_queue_tag(junk) is None


def test_the_tally_sums_enqueued_batches_of_the_model_only() -> None:
    batches = [
        batch("a", "validating", queue_tag(10, "m")),
        batch("b", "in_progress", queue_tag(20, "m")),
        batch("c", "finalizing", queue_tag(30, "m")),
        batch("d", "cancelling", queue_tag(40, "m")),
        batch("e", "completed", queue_tag(1000, "m")),
        batch("f", "failed", queue_tag(1000, "m")),
        batch("g", "in_progress", queue_tag(1000, "other")),
        batch("h", "in_progress", None),  # another tool's batch: invisible
        batch("i", "in_progress", "garbage"),
    ]
    ledger = tally(batches, get_dialect("openai"), "m")
    assert ledger.tokens == 100
    assert ledger.batches["a"].state is BatchState.VALIDATING and len(ledger.batches) == len(batches)


def test_fits_up_to_the_cap_inclusive() -> None:
    ledger = Ledger("m", 60)
    assert ledger.fits(40, 100) and not ledger.fits(41, 100)
    assert Ledger("m").fits(100, 100)


def test_a_shard_over_the_cap_alone_is_refused_naming_it() -> None:
    check_shard_fits(3, 100, 100)
    with pytest.raises(ConfigurationError, match=r"shard 3 holds an estimated 101 input tokens.*\(100\)"):
        check_shard_fits(3, 101, 100)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_a_vendor_without_batch_metadata_cannot_keep_a_ledger(name: str) -> None:
    dialect = get_dialect(name)
    if (
        dialect.supports_metadata
        and dialect.orphan_lookup == "tags"
        and dialect.submission_mode != "object_store"
    ):
        check_ledger_dialect(dialect)
        return
    with pytest.raises(ConfigurationError, match="max_enqueued_tokens needs batches that carry metadata"):
        check_ledger_dialect(dialect)


def test_the_entry_is_kept_in_the_metadata_before_identity_pairs() -> None:
    dialect = get_dialect("openai")
    identity = RunIdentity("dag", "submit", "run", -1)
    user = {f"k{i}": "v" for i in range(dialect.max_metadata_pairs - 3)}
    meta = batch_metadata(identity, shard=0, fingerprint="f" * 64, dialect=dialect, extra=user, queue="9:m")
    assert meta[QUEUE_TAG] == "9:m" and len(meta) == dialect.max_metadata_pairs
    with pytest.raises(ConfigurationError, match=f"at least 3 .*{QUEUE_TAG}"):
        batch_metadata(
            identity,
            shard=0,
            fingerprint="f" * 64,
            dialect=dialect,
            extra={**user, "one": "more"},
            queue="9:m",
        )
