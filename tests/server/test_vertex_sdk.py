"""The official ``google-genai`` SDK (``vertexai=True``) drives ``serve --dialect vertex``: batch
prediction jobs reading their input from, and writing predictions to, a Cloud Storage emulator.

The SDK speaks Vertex AI as Google publishes it (``projects/{p}/locations/{l}/batchPredictionJobs``,
``JOB_STATE_*``, ``completionStats``, a bearer token, ``{"error": {"code", "message", "status"}}``),
so these tests hold the server mode to Google's shapes, not to the provider's dialect.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from google import genai
from google.genai import errors, types
from google.oauth2.credentials import Credentials

from tests.fixtures.gcs import GcsStaging

TOKEN = "ya29.vertex-sdk-test"
MODEL = "gemini-2.5-flash"
DONE = {"JOB_STATE_SUCCEEDED", "JOB_STATE_PARTIALLY_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}


def vertex_lines(count: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "key": f"req-{i}",
                "request": {
                    "contents": [{"role": "user", "parts": [{"text": f"hello number {i}"}]}],
                    "generationConfig": {"maxOutputTokens": 20},
                },
            }
        )
        + b"\n"
        for i in range(count)
    )


def sdk(server: Any, token: str = TOKEN) -> genai.Client:
    return genai.Client(
        vertexai=True,
        project="my-project",
        location="us-central1",
        credentials=Credentials(token=token),
        http_options=types.HttpOptions(base_url=server.root_url, api_version="v1", timeout=10_000),
    )


def wait_until(client: genai.Client, name: str) -> types.BatchJob:
    deadline = time.monotonic() + 30
    job = client.batches.get(name=name)
    while job.state not in DONE:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
        job = client.batches.get(name=name)
    return job


def test_vertex_sdk_round_trip(batch_server: Any, gcs_staging: GcsStaging) -> None:
    server = batch_server(dialect="vertex", api_key=TOKEN, gcs_endpoint_url=gcs_staging.endpoint)
    client = sdk(server)
    gcs_staging.path("in", "lines.jsonl").write_bytes(vertex_lines(6))
    job = client.batches.create(
        model=MODEL,
        src=f"gs://{gcs_staging.bucket}/in/lines.jsonl",
        config={"display_name": "run-a", "dest": f"gs://{gcs_staging.bucket}/out"},
    )
    assert job.name is not None and job.name.startswith(
        "projects/my-project/locations/us-central1/batchPredictionJobs/"
    )
    assert job.display_name == "run-a" and job.model == f"publishers/google/models/{MODEL}"
    job = wait_until(client, job.name)
    assert job.state == "JOB_STATE_SUCCEEDED" and job.end_time is not None
    assert job.completion_stats is not None and job.completion_stats.successful_count == 6
    assert job.dest is not None and job.dest.gcs_uri == f"gs://{gcs_staging.bucket}/out"
    (written,) = gcs_staging.keys("out/")
    assert written.startswith("out/prediction-model-") and written.endswith("/predictions.jsonl")
    lines = [orjson.loads(line) for line in gcs_staging.read(written).splitlines()]
    assert sorted(line["key"] for line in lines) == sorted(f"req-{i}" for i in range(6))
    for line in lines:
        assert line["status"] == ""
        response = types.GenerateContentResponse._from_response(response=line["response"], kwargs={})
        assert response.text
    assert job.name in [j.name for j in client.batches.list(config={"page_size": 1})]


def test_vertex_sdk_filter_pages_and_cancel(batch_server: Any, gcs_staging: GcsStaging) -> None:
    server = batch_server(
        dialect="vertex", api_key=TOKEN, gcs_endpoint_url=gcs_staging.endpoint, faults={"stall_batches": True}
    )
    client = sdk(server)
    gcs_staging.path("in", "lines.jsonl").write_bytes(vertex_lines(2))
    src = f"gs://{gcs_staging.bucket}/in/lines.jsonl"
    names = [
        client.batches.create(
            model=MODEL,
            src=src,
            config={"display_name": f"run-{i}", "dest": f"gs://{gcs_staging.bucket}/o{i}"},
        ).name
        for i in range(3)
    ]
    assert sorted(j.name for j in client.batches.list(config={"page_size": 2})) == sorted(names)
    client.batches.cancel(name=names[0])
    assert wait_until(client, names[0]).state == "JOB_STATE_CANCELLED"
    server.force(names[1].rsplit("/", 1)[-1], "complete")
    wait_until(client, names[1])
    with pytest.raises(errors.ClientError) as refused:
        client.batches.cancel(name=names[1])
    assert refused.value.code == 400 and refused.value.status == "FAILED_PRECONDITION"


def test_vertex_sdk_errors_in_googles_shape(batch_server: Any, gcs_staging: GcsStaging) -> None:
    server = batch_server(dialect="vertex", api_key=TOKEN, gcs_endpoint_url=gcs_staging.endpoint)
    stranger = sdk(server, token="ya29.someone-else")  # held: a dropped client closes its session
    with pytest.raises(errors.ClientError) as wrong:
        stranger.batches.get(name="projects/my-project/locations/us-central1/batchPredictionJobs/1")
    assert wrong.value.code == 401 and wrong.value.status == "UNAUTHENTICATED"
    assert "someone-else" not in str(wrong.value)
    client = sdk(server)
    with pytest.raises(errors.ClientError) as missing:
        client.batches.get(name="projects/my-project/locations/us-central1/batchPredictionJobs/123")
    assert missing.value.code == 404 and missing.value.status == "NOT_FOUND"
    with pytest.raises(errors.ClientError) as no_input:
        client.batches.create(
            model=MODEL,
            src=f"gs://{gcs_staging.bucket}/nothing.jsonl",
            config={"display_name": "x", "dest": f"gs://{gcs_staging.bucket}/o"},
        )
    assert no_input.value.code == 400 and "nothing.jsonl" in str(no_input.value)
