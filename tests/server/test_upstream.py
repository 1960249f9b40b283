"""The upstream backend forwards lines to another server (here: a second local server's echo)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for


@pytest.fixture
def upstream(batch_server):
    return batch_server(api_key="sk-upstream")


@pytest.fixture
def proxy(batch_server, upstream, monkeypatch):
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-upstream")
    return batch_server(
        backend="upstream",
        upstream_url=upstream.base_url,
        upstream_api_key_env="TEST_UPSTREAM_KEY",
        # Faults fire on a fixed share of all calls, counted across the 4 concurrent workers, so
        # one line can land on a fault slot several times running; enough retries make the
        # test about retrying, not about that timing.
        upstream_max_retries=12,
        upstream_max_backoff=0.01,
        upstream_concurrency=4,
        chunk_size=16,
    )


def test_lines_are_answered_by_the_upstream_with_retries(upstream, proxy):
    upstream.set_faults(rate_429=0.3, rate_503=0.1, retry_after=0.01)
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-test"}}
    lines = [chat_line(i) for i in range(40)] + [bad]
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, jsonl(lines)))["id"])
        outputs = read_lines(client, done["output_file_id"])
        errors = read_lines(client, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 41, "completed": 40, "failed": 1}
    by_id = {o["custom_id"]: o["response"]["body"] for o in outputs}
    assert by_id["req-5"]["choices"][0]["message"]["content"] == "echo: hello number 5"
    assert by_id["req-5"]["model"] == "echo:gpt-test"
    # The upstream's own 400 becomes an error line carrying its answer.
    (error,) = errors
    assert error["custom_id"] == "bad"
    assert error["response"]["status_code"] == 400
    counters = upstream.stats()["counters"]
    assert counters["status_429"] > 0 and counters["status_503"] > 0


def test_exhausted_retries_become_error_lines(batch_server, upstream, monkeypatch):
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-upstream")
    proxy = batch_server(
        backend="upstream",
        upstream_url=upstream.base_url,
        upstream_api_key_env="TEST_UPSTREAM_KEY",
        upstream_max_retries=1,
        upstream_max_backoff=0.01,
    )
    upstream.set_faults(rate_500=1.0)
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, jsonl(chat_line(i) for i in range(3))))["id"])
        errors = read_lines(client, done["error_file_id"])
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert {e["response"]["status_code"] for e in errors} == {500}
    assert upstream.stats()["counters"]["status_500"] == 6  # 3 lines x (1 try + 1 retry)


def test_wrong_upstream_key_is_an_error_line_without_the_key(batch_server, upstream, monkeypatch):
    monkeypatch.setenv("TEST_WRONG_KEY", "sk-wrong-key-value")
    proxy = batch_server(
        backend="upstream", upstream_url=upstream.base_url, upstream_api_key_env="TEST_WRONG_KEY"
    )
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, jsonl([chat_line(1)])))["id"])
        errors = read_lines(client, done["error_file_id"])
    assert errors[0]["response"]["status_code"] == 401
    assert "sk-wrong-key-value" not in str(errors)


def test_unreachable_upstream(batch_server):
    proxy = batch_server(
        backend="upstream", upstream_url="http://127.0.0.1:9/v1", upstream_max_retries=0, upstream_timeout=2
    )
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, jsonl([chat_line(1)])))["id"])
        errors = read_lines(client, done["error_file_id"])
    assert errors[0]["response"]["status_code"] == 502
    assert errors[0]["response"]["body"]["error"]["code"] == "upstream_unreachable"


def test_sync_endpoints_forward_through_the_proxy(proxy):
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        chat = client.post(
            "/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "hi"}]}
        )
        emb = client.post("/embeddings", json={"model": "e", "input": ["a", "b"]})
    assert chat.json()["choices"][0]["message"]["content"] == "echo: hi"
    assert [d["index"] for d in emb.json()["data"]] == [0, 1]


def test_upstream_needs_a_url(batch_server):
    with pytest.raises(ValueError, match="upstream_url"):
        batch_server(backend="upstream")
