"""The xAI dialect: derived states, name-as-identity, colon cancel, paged results."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from airflow_batch_provider.dialects import XAIDialect
from airflow_batch_provider.dialects.xai import NAME_KEY
from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.models import BatchState

D = XAIDialect()
FUTURE = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
PAST = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat()


def xbatch(**state: int) -> dict[str, Any]:
    counts = {"num_requests": 4, "num_pending": 0, "num_success": 4, "num_error": 0, "num_cancelled": 0}
    counts.update(state)
    return {
        "batch_id": "batch-x1",
        "name": "dag.task.run",
        "create_time": "2026-11-30T10:00:00Z",
        "expire_time": FUTURE,
        "state": counts,
    }


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        (xbatch(num_requests=0, num_success=0), BatchState.VALIDATING),
        (xbatch(num_pending=3, num_success=1), BatchState.IN_PROGRESS),
        (xbatch(), BatchState.COMPLETED),
        (xbatch(num_success=1, num_error=3), BatchState.COMPLETED),
        (xbatch(num_pending=2) | {"cancel_time": "2026-11-30T10:05:00Z"}, BatchState.CANCELLING),
        (
            xbatch(num_success=1, num_cancelled=3) | {"cancel_time": "2026-11-30T10:05:00Z"},
            BatchState.CANCELLED,
        ),
        # Past expire_time with pending requests and no cancel: xAI still runs it.
        (xbatch(num_pending=2) | {"expire_time": PAST}, BatchState.IN_PROGRESS),
        (xbatch(num_success=2, num_error=2) | {"expire_time": PAST}, BatchState.COMPLETED),
        (
            xbatch(num_requests=0, num_success=0) | {"cancel_by_xai_message": "line 3: invalid JSON"},
            BatchState.FAILED,
        ),
    ],
)
def test_derived_states(raw: dict[str, Any], state: BatchState) -> None:
    assert D.parse_batch(raw).state is state


def test_derived_batch_fields() -> None:
    parsed = D.parse_batch(xbatch(num_success=3, num_error=1))
    assert parsed.id == "batch-x1"
    assert parsed.request_counts.total == 4
    assert (parsed.request_counts.completed, parsed.request_counts.failed) == (3, 1)
    assert parsed.created_at == datetime(2026, 11, 30, 10, tzinfo=timezone.utc)
    assert D.metadata_of(parsed) == {NAME_KEY: "dag.task.run", "name": "dag.task.run"}


def test_xai_cancel_is_a_failure_with_its_message() -> None:
    parsed = D.parse_batch(xbatch() | {"cancel_by_xai_message": "line 3: invalid JSON"})
    assert parsed.errors[0].code == "cancelled_by_xai"
    assert parsed.errors[0].message == "line 3: invalid JSON"


def test_unreadable_batches() -> None:
    with pytest.raises(BatchApiResponseError, match="batch_id"):
        D.parse_batch({"name": "n", "state": {}})
    with pytest.raises(BatchApiResponseError, match="unreadable state"):
        D.parse_batch({"batch_id": "b", "state": "RUNNING"})


def test_wire_differences() -> None:
    assert D.upload_form() == {}
    assert D.cancel_path("b1") == "batches/b1:cancel"
    assert D.results_path("b1") == "batches/b1/results"
    assert D.results_modes == ("results_endpoint",)
    assert D.mixed_endpoints and D.validation_rules().mixed_endpoints
    assert not D.supports_metadata
    assert D.auth_headers("xk") == {"Authorization": "Bearer xk"}


def test_create_body_carries_the_identity_in_the_name() -> None:
    common = {"input_file_id": "file-1", "endpoint": "/v1/responses", "completion_window": "24h"}
    assert D.create_batch_body(**common, metadata={NAME_KEY: "run-7", "other": "x"}) == {
        "name": "run-7",
        "input_file_id": "file-1",
    }
    assert D.create_batch_body(**common, name="mine") == {"name": "mine", "input_file_id": "file-1"}
    assert D.create_batch_body(**common) == {"name": "airflow-batch", "input_file_id": "file-1"}


def test_list_page_gives_back_known_batches_by_batch_id() -> None:
    known = {b.id: b for b in D.parse_list_page({"batches": [xbatch(num_pending=3)]}, {}).batches}
    again = D.parse_list_page({"batches": [xbatch(num_pending=3), xbatch(num_pending=2)]}, {}, known)
    assert again.batches[0] is known["batch-x1"]
    assert again.batches[1] is not known["batch-x1"] and again.batches[1].raw["state"]["num_pending"] == 2


def test_list_page_pagination_token() -> None:
    page = D.parse_list_page({"batches": [xbatch()], "pagination_token": "tok"}, {"limit": 1})
    assert [b.id for b in page.batches] == ["batch-x1"]
    assert page.next_params == {"limit": 1, "pagination_token": "tok"}
    assert (
        D.parse_list_page({"batches": [xbatch()], "pagination_token": None}, {"limit": 1}).next_params is None
    )
    # The token is the end marker, not the page's length.
    assert D.parse_list_page({"batches": [], "pagination_token": "tok"}, {"limit": 1}).next_params == {
        "limit": 1,
        "pagination_token": "tok",
    }
    assert D.parse_list_page({"batches": [xbatch()]}, {"limit": 5}).next_params is None


def test_results_page() -> None:
    raw = {
        "results": [
            {
                "batch_request_id": "a",
                "batch_result": {"response": {"chat_get_completion": {"content": "hi"}}},
            },
            {
                "batch_request_id": "b",
                "batch_result": {"response": {"status_code": 200, "body": {"id": "r"}}},
            },
            {
                "batch_request_id": "c",
                "batch_result": {"error": {"code": "invalid_argument", "message": "no"}},
            },
            {"batch_request_id": "d", "batch_result": {}, "error_message": "timed out"},
            {"batch_request_id": "e", "batch_result": {}},
            {
                "batch_request_id": "f",
                "batch_result": {"response": {"status_code": 500, "body": {"error": "x"}}},
            },
        ],
        "pagination_token": "next",
    }
    page = D.parse_results_page(raw, {"limit": 6})
    by_id = {line.custom_id: line for line in page.lines}
    assert by_id["a"].ok and by_id["a"].body == {"content": "hi"} and by_id["a"].status_code == 200
    assert by_id["b"].ok and by_id["b"].body == {"id": "r"}
    assert not by_id["c"].ok and by_id["c"].error is not None and by_id["c"].error.code == "invalid_argument"
    assert by_id["d"].error is not None and by_id["d"].error.message == "timed out"
    assert by_id["e"].error is not None and by_id["e"].error.code == "unknown_error"
    assert not by_id["f"].ok and by_id["f"].error is not None and by_id["f"].error.code == "http_500"
    assert all(line.source == "inline" for line in page.lines)
    assert page.next_params == {"limit": 6, "pagination_token": "next"}


def test_results_page_last_and_bad() -> None:
    assert D.parse_results_page({"results": [], "pagination_token": None}, {"limit": 5}).next_params is None
    assert D.parse_results_page({"results": []}, {"limit": 5}).next_params is None
    # A page shorter than the limit asked for, with a token, is not the end.
    short = {
        "results": [{"batch_request_id": "a", "batch_result": {"response": {"x": {}}}}],
        "pagination_token": "t",
    }
    assert D.parse_results_page(short, {"limit": 1000}).next_params == {
        "limit": 1000,
        "pagination_token": "t",
    }
    with pytest.raises(BatchApiResponseError, match="unreadable"):
        D.parse_results_page([1, 2], {"limit": 5})
    with pytest.raises(BatchApiResponseError, match="batch_request_id"):
        D.parse_results_item({"batch_result": {}})


@pytest.mark.parametrize(
    "error", [{}, {"code": 0}, {"code": "0"}, {"code": "OK", "message": ""}, {"code": 0, "message": "ok"}]
)
def test_grpc_ok_or_empty_error_is_a_success(error: dict[str, Any]) -> None:
    item = {
        "batch_request_id": "a",
        "batch_result": {"response": {"chat_get_completion": {"id": "r"}}, "error": error},
    }
    line = D.parse_results_item(item)
    assert line.ok and line.error is None and line.body == {"id": "r"}


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"code": 1, "message": "cancelled by user"}, "batch_cancelled"),
        ({"code": "CANCELLED"}, "batch_cancelled"),
        ({"code": 4, "message": "deadline"}, "batch_expired"),
        ({"code": 3, "message": "bad request"}, "invalid_argument"),
        ({"code": "RESOURCE_EXHAUSTED", "message": "m"}, "resource_exhausted"),
        ({"message": "no code"}, None),
    ],
)
def test_grpc_error_codes(error: dict[str, Any], code: str | None) -> None:
    line = D.parse_results_item({"batch_request_id": "a", "batch_result": {"response": None, "error": error}})
    assert not line.ok and line.error is not None and line.error.code == code


def test_batch_keeps_its_input_file_id() -> None:
    assert D.parse_batch(xbatch() | {"input_file_id": "file-9"}).input_file_id == "file-9"
    assert D.parse_batch(xbatch()).input_file_id is None


def test_a_listed_item_is_named_by_its_batch_id_or_its_id() -> None:
    # The same keys parse_batch reads: a poller looking for "b1" finds it either way.
    assert D.listed_id({"batch_id": "b1", "id": "other"}) == "b1"
    assert D.listed_id({"id": "b1"}) == "b1"
    assert D.listed_id({"batch_id": 5}) is None and D.listed_id(["b1"]) is None
