"""Vertex AI results on Cloud Storage: the hook lists the job's output prefix on a GCS emulator
(through the seam's object-store results, ``hooks/objects.py``) and reads every
``predictions*.jsonl`` line through the Vertex dialect; other objects are left alone."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects.vertex import VertexDialect
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.gcs import GcsStaging

ANSWER = {
    "candidates": [{"content": {"role": "model", "parts": [{"text": "Hi"}]}, "finishReason": "STOP"}],
    "usageMetadata": {"promptTokenCount": 2, "candidatesTokenCount": 1, "totalTokenCount": 3},
}


@pytest.fixture
def hook(gcs_staging: GcsStaging, monkeypatch: pytest.MonkeyPatch) -> BatchApiHook:
    extra = {"dialect": "vertex", "project": "p", "location": "us-central1", "storage_conn_id": "abp_gcs"}
    monkeypatch.setenv("AIRFLOW_CONN_VX", orjson.dumps({"conn_type": "batch_api", "extra": extra}).decode())
    return BatchApiHook("vx", dialect=VertexDialect())


def job(gcs: GcsStaging, state: str, **fields: Any) -> Any:
    raw = {
        "name": "projects/p/locations/us-central1/batchPredictionJobs/77",
        "state": state,
        "outputConfig": {
            "predictionsFormat": "jsonl",
            "gcsDestination": {"outputUriPrefix": f"gs://{gcs.bucket}/run/out"},
        },
        **fields,
    }
    return VertexDialect(project="p", location="us-central1").parse_batch(raw)


def test_the_output_directory_is_listed_and_its_predictions_read(
    hook: BatchApiHook, gcs_staging: GcsStaging
) -> None:
    folder = "run/out/prediction-model-2026-12-04T07:00:00.000000Z"
    lines = [
        {"key": "k1", "status": "", "request": {}, "response": ANSWER},
        {"key": "k2", "status": "Bad Request: the request is invalid", "request": {}},
    ]
    gcs_staging.path(folder, "predictions_00001.jsonl").write_bytes(
        b"".join(orjson.dumps(x) + b"\n" for x in lines)
    )
    gcs_staging.path(folder, "predictions_00002.jsonl").write_bytes(
        orjson.dumps({"key": "k3", "status": "", "response": ANSWER}) + b"\n"
    )
    gcs_staging.path(folder, "notes.txt").write_bytes(b"not results")
    batch = job(
        gcs_staging,
        "JOB_STATE_PARTIALLY_SUCCEEDED",
        outputInfo={"gcsOutputDirectory": f"gs://{gcs_staging.bucket}/{folder}"},
        completionStats={"successfulCount": "2", "failedCount": "1"},
    )
    results = list(hook.iter_results(batch))
    assert [(r.custom_id, r.ok) for r in results] == [("k1", True), ("k2", False), ("k3", True)]
    assert results[0].body is not None and results[0].body["choices"][0]["message"]["content"] == "Hi"
    assert results[1].error is not None and results[1].error.message == "Bad Request: the request is invalid"


def test_an_ended_job_without_output_info_is_read_under_its_prefix(
    hook: BatchApiHook, gcs_staging: GcsStaging
) -> None:
    folder = "run/out/prediction-model-2026-12-04T08:00:00.000000Z"
    gcs_staging.path(folder, "predictions.jsonl").write_bytes(
        orjson.dumps({"key": "k1", "status": "", "response": ANSWER}) + b"\n"
    )
    cancelled = job(gcs_staging, "JOB_STATE_CANCELLED")
    assert [r.custom_id for r in hook.iter_results(cancelled)] == ["k1"]
    # A running job names no output yet: nothing is read.
    assert list(hook.iter_results(job(gcs_staging, "JOB_STATE_RUNNING"))) == []
