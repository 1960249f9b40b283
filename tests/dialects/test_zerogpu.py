"""The ZeroGPU dialect: x-api-key auth, chat completions only, seed 001 line shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.dialects import Limits, ZeroGPUDialect
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


def test_limits_shard_at_the_100mb_upload_limit() -> None:
    # A batch may be 200 MB, but one upload at most 100 MB: shards are cut at the upload limit.
    assert D.limits.max_file_bytes == 200 << 20 and D.limits.max_upload_bytes == 100 << 20
    assert D.limits.max_shard_bytes == 100 << 20
    assert D.limits.tightened().max_file_bytes == 100 << 20  # what the build operator shards to
    assert D.limits.tightened(max_file_bytes=1000).max_file_bytes == 1000
    assert D.limits.max_line_bytes == 1 << 20  # the only documented per-line limit


def test_sharded_writer_cuts_at_the_upload_limit(tmp_path: Path) -> None:
    directory = staging.resolve_path(tmp_path)
    limits = Limits(max_lines=100, max_file_bytes=40, max_line_bytes=10, max_upload_bytes=20)
    with staging.ShardedJsonlWriter(directory, limits) as writer:
        indexes = [writer.add(b"x" * 9) for _ in range(4)]
    assert indexes == [0, 0, 1, 1]
    assert [s.bytes for s in writer.shards] == [20, 20]
    # The resubmission path of the merge hands the dialect's own limits to the same writer.
    assert staging.ShardedJsonlWriter(directory, D.limits)._max_bytes == 100 << 20


def test_project_is_required_and_a_finished_batch_cancel_is_final() -> None:
    assert D.required_extras == ("project",)
    with pytest.raises(ConfigurationError, match="'zerogpu' needs extra 'project'"):
        D.check_connection({"dialect": "zerogpu"}, "c")
    D.check_connection({"project": "p"}, "c")
    assert D.cancel_final_statuses == {409}
