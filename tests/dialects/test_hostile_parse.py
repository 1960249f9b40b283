"""Every dialect reads any vendor answer into a Batch or a typed error, never a crash.

A listing carries batches nobody here waits on; one of them with a new status, an odd field or
a number where an object belongs must fail only itself (``ListPage.unreadable``), and a batch
read alone must fail as ``BatchApiResponseError`` (``UnknownBatchStatusError`` for a status),
never as TypeError, AttributeError, OverflowError, OSError or a pydantic error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS, get_dialect
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError

OPENAI_SHAPED = ("openai", "doubleword", "zerogpu", "azure")
# Every registered dialect: a new one must say here how its items look (test_every_dialect_is_covered).
ALL = tuple(sorted(DIALECTS))


def openai_item(batch_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": batch_id,
        "object": "batch",
        "status": "in_progress",
        "created_at": 1_736_000_000,
        "request_counts": {"total": 2, "completed": 1, "failed": 0},
        "metadata": {"airflow_batch_key": "k"},
        **fields,
    }


def xai_item(batch_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "batch_id": batch_id,
        "name": "run-1",
        "create_time": "2025-01-04T12:00:00Z",
        "state": {"num_requests": 2, "num_pending": 1, "num_success": 1, "num_error": 0},
        **fields,
    }


def mistral_item(batch_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": batch_id,
        "object": "batch",
        "status": "RUNNING",
        "input_files": ["f-1"],
        "endpoint": "/v1/chat/completions",
        "model": "mistral-small-latest",
        "created_at": 1_736_000_000,
        "total_requests": 2,
        "succeeded_requests": 1,
        "failed_requests": 0,
        "metadata": {"airflow_batch_key": "k"},
        "errors": [],
        **fields,
    }


def anthropic_item(batch_id: str, **fields: Any) -> dict[str, Any]:
    if "status" in fields:
        fields["processing_status"] = fields.pop("status")
    return {
        "id": batch_id,
        "type": "message_batch",
        "processing_status": "in_progress",
        "request_counts": {"processing": 2, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0},
        "created_at": "2026-01-04T12:00:00Z",
        "expires_at": "2026-01-05T12:00:00Z",
        "ended_at": None,
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": None,
        **fields,
    }


# Fields of a Gemini batch operation itself; the others are of its metadata (the batch).
_OPERATION_KEYS = ("name", "done", "error", "response")


def gemini_item(batch_id: Any, **fields: Any) -> dict[str, Any]:
    if "status" in fields:
        fields["state"] = fields.pop("status")
    top = {k: fields.pop(k) for k in _OPERATION_KEYS if k in fields}
    name = f"batches/{batch_id}" if isinstance(batch_id, str) else batch_id
    return {
        "name": name,
        "metadata": {
            "@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch",
            "name": name,
            "model": "models/gemini-2.5-flash",
            "displayName": "k",
            "inputConfig": {"fileName": "files/in-1"},
            "state": "BATCH_STATE_RUNNING",
            "createTime": "2026-01-04T12:00:00.123456789Z",
            "batchStats": {"requestCount": "2", "pendingRequestCount": "2"},
            **fields,
        },
        "done": False,
        **top,
    }


def bedrock_item(batch_id: Any, **fields: Any) -> dict[str, Any]:
    arn = f"arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/{batch_id}"
    return {
        "jobArn": arn if isinstance(batch_id, str) else batch_id,
        "jobName": "k",
        "modelId": "anthropic.claude-3-haiku-20240307-v1:0",
        "roleArn": "arn:aws:iam::123456789012:role/r",
        "status": "InProgress",
        "submitTime": "2026-01-04T12:00:00Z",
        "inputDataConfig": {"s3InputDataConfig": {"s3Uri": "s3://b/in/"}},
        "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": "s3://b/out/"}},
        "totalRecordCount": 2,
        "processedRecordCount": 1,
        "successRecordCount": 1,
        "errorRecordCount": 0,
        **fields,
    }


def vertex_item(batch_id: Any, **fields: Any) -> dict[str, Any]:
    if "status" in fields:
        fields["state"] = fields.pop("status")
    name = f"projects/p/locations/us-central1/batchPredictionJobs/{batch_id}"
    return {
        "name": name if isinstance(batch_id, str) else batch_id,
        "displayName": "k",
        "model": "publishers/google/models/gemini-2.5-flash",
        "state": "JOB_STATE_RUNNING",
        "createTime": "2026-01-04T12:00:00.123456Z",
        "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": ["gs://b/in.jsonl"]}},
        "outputConfig": {"predictionsFormat": "jsonl", "gcsDestination": {"outputUriPrefix": "gs://b/out"}},
        "labels": {"airflow_batch_key": "k"},
        "completionStats": {"successfulCount": "1", "failedCount": "0", "incompleteCount": "1"},
        **fields,
    }


ITEMS: dict[str, Callable[..., dict[str, Any]]] = {
    **dict.fromkeys(OPENAI_SHAPED, openai_item),
    "xai": xai_item,
    "mistral": mistral_item,
    "anthropic": anthropic_item,
    "gemini": gemini_item,
    "bedrock": bedrock_item,
    "vertex": vertex_item,
}


def item_of(dialect: str) -> Callable[..., dict[str, Any]]:
    return ITEMS[dialect]


def page_of(dialect: str, items: list[Any], **envelope: Any) -> dict[str, Any]:
    if dialect == "xai":
        return {"batches": items, **envelope}
    if dialect == "mistral":
        return {"object": "list", "data": items, "total": len(items), **envelope}
    if dialect == "gemini":
        return {"operations": items, **envelope}
    if dialect == "bedrock":
        return {"invocationJobSummaries": items, **envelope}
    if dialect == "vertex":
        return {"batchPredictionJobs": items, **envelope}
    return {"object": "list", "data": items, "has_more": False, **envelope}


# A field of the wrong type or out of range, for the batch "b-bad".
OPENAI_FIELDS: dict[str, dict[str, Any]] = {
    "metadata-number": {"metadata": 5},
    "metadata-list": {"metadata": ["a"]},
    "created-1e20": {"created_at": 1e20},
    "created-minus-1e20": {"created_at": -1e20},
    "created-bool": {"created_at": True},
    "created-object": {"created_at": {"at": 1}},
    "completed-not-a-date": {"completed_at": "yesterday-ish"},
    "counts-text": {"request_counts": "two"},
    "counts-number-text": {"request_counts": {"total": "many"}},
    "errors-text": {"errors": "x"},
    "errors-data-number": {"errors": {"data": 5}},
}
XAI_FIELDS: dict[str, dict[str, Any]] = {
    "create-1e20": {"create_time": 1e20},
    "create-garbage": {"create_time": "not a time"},
    "expire-object": {"expire_time": {"seconds": 1}},
    "cancel-bool": {"cancel_time": True},
    "state-list": {"state": [1, 2]},
    "count-text": {"state": {"num_requests": "two"}},
    "count-object": {"state": {"num_pending": {"n": 1}}},
    "count-1e300": {"state": {"num_pending": 1e300, "num_requests": 1e308 * 10}},
    "name-number": {"name": 5},
}


MISTRAL_FIELDS: dict[str, dict[str, Any]] = {
    "metadata-number": {"metadata": 5},
    "created-1e20": {"created_at": 1e20},
    "started-bool": {"started_at": True},
    "completed-garbage": {"completed_at": "yesterday-ish"},
    "count-text": {"total_requests": "two"},
    "count-object": {"succeeded_requests": {"n": 1}},
    "input-files-number": {"input_files": [5]},
    "output-file-path": {"output_file": "../admin"},
}
ANTHROPIC_FIELDS: dict[str, dict[str, Any]] = {
    "created-1e20": {"created_at": 1e20},
    "created-garbage": {"created_at": "yesterday-ish"},
    "expires-object": {"expires_at": {"at": 1}},
    "counts-text": {"request_counts": "two"},
    "count-text": {"request_counts": {"processing": "two"}},
    "count-negative": {"request_counts": {"processing": -1}},
    "count-bool": {"request_counts": {"succeeded": True}},
    "results-url-number": {"results_url": 5},
}
GEMINI_FIELDS: dict[str, dict[str, Any]] = {
    "created-garbage": {"createTime": "yesterday-ish"},
    "created-object": {"createTime": {"seconds": 1}},
    "ended-bool": {"endTime": True},
    "stats-text": {"batchStats": "two"},
    "count-text": {"batchStats": {"requestCount": "two"}},
    "count-negative": {"batchStats": {"requestCount": -1}},
    "count-object": {"batchStats": {"successfulRequestCount": {"n": 1}}},
    "display-number": {"displayName": 5},
    "output-file-path": {"output": {"responsesFile": "files/../admin"}},
    "input-file-number": {"inputConfig": {"fileName": 5}},
}
BEDROCK_FIELDS: dict[str, dict[str, Any]] = {
    "submitted-garbage": {"submitTime": "yesterday-ish"},
    "submitted-object": {"submitTime": {"seconds": 1}},
    "ended-bool": {"endTime": True},
    "count-text": {"totalRecordCount": "two"},
    "count-negative": {"errorRecordCount": -1},
    "count-object": {"successRecordCount": {"n": 1}},
    "name-number": {"jobName": 5},
}
VERTEX_FIELDS: dict[str, dict[str, Any]] = {
    "created-garbage": {"createTime": "yesterday-ish"},
    "created-object": {"createTime": {"seconds": 1}},
    "ended-bool": {"endTime": True},
    "stats-text": {"completionStats": "two"},
    "count-text": {"completionStats": {"successfulCount": "two"}},
    "count-negative": {"completionStats": {"failedCount": -1}},
    "count-object": {"completionStats": {"incompleteCount": {"n": 1}}},
    "labels-number": {"labels": 5},
    "label-value-number": {"labels": {"k": 5}},
    "output-directory-number": {"outputInfo": {"gcsOutputDirectory": 5}},
}
FIELDS = {
    "bedrock": BEDROCK_FIELDS,
    "vertex": VERTEX_FIELDS,
    "xai": XAI_FIELDS,
    "mistral": MISTRAL_FIELDS,
    "anthropic": ANTHROPIC_FIELDS,
    "gemini": GEMINI_FIELDS,
}
# The status each dialect reports for a batch in progress, and one it does not know.
UNKNOWN_STATUS = {
    "bedrock": "Paused",
    "mistral": "PAUSED",
    "anthropic": "paused",
    "gemini": "BATCH_STATE_PAUSED",
    "vertex": "JOB_STATE_UNSPECIFIED",
}


def bad_fields(dialect: str) -> list[dict[str, Any]]:
    return list(FIELDS.get(dialect, OPENAI_FIELDS).values())


def test_every_dialect_is_covered() -> None:
    assert set(ITEMS) == set(DIALECTS)


def non_objects() -> list[Any]:
    return [5, "x", [1, 2], None, 1.5, True]


@pytest.mark.parametrize("dialect", ALL)
def test_a_batch_with_a_bad_field_is_a_response_error(dialect: str) -> None:
    d = get_dialect(dialect)
    for fields in bad_fields(dialect):
        with pytest.raises(BatchApiResponseError, match="b-bad") as caught:
            d.parse_batch(item_of(dialect)("b-bad", **fields))
        assert type(caught.value) is BatchApiResponseError, fields


@pytest.mark.parametrize("dialect", ALL)
def test_a_batch_that_is_not_an_object_or_has_no_string_id_is_a_response_error(dialect: str) -> None:
    d = get_dialect(dialect)
    for raw in non_objects():
        with pytest.raises(BatchApiResponseError, match="not a JSON object"):
            d.parse_batch(raw)
    key = d.listed_id_key
    for bad_id in (5, ["b1"], {"id": 1}, True):
        with pytest.raises(BatchApiResponseError, match="not a string"):
            d.parse_batch({**item_of(dialect)("b1"), key: bad_id})


@pytest.mark.parametrize("dialect", [*OPENAI_SHAPED, "mistral", "anthropic", "gemini", "bedrock", "vertex"])
def test_an_unknown_status_is_a_read_error_of_its_batch(dialect: str) -> None:
    d = get_dialect(dialect)
    for status in (UNKNOWN_STATUS.get(dialect, "queued"), 5, ["completed"]):
        with pytest.raises(UnknownBatchStatusError, match="b-new"):
            d.parse_batch(item_of(dialect)("b-new", status=status))
    # A read error like any unreadable answer: a poll loop judges it within its error budget.
    assert issubclass(UnknownBatchStatusError, BatchApiResponseError)


@pytest.mark.parametrize("dialect", ALL)
def test_a_listed_item_that_does_not_parse_fails_only_itself(dialect: str) -> None:
    d = get_dialect(dialect)
    make = item_of(dialect)
    bad = [make(f"b-bad-{i}", **fields) for i, fields in enumerate(bad_fields(dialect))]
    if dialect != "xai":
        bad.append(make("b-queued", status=UNKNOWN_STATUS.get(dialect, "queued")))
    items = [make("b-1"), *non_objects(), *bad, make("b-2"), make(5)]
    for known in (None, {}):
        page = d.parse_list_page(page_of(dialect, items), {"limit": 100}, known)
        assert [b.id for b in page.batches] == ["b-1", "b-2"]
        # Each unreadable item names its batch when it names one as a string, and says why.
        assert [u.batch_id for u in page.unreadable] == [None] * len(non_objects()) + [
            make_id(item, d.listed_id_key) for item in bad
        ] + [None]
        assert all(isinstance(u.error, BatchApiResponseError) for u in page.unreadable)


def make_id(item: dict[str, Any], key: str) -> str:
    # Gemini names a batch "batches/<id>", Bedrock by its ARN: the id is the part after the last "/".
    return str(item[key]).rpartition("/")[2]


@pytest.mark.parametrize("dialect", OPENAI_SHAPED)
@pytest.mark.parametrize(
    "raw",
    [
        [],
        "x",
        5,
        {"data": "x"},
        {"data": {}},
        {"data": 5},
        {"data": [], "has_more": "yes"},
        {"data": [], "has_more": 1},
        {"data": [], "has_more": True, "last_id": 5},
        {"data": [], "has_more": True, "last_id": ["b"]},
    ],
    ids=repr,
)
def test_an_unreadable_openai_shaped_page_is_a_response_error(dialect: str, raw: Any) -> None:
    with pytest.raises(BatchApiResponseError, match="listing batches"):
        get_dialect(dialect).parse_list_page(raw, {"limit": 100})


@pytest.mark.parametrize(
    "raw",
    [[], "x", 5, {"batches": "x"}, {"batches": {}}, {"batches": [], "pagination_token": 5}],
    ids=repr,
)
def test_an_unreadable_xai_page_is_a_response_error(raw: Any) -> None:
    with pytest.raises(BatchApiResponseError, match="listing batches"):
        get_dialect("xai").parse_list_page(raw, {"limit": 100})


@pytest.mark.parametrize("dialect", OPENAI_SHAPED)
def test_the_cursor_of_an_openai_shaped_page_skips_an_unreadable_last_item(dialect: str) -> None:
    d = get_dialect(dialect)
    # No last_id and a last item with no string id: no cursor can be made, the listing ends.
    page = d.parse_list_page({"data": [openai_item("b1"), 5], "has_more": True}, {"limit": 2})
    assert page.next_params is None and [b.id for b in page.batches] == ["b1"]
    page = d.parse_list_page({"data": [openai_item("b1"), {"id": 7}], "has_more": True}, {"limit": 2})
    assert page.next_params is None
