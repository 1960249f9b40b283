"""The shared decision function: every terminal outcome, precedence, deadline and events."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from airflow_batch_provider.models import Batch, BatchError, BatchState, RequestCounts
from airflow_batch_provider.outcome import decide, error_event, parse_event, progress_line

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def batch(bid: str, state: str, total: int = 10, completed: int = 0, failed: int = 0, **kw: object) -> Batch:
    return Batch(
        id=bid,
        state=BatchState(state),
        request_counts=RequestCounts(total=total, completed=completed, failed=failed),
        **kw,  # type: ignore[arg-type]
    )


def test_running_until_all_terminal() -> None:
    out = decide([batch("b1", "completed", completed=10), batch("b2", "in_progress", completed=3)], now=NOW)
    assert out.status == "running"
    assert not out.is_terminal
    assert out.counts == RequestCounts(total=20, completed=13, failed=0)


def test_all_completed_is_success() -> None:
    out = decide([batch("b1", "completed", completed=10), batch("b2", "completed", completed=10)])
    assert out.status == "success"
    assert out.termination_reason == "all_completed"
    event = out.event()
    assert event["batch_ids"] == ["b1", "b2"]
    assert event["counts"] == {"total": 20, "completed": 20, "failed": 0}
    assert [b["state"] for b in event["batches"]] == ["completed", "completed"]


def test_completed_with_failed_lines_is_partial() -> None:
    out = decide([batch("b1", "completed", completed=7, failed=3), batch("b2", "completed", completed=10)])
    assert out.status == "partial"
    assert "b1: 3 of 10 failed" in out.message
    assert "b2" not in out.message.split(":", 1)[1]


def test_completed_with_every_line_failed_is_failed() -> None:
    out = decide(
        [batch("b1", "completed", completed=0, failed=10), batch("b2", "completed", failed=5, total=5)]
    )
    assert out.status == "failed"
    assert out.termination_reason == "all_lines_failed"
    assert "all 15 line(s) failed" in out.message


@pytest.mark.parametrize("state", ["failed", "expired", "cancelled"])
def test_any_bad_batch_ends_the_wait_even_if_others_run(state: str) -> None:
    out = decide([batch("ok", "in_progress"), batch("bad", state)], now=NOW)
    assert out.status == state
    assert out.termination_reason == f"batch_{state}"
    assert "batch bad " + state in out.message


def test_failed_outranks_expired_and_cancelled_and_all_are_named() -> None:
    out = decide([batch("c", "cancelled"), batch("e", "expired"), batch("f", "failed")])
    assert out.status == "failed"
    for bid in ("c", "e", "f"):
        assert f"batch {bid} " in out.message


def test_vendor_errors_are_in_the_message() -> None:
    errors = [BatchError(code="invalid_json", message="bad line", line=i) for i in range(1, 9)]
    out = decide([batch("b1", "failed", total=0, errors=errors)])
    assert "invalid_json line 1: bad line" in out.message
    assert "(+3 more)" in out.message


def test_deadline_gives_timeout_only_when_work_is_outstanding() -> None:
    deadline = NOW - timedelta(seconds=1)
    out = decide(
        [batch("b1", "in_progress", completed=4), batch("b2", "completed")], deadline=deadline, now=NOW
    )
    assert out.status == "timeout"
    assert "b1 (in_progress, 6 line(s) pending)" in out.message
    assert "b2" not in out.message
    # Completing at the deadline still counts as completed.
    assert decide([batch("b1", "completed", completed=10)], deadline=deadline, now=NOW).status == "success"
    # Before the deadline it keeps running.
    assert (
        decide([batch("b1", "in_progress")], deadline=NOW + timedelta(hours=1), now=NOW).status == "running"
    )


def test_cancelling_is_not_terminal() -> None:
    assert decide([batch("b1", "cancelling")], now=NOW).status == "running"


def test_no_batches_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        decide([])


def test_event_round_trip_and_validation() -> None:
    out = decide([batch("b1", "completed", completed=9, failed=1, created_at=NOW)])
    parsed = parse_event(out.event())
    assert parsed.status == "partial"
    assert parsed.batches[0].created_at == NOW
    assert parsed.counts.failed == 1
    err = parse_event(error_event(["b1"], "gave up"))
    assert err.status == "error" and err.batch_ids == ["b1"] and err.batches == []
    with pytest.raises(ValueError, match="mapping"):
        parse_event(None)
    with pytest.raises(ValueError, match="unknown status 'done'"):
        parse_event({"status": "done", "batch_ids": ["b1"]})
    with pytest.raises(ValueError, match="batch_ids"):
        parse_event({"status": "success"})


def test_progress_line() -> None:
    text = progress_line([batch("b1", "in_progress", completed=5), batch("b2", "validating")], 75)
    assert text == (
        "2 batch(es): 1 in_progress, 1 validating; lines 5 completed, 0 failed, 15 processing, 20 total"
        " (25.0%);"
        " elapsed 1m15s"
    )


def test_deadline_after_polling_errors_ends_as_timeout_even_with_no_state_read() -> None:
    from datetime import datetime, timedelta, timezone

    from airflow_batch_provider.exceptions import BatchApiServerError
    from airflow_batch_provider.outcome import deadline_event_after_error

    now = datetime(2026, 1, 2, tzinfo=timezone.utc)
    error = BatchApiServerError("busy", status_code=503)
    assert (
        deadline_event_after_error([], ["b1"], deadline=now + timedelta(seconds=1), now=now, error=error)
        is None
    )
    assert deadline_event_after_error([], ["b1"], deadline=None, now=now, error=error) is None
    event = deadline_event_after_error([], ["b1"], deadline=now - timedelta(seconds=1), now=now, error=error)
    assert event is not None
    assert (event["status"], event["termination_reason"], event["batch_ids"]) == (
        "timeout",
        "deadline_exceeded",
        ["b1"],
    )
    assert "busy" in event["message"]
