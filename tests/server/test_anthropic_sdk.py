"""The official ``anthropic`` SDK drives ``serve --dialect anthropic``: create, retrieve, list,
cancel and results of Message Batches.

The SDK parses every answer into its own models (``MessageBatch``, ``SyncPage``,
``MessageBatchIndividualResponse``) and raises its typed errors from the status and error body,
so these tests hold the server mode to the shapes Anthropic publishes, not to the dialect.
"""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import pytest

KEY = "anthropic-sdk-test"
MODEL = "claude-sonnet-4-5"


def sdk(server: Any, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=server.root_url, timeout=10, max_retries=0)


def requests(count: int, prefix: str = "req-") -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}{i}",
            "params": {
                "model": MODEL,
                "max_tokens": 20,
                "system": "be brief",
                "messages": [{"role": "user", "content": f"hello number {i}"}],
            },
        }
        for i in range(count)
    ]


def wait_ended(client: anthropic.Anthropic, batch_id: str) -> Any:
    deadline = time.monotonic() + 30
    batch = client.messages.batches.retrieve(batch_id)
    while batch.processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
        batch = client.messages.batches.retrieve(batch_id)
    return batch


def test_anthropic_sdk_round_trip(batch_server: Any) -> None:
    server = batch_server(dialect="anthropic", api_key=KEY)
    client = sdk(server)
    created = client.messages.batches.create(requests=requests(10))  # type: ignore[arg-type]
    assert created.type == "message_batch" and created.processing_status == "in_progress"
    # Counts stay "processing" until the batch ends; no results_url before then.
    assert created.request_counts.processing == 10 and created.request_counts.succeeded == 0
    assert created.results_url is None and created.id.startswith("msgbatch_")

    batch = wait_ended(client, created.id)
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (
        0,
        10,
        0,
        0,
        0,
    )
    assert (
        batch.ended_at is not None
        and batch.results_url == f"{server.base_url}/messages/batches/{batch.id}/results"
    )

    results = {r.custom_id: r for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == sorted(f"req-{i}" for i in range(10))
    answer = results["req-3"].result
    assert answer.type == "succeeded"
    message = answer.message  # type: ignore[union-attr]
    assert message.role == "assistant" and message.stop_reason == "end_turn"
    assert message.content[0].text == "echo: hello number 3"  # type: ignore[union-attr]
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0

    # A second batch, stalled by the fault header so it is still running, to cancel.
    other = client.messages.batches.create(
        requests=requests(4, "c-"),  # type: ignore[arg-type]
        extra_headers={"X-Batch-Fault": "stall"},
    )
    cancelling = client.messages.batches.cancel(other.id)
    assert cancelling.processing_status in ("canceling", "ended")
    cancelled = wait_ended(client, other.id)
    assert cancelled.request_counts.canceled == 4 and cancelled.request_counts.succeeded == 0
    assert {r.result.type for r in client.messages.batches.results(other.id)} == {"canceled"}

    # The listing: newest first, paged by limit with after_id (the SDK follows last_id).
    assert [b.id for b in client.messages.batches.list()] == [other.id, batch.id]
    first = client.messages.batches.list(limit=1)
    assert [b.id for b in first.data] == [other.id] and first.has_more and first.last_id == other.id
    assert [b.id for b in client.messages.batches.list(limit=1, after_id=other.id).data] == [batch.id]
    assert [b.id for b in client.messages.batches.list(limit=5, before_id=batch.id).data] == [other.id]
    assert [b.id for page in client.messages.batches.list(limit=1).iter_pages() for b in page.data] == [
        other.id,
        batch.id,
    ]


def test_anthropic_sdk_sees_auth_not_found_and_invalid_request_errors(batch_server: Any) -> None:
    server = batch_server(dialect="anthropic", api_key=KEY)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        sdk(server, key="wrong").messages.batches.list()
    assert refused.value.status_code == 401
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid x-api-key"},
        "request_id": refused.value.body["request_id"],  # type: ignore[index]
    }
    assert KEY not in str(refused.value.body) and "wrong" not in str(refused.value.body)
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk(server).messages.batches.retrieve("msgbatch_0123456789abcdef01234567")
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    client = sdk(server)
    bad_id = requests(1)
    bad_id[0]["custom_id"] = "has.dot"
    with pytest.raises(anthropic.BadRequestError) as pattern:
        client.messages.batches.create(requests=bad_id)  # type: ignore[arg-type]
    assert "requests.0.custom_id" in pattern.value.message
    no_tokens = requests(2)
    del no_tokens[1]["params"]["max_tokens"]
    with pytest.raises(anthropic.BadRequestError) as tokens:
        client.messages.batches.create(requests=no_tokens)  # type: ignore[arg-type]
    assert "requests.1.params.max_tokens" in tokens.value.message
    with pytest.raises(anthropic.BadRequestError) as twice:
        client.messages.batches.create(requests=requests(1) + requests(1))  # type: ignore[arg-type]
    assert "duplicate custom_id" in twice.value.message

    # An ended batch cannot be cancelled; its results are there. A running one has none yet.
    done = wait_ended(client, client.messages.batches.create(requests=requests(1)).id)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.cancel(done.id)
    running = client.messages.batches.create(
        requests=requests(1),  # type: ignore[arg-type]
        extra_headers={"X-Batch-Fault": "stall"},
    )
    answer = httpx.get(
        f"{server.base_url}/messages/batches/{running.id}/results",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    )
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_mode_requires_its_version_header_and_owns_only_its_paths(batch_server: Any) -> None:
    server = batch_server(dialect="anthropic", api_key=KEY)
    no_version = httpx.get(f"{server.base_url}/messages/batches", headers={"x-api-key": KEY})
    assert no_version.status_code == 400
    assert no_version.json()["error"] == {
        "type": "invalid_request_error",
        "message": "anthropic-version: header is required",
    }
    # The OpenAI batch paths are not Anthropic's, and the other modes do not answer Anthropic's.
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    assert httpx.get(f"{server.base_url}/batches", headers=headers).status_code == 404
    openai_server = batch_server(dialect="openai")
    assert httpx.get(f"{openai_server.base_url}/messages/batches").status_code == 404
