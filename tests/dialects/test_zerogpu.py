"""The ZeroGPU dialect: x-api-key auth, chat completions only, seed 001 line shapes."""

from __future__ import annotations

import pytest

from airflow_batch_provider.dialects import ZeroGPUDialect
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import BatchState

D = ZeroGPUDialect()


def test_auth_uses_x_api_key_and_project() -> None:
    assert D.auth_headers("zk-1") == {"x-api-key": "zk-1"}
    assert D.auth_headers("zk-1", {"project": "p-1", "organization": "ignored"}) == {
        "x-api-key": "zk-1",
        "x-project-id": "p-1",
    }
    assert "Authorization" not in D.auth_headers("zk-1")


def test_only_chat_completions() -> None:
    assert D.endpoints == {"/v1/chat/completions"}
    with pytest.raises(ConfigurationError, match="zerogpu"):
        D.check_endpoint("/v1/embeddings")
    assert D.completion_windows == ("24h",)
    assert D.results_modes == ("files",)
    assert D.upload_form() == {"purpose": "batch"}


def test_completed_with_failed_lines_is_completed() -> None:
    parsed = D.parse_batch(
        {
            "id": "batch_z",
            "status": "completed",
            "output_file_id": "file-out",
            "error_file_id": "file-err",
            "request_counts": {"total": 3, "completed": 1, "failed": 2},
        }
    )
    assert parsed.state is BatchState.COMPLETED
    assert parsed.request_counts.failed == 2
    assert (parsed.output_file_id, parsed.error_file_id) == ("file-out", "file-err")


def test_validation_failure_carries_the_line() -> None:
    parsed = D.parse_batch(
        {
            "id": "batch_z",
            "status": "failed",
            "errors": {
                "data": [{"code": "invalid_request_error", "line": 7, "message": "custom_id repeated"}]
            },
        }
    )
    assert parsed.state is BatchState.FAILED
    assert parsed.errors[0].line == 7


# The three error lines of seed 001.
SEED_ERRORS = [
    {
        "id": "batch_req_e1",
        "custom_id": "req-5",
        "response": None,
        "error": {
            "code": "invalid_request_error",
            "message": '[legacy:http_400] {"message":"messages: missing required field"}',
            "param": None,
        },
    },
    {
        "id": "batch_req_e2",
        "custom_id": "req-9",
        "response": None,
        "error": {
            "code": "internal_error",
            "message": "[legacy:retries_exhausted] Line failed",
            "param": None,
        },
    },
    {
        "id": "batch_req_e3",
        "custom_id": "req-12",
        "response": None,
        "error": {
            "code": "internal_error",
            "message": "[legacy:dlq_exhausted] routed to the DLQ",
            "param": None,
        },
    },
]


@pytest.mark.parametrize("raw", SEED_ERRORS)
def test_seed_error_lines(raw: dict) -> None:
    line = D.parse_result_line(raw, "error")
    assert not line.ok and line.source == "error"
    assert line.custom_id == raw["custom_id"] and line.line_id == raw["id"]
    assert line.error is not None
    assert line.error.code == raw["error"]["code"] and line.error.code in D.error_codes
    assert line.error.message == raw["error"]["message"]


@pytest.mark.parametrize("code", sorted(ZeroGPUDialect.error_codes) + ["a_code_added_later"])
def test_every_error_code_passes_through(code: str) -> None:
    line = D.parse_result_line(
        {"custom_id": "c", "response": None, "error": {"code": code, "message": "m"}}, "error"
    )
    assert line.error is not None and line.error.code == code and not line.ok
