"""Mistral dialect: job objects, statuses, listing pages and filter, encoded lines, create body.

The payloads are checked against the official ``mistralai`` SDK's own models, so the dialect is
tested against Mistral's published shapes rather than shapes it produced itself.
"""

from __future__ import annotations

from typing import Any

import pytest
from mistralai.client import models as sdk

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.dialects.mistral import STATUSES, MistralDialect
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.models import BatchState

D = MistralDialect()
JOB_ID = "0b9b3e4e-7c33-4c59-9d55-0c6a3f1f7a10"


def job(status: str = "RUNNING", **fields: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "id": JOB_ID,
        "object": "batch",
        "input_files": ["6c0e6d4b-0b7f-4c24-9a2a-4d7b1f3e9a01"],
        "metadata": {"airflow_batch_key": "abp-1-s00000", "airflow_fingerprint": "f" * 64},
        "endpoint": "/v1/chat/completions",
        "model": "mistral-small-latest",
        "errors": [],
        "status": status,
        "created_at": 1_736_380_000,
        "total_requests": 10,
        "completed_requests": 7,
        "succeeded_requests": 5,
        "failed_requests": 2,
        "started_at": 1_736_380_060,
        "completed_at": None,
        "output_file": None,
        "error_file": None,
        **fields,
    }
    sdk.BatchJob.model_validate(raw)  # the SDK reads it: the fixture is Mistral's shape
    return raw


def test_registered_with_its_contract() -> None:
    d = get_dialect("mistral")
    assert isinstance(d, MistralDialect)
    assert (d.model_placement, d.encodes_lines, d.mixed_models) == ("job", True, False)
    assert d.batches_path == "batch/jobs"
    assert (d.batch_path("j1"), d.cancel_path("j1")) == ("batch/jobs/j1", "batch/jobs/j1/cancel")
    assert (d.file_path("f1"), d.file_content_path("f1")) == ("files/f1", "files/f1/content")
    assert d.upload_form() == {"purpose": "batch"}
    assert d.auth_headers("k") == {"Authorization": "Bearer k"}
    # Every endpoint the dialect accepts is one Mistral's SDK knows.
    assert set(d.endpoints) <= set(sdk.APIEndpoint.__args__[0].__args__)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("QUEUED", BatchState.VALIDATING),
        ("RUNNING", BatchState.IN_PROGRESS),
        ("SUCCESS", BatchState.COMPLETED),
        ("FAILED", BatchState.FAILED),
        ("TIMEOUT_EXCEEDED", BatchState.EXPIRED),
        ("CANCELLATION_REQUESTED", BatchState.CANCELLING),
        ("CANCELLED", BatchState.CANCELLED),
    ],
)
def test_every_status_maps(status: str, state: BatchState) -> None:
    assert D.parse_batch(job(status)).state is state
    assert set(STATUSES) == set(sdk.BatchJobStatus.__args__[0].__args__)  # type: ignore[attr-defined]


def test_job_fields_are_read() -> None:
    batch = D.parse_batch(
        job(
            "SUCCESS",
            output_file="out-1",
            error_file="err-1",
            completed_at=1_736_390_000,
            errors=[{"message": "3 lines were not valid", "count": 3}],
        )
    )
    assert batch.id == JOB_ID and batch.input_file_id == "6c0e6d4b-0b7f-4c24-9a2a-4d7b1f3e9a01"
    assert (batch.output_file_id, batch.error_file_id) == ("out-1", "err-1")
    assert batch.request_counts.model_dump() == {"total": 10, "completed": 5, "failed": 2}
    assert batch.created_at is not None and batch.created_at.timestamp() == 1_736_380_000
    assert batch.in_progress_at is not None and batch.completed_at is not None
    assert D.metadata_of(batch)["airflow_batch_key"] == "abp-1-s00000"
    assert [e.message for e in batch.errors] == ["3 lines were not valid"]


def test_unknown_or_missing_status_is_an_error_never_success() -> None:
    with pytest.raises(UnknownBatchStatusError, match=r"unknown status 'PAUSED'; known: QUEUED"):
        D.parse_batch({**job(), "status": "PAUSED"})
    with pytest.raises(UnknownBatchStatusError, match="unknown status None"):
        D.parse_batch({k: v for k, v in job().items() if k != "status"})
    with pytest.raises(BatchApiResponseError, match="has no id"):
        D.parse_batch({"status": "RUNNING"})


def test_create_body_puts_model_and_file_on_the_job() -> None:
    body = D.create_batch_body(
        input_file_id="file-1",
        endpoint="/v1/chat/completions",
        completion_window="48h",
        metadata={"airflow_batch_key": "k"},
        model="mistral-small-latest",
    )
    assert body == {
        "input_files": ["file-1"],
        "endpoint": "/v1/chat/completions",
        "model": "mistral-small-latest",
        "timeout_hours": 48,
        "metadata": {"airflow_batch_key": "k"},
    }
    sdk.CreateBatchJobRequest.model_validate(body)


def test_encode_line_is_custom_id_and_body_without_model() -> None:
    canonical = {
        "custom_id": "k-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9},
    }
    encoded = D.encode_line(canonical)
    assert encoded == {
        "custom_id": "k-1",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9},
    }
    sdk.BatchRequest.model_validate(encoded)
    embedding = {
        "custom_id": "e",
        "url": "/v1/embeddings",
        "body": {"model": "m", "input": "x", "dimensions": 8},
    }
    assert D.encode_line(embedding)["body"] == {"input": "x", "output_dimension": 8}


def test_unsupported_names_the_feature_and_the_vendor() -> None:
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}
    assert D.unsupported(line) is None
    line["body"]["logprobs"] = True
    line["body"]["logit_bias"] = {"1": 2}
    assert D.unsupported(line) == "logit_bias, logprobs not supported by Mistral's chat completions"
    # An explicit "off" asks for nothing the vendor lacks.
    assert D.unsupported({**line, "body": {"model": "m", "logprobs": False}}) is None


def test_listing_pages_by_total_and_filters_by_metadata() -> None:
    params = D.list_params(2)
    assert params == {"page": 0, "page_size": 2}
    assert D.filter_params({"airflow_batch_key": "k"}) == {"airflow_batch_key": "k"}
    first = D.parse_list_page({"object": "list", "data": [job(), job()], "total": 5}, params)
    assert len(first.batches) == 2 and first.next_params == {"page": 1, "page_size": 2}
    last = D.parse_list_page({"object": "list", "data": [job()], "total": 5}, {"page": 2, "page_size": 2})
    assert last.next_params is None
    # A server that clamps the page size: the count is of lines seen, not asked for.
    clamped = D.parse_list_page({"data": [job()], "total": 3}, {"page": 0, "page_size": 100})
    assert clamped.next_params == {"page": 1, "page_size": 1}
    assert D.parse_list_page({"data": [], "total": 3}, {"page": 3, "page_size": 1}).next_params is None
    sdk.ListBatchJobsResponse.model_validate({"object": "list", "data": [job()], "total": 1})


def test_result_lines_decode_into_the_one_result_line() -> None:
    ok = D.parse_result_line(
        {
            "id": "r1",
            "custom_id": "k-1",
            "response": {
                "status_code": 200,
                "body": {"choices": [{"message": {"content": "yes"}, "finish_reason": "stop"}]},
            },
            "error": None,
        },
        "output",
    )
    assert ok.ok and ok.custom_id == "k-1" and ok.body is not None
    failed = D.parse_result_line(
        {
            "id": "r2",
            "custom_id": "k-2",
            "response": {"status_code": 400, "body": {"object": "error", "message": "bad", "code": "3051"}},
            "error": None,
        },
        "error",
    )
    assert not failed.ok and failed.error is not None and failed.error.code == "http_400"
    text = D.parse_result_line({"custom_id": "k-3", "error": "model timed out"}, "error")
    assert text.error is not None and text.error.message == "model timed out"
