"""The wire and domain models: strict requests, tolerant responses, aware UTC timestamps."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import orjson
import pytest
from pydantic import ValidationError

from airflow_batch_provider.exceptions import UnknownBatchStatusError
from airflow_batch_provider.models import (
    Batch,
    BatchState,
    LineError,
    Manifest,
    RequestCounts,
    RequestLine,
    ResultLine,
    Shard,
    to_utc,
)

TERMINAL = {BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED}


@pytest.mark.parametrize("state", list(BatchState))
def test_terminal_and_success(state: BatchState) -> None:
    assert state.is_terminal is (state in TERMINAL)
    assert state.is_success is (state is BatchState.COMPLETED)


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("completed", BatchState.COMPLETED),
        (" COMPLETED ", BatchState.COMPLETED),
        ("in-progress", BatchState.IN_PROGRESS),
        ("canceled", BatchState.CANCELLED),
        ("Canceling", BatchState.CANCELLING),
    ],
)
def test_parse_spellings(text: str, state: BatchState) -> None:
    assert BatchState.parse(text) is state


def test_parse_unknown_or_missing() -> None:
    with pytest.raises(
        UnknownBatchStatusError, match=r"batch b1 reported unknown status 'archived'; known: validating"
    ):
        BatchState.parse("archived", batch_id="b1")
    with pytest.raises(UnknownBatchStatusError, match="batch b2 has no status"):
        BatchState.parse(None, batch_id="b2")


def test_request_line_is_strict() -> None:
    line = RequestLine(custom_id="a", url="/v1/chat/completions", body={"model": "m"})
    assert line.method == "POST"
    with pytest.raises(ValidationError, match="extra"):
        RequestLine.model_validate({"custom_id": "a", "url": "/u", "body": {}, "stream": True})
    with pytest.raises(ValidationError, match="custom_id"):
        RequestLine.model_validate({"custom_id": "", "url": "/u", "body": {}})
    with pytest.raises(ValidationError, match="custom_id"):
        RequestLine.model_validate({"custom_id": 7, "url": "/u", "body": {}})  # strict: no coercion
    with pytest.raises(ValidationError, match="body"):
        RequestLine.model_validate({"custom_id": "a", "url": "/u", "body": "text"})


def test_request_counts() -> None:
    counts = RequestCounts.model_validate({"total": 10, "completed": 6, "failed": 1, "new_field": 3})
    assert counts.pending == 3
    assert RequestCounts(total=1, completed=2, failed=0).pending == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1_736_295_000, datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc)),
        (1_736_295_000_000, datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc)),  # milliseconds
        (1_736_295_000.5, datetime(2025, 1, 8, 0, 10, 0, 500000, tzinfo=timezone.utc)),
        ("2025-01-08T00:10:00Z", datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc)),
        ("2025-01-08T02:10:00+02:00", datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc)),
        ("2025-01-08T00:10:00", datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc)),  # naive means UTC
        (datetime(2025, 1, 8, 0, 10), datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc)),
        (
            datetime(2025, 1, 8, 1, 10, tzinfo=timezone(timedelta(hours=1))),
            datetime(2025, 1, 8, 0, 10, tzinfo=timezone.utc),
        ),
        (None, None),
        ("", None),
    ],
)
def test_to_utc(value: object, expected: datetime | None) -> None:
    result = to_utc(value)
    assert result == expected
    if result is not None:
        assert result.tzinfo is not None and result.utcoffset() == timedelta(0)


def test_to_utc_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="timestamp"):
        to_utc([2025])
    with pytest.raises(ValueError):
        to_utc("yesterday")


def test_batch_is_tolerant_and_normalised() -> None:
    batch = Batch.model_validate(
        {
            "id": "b",
            "state": "completed",
            "created_at": 1_736_295_000,
            "completed_at": "2025-01-08T01:00:00Z",
            "metadata": {"n": 1, "flag": True},
            "errors": {"object": "list", "data": [{"code": "x", "line": 2, "message": "m", "extra": 1}]},
            "unknown_vendor_field": "ignored",
            "raw": {"id": "b", "status": "completed"},
        }
    )
    assert batch.state is BatchState.COMPLETED and batch.is_terminal
    assert batch.created_at is not None and batch.created_at.tzinfo is not None
    assert batch.metadata == {"n": "1", "flag": "True"}
    assert batch.errors[0].line == 2
    assert Batch(id="b", state=BatchState.VALIDATING, metadata=None, errors=None).metadata == {}  # type: ignore[arg-type]
    assert (
        Batch.model_validate({"id": "b", "state": "failed", "errors": [{"code": "c"}]}).errors[0].code == "c"
    )


def test_batch_summary_is_small_and_json_able() -> None:
    batch = Batch(id="b", state=BatchState.FAILED, raw={"secret_vendor_blob": "x" * 10_000})
    summary = batch.summary()
    assert "raw" not in summary
    assert summary["state"] == "failed"
    assert orjson.loads(orjson.dumps(summary))["id"] == "b"
    assert "secret_vendor_blob" not in repr(batch)


def test_batch_rejects_an_unknown_state() -> None:
    with pytest.raises(ValidationError):
        Batch.model_validate({"id": "b", "state": "paused"})


def test_result_line() -> None:
    line = ResultLine.model_validate(
        {
            "custom_id": "c",
            "ok": False,
            "error": {"code": "x", "message": "m", "new": 1},
            "source": "error",
            "z": 1,
        }
    )
    assert line.error == LineError(code="x", message="m")
    assert line.source == "error"
    with pytest.raises(ValidationError, match="source"):
        ResultLine.model_validate({"custom_id": "c", "ok": True, "source": "somewhere"})


def test_manifest_round_trip() -> None:
    manifest = Manifest(
        endpoint="/v1/chat/completions",
        key_columns=["id"],
        key_types=["integer"],
        shards=[Shard(index=0, path="shard-00000.jsonl", lines=3, bytes=120, fingerprint="ab" * 32)],
        rows_read=4,
        rows_written=3,
        rows_rejected=1,
    )
    assert manifest.created_at.tzinfo is not None
    again = Manifest.model_validate_json(manifest.model_dump_json())
    assert again == manifest
    assert Manifest.model_validate({"endpoint": "/v1/embeddings", "future_field": 1}).dialect == "openai"


@pytest.mark.parametrize("value", [1e20, -1e20, 10**30, True, {"at": 1}], ids=repr)
def test_to_utc_out_of_range_or_odd_is_a_value_error(value: object) -> None:
    # Never an OverflowError or OSError: the models report a ValueError as an invalid field.
    with pytest.raises(ValueError, match="as a timestamp"):
        to_utc(value)


@pytest.mark.parametrize(
    "fields", [{"metadata": 5}, {"metadata": ["a"]}, {"created_at": 1e20}, {"expires_at": True}], ids=repr
)
def test_batch_with_an_unreadable_field_is_a_validation_error(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Batch.model_validate({"id": "b1", "state": "in_progress", **fields})
