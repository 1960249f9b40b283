"""The official ``openai`` SDK drives ``serve --dialect azure`` on both of Azure's path styles.

``openai.AzureOpenAI`` (azure_endpoint + api_version: the classic ``/openai/...?api-version=``
paths, with ``api_key`` or ``azure_ad_token_provider``) and ``openai.OpenAI`` pointed at
``{endpoint}/openai/v1`` (the v1 path, no version): upload, create, retrieve, list, cancel and
file content, as Microsoft's batch guide does them. The SDK parses every answer into its own
models, so the mode is held to the published shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.server.helpers import chat_line, jsonl

KEY = "azure-sdk-test-key"
TOKEN = "eyJ0eXAiOiJKV1QiLCJhbGciOiJSUzI1NiJ9.entra-stand-in"
API_VERSION = "2024-10-21"
DEPLOYMENT = "gpt-4o-mini-batch"
FOURTEEN_DAYS = 14 * 24 * 3600
TERMINAL = ("completed", "failed", "expired", "cancelled")


def wait(client: openai.OpenAI, batch: Any, statuses: tuple[str, ...] = TERMINAL) -> Any:
    deadline = time.monotonic() + 30
    while batch.status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
        batch = client.batches.retrieve(batch.id)
    return batch


# How Microsoft's batch guide names the endpoint: in the lines and the create of its classic
# (AzureOpenAI + api_version) samples, ``/chat/completions``; its v1 samples put
# ``/v1/chat/completions`` in the lines and ``/chat/completions`` in the create.
CLASSIC = ("/chat/completions", "/chat/completions")
V1_SAMPLE = ("/v1/chat/completions", "/chat/completions")
V1_REFERENCE = ("/v1/chat/completions", "/v1/chat/completions")


def round_trip(client: openai.OpenAI, tmp_path: Path, form: tuple[str, str] = V1_REFERENCE) -> list[str]:
    """Upload, create, retrieve, content, cancel a second batch, list; the requests' paths.

    :param form: the endpoint as the lines' ``url`` and the create's ``endpoint`` name it.
    """
    line_url, endpoint = form
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(chat_line(i, model=DEPLOYMENT, url=line_url) for i in range(6)))
    uploaded = client.files.create(
        file=path.open("rb"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": FOURTEEN_DAYS},
    )
    assert uploaded.bytes == path.stat().st_size
    assert uploaded.expires_at == uploaded.created_at + FOURTEEN_DAYS
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]  # the SDK's type lists OpenAI's /v1 form only
        completion_window="24h",
        metadata={"airflow_batch_key": "run-a"},
        extra_body={"output_expires_after": {"anchor": "created_at", "seconds": FOURTEEN_DAYS}},
    )
    batch = wait(client, batch)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
    assert batch.output_file_id and not batch.error_file_id  # no failed line, no error file
    content = client.files.content(batch.output_file_id).content
    answers = {row["custom_id"]: row for row in map(orjson.loads, content.splitlines())}
    body = answers["req-3"]["response"]["body"]
    assert body["model"] == f"echo:{DEPLOYMENT}"
    assert body["choices"][0]["message"]["content"] == "echo: hello number 3"

    other = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        extra_headers={"X-Batch-Fault": "stall"},
    )
    cancelled = wait(client, client.batches.cancel(other.id), ("cancelled",))
    assert cancelled.request_counts is not None and cancelled.request_counts.failed == 6
    assert [b.id for b in client.batches.list(limit=1)] == [other.id, batch.id]
    return [batch.id, other.id]


class Recorder:
    """Records the URL and auth headers of every request the SDK sends."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []

    def __call__(self, request: httpx.Request) -> None:
        auth = {k: v for k, v in request.headers.items() if k in ("api-key", "authorization")}
        self.seen.append((request.url.path, request.url.query.decode(), auth))


def recorded_client(recorder: Recorder) -> httpx.Client:
    return httpx.Client(event_hooks={"request": [recorder]}, timeout=10)


def test_azure_openai_client_on_the_classic_path_with_a_key(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="azure", api_key=KEY)
    recorder = Recorder()
    client = openai.AzureOpenAI(
        azure_endpoint=server.root_url,
        api_version=API_VERSION,
        api_key=KEY,
        max_retries=0,
        http_client=recorded_client(recorder),
    )
    round_trip(client, tmp_path, CLASSIC)
    paths = {path for path, _, _ in recorder.seen}
    assert {"/openai/files", "/openai/batches"} <= paths
    assert all(p.startswith("/openai/") and not p.startswith("/openai/v1/") for p in paths)
    assert all(query.startswith(f"api-version={API_VERSION}") for _, query, _ in recorder.seen)
    assert all(auth == {"api-key": KEY} for _, _, auth in recorder.seen)


def test_azure_openai_client_with_an_entra_token_provider(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="azure", api_key=KEY, bearer_token=TOKEN)
    recorder = Recorder()
    calls: list[int] = []

    def provider() -> str:
        calls.append(1)
        return TOKEN

    client = openai.AzureOpenAI(
        azure_endpoint=server.root_url,
        api_version=API_VERSION,
        azure_ad_token_provider=provider,
        max_retries=0,
        http_client=recorded_client(recorder),
    )
    round_trip(client, tmp_path, CLASSIC)
    assert calls and all(auth == {"authorization": f"Bearer {TOKEN}"} for _, _, auth in recorder.seen)
    # A token the server does not accept is refused in Azure's 401 shape, echoing nothing.
    stale = openai.AzureOpenAI(
        azure_endpoint=server.root_url,
        api_version=API_VERSION,
        azure_ad_token_provider=lambda: "expired-token",
        max_retries=0,
    )
    with pytest.raises(openai.AuthenticationError) as refused:
        stale.batches.list()
    assert refused.value.status_code == 401
    body = refused.value.response.json()
    assert body["error"]["code"] == "401" and "Access denied" in body["error"]["message"]
    assert "expired-token" not in refused.value.response.text and KEY not in refused.value.response.text


@pytest.mark.parametrize("form", [V1_SAMPLE, V1_REFERENCE], ids=["v1-sample", "v1-reference"])
def test_openai_client_on_the_v1_path(batch_server: Any, tmp_path: Path, form: tuple[str, str]) -> None:
    server = batch_server(dialect="azure", api_key=KEY)
    assert server.base_url == f"{server.root_url}/openai/v1"
    recorder = Recorder()
    client = openai.OpenAI(
        base_url=f"{server.root_url}/openai/v1",
        api_key=KEY,
        max_retries=0,
        http_client=recorded_client(recorder),
    )
    round_trip(client, tmp_path, form)
    assert all(
        path.startswith("/openai/v1/") and "api-version" not in query for path, query, _ in recorder.seen
    )
    assert all(auth == {"authorization": f"Bearer {KEY}"} for _, _, auth in recorder.seen)


def test_classic_path_without_api_version_and_openai_paths_are_refused(batch_server: Any) -> None:
    server = batch_server(dialect="azure", api_key=KEY)
    headers = {"api-key": KEY}
    missing = httpx.get(f"{server.root_url}/openai/batches", headers=headers)
    assert missing.status_code == 400 and "api-version" in missing.json()["error"]["message"]
    assert httpx.get(f"{server.root_url}/openai/v1/batches", headers=headers).status_code == 200
    # OpenAI's own /v1 root is not Azure's.
    assert httpx.get(f"{server.root_url}/v1/batches", headers=headers).status_code == 404
    # No key at all: Azure's 401.
    anonymous = httpx.get(f"{server.root_url}/openai/v1/batches")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "401"


def test_file_expiry_outside_azures_range_is_refused(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="azure", api_key=KEY)
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(0, model=DEPLOYMENT)]))
    with pytest.raises(openai.BadRequestError) as short:
        client.files.create(
            file=path.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
        )
    assert "expires_after.seconds" in str(short.value)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as output:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}},
        )
    assert "output_expires_after.seconds" in str(output.value)
    assert server.config.limits().max_lines == 100_000


def test_token_limit_exceeded_at_create_and_as_a_failed_batch(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(dialect="azure", api_key=KEY)
    client = openai.AzureOpenAI(
        azure_endpoint=server.root_url, api_version=API_VERSION, api_key=KEY, max_retries=0
    )
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(0, model=DEPLOYMENT)]))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers={"X-Batch-Fault": "token_limit"},
        )
    assert refused.value.code == "token_limit_exceeded"
    failed = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers={"X-Batch-Fault": "token_limit_failed"},
    )
    failed = wait(client, failed)
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data
    assert failed.errors.data[0].code == "token_limit_exceeded"


def test_serve_dialect_azure_command_answers_both_clients(tmp_path: Path) -> None:
    # The command a user runs: `airflow-batch serve --dialect azure` with a key and a stand-in
    # Entra ID token, then AzureOpenAI (classic, bearer) and OpenAI (v1, key) at its root.
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "AZ_TEST_KEY": KEY, "AZ_TEST_TOKEN": TOKEN}
    cmd = [
        sys.executable,
        "-m",
        "airflow_batch_provider.cli",
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
    ]
    cmd += ["--dialect", "azure", "--api-key-env", "AZ_TEST_KEY", "--bearer-token-env", "AZ_TEST_TOKEN"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        banner = ""
        for _ in range(50):
            banner = proc.stdout.readline()
            if "Local batch server" in banner or not banner:
                break
        url = banner.split(" at ", 1)[1].split()[0]
        assert url.endswith("/openai/v1") and "also under /openai" in banner, banner
        assert KEY not in banner and TOKEN not in banner
        root = url.removesuffix("/openai/v1")
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/batches", headers={"api-key": KEY})
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        classic = openai.AzureOpenAI(
            azure_endpoint=root, api_version=API_VERSION, azure_ad_token_provider=lambda: TOKEN, max_retries=0
        )
        path = tmp_path / "in.jsonl"
        path.write_bytes(jsonl(chat_line(i, model=DEPLOYMENT) for i in range(3)))
        uploaded = classic.files.create(file=path.open("rb"), purpose="batch")
        batch = classic.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        v1 = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        assert wait(v1, v1.batches.retrieve(batch.id)).status == "completed"
        assert [b.id for b in classic.batches.list()] == [batch.id]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
