"""Echo work is capped (a clear 400 or error line beyond the limits) and never blocks the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from airflow_batch_provider.server.backends import (
    ECHO_MAX_EMBEDDING_VALUES,
    ECHO_MAX_INPUT_CHARS,
    ECHO_MAX_INPUTS,
    ECHO_MAX_N,
    ECHO_MAX_OUTPUT_CHARS,
    ECHO_MAX_REQUEST_VALUES,
)
from airflow_batch_provider.server.config import ServerConfig
from tests.fixtures.server import SubprocessServer
from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for


def _schema_body(schema):
    return {
        "model": "gpt-test",  # the model of chat_line: an OpenAI file keeps one model
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }


NESTED = {"type": "array", "minItems": 100, "items": {"type": "array", "minItems": 100, "items": {}}}
NESTED["items"]["items"] = {"type": "array", "minItems": 100, "items": {"type": "string"}}

TOO_MUCH = {
    "nested_min_items": ("/v1/chat/completions", _schema_body(NESTED), "response_format"),
    "min_length": (
        "/v1/chat/completions",
        _schema_body({"type": "string", "minLength": 30_000_000}),
        "response_format",
    ),
    "n": ("/v1/chat/completions", {**chat_line(0)["body"], "n": 200_000}, "n"),
    "embeddings": ("/v1/embeddings", {"model": "e", "input": ["x"] * 300, "dimensions": 8192}, "dimensions"),
    "embedding_inputs": ("/v1/embeddings", {"model": "e", "input": ["x"] * 3000, "dimensions": 1}, "input"),
}


@pytest.mark.parametrize("name", sorted(TOO_MUCH))
def test_sync_request_beyond_the_echo_limits_is_a_clear_400(batch_server, name):
    url, body, param = TOO_MUCH[name]
    assert len(orjson.dumps(NESTED)) < 220  # the small request of the issue
    server = batch_server()
    with httpx.Client(base_url=server.root_url, timeout=30) as client:
        response = client.post(url, json=body)
    assert response.status_code == 400
    assert len(response.content) < 2000
    error = response.json()["error"]
    assert error["param"] == param
    assert "limit" in error["message"] or "at most" in error["message"]


def test_limits_are_the_documented_ones(batch_server):
    server = batch_server()
    with httpx.Client(base_url=server.root_url, timeout=30) as client:
        at_n = client.post("/v1/chat/completions", json={**chat_line(0)["body"], "n": ECHO_MAX_N})
        over_n = client.post("/v1/chat/completions", json={**chat_line(0)["body"], "n": ECHO_MAX_N + 1})
        dims = 8192
        count = ECHO_MAX_EMBEDDING_VALUES // dims
        at_embed = client.post("/v1/embeddings", json={"input": ["x"] * count, "dimensions": dims})
        over_embed = client.post("/v1/embeddings", json={"input": ["x"] * (count + 1), "dimensions": dims})
        at_len = client.post(
            "/v1/chat/completions",
            json=_schema_body({"type": "string", "minLength": ECHO_MAX_OUTPUT_CHARS - 2}),
        )
    assert (at_n.status_code, over_n.status_code) == (200, 400)
    assert len(at_n.json()["choices"]) == ECHO_MAX_N
    assert (at_embed.status_code, over_embed.status_code) == (200, 400)
    assert at_len.status_code == 200


def test_a_batch_line_beyond_the_limits_gets_an_error_line(batch_server):
    server = batch_server()
    lines = [chat_line(i) for i in range(5)]
    lines[2]["body"] = {**lines[2]["body"], "n": 200_000}
    lines[3]["body"] = _schema_body(NESTED)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, jsonl(lines)))["id"])
        errors = read_lines(client, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert sorted(e["custom_id"] for e in errors) == ["req-2", "req-3"]
    assert {e["response"]["status_code"] for e in errors} == {400}


# Just over what the echo model reads (ECHO_MAX_INPUT_CHARS characters of text per request).
BIG_TEXT = "word " * (ECHO_MAX_INPUT_CHARS // 5 + 1)

OVERSIZE = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": BIG_TEXT}]}),
    "completions": ("/v1/completions", {"model": "m", "prompt": BIG_TEXT}),
    "completions_prompts": ("/v1/completions", {"model": "m", "prompt": ["x"] * (ECHO_MAX_INPUTS + 1)}),
    "responses": ("/v1/responses", {"model": "m", "input": BIG_TEXT}),
    "embeddings": ("/v1/embeddings", {"model": "m", "input": BIG_TEXT}),
    # The case, scaled down: a list of numbers answered one result each (550 MB for 10^7).
    "moderations": ("/v1/moderations", {"model": "m", "input": [0] * (ECHO_MAX_REQUEST_VALUES + 1)}),
    "moderations_inputs": ("/v1/moderations", {"model": "m", "input": ["x"] * (ECHO_MAX_INPUTS + 1)}),
}
PARAM = {"chat": "messages", "completions": "prompt", "completions_prompts": "prompt"}


@pytest.mark.parametrize("name", sorted(OVERSIZE))
def test_every_endpoint_refuses_a_request_larger_than_the_echo_model_reads(batch_server, name):
    """One bound on every endpoint: a clear 400 naming the field, a small answer, no echo of the input."""
    url, body = OVERSIZE[name]
    server = batch_server()
    with httpx.Client(base_url=server.root_url, timeout=60) as client:
        response = client.post(url, content=orjson.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.content[:300]
    assert len(response.content) < 2000
    error = response.json()["error"]
    assert error["param"] == PARAM.get(name, "input")
    assert "limit" in error["message"]


def test_a_request_within_the_echo_input_limit_is_answered_with_a_bounded_answer(batch_server):
    server = batch_server()
    prompt = "w " * ((ECHO_MAX_INPUT_CHARS - 100) // 2)
    with httpx.Client(base_url=server.root_url, timeout=60) as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3})
        full = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "echo: w w"
    assert response.json()["usage"]["prompt_tokens"] == len(prompt) // 2
    assert full.status_code == 200
    assert len(prompt) < len(full.content) < len(prompt) + 2000


def test_an_oversize_batch_line_fails_alone_with_a_400_error_line(batch_server):
    """Every endpoint's bound holds in a batch too: the line fails, the batch and the others do not."""
    server = batch_server()

    def line(i, prompt):
        body = {"model": "gpt-test", "prompt": prompt}
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}

    lines = [line(0, "hi"), line(1, BIG_TEXT), line(2, "there")]
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        file_id = upload(client, jsonl(lines))
        done = wait_for(client, create(client, file_id, "/v1/completions")["id"], timeout=60)
        output = client.get(f"/files/{done['output_file_id']}/content").content
        errors = read_lines(client, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert len(output) < 5000  # the two small answers; nothing of the 4 MB prompt
    assert [e["custom_id"] for e in errors] == ["req-1"]
    response = errors[0]["response"]
    assert response["status_code"] == 400
    assert response["body"]["error"]["param"] == "prompt"
    assert "limit" in response["body"]["error"]["message"]


def _heavy_line(i):
    # About 60 ms of echo work each: 3,000 objects of two properties (within the limits).
    schema = {
        "type": "array",
        "minItems": 3000,
        "items": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}},
    }
    return {
        **chat_line(i),
        "body": {**_schema_body(schema), "messages": [{"role": "user", "content": f"r{i}"}]},
    }


LINES = 80  # ~5 s of echo work in one chunk of 256 lines


def test_health_answers_while_batches_and_requests_are_processing(tmp_path):
    """The event loop stays free: /health is measured from a client during heavy work.

    The issue's target is 100 ms; the assertion leaves room for a loaded 2-core CI machine
    (before the fix /health waited for whole chunks of work: seconds). The server runs in a
    process of its own, as `airflow-batch serve` does: in this pytest process (Airflow
    imported, ~200,000 objects) one full garbage collection took 0.3 s by itself.
    """
    latencies: list[float] = []
    done = threading.Event()
    config = ServerConfig(port=0, data_dir=tmp_path, time_scale=0.001)
    with SubprocessServer(config) as server:

        def heavy_requests():
            with httpx.Client(base_url=server.root_url, timeout=60) as client:
                for _ in range(3):
                    body = {"input": ["x"] * (ECHO_MAX_EMBEDDING_VALUES // 8192), "dimensions": 8192}
                    assert client.post("/v1/embeddings", json=body).status_code == 200

        def poll_health():
            with httpx.Client(base_url=server.root_url, timeout=60) as health:
                while not done.is_set():
                    t0 = time.perf_counter()
                    assert health.get("/health").status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        poller = threading.Thread(target=poll_health)
        poller.start()
        try:
            with httpx.Client(base_url=server.base_url, timeout=60) as client:
                batch = create(client, upload(client, jsonl(_heavy_line(i) for i in range(LINES))))
                workers = [threading.Thread(target=heavy_requests) for _ in range(2)]
                for worker in workers:
                    worker.start()
                finished = wait_for(client, batch["id"], timeout=120)
                for worker in workers:
                    worker.join()
        finally:
            done.set()
            poller.join()
    assert finished["status"] == "completed"
    assert finished["request_counts"]["completed"] == LINES
    assert len(latencies) >= 5
    print(f"/health during heavy work: {len(latencies)} probes, max {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 1.0
