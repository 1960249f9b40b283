"""The OpenAI dialect (the baseline every other dialect inherits from)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS, Dialect, OpenAIDialect, get_dialect
from airflow_batch_provider.exceptions import (
    BatchApiResponseError,
    ConfigurationError,
    UnknownBatchStatusError,
    UnknownDialectError,
)
from airflow_batch_provider.models import BatchState

D = OpenAIDialect()


def batch(status: str = "in_progress", **fields: Any) -> dict[str, Any]:
    return {
        "id": "batch_abc123",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "errors": None,
        "input_file_id": "file-in",
        "completion_window": "24h",
        "status": status,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": 1_736_295_000,
        "in_progress_at": None,
        "expires_at": 1_736_381_400,
        "request_counts": {"total": 10, "completed": 4, "failed": 1},
        "metadata": {"airflow_batch_key": "k1"},
        "a_field_added_next_year": {"x": 1},
        **fields,
    }


def test_registry() -> None:
    assert sorted(DIALECTS) == [
        "anthropic",
        "azure",
        "bedrock",
        "doubleword",
        "gemini",
        "mistral",
        "openai",
        "vertex",
        "xai",
        "zerogpu",
    ]
    assert isinstance(get_dialect(None), OpenAIDialect)
    assert get_dialect(" XAI ").name == "xai"
    assert get_dialect(D) is D
    with pytest.raises(
        UnknownDialectError,
        match="unknown dialect 'palm'.*anthropic, azure, bedrock, doubleword, gemini, mistral, "
        "openai, vertex, xai, zerogpu",
    ):
        get_dialect("palm")


def test_auth_headers() -> None:
    assert D.auth_headers("sk-1") == {"Authorization": "Bearer sk-1"}
    assert D.auth_headers("sk-1", {"organization": "org-9", "project": "proj-3"}) == {
        "Authorization": "Bearer sk-1",
        "OpenAI-Organization": "org-9",
        "OpenAI-Project": "proj-3",
    }
    assert D.auth_headers(None) == {}


def test_paths_and_upload_form() -> None:
    assert D.files_path == "files" and D.batches_path == "batches"
    assert D.file_path("f1") == "files/f1"
    assert D.file_content_path("f1") == "files/f1/content"
    assert D.batch_path("b1") == "batches/b1"
    assert D.cancel_path("b1") == "batches/b1/cancel"
    assert D.upload_form() == {"purpose": "batch"}
    assert D.results_modes == ("files",)
    with pytest.raises(NotImplementedError):
        D.results_path("b1")
    with pytest.raises(NotImplementedError):
        D.results_params()


def test_parse_file_id() -> None:
    assert D.parse_file_id({"id": "file-1", "object": "file"}) == "file-1"
    with pytest.raises(BatchApiResponseError, match="no id"):
        D.parse_file_id({"object": "file"})


def test_create_body() -> None:
    body = D.create_batch_body(
        input_file_id="file-1", endpoint="/v1/embeddings", completion_window="24h", metadata={"k": "v"}
    )
    assert body == {
        "input_file_id": "file-1",
        "endpoint": "/v1/embeddings",
        "completion_window": "24h",
        "metadata": {"k": "v"},
    }
    assert "metadata" not in D.create_batch_body(
        input_file_id="f", endpoint="/v1/embeddings", completion_window="24h"
    )


def test_endpoint_and_window_checks() -> None:
    D.check_endpoint("/v1/responses")
    D.check_completion_window("24h")
    with pytest.raises(ConfigurationError, match="'/v1/images/generations' is not supported"):
        D.check_endpoint("/v1/images/generations")
    with pytest.raises(ConfigurationError, match="'1h' is not supported"):
        D.check_completion_window("1h")


@pytest.mark.parametrize(
    ("status", "state", "terminal"),
    [
        ("validating", BatchState.VALIDATING, False),
        ("in_progress", BatchState.IN_PROGRESS, False),
        ("finalizing", BatchState.FINALIZING, False),
        ("completed", BatchState.COMPLETED, True),
        ("failed", BatchState.FAILED, True),
        ("expired", BatchState.EXPIRED, True),
        ("cancelling", BatchState.CANCELLING, False),
        ("cancelled", BatchState.CANCELLED, True),
        ("canceled", BatchState.CANCELLED, True),
        ("canceling", BatchState.CANCELLING, False),
        ("In-Progress", BatchState.IN_PROGRESS, False),
    ],
)
def test_every_status(status: str, state: BatchState, terminal: bool) -> None:
    parsed = D.parse_batch(batch(status))
    assert parsed.state is state
    assert parsed.is_terminal is terminal


@pytest.mark.parametrize("status", ["paused", "succeeded", "", "done"])
def test_unknown_status_raises(status: str) -> None:
    with pytest.raises(UnknownBatchStatusError, match="batch_abc123"):
        D.parse_batch(batch(status))


def test_missing_status_or_id() -> None:
    raw = batch()
    del raw["status"]
    with pytest.raises(UnknownBatchStatusError, match="has no status"):
        D.parse_batch(raw)
    with pytest.raises(BatchApiResponseError, match="no id"):
        D.parse_batch({"status": "completed"})


def test_parse_batch_fields() -> None:
    parsed = D.parse_batch(
        batch(
            "failed",
            failed_at="2026-01-08T00:00:05Z",
            errors={
                "object": "list",
                "data": [{"code": "invalid_json", "line": 3, "message": "bad line", "param": None}],
            },
        )
    )
    assert parsed.id == "batch_abc123"
    assert parsed.created_at == datetime.fromtimestamp(1_736_295_000, tz=timezone.utc)
    assert parsed.failed_at == datetime(2026, 1, 8, 0, 0, 5, tzinfo=timezone.utc)
    assert parsed.request_counts.total == 10 and parsed.request_counts.pending == 5
    assert parsed.errors[0].line == 3 and parsed.errors[0].code == "invalid_json"
    assert D.metadata_of(parsed) == {"airflow_batch_key": "k1"}
    assert parsed.raw["a_field_added_next_year"] == {"x": 1}
    assert "raw" not in parsed.summary()


def test_list_page() -> None:
    raw = {"object": "list", "data": [batch(), batch(id="batch_2")], "has_more": True, "last_id": "batch_2"}
    page = D.parse_list_page(raw, {"limit": 2})
    assert [b.id for b in page.batches] == ["batch_abc123", "batch_2"]
    assert page.next_params == {"limit": 2, "after": "batch_2"}
    # No last_id: fall back to the last item's id.
    page = D.parse_list_page({"data": [batch(id="batch_9")], "has_more": True}, {"limit": 1})
    assert page.next_params == {"limit": 1, "after": "batch_9"}
    assert D.parse_list_page({"data": [batch()], "has_more": False}, {"limit": 2}).next_params is None
    assert D.parse_list_page({"data": [], "has_more": True}, {"limit": 2}).next_params is None


def test_list_page_gives_back_known_batches_the_vendor_shows_unchanged() -> None:
    first = D.parse_list_page({"data": [batch(), batch(id="batch_2")]}, {"limit": 2})
    known = {b.id: b for b in first.batches}
    moved = batch(id="batch_2", request_counts={"total": 10, "completed": 9, "failed": 0})
    again = D.parse_list_page({"data": [batch(), moved, batch(id="batch_3")]}, {}, known)
    # Unchanged: the very object read before. Changed or new: parsed afresh.
    assert again.batches[0] is known["batch_abc123"]
    assert again.batches[1] is not known["batch_2"] and again.batches[1].request_counts.completed == 9
    assert again.batches[2].id == "batch_3"
    assert [b.id for b in D.parse_list_page({"data": [batch()]}, {}, None).batches] == ["batch_abc123"]
    # An id that is not a string is parsed (and judged) as without ``known``: unreadable, alone.
    odd = D.parse_list_page({"data": [{"id": ["odd"], "status": "in_progress"}, batch()]}, {}, known)
    assert odd.batches == [known["batch_abc123"]]
    assert [u.batch_id for u in odd.unreadable] == [None]
    assert isinstance(odd.unreadable[0].error, BatchApiResponseError)


# Lines from seed 001 (the canonical output/error shapes).
OUTPUT_LINE = {
    "id": "batch_req_a",
    "custom_id": "req-1",
    "response": {
        "status_code": 200,
        "request_id": "req_xyz",
        "body": {"id": "chatcmpl-abc", "choices": [{"message": {"content": "Paris."}}]},
    },
}
ERROR_LINE = {
    "id": "batch_req_e1",
    "custom_id": "req-5",
    "response": None,
    "error": {"code": "invalid_request_error", "message": "[legacy:http_400] bad", "param": None},
}


def test_result_line_success() -> None:
    line = D.parse_result_line(OUTPUT_LINE, "output")
    assert line.ok and line.status_code == 200
    assert line.body == OUTPUT_LINE["response"]["body"]  # type: ignore[index]
    assert line.request_id == "req_xyz" and line.line_id == "batch_req_a" and line.source == "output"
    assert line.error is None


def test_result_line_error() -> None:
    line = D.parse_result_line(ERROR_LINE, "error")
    assert not line.ok and line.source == "error"
    assert line.error is not None
    assert (line.error.code, line.error.message, line.error.param) == (
        "invalid_request_error",
        "[legacy:http_400] bad",
        None,
    )


def test_result_line_non_2xx_response_is_a_failure() -> None:
    raw = {
        "custom_id": "c",
        "response": {
            "status_code": 400,
            "body": {
                "error": {"code": "context_length_exceeded", "message": "too long", "type": "invalid_request"}
            },
        },
        "error": None,
    }
    line = D.parse_result_line(raw, "output")
    assert not line.ok and line.status_code == 400
    assert (
        line.error is not None
        and line.error.code == "context_length_exceeded"
        and line.error.type == "invalid_request"
    )
    bare = D.parse_result_line({"custom_id": "c", "response": {"status_code": 503, "body": "down"}}, "output")
    assert bare.error is not None and bare.error.code == "http_503"


@pytest.mark.parametrize(
    "raw",
    [
        {"custom_id": "c", "response": None, "error": None},
        {"custom_id": "c", "response": {"body": {"x": 1}}},  # no status code: not proven a success
    ],
)
def test_result_line_without_proof_of_success_is_a_failure(raw: dict[str, Any]) -> None:
    line = D.parse_result_line(raw, "output")
    assert not line.ok
    assert line.error is not None and line.error.code == "unknown_error"


def test_result_line_string_error() -> None:
    line = D.parse_result_line({"custom_id": "c", "error": "boom"}, "error")
    assert line.error is not None and (line.error.code, line.error.message) == ("error", "boom")


@pytest.mark.parametrize("raw", [{"response": {}}, {"custom_id": ""}, {"custom_id": 5}])
def test_result_line_needs_custom_id(raw: dict[str, Any]) -> None:
    with pytest.raises(BatchApiResponseError, match="custom_id"):
        D.parse_result_line(raw, "output")


def test_validation_rules_and_tightened_limits() -> None:
    rules = D.validation_rules()
    assert rules.unique_custom_ids and not rules.mixed_endpoints and not rules.mixed_models
    # OpenAI documents no per-line limit: a line may be as large as the 200 MB file.
    assert rules.limits.max_lines == 50_000 and rules.limits.max_line_bytes == 200 * 1024 * 1024
    assert rules.max_custom_id_chars == 64
    tight = D.limits.tightened(max_lines=10, max_file_bytes=10**12)
    assert tight.max_lines == 10 and tight.max_file_bytes == D.limits.max_file_bytes
    assert D.validation_rules(tight).limits.max_lines == 10


def test_repr() -> None:
    assert repr(D) == "<Dialect openai>"
    assert isinstance(D, Dialect)


def test_null_fields_of_a_validating_batch() -> None:
    # OpenAI-compatible servers send null counts, errors, usage, model and timestamps while
    # validating: the counts are unknown (read as 0), nothing crashes.
    raw = {
        "id": "batch_n",
        "object": "batch",
        "status": "validating",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "request_counts": None,
        "errors": None,
        "usage": None,
        "model": None,
        "metadata": None,
        "created_at": None,
        "in_progress_at": None,
        "expires_at": None,
        "completed_at": None,
        "output_file_id": None,
        "error_file_id": None,
    }
    batch = D.parse_batch(raw)
    assert batch.state is BatchState.VALIDATING and batch.input_file_id == "file-1"
    assert batch.request_counts.total == 0 and batch.request_counts.pending == 0
    assert batch.errors == [] and batch.metadata == {} and batch.created_at is None
    partial = D.parse_batch({**raw, "request_counts": {"total": 3, "completed": None, "failed": None}})
    assert (partial.request_counts.total, partial.request_counts.completed) == (3, 0)


def test_quota_errors_are_named_by_code_or_type() -> None:
    quota = {
        "error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": None}
    }
    assert D.is_quota_error(429, quota)
    assert D.is_quota_error(429, {"error": {"code": "insufficient_quota"}})
    assert D.is_quota_error(402, {"error": {"type": "insufficient_quota"}})
    assert not D.is_quota_error(429, {"error": {"code": "rate_limit_exceeded", "type": "requests"}})
    assert not D.is_quota_error(400, quota)
    assert not D.is_quota_error(429, "insufficient_quota")
