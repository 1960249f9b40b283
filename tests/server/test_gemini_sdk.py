"""The official ``google-genai`` SDK drives ``serve --dialect gemini``: upload, create, get, list,
cancel, download.

The SDK speaks the Gemini API as Google publishes it (the resumable upload protocol, batches as
operations, ``BATCH_STATE_*``, ``{"error": {"code", "message", "status"}}``), so these tests hold
the server mode to Google's shapes, not to the provider's dialect.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from google import genai
from google.genai import errors, types

KEY = "gemini-sdk-test"
MODEL = "gemini-2.5-flash"
DONE = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}


def gemini_lines(count: int, prefix: str = "req-") -> bytes:
    """Gemini batch lines: ``{key, request: GenerateContentRequest}``, the model being the batch's."""
    return b"".join(
        orjson.dumps(
            {
                "key": f"{prefix}{i}",
                "request": {
                    "contents": [{"role": "user", "parts": [{"text": f"hello number {i}"}]}],
                    "systemInstruction": {"parts": [{"text": "Be brief."}]},
                    "generationConfig": {"maxOutputTokens": 20, "temperature": 0},
                },
            }
        )
        + b"\n"
        for i in range(count)
    )


def sdk(server: Any, key: str = KEY) -> genai.Client:
    return genai.Client(
        api_key=key,
        http_options=types.HttpOptions(base_url=server.root_url, api_version="v1beta", timeout=10_000),
    )


def upload(client: genai.Client, tmp_path: Path, data: bytes, name: str = "in.jsonl") -> types.File:
    path = tmp_path / name
    path.write_bytes(data)
    return client.files.upload(file=path, config={"mime_type": "application/jsonl", "display_name": name})


def wait_until(client: genai.Client, name: str, states: set[str]) -> types.BatchJob:
    deadline = time.monotonic() + 30
    job = client.batches.get(name=name)
    while job.state not in states:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
        job = client.batches.get(name=name)
    return job


def test_gemini_sdk_round_trip(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="gemini", api_key=KEY)
    client = sdk(server)
    data = gemini_lines(10)
    uploaded = upload(client, tmp_path, data)
    assert uploaded.name is not None and uploaded.name.startswith("files/")
    assert (uploaded.size_bytes, uploaded.mime_type, uploaded.display_name) == (
        len(data),
        "application/jsonl",
        "in.jsonl",
    )
    assert client.files.get(name=uploaded.name).size_bytes == len(data)

    job = client.batches.create(model=MODEL, src=uploaded.name, config={"display_name": "run-a"})
    assert job.name is not None and job.name.startswith("batches/")
    assert job.display_name == "run-a" and job.model == f"models/{MODEL}"
    assert job.state in ("JOB_STATE_PENDING", "JOB_STATE_RUNNING")
    job = wait_until(client, job.name, DONE)
    assert job.state == "JOB_STATE_SUCCEEDED" and job.end_time is not None
    assert job.dest is not None and job.dest.file_name is not None

    results = client.files.download(file=job.dest.file_name)
    lines = [orjson.loads(line) for line in results.splitlines()]
    assert sorted(line["key"] for line in lines) == sorted(f"req-{i}" for i in range(10))
    for line in lines:
        # Each response is a GenerateContentResponse the SDK reads.
        response = types.GenerateContentResponse._from_response(response=line["response"], kwargs={})
        assert response.text and response.usage_metadata is not None
        assert response.usage_metadata.prompt_token_count

    listed = [j.name for j in client.batches.list(config={"page_size": 1})]
    assert job.name in listed
    client.files.delete(name=uploaded.name)
    with pytest.raises(errors.ClientError) as gone:
        client.files.get(name=uploaded.name)
    assert gone.value.code == 404


def test_gemini_sdk_list_pages_and_cancel(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="gemini", api_key=KEY, faults={"stall_batches": True})
    client = sdk(server)
    uploaded = upload(client, tmp_path, gemini_lines(3))
    names = [
        client.batches.create(model=MODEL, src=uploaded.name, config={"display_name": f"run-{i}"}).name
        for i in range(3)
    ]
    pager = client.batches.list(config={"page_size": 2})
    # Two pages: the SDK follows nextPageToken.
    assert sorted(j.name for j in pager) == sorted(names)
    client.batches.cancel(name=names[0])
    job = wait_until(client, names[0], DONE)
    assert job.state == "JOB_STATE_CANCELLED"
    # Cancelling a batch that has ended is refused as a failed precondition.
    server.force(names[1].removeprefix("batches/"), "complete")
    wait_until(client, names[1], DONE)
    with pytest.raises(errors.ClientError) as refused:
        client.batches.cancel(name=names[1])
    assert refused.value.code == 400 and refused.value.status == "FAILED_PRECONDITION"


def test_gemini_sdk_errors_in_googles_shape(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="gemini", api_key=KEY)
    stranger = sdk(server, key="not-the-key")
    with pytest.raises(errors.ClientError) as wrong_key:
        stranger.batches.list()
    assert wrong_key.value.code == 400 and wrong_key.value.status == "INVALID_ARGUMENT"
    assert "not-the-key" not in str(wrong_key.value)
    client = sdk(server)
    with pytest.raises(errors.ClientError) as missing:
        client.batches.get(name="batches/nope123")
    assert missing.value.code == 404 and missing.value.status == "NOT_FOUND"
    # Without a key: refused as an unregistered caller, in Google's error shape.
    answer = httpx.get(f"{server.base_url}/batches", timeout=10)
    body = answer.json()
    assert answer.status_code == 403 and set(body["error"]) == {"code", "message", "status"}
    assert body["error"]["status"] == "PERMISSION_DENIED"


def test_gemini_sdk_embeddings_batch(batch_server: Any, tmp_path: Path) -> None:
    """``batches.create_embeddings``: ``models/{model}:asyncBatchEmbedContent`` over an uploaded
    file of ``{key, request: EmbedContentRequest}`` lines; the responses file holds embeddings."""
    server = batch_server(dialect="gemini", api_key=KEY)
    client = sdk(server)
    data = b"".join(
        orjson.dumps(
            {
                "key": f"emb-{i}",
                "request": {"content": {"parts": [{"text": f"text {i}"}]}, "outputDimensionality": 8},
            }
        )
        + b"\n"
        for i in range(4)
    )
    uploaded = upload(client, tmp_path, data)
    job = client.batches.create_embeddings(
        model="gemini-embedding-001", src={"file_name": uploaded.name}, config={"display_name": "emb-run"}
    )
    assert job.name is not None and job.display_name == "emb-run"
    job = wait_until(client, job.name, DONE)
    assert job.state == "JOB_STATE_SUCCEEDED"
    assert job.dest is not None and job.dest.file_name is not None
    lines = [orjson.loads(line) for line in client.files.download(file=job.dest.file_name).splitlines()]
    assert sorted(line["key"] for line in lines) == [f"emb-{i}" for i in range(4)]
    for line in lines:
        response = types.SingleEmbedContentResponse._from_response(response=line["response"], kwargs={})
        assert response.embedding is not None and len(response.embedding.values or []) == 8
        assert response.token_count
