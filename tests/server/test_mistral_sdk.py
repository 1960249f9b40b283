"""The official ``mistralai`` SDK drives ``serve --dialect mistral``: upload, create, list, cancel, results.

The SDK validates every answer against its own models (``ResponseValidationError`` otherwise), so
these tests hold the server mode to the shapes Mistral publishes, not to the provider's dialect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from mistralai.client import Mistral, errors

KEY = "mistral-sdk-test"
MODEL = "mistral-small-latest"


def mistral_lines(count: int, prefix: str = "req-") -> bytes:
    """Mistral's input lines: ``{custom_id, body}``, the model and endpoint being the job's."""
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"{prefix}{i}",
                "body": {"max_tokens": 20, "messages": [{"role": "user", "content": f"hello number {i}"}]},
            }
        )
        + b"\n"
        for i in range(count)
    )


def sdk(server: Any, key: str = KEY) -> Mistral:
    return Mistral(api_key=key, server_url=server.root_url, timeout_ms=10_000)


def wait_until(client: Mistral, job_id: str, statuses: set[str]) -> Any:
    deadline = time.monotonic() + 30
    job = client.batch.jobs.get(job_id=job_id)
    while job.status not in statuses:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
        job = client.batch.jobs.get(job_id=job_id)
    return job


def upload(client: Mistral, data: bytes, name: str = "in.jsonl") -> Any:
    return client.files.upload(file={"file_name": name, "content": data}, purpose="batch")


def test_mistral_sdk_round_trip(batch_server: Any) -> None:
    server = batch_server(dialect="mistral", api_key=KEY)
    client = sdk(server)
    data = mistral_lines(10)
    uploaded = upload(client, data)
    assert (uploaded.size_bytes, uploaded.purpose, uploaded.sample_type) == (
        len(data),
        "batch",
        "batch_request",
    )

    job = client.batch.jobs.create(
        input_files=[uploaded.id],
        model=MODEL,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "run-a"},
        timeout_hours=24,
    )
    assert job.status in ("QUEUED", "RUNNING") and job.model == MODEL and job.input_files == [uploaded.id]
    job = wait_until(client, job.id, {"SUCCESS", "FAILED", "TIMEOUT_EXCEEDED", "CANCELLED"})
    assert job.status == "SUCCESS"
    assert (job.total_requests, job.succeeded_requests, job.failed_requests) == (10, 10, 0)
    assert job.completed_requests == 10 and job.output_file and job.completed_at is not None
    assert not job.error_file  # no failed line, no error file

    content = client.files.download(file_id=job.output_file).read()
    answers = {row["custom_id"]: row for row in map(orjson.loads, content.splitlines())}
    assert sorted(answers) == sorted(f"req-{i}" for i in range(10))
    body = answers["req-3"]["response"]["body"]
    assert answers["req-3"]["response"]["status_code"] == 200
    # The job's model answered each line (the lines name none).
    assert body["model"] == f"echo:{MODEL}"
    assert body["choices"][0]["message"]["content"] == "echo: hello number 3"

    # A second job, stalled by the fault header so it is still running, to cancel.
    other = client.batch.jobs.create(
        input_files=[uploaded.id],
        model=MODEL,
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": "run-b"},
        http_headers={"X-Batch-Fault": "stall"},
    )
    cancelled = client.batch.jobs.cancel(job_id=other.id)
    assert cancelled.status in ("CANCELLATION_REQUESTED", "CANCELLED")
    cancelled = wait_until(client, other.id, {"CANCELLED"})
    assert cancelled.failed_requests == 10 and cancelled.error_file
    lines = [orjson.loads(x) for x in client.files.download(file_id=cancelled.error_file).read().splitlines()]
    assert {line["error"]["code"] for line in lines} == {"batch_cancelled"}

    # The listing: newest first, paged with page/page_size and a total, filtered by metadata
    # (sent by the SDK as one query parameter per pair) and by status.
    listed = client.batch.jobs.list()
    assert [j.id for j in listed.data or []] == [other.id, job.id] and listed.total == 2
    page = client.batch.jobs.list(page=1, page_size=1)
    assert [j.id for j in page.data or []] == [job.id] and page.total == 2
    tagged = client.batch.jobs.list(metadata={"airflow_batch_key": "run-a"})
    assert [j.id for j in tagged.data or []] == [job.id] and tagged.total == 1
    assert client.batch.jobs.list(metadata={"airflow_batch_key": "nothing"}).total == 0
    assert [j.id for j in client.batch.jobs.list(status=["CANCELLED"]).data or []] == [other.id]
    oldest = client.batch.jobs.list(order_by="created")
    assert [j.id for j in oldest.data or []] == [job.id, other.id]


def test_mistral_sdk_sees_auth_and_not_found_errors(batch_server: Any) -> None:
    server = batch_server(dialect="mistral", api_key=KEY)
    with pytest.raises(errors.SDKError) as refused:
        sdk(server, key="wrong").batch.jobs.list()
    assert refused.value.status_code == 401
    assert orjson.loads(refused.value.body)["message"] == "Unauthorized"
    assert KEY not in refused.value.body and "wrong" not in refused.value.body
    with pytest.raises(errors.SDKError) as missing:
        sdk(server).batch.jobs.get(job_id="0b9b3e4e-7c33-4c59-9d55-0c6a3f1f7a10")
    assert missing.value.status_code == 404
    assert orjson.loads(missing.value.body)["object"] == "error"
    # The OpenAI paths are not Mistral's.
    answer = httpx.get(f"{server.base_url}/batches", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 404 and "/v1/batch/jobs" in answer.json()["message"]


def test_mistral_job_refuses_what_the_api_refuses(batch_server: Any) -> None:
    server = batch_server(dialect="mistral")
    client = sdk(server)
    uploaded = upload(client, mistral_lines(2))
    with pytest.raises(errors.SDKError) as no_model:
        client.batch.jobs.create(input_files=[uploaded.id], endpoint="/v1/chat/completions")
    assert no_model.value.status_code == 422 and "model" in no_model.value.body
    with pytest.raises(errors.SDKError) as hours:
        client.batch.jobs.create(
            input_files=[uploaded.id], model=MODEL, endpoint="/v1/chat/completions", timeout_hours=999
        )
    assert hours.value.status_code == 422 and "timeout_hours" in hours.value.body


def test_an_openai_shaped_file_fails_the_job_naming_the_line(batch_server: Any, tmp_path: Path) -> None:
    # Mistral lines are {custom_id, body}: a file in OpenAI's shape is not silently accepted.
    server = batch_server(dialect="mistral")
    client = sdk(server)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    uploaded = upload(client, orjson.dumps(line) + b"\n")
    job = client.batch.jobs.create(input_files=[uploaded.id], model=MODEL, endpoint="/v1/chat/completions")
    job = wait_until(client, job.id, {"FAILED", "SUCCESS"})
    assert job.status == "FAILED"
    assert "unexpected field(s) method, url" in job.errors[0].message


def test_serve_dialect_mistral_command_answers_the_sdk(tmp_path: Path) -> None:
    # The command a user runs: `airflow-batch serve --dialect mistral`, then the SDK at its root URL.
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MISTRAL_TEST_KEY": KEY}
    cmd = [sys.executable, "-m", "airflow_batch_provider.cli", "serve", "--port", "0"]
    cmd += ["--data-dir", str(tmp_path), "--dialect", "mistral", "--api-key-env", "MISTRAL_TEST_KEY"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        banner = ""
        for _ in range(50):
            banner = proc.stdout.readline()
            if "Local batch server" in banner or not banner:
                break
        url = banner.split(" at ", 1)[1].split()[0]
        assert url.endswith("/v1"), banner
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/batch/jobs", headers={"Authorization": f"Bearer {KEY}"})
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        client = Mistral(api_key=KEY, server_url=url.removesuffix("/v1"), timeout_ms=10_000)
        listed = client.batch.jobs.list()
        assert (listed.total, listed.data) == (0, [])
        uploaded = upload(client, mistral_lines(3))
        created = client.batch.jobs.create(
            input_files=[uploaded.id], model=MODEL, endpoint="/v1/chat/completions"
        )
        assert wait_until(client, created.id, {"SUCCESS", "FAILED"}).status == "SUCCESS"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
