"""The Bedrock dialect apart from I/O: Converse and Titan encodings, what is refused by name, job
statuses and counts, result lines, the create body, per-job limits and the connection's extras."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.dialects.bedrock import BedrockDialect
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import BatchState

ARN = "arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/abcdef123456"
ROLE = "arn:aws:iam::123456789012:role/bedrock-batch"


def dialect(**extra: Any) -> BedrockDialect:
    configured = get_dialect("bedrock").configure({"role_arn": ROLE, **extra}, "c")
    assert isinstance(configured, BedrockDialect)
    return configured


def chat(**body: Any) -> dict[str, Any]:
    return {
        "custom_id": "row-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "anthropic.claude-3-haiku-20240307-v1:0", **body},
    }


def test_a_chat_line_is_one_converse_request() -> None:
    line = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "4"},
            {"role": "user", "content": "Thanks"},
        ],
        max_completion_tokens=50,
        temperature=0.2,
        top_p=0.9,
        stop="END",
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    d = dialect()
    assert d.unsupported(line) is None
    encoded = d.encode_line(line)
    assert encoded["recordId"] == "row-1"
    request = encoded["modelInput"]
    assert request["system"] == [{"text": "Be brief."}]
    # The tool result and the next user turn are one user message: Converse alternates roles.
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "user"]
    assert request["messages"][0]["content"] == [{"text": "What is 2+2?"}]
    assert request["messages"][1]["content"] == [
        {"toolUse": {"toolUseId": "t1", "name": "add", "input": {"a": 2}}}
    ]
    assert request["messages"][2]["content"] == [
        {"toolResult": {"toolUseId": "t1", "content": [{"text": "4"}]}},
        {"text": "Thanks"},
    ]
    assert request["inferenceConfig"] == {
        "maxTokens": 50,
        "temperature": 0.2,
        "topP": 0.9,
        "stopSequences": ["END"],
    }
    assert request["toolConfig"]["toolChoice"] == {"tool": {"name": "add"}}
    assert request["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"] == {"json": {"type": "object"}}
    assert "model" not in orjson.dumps(request).decode()


def test_a_titan_embedding_line_is_its_native_body() -> None:
    line = {
        "custom_id": "e1",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "amazon.titan-embed-text-v2:0", "input": "hello", "dimensions": 256},
    }
    assert dialect().unsupported(line) is None
    assert dialect().encode_line(line) == {
        "recordId": "e1",
        "modelInput": {"inputText": "hello", "dimensions": 256},
    }


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            chat(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}),
            "response_format",
        ),
        (chat(messages=[{"role": "user", "content": "x"}], n=2), "n=2"),
        (chat(messages=[{"role": "user", "content": "x"}], logprobs=True), "logprobs"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "image_url",
        ),
        (chat(messages=[]), "non-empty"),
        (
            {
                "custom_id": "e",
                "url": "/v1/embeddings",
                "body": {"model": "cohere.embed-english-v3", "input": "x"},
            },
            "cohere.embed-english-v3",
        ),
        (
            {
                "custom_id": "e",
                "url": "/v1/embeddings",
                "body": {"model": "amazon.titan-embed-text-v2:0", "input": ["a", "b"]},
            },
            "one text",
        ),
    ],
)
def test_what_bedrock_cannot_express_is_refused_by_name(line: dict[str, Any], reason: str) -> None:
    problem = dialect().unsupported(line)
    assert problem is not None and reason in problem


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("Submitted", BatchState.VALIDATING),
        ("Validating", BatchState.VALIDATING),
        ("Scheduled", BatchState.VALIDATING),
        ("InProgress", BatchState.IN_PROGRESS),
        ("Completed", BatchState.COMPLETED),
        ("PartiallyCompleted", BatchState.COMPLETED),
        ("Failed", BatchState.FAILED),
        ("Stopping", BatchState.CANCELLING),
        ("Stopped", BatchState.CANCELLED),
        ("Expired", BatchState.EXPIRED),
    ],
)
def test_every_job_status_maps_with_its_counts(status: str, state: BatchState) -> None:
    batch = dialect().parse_batch(
        {
            "jobArn": ARN,
            "jobName": "abp-key-s00000",
            "status": status,
            "message": "the role cannot read the input",
            "submitTime": "2026-01-04T12:00:00Z",
            "endTime": "2026-01-04T13:00:00Z",
            "totalRecordCount": 10,
            "processedRecordCount": 8,
            "successRecordCount": 7,
            "errorRecordCount": 1,
            "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": "s3://b/run/vendor/k/output/"}},
        }
    )
    assert batch.id == "abcdef123456" and batch.state is state
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        10,
        7,
        1,
    )
    assert batch.metadata == {"airflow_batch_key": "abp-key-s00000", "name": "abp-key-s00000"}
    assert bool(batch.errors) == (status == "Failed")
    assert dialect().results_prefix_of(batch) == "s3://b/run/vendor/k/output/abcdef123456/"


def test_a_create_answer_is_a_submitted_job() -> None:
    batch = dialect().parse_batch({"jobArn": ARN})
    assert batch.id == "abcdef123456" and batch.state is BatchState.VALIDATING


def test_the_create_body_carries_the_key_as_name_and_token() -> None:
    body = dialect().object_create_body(
        input_uri="s3://b/run/vendor/k/input/shard-00000.jsonl",
        output_uri="s3://b/run/vendor/k/output/",
        endpoint="/v1/chat/completions",
        completion_window="48h",
        metadata={"airflow_batch_key": "abp-0123-s00000", "airflow_fingerprint": "f" * 64},
        name="abp-0123-s00000",
        model="meta.llama3-8b-instruct-v1:0",
    )
    assert body["jobName"] == body["clientRequestToken"] == "abp-0123-s00000"
    assert body["roleArn"] == ROLE and body["modelId"] == "meta.llama3-8b-instruct-v1:0"
    assert body["timeoutDurationInHours"] == 48 and body["modelInvocationType"] == "Converse"
    assert body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"].endswith("shard-00000.jsonl")
    assert {"key": "airflow_batch_key", "value": "abp-0123-s00000"} in body["tags"]
    with pytest.raises(ConfigurationError, match="role_arn"):
        get_dialect("bedrock").object_create_body(
            input_uri="s3://b/i", output_uri="s3://b/o/", endpoint="/v1/chat/completions",
            completion_window="24h", metadata=None, name="n", model="m",
        )  # fmt: skip


def test_result_lines_become_the_merge_columns() -> None:
    d = dialect()
    ok = d.parse_result_line(
        {
            "recordId": "r1",
            "modelInput": {},
            "modelOutput": {
                "output": {"message": {"role": "assistant", "content": [{"text": "four"}]}},
                "stopReason": "max_tokens",
                "usage": {"inputTokens": 10, "outputTokens": 3, "cacheReadInputTokens": 4, "totalTokens": 17},
            },
        },
        "output",
    )
    assert ok.ok and ok.custom_id == "r1"
    assert ok.body is not None
    choice = ok.body["choices"][0]
    assert choice["message"]["content"] == "four" and choice["finish_reason"] == "length"
    assert ok.body["usage"] == {
        "prompt_tokens": 14,
        "completion_tokens": 3,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    failed = d.parse_result_line(
        {"recordId": "r2", "error": {"errorCode": 400, "errorMessage": "bad"}}, "output"
    )
    assert (
        not failed.ok
        and failed.error is not None
        and (failed.error.code, failed.error.message) == ("http_400", "bad")
    )
    embedded = d.parse_result_line(
        {"recordId": "r3", "modelOutput": {"embedding": [0.5], "inputTextTokenCount": 2}}, "output"
    )
    assert embedded.body is not None and embedded.body["data"][0]["embedding"] == [0.5]
    assert embedded.body["usage"]["prompt_tokens"] == 2


def test_outputs_are_found_by_name_and_the_manifest_is_checked() -> None:
    d = dialect()
    assert d.result_object_kind("shard-00000.jsonl.out") == "output"
    assert d.result_object_kind("manifest.json.out") == "summary"
    assert d.result_object_kind("shard-00000.jsonl") is None
    batch = d.parse_batch({"jobArn": ARN, "status": "Completed"})
    assert d.check_summary(batch, {"processedRecordCount": 3}, {"output": 3, "error": 0}) is None
    assert "3 processed record(s) but 2" in str(
        d.check_summary(batch, {"processedRecordCount": 3}, {"output": 2})
    )


def test_job_limits_come_from_the_connection() -> None:
    default = dialect()
    assert "at least 100" in str(default.job_problem(99, None))
    assert default.job_problem(100, None) is None
    tight = dialect(min_records_per_job="1", max_records_per_job=10, max_bytes_per_file=1000)
    assert tight.job_problem(1, None) is None
    assert "at most 10" in str(tight.job_problem(11, None))
    assert tight.limits.max_lines == 10 and tight.limits.max_file_bytes == 1000
    assert tight.validation_rules(tight.limits).limits.max_lines == 10
    with pytest.raises(ConfigurationError, match="min_records_per_job 5 is above max_records_per_job 2"):
        dialect(min_records_per_job=5, max_records_per_job=2)
    with pytest.raises(ConfigurationError, match="role_arn"):
        dialect(role_arn="not-an-arn")
    with pytest.raises(ConfigurationError, match="region_name"):
        dialect(region_name="Mars")
    assert dialect(region_name="eu-west-3").default_base_url == "https://bedrock.eu-west-3.amazonaws.com"


# ---- native (InvokeModel) bodies ----------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
]


def native_line(model: str, **body: Any) -> dict[str, Any]:
    line = chat(messages=CONVERSATION, max_tokens=64, temperature=0.2, top_p=0.9, **body)
    line["body"]["model"] = model
    return line


def encoded(d: BedrockDialect, line: dict[str, Any]) -> dict[str, Any]:
    assert d.unsupported(line) is None, d.unsupported(line)
    out = d.encode_line(line)
    assert out["recordId"] == "row-1"
    result: dict[str, Any] = out["modelInput"]
    return result


def test_model_ids_are_read_as_their_family() -> None:
    from airflow_batch_provider.dialects.bedrock_native import model_family

    assert model_family("anthropic.claude-3-haiku-20240307-v1:0") == "anthropic"
    assert model_family("us.anthropic.claude-3-5-sonnet-20241022-v2:0") == "anthropic"
    assert model_family("eu.meta.llama3-2-3b-instruct-v1:0") == "meta"
    assert model_family("arn:aws:bedrock:us-east-1::foundation-model/mistral.mistral-7b-instruct-v0:2") == (
        "mistral"
    )
    assert model_family(
        "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.amazon.nova-lite-v1:0"
    ) == ("nova")
    assert model_family("amazon.titan-text-express-v1") == "titan-text"
    assert model_family("amazon.titan-embed-text-v2:0") is None
    assert model_family("cohere.command-r-v1:0") is None
    assert model_family("usx.meta.llama3") is None


def test_claude_native_is_the_anthropic_dialects_messages_body() -> None:
    from airflow_batch_provider.dialects.anthropic import AnthropicDialect

    d = dialect(invocation_type="native")
    line = native_line("us.anthropic.claude-3-5-haiku-20241022-v1:0", stop=["END"])
    body = encoded(d, line)
    # The Anthropic dialect's own params, less the model (the job's), plus Bedrock's version.
    params = AnthropicDialect().encode_line(line)["params"]
    params.pop("model")
    assert body == {"anthropic_version": "bedrock-2023-05-31", **params}
    assert body["system"] == "Be brief." and body["max_tokens"] == 64 and body["stop_sequences"] == ["END"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    # Refused as Anthropic refuses it, and what Bedrock's body lacks besides.
    assert "max_tokens is required" in str(d.unsupported(chat(messages=CONVERSATION)))
    assert "user not supported" in str(d.unsupported(native_line("anthropic.claude-v2", user="u1")))
    remote = chat(
        messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
        ],
        max_tokens=5,
    )
    assert "data: URL" in str(d.unsupported(remote))
    answer = d.parse_result_line(
        {
            "recordId": "r1",
            "modelOutput": {
                "id": "msg_bdrk_1",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": "4"}],
                "stop_reason": "max_tokens",
                "usage": {"input_tokens": 12, "output_tokens": 1},
            },
        },
        "output",
    )
    assert answer.ok and answer.body is not None
    assert answer.body["choices"][0]["message"]["content"] == "4"
    assert answer.body["choices"][0]["finish_reason"] == "length"
    assert answer.body["usage"]["prompt_tokens"] == 12 and answer.body["usage"]["completion_tokens"] == 1


def test_llama_native_is_the_llama3_prompt() -> None:
    d = dialect(invocation_type="native")
    body = encoded(d, native_line("meta.llama3-8b-instruct-v1:0"))
    assert body == {
        "prompt": "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "max_gen_len": 64,
        "temperature": 0.2,
        "top_p": 0.9,
    }
    answer = d.parse_result_line(
        {
            "recordId": "r1",
            "modelOutput": {
                "generation": "4",
                "prompt_token_count": 30,
                "generation_token_count": 2,
                "stop_reason": "stop",
            },
        },
        "output",
    )
    assert answer.body is not None and answer.body["choices"][0]["message"]["content"] == "4"
    assert answer.body["choices"][0]["finish_reason"] == "stop"
    assert answer.body["usage"] == {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32}


def test_mistral_native_is_the_inst_prompt() -> None:
    d = dialect(invocation_type="native")
    body = encoded(d, native_line("mistral.mixtral-8x7b-instruct-v0:1", stop=["\n\n"]))
    assert body == {
        "prompt": "<s>[INST] Be brief.\n\nHi [/INST] Hello</s>[INST] 2+2? [/INST]",
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["\n\n"],
    }
    answer = d.parse_result_line(
        {"recordId": "r1", "modelOutput": {"outputs": [{"text": " 4", "stop_reason": "length"}]}}, "output"
    )
    assert answer.body is not None and answer.body["choices"][0]["message"]["content"] == " 4"
    assert answer.body["choices"][0]["finish_reason"] == "length" and "usage" not in answer.body


def test_titan_text_native_is_input_text_and_its_config() -> None:
    d = dialect(invocation_type="native")
    body = encoded(d, native_line("amazon.titan-text-express-v1", stop="User:"))
    assert body == {
        "inputText": "Be brief.\nUser: Hi\nBot: Hello\nUser: 2+2?\nBot:",
        "textGenerationConfig": {
            "maxTokenCount": 64,
            "temperature": 0.2,
            "topP": 0.9,
            "stopSequences": ["User:"],
        },
    }
    lone = chat(messages=[{"role": "user", "content": "Hi"}])
    lone["body"]["model"] = "amazon.titan-text-lite-v1"
    assert encoded(d, lone) == {"inputText": "Hi"}
    answer = d.parse_result_line(
        {
            "recordId": "r1",
            "modelOutput": {
                "inputTextTokenCount": 9,
                "results": [{"tokenCount": 1, "outputText": "4", "completionReason": "FINISH"}],
            },
        },
        "output",
    )
    assert answer.body is not None and answer.body["choices"][0]["message"]["content"] == "4"
    assert answer.body["choices"][0]["finish_reason"] == "stop"
    assert answer.body["usage"]["prompt_tokens"] == 9 and answer.body["usage"]["completion_tokens"] == 1


def test_nova_native_is_its_messages_body() -> None:
    d = dialect(invocation_type="native")
    body = encoded(d, native_line("us.amazon.nova-lite-v1:0", stop="END"))
    assert body == {
        "schemaVersion": "messages-v1",
        "messages": [
            {"role": "user", "content": [{"text": "Hi"}]},
            {"role": "assistant", "content": [{"text": "Hello"}]},
            {"role": "user", "content": [{"text": "2+2?"}]},
        ],
        "system": [{"text": "Be brief."}],
        "inferenceConfig": {"max_new_tokens": 64, "temperature": 0.2, "top_p": 0.9, "stopSequences": ["END"]},
    }
    answer = d.parse_result_line(
        {
            "recordId": "r1",
            "modelOutput": {
                "output": {"message": {"role": "assistant", "content": [{"text": "4"}]}},
                "stopReason": "end_turn",
                "usage": {
                    "inputTokens": 7,
                    "outputTokens": 1,
                    "totalTokens": 8,
                    "cacheReadInputTokenCount": 2,
                },
            },
        },
        "output",
    )
    assert answer.body is not None and answer.body["choices"][0]["message"]["content"] == "4"
    assert answer.body["usage"]["prompt_tokens"] == 9
    assert answer.body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


@pytest.mark.parametrize(
    ("model", "extra", "reason"),
    [
        (
            "meta.llama3-8b-instruct-v1:0",
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),
        ("mistral.mistral-7b-instruct-v0:2", {"response_format": {"type": "json_object"}}, "response_format"),
        ("amazon.titan-text-express-v1", {"tool_choice": "auto"}, "tool_choice"),
        (
            "meta.llama3-8b-instruct-v1:0",
            {"stop": ["x"]},
            "stop not supported by Bedrock's native Meta Llama",
        ),
        ("mistral.mistral-7b-instruct-v0:2", {"n": 2}, "n=2"),
        ("cohere.command-r-v1:0", {}, "no native body in the Bedrock dialect"),
    ],
)
def test_what_a_native_body_cannot_say_is_refused_by_name(
    model: str, extra: dict[str, Any], reason: str
) -> None:
    problem = dialect(invocation_type="native").unsupported(native_line(model, **extra))
    assert problem is not None and reason in problem


def test_native_tool_turns_and_an_assistant_last_prompt_are_refused() -> None:
    d = dialect(invocation_type="native")
    tool_turn = chat(
        messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "t", "content": "4"}]
    )
    tool_turn["body"]["model"] = "meta.llama3-8b-instruct-v1:0"
    assert "role 'tool' not supported" in str(d.unsupported(tool_turn))
    prefill = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}])
    prefill["body"]["model"] = "mistral.mistral-7b-instruct-v0:2"
    assert "last message must be the user's" in str(d.unsupported(prefill))


def test_invocation_type_chooses_the_body_and_the_jobs_invocation_type() -> None:
    def create(d: BedrockDialect, model: str) -> dict[str, Any]:
        return d.object_create_body(
            input_uri="s3://b/i.jsonl",
            output_uri="s3://b/o/",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=None,
            name="abp-0123-s00000",
            model=model,
        )

    llama, claude = "meta.llama3-8b-instruct-v1:0", "anthropic.claude-3-haiku-20240307-v1:0"
    converse, native, auto = dialect(), dialect(invocation_type="native"), dialect(invocation_type="AUTO")
    assert converse.invocation_type == "converse" and auto.invocation_type == "auto"
    # converse: every model; native: every family; auto: native for the prompt-string families.
    assert "messages" in encoded(converse, native_line(llama))
    assert create(converse, llama)["modelInvocationType"] == "Converse"
    assert "prompt" in encoded(native, native_line(llama))
    assert "modelInvocationType" not in create(native, llama)
    assert "anthropic_version" in encoded(native, native_line(claude))
    assert "modelInvocationType" not in create(native, claude)
    assert "prompt" in encoded(auto, native_line(llama)) and "modelInvocationType" not in create(auto, llama)
    assert "inferenceConfig" in encoded(auto, native_line(claude))
    assert create(auto, claude)["modelInvocationType"] == "Converse"
    assert create(auto, "cohere.command-r-v1:0")["modelInvocationType"] == "Converse"
    with pytest.raises(
        ConfigurationError, match="'invocation_type' 'invoke' is not one of converse, native, auto"
    ):
        dialect(invocation_type="invoke")


def test_a_replacement_jobs_name_is_its_generation_and_keeps_the_key() -> None:
    from airflow_batch_provider.submission import generation_name

    key = "abp-0123456789abcdef01234567-s00000"
    assert generation_name(key, 0) == key and generation_name(key, 2) == f"{key}-r2"
    d = dialect()
    body = d.object_create_body(
        input_uri="s3://b/i.jsonl",
        output_uri="s3://b/o/",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"airflow_batch_key": key},
        name=generation_name(key, 2),
        model="m",
    )
    assert body["jobName"] == body["clientRequestToken"] == f"{key}-r2" and len(body["jobName"]) <= 63
    batch = d.parse_batch({"jobArn": ARN, "status": "Failed", "jobName": f"{key}-r2"})
    assert d.metadata_of(batch) == {"airflow_batch_key": key, "name": f"{key}-r2"}
    assert d.filter_params({"airflow_batch_key": key}) == {"nameContains": key}


def test_the_orphan_lookup_asks_for_jobs_submitted_since_the_intent_less_the_margin() -> None:
    from datetime import datetime, timedelta, timezone

    from airflow_batch_provider.dialects.bedrock import SUBMIT_TIME_MARGIN

    intent = datetime(2026, 3, 1, 12, 0, 30, 123456, tzinfo=timezone(timedelta(hours=2)))
    params = dialect().filter_params({"airflow_batch_key": "abp-k-s00000"}, since=intent)
    assert params == {"nameContains": "abp-k-s00000", "submitTimeAfter": "2026-03-01T09:50:30Z"}
    assert timedelta(minutes=10) == SUBMIT_TIME_MARGIN
    assert dialect().filter_params({}, since=intent) == {}


def test_an_id_bedrock_refuses_as_malformed_is_no_such_batch() -> None:
    d = dialect()
    malformed = {
        "__type": "ValidationException",
        "message": "1 validation error detected: Value 'batch_missing' at 'jobIdentifier' failed ...",
    }
    assert d.is_not_found(400, malformed)
    assert not d.is_not_found(400, {"__type": "ValidationException", "message": "Value at 'roleArn' ..."})
    assert not d.is_not_found(400, {"__type": "ConflictException", "message": "jobIdentifier"})
    assert not d.is_not_found(500, malformed) and not get_dialect("openai").is_not_found(400, malformed)


def test_the_job_name_is_the_key_unless_the_name_is_a_later_generation_of_it() -> None:
    def name_of(metadata: dict[str, str] | None, name: str | None) -> str:
        body = dialect().object_create_body(
            input_uri="s3://b/i.jsonl",
            output_uri="s3://b/o/",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=metadata,
            name=name,
            model="m",
        )
        assert body["jobName"] == body["clientRequestToken"]
        return str(body["jobName"])

    assert name_of({"airflow_batch_key": "k-s00001"}, "k-s00001-r3") == "k-s00001-r3"
    assert name_of({"airflow_batch_key": "k-s00001"}, "something-else") == "k-s00001"
    assert name_of({"airflow_batch_key": "k-s00001"}, None) == "k-s00001"
    assert name_of(None, "just-a-name") == "just-a-name"
