"""Anthropic dialect: batch objects and their terminal mapping, listing pages, encoded requests,
refused features, and result lines decoded into the chat-completion answer the merge reads.

Batch objects and result lines are checked against the official ``anthropic`` SDK's models and
encoded requests against its create-params type, so the dialect is held to Anthropic's
published shapes rather than to shapes it produced itself.
"""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from anthropic.types.messages.batch_create_params import Request as SdkRequest
from pydantic import TypeAdapter

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.dialects.anthropic import AnthropicDialect
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.models import BatchState
from airflow_batch_provider.outcome import progress_line
from airflow_batch_provider.warehouse.rows import extract_answer, extract_usage

D = AnthropicDialect()
BATCH_ID = "msgbatch_013Zva2CMHLNnXjNJJKqJ2EF"
REQUEST = TypeAdapter(SdkRequest)


def batch(status: str = "in_progress", **counts: int) -> dict[str, Any]:
    tally = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0, **counts}
    raw: dict[str, Any] = {
        "id": BATCH_ID,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": tally,
        "created_at": "2024-09-24T18:37:24.100435Z",
        "expires_at": "2024-09-25T18:37:24.100435Z",
        "ended_at": "2024-09-24T18:57:24.100435Z" if status == "ended" else None,
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": f"https://api.anthropic.com/v1/messages/batches/{BATCH_ID}/results"
        if status == "ended"
        else None,
    }
    MessageBatch.model_validate(raw)  # the SDK reads it: the fixture is Anthropic's shape
    return raw


def line(custom_id: str = "row-1", **body: Any) -> dict[str, Any]:
    base = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {**base, **body}}


def test_registered_with_its_contract() -> None:
    d = get_dialect("anthropic")
    assert isinstance(d, AnthropicDialect)
    assert (d.submission_mode, d.encodes_lines, d.results_modes) == ("inline", True, ("results_url",))
    assert (d.orphan_lookup, get_dialect("openai").orphan_lookup) == ("time_and_count", "tags")
    assert (d.batches_path, d.batch_path("b1"), d.cancel_path("b1")) == (
        "messages/batches",
        "messages/batches/b1",
        "messages/batches/b1/cancel",
    )
    assert (d.limits.max_lines, d.limits.max_file_bytes) == (100_000, 256 * 1024 * 1024)
    assert d.auth_headers("k") == {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    assert d.auth_headers("k", {"anthropic_beta": "b1", "anthropic_version": "2026-10-21"}) == {
        "x-api-key": "k",
        "anthropic-version": "2026-10-21",
        "anthropic-beta": "b1",
    }
    assert d.is_quota_error(402, {"type": "error", "error": {"type": "billing_error", "message": "x"}})
    assert not d.is_quota_error(429, {"type": "error", "error": {"type": "rate_limit_error", "message": "x"}})


def test_running_batch_counts_everything_as_processing() -> None:
    parsed = D.parse_batch(batch("in_progress", processing=7))
    assert parsed.state is BatchState.IN_PROGRESS and not parsed.is_terminal
    assert (parsed.request_counts.total, parsed.request_counts.pending) == (7, 7)
    assert D.results_url_of(parsed) is None
    assert D.parse_batch(batch("canceling", processing=7)).state is BatchState.CANCELLING
    # Nothing is counted until the end: progress says the lines are processing, not a bare 0%.
    assert "lines 0 completed, 0 failed, 7 processing, 7 total (0.0%)" in progress_line([parsed])


@pytest.mark.parametrize(
    ("counts", "state", "completed", "failed"),
    [
        ({"succeeded": 3, "errored": 1, "canceled": 1, "expired": 1}, BatchState.COMPLETED, 3, 3),
        ({"errored": 4}, BatchState.COMPLETED, 0, 4),  # all errored: completed, every row failed
        ({"canceled": 4}, BatchState.CANCELLED, 0, 4),
        ({"expired": 4}, BatchState.EXPIRED, 0, 4),
        ({"canceled": 2, "expired": 2}, BatchState.COMPLETED, 0, 4),
    ],
)
def test_ended_batch_maps_to_a_terminal_state(
    counts: dict[str, int], state: BatchState, completed: int, failed: int
) -> None:
    parsed = D.parse_batch(batch("ended", **counts))
    assert parsed.state is state and parsed.is_terminal
    assert (parsed.request_counts.completed, parsed.request_counts.failed) == (completed, failed)
    assert D.results_url_of(parsed) == f"https://api.anthropic.com/v1/messages/batches/{BATCH_ID}/results"


def test_unknown_status_and_bad_counts_are_errors_never_success() -> None:
    with pytest.raises(UnknownBatchStatusError, match="'done'"):
        D.parse_batch({**batch(), "processing_status": "done"})
    with pytest.raises(BatchApiResponseError, match="request_counts"):
        D.parse_batch({**batch(), "request_counts": {"processing": "many"}})
    with pytest.raises(BatchApiResponseError, match="no id"):
        D.parse_batch({**batch(), "id": None})


def test_listing_pages_with_after_id() -> None:
    page = D.parse_list_page(
        {"data": [batch(), batch()], "has_more": True, "first_id": "a", "last_id": BATCH_ID},
        D.list_params(2),
    )
    assert len(page.batches) == 2 and page.next_params == {"limit": 2, "after_id": BATCH_ID}
    last = D.parse_list_page({"data": [batch()], "has_more": False, "first_id": "a", "last_id": "a"}, {})
    assert last.next_params is None
    with pytest.raises(BatchApiResponseError, match="listing batches"):
        D.parse_list_page({"data": "x", "has_more": False}, {})


def test_encodes_a_chat_line_as_messages_params() -> None:
    canonical = line(
        max_tokens=None,
        max_completion_tokens=300,
        temperature=0.2,
        top_p=0.9,
        stop="END",
        user="u-7",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "no lists"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "look", "arguments": '{"q": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "look",
                    "description": "look it up",
                    "parameters": {"type": "object", "properties": {"q": {"type": "integer"}}},
                },
            }
        ],
        tool_choice={"type": "function", "function": {"name": "look"}},
        parallel_tool_calls=False,
    )
    assert D.unsupported(canonical) is None
    encoded = D.encode_line(canonical)
    REQUEST.validate_python(encoded)  # the SDK's create-params type takes it
    params = encoded["params"]
    assert encoded["custom_id"] == "row-1"
    assert params["model"] == "claude-sonnet-4-5" and params["max_tokens"] == 300
    assert params["system"] == "be brief\n\nno lists"
    assert params["stop_sequences"] == ["END"] and params["metadata"] == {"user_id": "u-7"}
    assert (params["temperature"], params["top_p"]) == (0.2, 0.9)
    user, assistant, tool = params["messages"]
    assert user["content"][1] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    assert user["content"][2]["source"] == {"type": "url", "url": "https://example.com/cat.jpg"}
    assert assistant["content"] == [{"type": "tool_use", "id": "call_1", "name": "look", "input": {"q": 1}}]
    assert tool == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "a cat"}],
    }
    assert params["tools"] == [
        {
            "name": "look",
            "description": "look it up",
            "input_schema": {"type": "object", "properties": {"q": {"type": "integer"}}},
        }
    ]
    assert params["tool_choice"] == {"type": "tool", "name": "look", "disable_parallel_tool_use": True}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"url": "/v1/embeddings"}, "endpoint /v1/embeddings"),
        ({"custom_id": "a.b:c"}, "does not match Anthropic's pattern"),
        ({"body": {"n": 2}}, "n=2"),
        ({"body": {"response_format": {"type": "json_object"}}}, "response_format not supported"),
        ({"body": {"logprobs": True, "seed": 3}}, "logprobs, seed not supported"),
        (
            {"body": {"presence_penalty": 0.5, "frequency_penalty": 0.1}},
            "frequency_penalty, presence_penalty",
        ),
        ({"body": {"temperature": 1.5}}, "temperature 1.5"),
        ({"body": {"max_tokens": None}}, "max_tokens is required"),
        ({"body": {"tools": [{"type": "web_search"}]}}, "tool of type 'web_search'"),
        (
            {"body": {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}},
            "content part 'input_audio'",
        ),
        (
            {
                "body": {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ]
                }
            },
            "image_url must be",
        ),
        (
            {
                "body": {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {
                            "role": "assistant",
                            "tool_calls": [
                                {
                                    "id": "c",
                                    "type": "function",
                                    "function": {"name": "f", "arguments": "{oops"},
                                }
                            ],
                        },
                    ]
                }
            },
            "tool_calls need a function name and JSON object arguments",
        ),
    ],
)
def test_what_anthropic_cannot_express_is_refused_by_name(change: dict[str, Any], named: str) -> None:
    canonical = line()
    body = {**canonical["body"], **change.pop("body", {})}
    reason = D.unsupported({**canonical, **change, "body": body})
    assert reason is not None and named in reason


def result(custom_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    raw = {"custom_id": custom_id, "result": payload}
    MessageBatchIndividualResponse.model_validate(raw)
    return raw


def test_a_succeeded_result_reads_as_a_chat_completion() -> None:
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [
            {"type": "text", "text": "It is "},
            {"type": "text", "text": "a cat."},
            {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"q": 1}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_creation_input_tokens": 3,
            "cache_read_input_tokens": 20,
        },
    }
    parsed = D.parse_result_line(result("row-1", {"type": "succeeded", "message": message}), "output")
    assert parsed.ok and parsed.status_code == 200 and parsed.error is None
    assert parsed.body is not None
    content, _, finish = extract_answer(parsed.body)
    assert (content, finish) == ("It is a cat.", "tool_calls")
    assert parsed.body["choices"][0]["message"]["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "look", "arguments": '{"q":1}'}}
    ]
    # Prompt tokens count cache writes and reads, as OpenAI's do; the cached reads are named.
    assert extract_usage(parsed.body) == (33, 5, 38)
    usage = parsed.body["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 20}
    assert (usage["cache_creation_input_tokens"], usage["cache_read_input_tokens"]) == (3, 20)
    stop = {**message, "content": [{"type": "text", "text": "x"}]}
    for reason, finish in (("end_turn", "stop"), ("max_tokens", "length"), ("stop_sequence", "stop")):
        body = D.parse_result_line(
            result("r", {"type": "succeeded", "message": {**stop, "stop_reason": reason}}), "output"
        ).body
        assert body is not None and body["choices"][0]["finish_reason"] == finish


def test_errored_canceled_and_expired_results_carry_the_codes_the_merge_maps() -> None:
    errored = D.parse_result_line(
        result(
            "a",
            {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "bad"},
                    "request_id": "req_1",
                },
            },
        ),
        "output",
    )
    assert not errored.ok and errored.error is not None
    assert (errored.error.code, errored.error.message, errored.request_id) == (
        "invalid_request_error",
        "bad",
        "req_1",
    )
    cancelled = D.parse_result_line(result("b", {"type": "canceled"}), "output")
    expired = D.parse_result_line(result("c", {"type": "expired"}), "output")
    assert cancelled.error is not None and cancelled.error.code == "batch_cancelled"
    assert expired.error is not None and expired.error.code == "batch_expired"
    with pytest.raises(BatchApiResponseError, match="unknown type 'later'"):
        D.parse_result_line({"custom_id": "d", "result": {"type": "later"}}, "output")
    with pytest.raises(BatchApiResponseError, match="no custom_id"):
        D.parse_result_line({"result": {"type": "expired"}}, "output")
