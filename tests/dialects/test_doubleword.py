"""The Doubleword dialect: OpenAI files and batches plus a skip/limit results endpoint."""

from __future__ import annotations

import orjson
import pytest

from airflow_batch_provider.dialects import DoublewordDialect
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.models import BatchState

D = DoublewordDialect()
UUID = "0b7c1d7e-3f6a-4d1e-9a53-2b8c6f1e4a90"


def test_declared_differences() -> None:
    assert D.completion_windows == ("24h", "1h")
    D.check_completion_window("1h")
    assert D.unique_custom_ids is False
    assert D.validation_rules().unique_custom_ids is False
    assert D.results_modes == ("files", "results_endpoint")
    assert D.endpoints == {"/v1/chat/completions", "/v1/embeddings", "/v1/responses"}
    assert D.auth_headers("k") == {"Authorization": "Bearer k"}
    assert D.upload_form() == {"purpose": "batch"}
    assert D.results_path(UUID) == f"batches/{UUID}/results"
    assert D.results_params() == {"skip": 0, "limit": 1000}
    assert D.results_params(50) == {"skip": 0, "limit": 50}


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("validating", BatchState.VALIDATING),
        ("in_progress", BatchState.IN_PROGRESS),
        ("finalizing", BatchState.FINALIZING),
        ("completed", BatchState.COMPLETED),
        ("failed", BatchState.FAILED),
        ("cancelling", BatchState.CANCELLING),
        ("cancelled", BatchState.CANCELLED),
    ],
)
def test_statuses_with_uuid_ids(status: str, state: BatchState) -> None:
    parsed = D.parse_batch(
        {"id": UUID, "status": status, "request_counts": {"total": 3, "completed": 2, "failed": 1}}
    )
    assert parsed.id == UUID and parsed.state is state


def test_unknown_status_raises() -> None:
    with pytest.raises(UnknownBatchStatusError, match="running_late"):
        D.parse_batch({"id": UUID, "status": "running_late"})


# The result format of seed 000 (no "status" field) and the endpoint's fuller shape.
SEED_ITEM = {
    "id": "req-abc123",
    "custom_id": "request-001",
    "response_body": {
        "id": "chatcmpl-xyz",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Batch inference is..."}}],
        "usage": {"prompt_tokens": 42, "completion_tokens": 128, "total_tokens": 170},
    },
}


def test_seed_result_item() -> None:
    line = D.parse_results_item(SEED_ITEM)
    assert line.ok and line.custom_id == "request-001"
    assert line.body == SEED_ITEM["response_body"]
    assert line.line_id == "req-abc123" and line.source == "inline" and line.status_code == 200


@pytest.mark.parametrize(
    ("item", "code", "message"),
    [
        (
            {"custom_id": "c", "response_body": None, "error": "model overloaded", "status": "failed"},
            "error",
            "model overloaded",
        ),
        ({"custom_id": "c", "error": {"code": "bad", "message": "no"}, "status": "failed"}, "bad", "no"),
        (
            {"custom_id": "c", "response_body": None, "status": "cancelled"},
            "cancelled",
            "request ended cancelled",
        ),
        ({"custom_id": "c", "response_body": {"x": 1}, "status": "failed"}, "failed", "request ended failed"),
        ({"custom_id": "c"}, "unknown_error", "request ended without a body"),
    ],
)
def test_failed_items(item: dict, code: str, message: str) -> None:
    line = D.parse_results_item(item)
    assert not line.ok
    assert line.error is not None and (line.error.code, line.error.message) == (code, message)


@pytest.mark.parametrize("item", [{"id": "x", "response_body": {}}, {"id": "x", "custom_id": None}])
def test_item_without_custom_id_is_kept_as_an_unmatched_failure(item: dict) -> None:
    # Doubleword's custom_id is optional (null on the results endpoint): the line is reported,
    # not a crash of the whole read.
    line = D.parse_results_item({**item, "status": "completed"})
    assert line.custom_id == "" and not line.ok and line.line_id == "x"
    assert (
        line.error is not None and line.error.code == "missing_custom_id" and "'x'" in str(line.error.message)
    )


def test_item_with_an_unreadable_custom_id() -> None:
    with pytest.raises(BatchApiResponseError, match="custom_id"):
        D.parse_results_item({"id": "x", "custom_id": 5, "response_body": {}})


def _item(i: int) -> dict:
    return {"id": f"r{i}", "custom_id": f"c{i}", "response_body": {"n": i}, "status": "completed"}


@pytest.mark.parametrize(
    "raw",
    [
        b"".join(orjson.dumps(_item(i)) + b"\n" for i in range(3)),
        b"".join(orjson.dumps(_item(i)) + b"\r\n\n" for i in range(3)).decode(),
        [_item(i) for i in range(3)],
        {"data": [_item(i) for i in range(3)]},
    ],
)
def test_results_page_shapes(raw: object) -> None:
    page = D.parse_results_page(raw, {"skip": 0, "limit": 10}, {"X-Incomplete": "false"})
    assert [line.custom_id for line in page.lines] == ["c0", "c1", "c2"]
    assert page.next_params is None  # the server said it was the last page


def test_a_short_page_is_not_the_end() -> None:
    # The server clamps limit (to 101): 3 lines for a limit of 1000 says nothing about the rest.
    page = D.parse_results_page([_item(i) for i in range(3)], {"skip": 0, "limit": 1000})
    assert page.next_params == {"skip": 3, "limit": 1000}
    page = D.parse_results_page(
        [_item(i) for i in range(3)], {"skip": 0, "limit": 1000}, {"X-Incomplete": "true"}
    )
    assert page.next_params == {"skip": 3, "limit": 1000}


def test_the_end_is_x_incomplete_false_or_an_empty_page() -> None:
    assert (
        D.parse_results_page([_item(0)], {"skip": 4, "limit": 2}, {"x-incomplete": "false"}).next_params
        is None
    )
    assert D.parse_results_page(b"", {"skip": 4, "limit": 2}).next_params is None
    # An empty page ends the walk even while the server says the batch still runs.
    assert D.parse_results_page(b"", {"skip": 4, "limit": 2}, {"X-Incomplete": "true"}).next_params is None


def test_full_page_asks_for_the_next() -> None:
    page = D.parse_results_page([_item(i) for i in range(2)], {"skip": 4, "limit": 2})
    assert page.next_params == {"skip": 6, "limit": 2}


def test_doubleword_limits() -> None:
    # 10 MB request bodies, 100 MB uploads (so shards are cut at 100 MB), 64-character custom_ids.
    assert D.limits.max_line_bytes == 10 << 20
    assert D.limits.max_upload_bytes == 100 << 20 and D.limits.max_shard_bytes == 100 << 20
    rules = D.validation_rules()
    assert rules.max_custom_id_chars == 64 and rules.mixed_models


def test_a_single_item_answered_as_one_json_object_is_not_dropped() -> None:
    # A one-line JSONL page parses as a single JSON object; it is an item, not an envelope.
    page = D.parse_results_page(_item(0), {"skip": 0, "limit": 10})
    assert [line.custom_id for line in page.lines] == ["c0"]


def test_unreadable_page() -> None:
    with pytest.raises(BatchApiResponseError, match="unreadable"):
        D.parse_results_page(42, {"skip": 0, "limit": 10})


def test_output_file_lines_use_the_openai_shape() -> None:
    raw = {"id": "x", "custom_id": "c", "response": {"status_code": 200, "body": {"a": 1}}, "error": None}
    assert D.parse_result_line(raw, "output").ok
