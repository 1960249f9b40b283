"""The echo backend: deterministic, honest about usage and about being echo."""

from __future__ import annotations

import base64
import struct

import httpx
import orjson
import pytest

from airflow_batch_provider.server.backends import ECHO_ERROR_MARK, EchoBackend, embed, schema_value

echo = EchoBackend(embedding_dim=12)

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "flag": {"type": "boolean"},
        "detail": {"$ref": "#/$defs/Detail"},
        "maybe": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
        "optional": {"type": "string"},
    },
    "required": ["sentiment", "score", "count", "tags", "flag", "detail", "maybe"],
    "$defs": {
        "Detail": {"type": "object", "properties": {"reason": {"type": "string"}}, "required": ["reason"]}
    },
}


def chat(content, **body):
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}], **body}


def test_chat_is_deterministic_and_named_echo():
    status, first = echo.answer("/v1/chat/completions", chat("the quick brown fox"))
    _, second = echo.answer("/v1/chat/completions", chat("the quick brown fox"))
    assert status == 200
    assert first["model"] == "echo:gpt-4o"
    assert first["choices"] == second["choices"]
    assert first["id"] == second["id"]
    assert first["choices"][0]["message"]["content"] == "echo: the quick brown fox"
    assert first["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


def test_usage_counts_every_message_and_choice():
    body = {
        "model": "m",
        "n": 2,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "two words"}]},
        ],
    }
    _, answer = echo.answer("/v1/chat/completions", body)
    assert answer["usage"]["prompt_tokens"] == 4
    assert len(answer["choices"]) == 2
    assert answer["usage"]["completion_tokens"] == 2 * 3


def test_max_tokens_truncates_with_length():
    _, answer = echo.answer("/v1/chat/completions", chat("one two three four five", max_tokens=3))
    assert answer["choices"][0]["message"]["content"] == "echo: one two"
    assert answer["choices"][0]["finish_reason"] == "length"


def test_json_schema_answers_are_valid_and_deterministic():
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "strict": True, "schema": SCHEMA}}
    _, answer = echo.answer("/v1/chat/completions", chat("great product", response_format=fmt))
    value = orjson.loads(answer["choices"][0]["message"]["content"])
    assert set(value) == set(SCHEMA["required"])
    assert value["sentiment"] in ("positive", "negative", "neutral")
    assert 0 <= value["score"] <= 1
    assert 1 <= value["count"] <= 5
    assert len(value["tags"]) == 2 and all(isinstance(t, str) for t in value["tags"])
    assert isinstance(value["flag"], bool)
    assert isinstance(value["detail"]["reason"], str)
    assert len(value["maybe"]) <= 5
    _, again = echo.answer("/v1/chat/completions", chat("great product", response_format=fmt))
    assert again["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]


def test_enum_choice_depends_on_input():
    schema = {"type": "object", "properties": {"label": {"enum": list("abcdefgh")}}, "required": ["label"]}
    picks = {schema_value(schema, f"text {i}", "", schema)["label"] for i in range(40)}
    assert len(picks) > 1


def test_json_object_mode():
    _, answer = echo.answer("/v1/chat/completions", chat("hi", response_format={"type": "json_object"}))
    assert orjson.loads(answer["choices"][0]["message"]["content"]) == {"echo": "hi"}


def test_embeddings_dimensions_and_base64():
    _, answer = echo.answer("/v1/embeddings", {"model": "e", "input": ["a", "b"]})
    vectors = [d["embedding"] for d in answer["data"]]
    assert [len(v) for v in vectors] == [12, 12]
    assert vectors[0] != vectors[1]
    assert vectors[0] == embed("a", 12)
    assert answer["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    _, packed = echo.answer(
        "/v1/embeddings", {"model": "e", "input": "a", "encoding_format": "base64", "dimensions": 4}
    )
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack("<4f", raw)) == pytest.approx(embed("a", 4), abs=1e-6)


def test_responses_completions_and_moderations():
    _, resp = echo.answer("/v1/responses", {"model": "grok", "input": "hello there"})
    assert resp["output"][0]["content"][0]["text"] == "echo: hello there"
    assert resp["usage"]["input_tokens"] == 2
    _, comp = echo.answer("/v1/completions", {"model": "m", "prompt": "abc"})
    assert comp["choices"][0]["text"] == "echo: abc"
    _, mod = echo.answer("/v1/moderations", {"input": ["a", "b"]})
    assert len(mod["results"]) == 2


@pytest.mark.parametrize(
    ("url", "body", "status", "param"),
    [
        ("/v1/images/generations", {"prompt": "x"}, 404, "url"),
        ("/v1/chat/completions", {"model": "m"}, 400, "messages"),
        ("/v1/chat/completions", {"model": 3, "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ("/v1/embeddings", {"model": "e", "input": "x", "dimensions": 0}, 400, "dimensions"),
        ("/v1/embeddings", {"model": "e", "input": []}, 400, "input"),
    ],
)
def test_bad_requests_are_openai_shaped_errors(url, body, status, param):
    got_status, answer = echo.answer(url, body)
    assert got_status == status
    assert answer["error"]["param"] == param
    assert answer["error"]["message"]


def test_sync_endpoints_on_the_server(batch_server):
    server = batch_server(embedding_dim=5)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        chat_answer = client.post("/chat/completions", json=chat("hello"))
        emb = client.post("/embeddings", json={"model": "e", "input": "x"})
        streamed = client.post("/chat/completions", json=chat("hello", stream=True))
        not_json = client.post("/chat/completions", content=b"{")
    assert chat_answer.status_code == 200
    assert chat_answer.json()["choices"][0]["message"]["content"] == "echo: hello"
    assert len(emb.json()["data"][0]["embedding"]) == 5
    assert streamed.status_code == 400
    assert not_json.status_code == 400


def test_the_error_mark_fails_the_request_on_purpose():
    # A deterministic failed row for demos and tests: only the last user message counts.
    backend = EchoBackend()
    status, body = backend.answer(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": f"x {ECHO_ERROR_MARK}"}]},
    )
    assert status == 400 and body["error"]["code"] == "echo_error"
    status, _ = backend.answer(
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": ECHO_ERROR_MARK},
                {"role": "user", "content": "a plain question"},
            ],
        },
    )
    assert status == 200
