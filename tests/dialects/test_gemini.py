"""Gemini dialect: batch operations, states, listing pages, encoded lines, create body and results.

Encoded requests and result fixtures are checked against the official ``google-genai`` SDK's own
models (which refuse unknown fields), so the dialect is tested against Google's published shapes
rather than shapes it produced itself.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.genai import batches as sdk_batches
from google.genai import types

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.dialects.gemini import STATES, GeminiDialect
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.models import BatchState

D = GeminiDialect()
CHAT = "/v1/chat/completions"


def operation(state: str = "BATCH_STATE_RUNNING", **meta: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "batches/abc123",
        "metadata": {
            "@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch",
            "name": "batches/abc123",
            "model": "models/gemini-2.5-flash",
            "displayName": "abp-1-s00000",
            "inputConfig": {"fileName": "files/in-1"},
            "createTime": "2026-01-04T12:00:00.123456789Z",
            "updateTime": "2026-01-04T12:05:00Z",
            "batchStats": {"requestCount": "10", "successfulRequestCount": "6", "failedRequestCount": "1"},
            "state": state,
            **meta,
        },
        "done": state not in ("BATCH_STATE_PENDING", "BATCH_STATE_RUNNING"),
    }
    job = types.BatchJob._from_response(response=sdk_batches._BatchJob_from_mldev(raw), kwargs={})
    assert job.name == "batches/abc123"  # the SDK reads it: the fixture is Google's shape
    return raw


def chat(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "k1",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "gemini-2.5-flash", "messages": [{"role": "user", "content": "hi"}], **body},
    }


def test_registered_with_its_contract() -> None:
    d = get_dialect("gemini")
    assert isinstance(d, GeminiDialect)
    assert (d.model_placement, d.encodes_lines, d.upload_protocol) == ("job", True, "resumable")
    assert d.default_base_url == "https://generativelanguage.googleapis.com/v1beta"
    assert d.auth_headers("k") == {"x-goog-api-key": "k"}
    assert (d.batch_path("abc"), d.cancel_path("abc")) == ("batches/abc", "batches/abc:cancel")
    # Either form of a Google resource name reaches the same path.
    assert d.batch_path("batches/abc") == "batches/abc"
    assert (d.file_path("files/f1"), d.file_content_path("f1")) == ("files/f1", "files/f1:download")
    assert d.file_content_params == {"alt": "media"}
    assert d.create_path("models/gemini-2.5-flash") == "models/gemini-2.5-flash:batchGenerateContent"
    assert d.create_path("gemini-2.5-flash") == "models/gemini-2.5-flash:batchGenerateContent"
    assert d.upload_url("https://generativelanguage.googleapis.com/v1beta") == (
        "https://generativelanguage.googleapis.com/upload/v1beta/files"
    )
    assert d.upload_url("http://127.0.0.1:8080/v1beta/") == "http://127.0.0.1:8080/upload/v1beta/files"


def test_a_model_or_id_cannot_reach_another_path() -> None:
    for bad in ("../admin", "a/b", "x?y"):
        with pytest.raises(ValueError):
            D.create_path(bad)
        with pytest.raises(ValueError):
            D.batch_path(bad)


@pytest.mark.parametrize(
    ("state", "mapped"),
    [
        ("BATCH_STATE_PENDING", BatchState.VALIDATING),
        ("BATCH_STATE_RUNNING", BatchState.IN_PROGRESS),
        ("BATCH_STATE_SUCCEEDED", BatchState.COMPLETED),
        ("BATCH_STATE_FAILED", BatchState.FAILED),
        ("BATCH_STATE_CANCELLED", BatchState.CANCELLED),
        ("BATCH_STATE_EXPIRED", BatchState.EXPIRED),
    ],
)
def test_every_state_maps(state: str, mapped: BatchState) -> None:
    assert D.parse_batch(operation(state)).state is mapped
    # Every state but the SDK's "unspecified" is known.
    sdk_states = {s.value.replace("JOB_STATE", "BATCH_STATE") for s in types.JobState}
    assert set(STATES) <= sdk_states


def test_an_unspecified_state_is_an_unknown_status() -> None:
    with pytest.raises(UnknownBatchStatusError, match="abc123"):
        D.parse_batch(operation("BATCH_STATE_UNSPECIFIED"))


def test_operation_fields_are_read() -> None:
    raw = operation(
        "BATCH_STATE_SUCCEEDED",
        endTime="2026-01-04T13:00:00Z",
        output={"responsesFile": "files/batch-abc123"},
    )
    raw["response"] = {
        "@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatchOutput",
        "responsesFile": "files/batch-abc123",
    }
    batch = D.parse_batch(raw)
    assert batch.id == "abc123"
    assert (batch.input_file_id, batch.output_file_id, batch.error_file_id) == ("in-1", "batch-abc123", None)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        10,
        6,
        1,
    )
    assert batch.created_at is not None and batch.created_at.isoformat().startswith(
        "2026-01-04T12:00:00.123456"
    )
    assert batch.completed_at is not None and batch.completed_at.hour == 13
    assert D.metadata_of(batch) == {"airflow_batch_key": "abp-1-s00000", "name": "abp-1-s00000"}
    assert batch.endpoint == CHAT


def test_a_failed_operation_carries_its_error() -> None:
    raw = operation("BATCH_STATE_FAILED")
    raw["error"] = {"code": 3, "message": "input file has a bad line", "status": "INVALID_ARGUMENT"}
    batch = D.parse_batch(raw)
    assert batch.state is BatchState.FAILED
    assert [(e.code, e.message) for e in batch.errors] == [("INVALID_ARGUMENT", "input file has a bad line")]


def test_listing_pages_on_the_next_page_token() -> None:
    page = D.parse_list_page({"operations": [operation()], "nextPageToken": "t2"}, D.list_params(5))
    assert [b.id for b in page.batches] == ["abc123"]
    assert page.next_params == {"pageSize": 5, "pageToken": "t2"}
    last = D.parse_list_page({"operations": [operation()]}, {"pageSize": 5, "pageToken": "t2"})
    assert last.next_params is None
    # An empty listing omits the repeated field.
    assert D.parse_list_page({}, {"pageSize": 5}).batches == []
    with pytest.raises(BatchApiResponseError, match="nextPageToken"):
        D.parse_list_page({"operations": [], "nextPageToken": 5}, {"pageSize": 5})


def test_the_create_body_carries_the_key_in_the_display_name() -> None:
    body = D.create_batch_body(
        input_file_id="in-1",
        endpoint=CHAT,
        completion_window="24h",
        metadata={"airflow_batch_key": "abp-1-s00003", "airflow_fingerprint": "f" * 64},
        model="gemini-2.5-flash",
    )
    assert body == {"batch": {"displayName": "abp-1-s00003", "inputConfig": {"fileName": "files/in-1"}}}
    assert D.create_name(body) == "abp-1-s00003"
    # The SDK sends the same shape for client.batches.create(src="files/in-1", config={display_name}).
    sent = sdk_batches._CreateBatchJobParameters_to_mldev(
        _mldev_client(),
        types._CreateBatchJobParameters(
            model="gemini-2.5-flash", src="files/in-1", config={"display_name": "abp-1-s00003"}
        ),
    )
    assert sent["batch"] == body["batch"]


def _mldev_client() -> Any:
    from google.genai import Client

    return Client(api_key="k")._api_client


def test_a_chat_line_is_encoded_as_a_generate_content_request() -> None:
    line = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is in"}, _image()]},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "Sure?"},
        ],
        temperature=0.2,
        top_p=0.9,
        max_completion_tokens=64,
        stop="END",
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.2,
    )
    assert D.unsupported(line) is None
    encoded = D.encode_line(line)
    assert encoded["key"] == "k1"
    request = encoded["request"]
    assert request["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert [c["role"] for c in request["contents"]] == ["user", "model", "user"]
    assert request["contents"][0]["parts"][1] == {"inlineData": {"mimeType": "image/png", "data": "aGk="}}
    assert request["generationConfig"] == {
        "temperature": 0.2,
        "topP": 0.9,
        "seed": 7,
        "presencePenalty": 0.1,
        "frequencyPenalty": 0.2,
        "maxOutputTokens": 64,
        "stopSequences": ["END"],
    }
    _sdk_reads(request)


def _image() -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}


def _sdk_reads(request: dict[str, Any]) -> None:
    """The SDK's models (extra fields forbidden) accept every part of the request."""
    for content in request["contents"]:
        types.Content.model_validate(content)
    if "systemInstruction" in request:
        types.Content.model_validate(request["systemInstruction"])
    if "generationConfig" in request:
        types.GenerationConfig.model_validate(request["generationConfig"])
    assert set(request) <= {"contents", "systemInstruction", "generationConfig"}


def test_a_json_schema_response_format_becomes_response_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["a", "b"]},
            "score": {"type": ["number", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["label", "score", "tags"],
        "additionalProperties": False,
    }
    line = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "strict": True, "schema": schema},
        }
    )
    assert D.unsupported(line) is None
    config = D.encode_line(line)["request"]["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    assert config["responseSchema"] == {
        "type": "OBJECT",
        "properties": {
            "label": {"type": "STRING", "enum": ["a", "b"]},
            "score": {"type": "NUMBER", "nullable": True},
            "tags": {"type": "ARRAY", "items": {"type": "STRING"}},
        },
        "required": ["label", "score", "tags"],
    }
    types.Schema.model_validate(config["responseSchema"])
    json_object = D.encode_line(chat(response_format={"type": "json_object"}))["request"]["generationConfig"]
    assert json_object == {"responseMimeType": "application/json"}


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (chat(logit_bias={"1": 2}), "logit_bias"),
        (chat(tools=[{"type": "web_search"}]), "'web_search'"),
        (
            chat(tool_choice="sometimes", tools=[{"type": "function", "function": {"name": "f"}}]),
            "tool_choice",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$defs": {}}}}]),
            "tools[0].function.parameters.$defs",
        ),
        (chat(parallel_tool_calls=False), "parallel_tool_calls"),
        (chat(n=2), "n=2"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}),
            "schema.$ref",
        ),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "properties": {"a": {"oneOf": []}}}},
                }
            ),
            "schema.properties.a.oneOf",
        ),
        (chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "c"}]), "tool_call_id 'c'"),
        (
            chat(
                messages=[
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                    },
                ]
            ),
            "JSON object arguments",
        ),
        (chat(messages=[{"role": "function", "content": "x"}]), "role 'function'"),
        (
            chat(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                    }
                ]
            ),
            "data:<mime>;base64",
        ),
        (chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "'input_audio'"),
        (
            {**chat(), "url": "/v1/embeddings", "body": {"model": "m", "input": ["x", "y"]}},
            "asyncBatchEmbedContent",
        ),
        (
            {**chat(), "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}},
            "chat completions and embeddings",
        ),
    ],
)
def test_what_gemini_cannot_express_is_refused_by_name(line: dict[str, Any], named: str) -> None:
    reason = D.unsupported(line)
    assert reason is not None and named in reason and "Gemini" in reason


def _response(**fields: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [{"text": "thinking...", "thought": True}, {"text": "Paris"}],
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 12,
            "candidatesTokenCount": 3,
            "cachedContentTokenCount": 8,
            "thoughtsTokenCount": 20,
            "totalTokenCount": 35,
        },
        "modelVersion": "gemini-2.5-flash",
        "responseId": "resp-1",
        **fields,
    }
    types.GenerateContentResponse._from_response(response=raw, kwargs={})
    return raw


def test_a_response_line_becomes_the_chat_completion_the_merge_reads() -> None:
    line = D.parse_result_line({"key": "k1", "response": _response()}, "output")
    assert (line.custom_id, line.ok, line.status_code, line.error) == ("k1", True, 200, None)
    assert line.body is not None
    choice = line.body["choices"][0]
    # The thought part is not the answer.
    assert choice["message"]["content"] == "Paris" and choice["finish_reason"] == "stop"
    usage = line.body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (12, 23, 35)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 8}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 20}
    assert line.body["model"] == "gemini-2.5-flash"


def test_an_error_line_and_a_blocked_prompt_are_failed_rows() -> None:
    error = {"code": 400, "message": "Invalid JSON payload", "status": "INVALID_ARGUMENT"}
    failed = D.parse_result_line({"key": "k2", "error": error}, "output")
    assert (failed.ok, failed.status_code, failed.source) == (False, 400, "error")
    assert failed.error is not None and (failed.error.code, failed.error.message) == (
        "INVALID_ARGUMENT",
        "Invalid JSON payload",
    )
    blocked = D.parse_result_line(
        {"key": "k3", "response": {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {}}},
        "output",
    )
    assert not blocked.ok and blocked.error is not None and blocked.error.code == "prompt_blocked"
    length = D.parse_result_line(
        {
            "key": "k4",
            "response": _response(
                candidates=[{"content": {"parts": [{"text": "x"}]}, "finishReason": "MAX_TOKENS"}]
            ),
        },
        "output",
    )
    assert length.body is not None and length.body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "raw",
    [{"response": {}}, {"key": "", "response": {}}, {"key": 5}, {"key": "k"}, {"key": "k", "response": "x"}],
)
def test_an_unreadable_result_line_is_a_response_error(raw: dict[str, Any]) -> None:
    with pytest.raises(BatchApiResponseError):
        D.parse_result_line(raw, "output")


def test_the_finalized_upload_names_the_file() -> None:
    assert D.parse_file_id({"file": {"name": "files/abc-123", "mimeType": "application/jsonl"}}) == "abc-123"
    with pytest.raises(BatchApiResponseError, match="no file name"):
        D.parse_file_id({"file": {}})
    with pytest.raises(BatchApiResponseError, match="its name"):
        D.parse_file_id({"file": {"name": "files/../x"}})


@pytest.mark.parametrize(
    "raw",
    [
        [],
        "x",
        5,
        {"operations": "x"},
        {"operations": {}},
        {"operations": 5},
        {"operations": [], "nextPageToken": ["t"]},
    ],
    ids=repr,
)
def test_an_unreadable_listing_page_is_a_response_error(raw: Any) -> None:
    with pytest.raises(BatchApiResponseError, match="listing batches"):
        D.parse_list_page(raw, {"pageSize": 5})


def test_a_refused_key_is_told_by_its_error_info() -> None:
    refused = {
        "error": {
            "code": 400,
            "message": "API key not valid. Please pass a valid API key.",
            "status": "INVALID_ARGUMENT",
            "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}],
        }
    }
    assert D.is_auth_error(400, refused)
    assert not D.is_auth_error(400, {"error": {"code": 400, "message": "bad", "status": "INVALID_ARGUMENT"}})
    assert not D.is_auth_error(400, "text") and not get_dialect("openai").is_auth_error(400, refused)


def test_a_line_without_a_model_is_left_to_the_job() -> None:
    # The batch names the model (submit's model= or the shard's lines): a line may go without.
    assert D.unsupported(chat(model=None)) is None
    assert "model" not in D.encode_line(chat(model=None))["request"]


def test_tools_tool_turns_and_tool_choice_are_encoded() -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    line = chat(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=True,
    )
    assert D.unsupported(line) is None
    request = D.encode_line(line)["request"]
    assert request["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "Weather of a city.",
                    "parameters": {
                        "type": "OBJECT",
                        "properties": {"city": {"type": "STRING"}},
                        "required": ["city"],
                    },
                }
            ]
        }
    ]
    assert request["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}
    }
    assert request["contents"][1] == {
        "role": "model",
        "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}],
    }
    # A JSON object answer is the response as it is; any other text goes under "content".
    assert [c["parts"][0]["functionResponse"] for c in request["contents"][2:]] == [
        {"name": "get_weather", "response": {"celsius": 21}},
        {"name": "get_weather", "response": {"content": "sunny"}},
    ]
    _sdk_reads({k: v for k, v in request.items() if k in ("contents", "generationConfig")})
    for tool in request["tools"]:
        types.Tool.model_validate(tool)
    types.ToolConfig.model_validate(request["toolConfig"])
    auto = D.encode_line(chat(tools=[weather], tool_choice="required"))["request"]
    assert auto["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}


def test_a_function_call_answer_becomes_tool_calls() -> None:
    answer = _response(
        candidates=[
            {
                "content": {
                    "role": "model",
                    "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}],
                },
                "finishReason": "STOP",
            }
        ]
    )
    line = D.parse_result_line({"key": "k1", "response": answer}, "output")
    assert line.ok and line.body is not None
    choice = line.body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city":"Paris"}'


def test_a_per_day_quota_stops_and_a_per_minute_limit_is_retried() -> None:
    def exhausted(quota_id: str) -> dict[str, Any]:
        violation = {
            "quotaMetric": "generativelanguage.googleapis.com/generate_requests",
            "quotaId": quota_id,
        }
        failure = {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [violation]}
        return {
            "error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED", "details": [failure]}
        }

    assert D.is_quota_error(429, exhausted("GenerateRequestsPerDayPerProjectPerModel-FreeTier"))
    assert not D.is_quota_error(429, exhausted("GenerateRequestsPerMinutePerProjectPerModel"))
    assert not D.is_quota_error(429, {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED"}})
    assert not D.is_quota_error(400, exhausted("GenerateRequestsPerDayPerProjectPerModel"))
