"""The official ``openai`` SDK drives a full round trip against the local batch server."""

from __future__ import annotations

import time

import openai
import orjson

from tests.server.helpers import chat_line, jsonl


def test_openai_sdk_round_trip(batch_server, tmp_path):
    server = batch_server(api_key="sk-sdk-test")
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-sdk-test", max_retries=2)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(chat_line(i) for i in range(10)))

    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.bytes == path.stat().st_size
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"dag": "demo"},
    )
    deadline = time.monotonic() + 30
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert batch.request_counts is not None and batch.request_counts.completed == 10
    assert batch.output_file_id is not None
    content = client.files.content(batch.output_file_id).content
    answers = {row["custom_id"]: row for row in map(orjson.loads, content.splitlines())}
    assert answers["req-3"]["response"]["body"]["choices"][0]["message"]["content"] == "echo: hello number 3"

    # A second batch, stalled by the fault header so it is still running, to cancel.
    other = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers={"X-Batch-Fault": "stall"},
    )
    cancelled = client.batches.cancel(other.id)
    assert cancelled.status in ("cancelling", "cancelled")
    while cancelled.status != "cancelled":
        assert time.monotonic() < deadline, cancelled
        time.sleep(0.02)
        cancelled = client.batches.retrieve(other.id)
    assert cancelled.request_counts is not None and cancelled.request_counts.failed == 10
    listed = [b.id for b in client.batches.list(limit=1)]
    assert listed == [other.id, batch.id]
    assert client.files.delete(uploaded.id).deleted is True


def test_openai_sdk_retries_injected_429(batch_server):
    server = batch_server()
    server.set_faults(rate_429=0.5, retry_after=0.01)
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-x", max_retries=3)
    assert list(client.batches.list()) == []
    assert server.stats()["counters"]["status_429"] == 1
