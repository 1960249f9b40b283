"""Result-line to row mapping: every body shape, usage names, JSON paths, structured output."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import LineError, ResultLine
from airflow_batch_provider.warehouse.rows import (
    RESULT_COLUMNS,
    OutputSchema,
    ResultMapper,
    compile_json_path,
    extract_answer,
    extract_usage,
    follow,
)

NAMES = ["custom_id", "seq", *(c.name for c in RESULT_COLUMNS)]


class Triage(BaseModel):
    label: str
    score: float
    urgent: bool = False
    tags: list[str] = []
    note: str | None = None


def as_dict(row: tuple[Any, ...], mapper: ResultMapper) -> dict[str, Any]:
    names = ["custom_id", "seq", *(c.name for c in mapper.columns)]
    return dict(zip(names, row, strict=True))


def ok(body: dict[str, Any], custom_id: str = "c1") -> ResultLine:
    return ResultLine(custom_id=custom_id, ok=True, status_code=200, body=body)


def test_chat_completion() -> None:
    body = {
        "model": "gpt-x",
        "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    mapper = ResultMapper()
    row = as_dict(mapper.row(ok(body), "b1"), mapper)
    assert row["status"] == "succeeded" and row["content"] == "hi" and row["finish_reason"] == "length"
    assert (row["model"], row["prompt_tokens"], row["completion_tokens"], row["total_tokens"]) == (
        "gpt-x",
        3,
        1,
        4,
    )
    assert row["batch_id"] == "b1" and row["seq"] == 1
    assert (mapper.prompt_tokens, mapper.completion_tokens, mapper.total_tokens) == (3, 1, 4)


def test_tool_calls_and_refusal_become_the_content() -> None:
    calls = [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    content, _, reason = extract_answer(
        {"choices": [{"message": {"content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}]}
    )
    assert content is not None and '"name":"f"' in content and reason == "tool_calls"
    content, _, _ = extract_answer({"choices": [{"message": {"content": None, "refusal": "no"}}]})
    assert content == "no"


def test_legacy_completions_text() -> None:
    assert extract_answer({"choices": [{"text": "abc", "finish_reason": "stop"}]}) == ("abc", None, "stop")


def test_responses_api_output_and_usage_names() -> None:
    body = {
        "object": "response",
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
        "output": [
            {"type": "reasoning", "summary": []},
            {
                "type": "message",
                "content": [
                    {"type": "output_text", "text": "part one, "},
                    {"type": "output_text", "text": "part two"},
                ],
            },
        ],
        "usage": {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12},
    }
    assert extract_answer(body) == ("part one, part two", None, "max_output_tokens")
    assert extract_usage(body) == (7, 5, 12)
    assert extract_answer({"output_text": "direct", "status": "completed"}) == ("direct", None, "completed")


def test_embeddings_single_and_several_inputs() -> None:
    one = {
        "object": "list",
        "data": [{"embedding": [0.1, 0.2]}],
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    }
    several = {"object": "list", "data": [{"embedding": [1.0]}, {"embedding": [2.0]}]}
    assert extract_answer(one) == (None, [0.1, 0.2], None)
    assert extract_answer(several) == (None, [[1.0], [2.0]], None)
    assert extract_usage(one) == (2, None, 2)
    mapper = ResultMapper()
    assert as_dict(mapper.row(ok(one), None), mapper)["embedding"] == "[0.1,0.2]"


def test_usage_ignores_non_integers_and_fills_the_total() -> None:
    assert extract_usage({"usage": {"prompt_tokens": True, "completion_tokens": 2}}) == (None, 2, 2)
    assert extract_usage({"usage": "n/a"}) == (None, None, None)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("batch_expired", "expired"),
        ("batch_cancelled", "cancelled"),
        ("rate_limit_exceeded", "failed"),
        (None, "failed"),
    ],
)
def test_error_codes_map_to_statuses(code: str | None, status: str) -> None:
    line = ResultLine(custom_id="c", ok=False, error=LineError(code=code, message="m"), source="error")
    mapper = ResultMapper()
    row = as_dict(mapper.row(line, "b"), mapper)
    assert row["status"] == status and row["error_code"] == code and row["error_message"] == "m"


def test_error_line_from_the_openai_dialect_keeps_usage_of_a_non_2xx_body() -> None:
    raw = {
        "custom_id": "c",
        "response": {"status_code": 400, "body": {"error": {"code": "bad", "message": "no"}}},
    }
    line = get_dialect("openai").parse_result_line(raw, "error")
    mapper = ResultMapper()
    row = as_dict(mapper.row(line, "b"), mapper)
    assert row["status"] == "failed" and row["error_code"] == "bad" and row["content"] is None


def test_json_paths() -> None:
    assert compile_json_path("$.choices[0].message.content") == ("choices", 0, "message", "content")
    assert compile_json_path("usage.prompt_tokens_details.cached_tokens")[-1] == "cached_tokens"
    assert follow({"a": [{"b": 1}]}, ("a", 0, "b")) == 1
    assert follow({"a": []}, ("a", 3)) is None and follow({"a": 1}, ("a", "b")) is None
    with pytest.raises(ConfigurationError, match="JSON path"):
        compile_json_path("$.a[x]")


def test_extra_columns_hold_scalars_as_text_and_objects_as_json() -> None:
    body = {
        "model": "m",
        "usage": {"prompt_tokens_details": {"cached_tokens": 5}},
        "system_fingerprint": "fp",
        "choices": [{"message": {"content": "x"}, "logprobs": {"content": []}}],
    }
    mapper = ResultMapper(
        extra_columns={
            "cached": "$.usage.prompt_tokens_details.cached_tokens",
            "fp": "system_fingerprint",
            "lp": "choices[0].logprobs",
            "gone": "nope",
        }
    )
    row = as_dict(mapper.row(ok(body), None), mapper)
    assert (row["cached"], row["fp"], row["lp"], row["gone"]) == (5, "fp", '{"content":[]}', None)


def test_extra_column_may_not_reuse_a_results_column() -> None:
    with pytest.raises(ConfigurationError, match="'status'"):
        ResultMapper(extra_columns={"status": "$.status"})


def test_output_schema_from_a_pydantic_model() -> None:
    schema = OutputSchema(Triage)
    assert [(c.name, c.type) for c in schema.columns] == [
        ("label", "text"),
        ("score", "float"),
        ("urgent", "boolean"),
        ("tags", "json"),
        ("note", "text"),
    ]
    values, reason = schema.parse('{"label": "bug", "score": 1, "tags": ["a"]}')
    assert reason is None and values == ("bug", 1.0, False, '["a"]', None)
    values, reason = schema.parse('{"label": "bug"}')
    assert values is None and reason is not None and "score" in reason and "Triage" in reason


def test_output_schema_from_a_dotted_path_and_prefix() -> None:
    schema = OutputSchema(f"{__name__}.Triage", prefix="out_")
    assert schema.columns[0].name == "out_label"
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        OutputSchema("no.such.Model")


def test_output_schema_from_json_schema() -> None:
    schema = OutputSchema(
        {
            "type": "object",
            "properties": {"n": {"type": ["integer", "null"]}, "obj": {"type": "object"}},
            "required": ["n"],
        }
    )
    assert [c.type for c in schema.columns] == ["integer", "json"]
    assert schema.parse('{"n": 2, "obj": {"a": 1}}') == ((2, '{"a":1}'), None)
    values, reason = schema.parse('{"n": "two"}')
    assert values is None and reason is not None and "at n" in reason
    assert schema.parse("")[1] == "the answer has no content to parse"
    with pytest.raises(ConfigurationError, match="not a valid JSON schema"):
        OutputSchema({"type": "object", "properties": {"a": {"type": 12}}})
    with pytest.raises(ConfigurationError, match="properties"):
        OutputSchema({"type": "string"})


def test_invalid_structured_answer_is_invalid_output_with_reason() -> None:
    mapper = ResultMapper(output_schema=OutputSchema(Triage))
    body = {"choices": [{"message": {"content": "not json"}}]}
    row = as_dict(mapper.row(ok(body), None), mapper)
    assert row["status"] == "invalid_output" and row["error_code"] == "invalid_output"
    assert row["label"] is None and "Triage" in row["error_message"]


def test_negative_absurd_or_non_integer_token_counts_are_null_and_counted() -> None:
    from airflow_batch_provider.warehouse.rows import unusable_token_counts

    body = {"usage": {"prompt_tokens": -1, "completion_tokens": 10**9 + 1, "total_tokens": 2.5}}
    assert extract_usage(body) == (None, None, None)
    assert unusable_token_counts(body) == {
        "prompt_tokens": -1,
        "completion_tokens": 10**9 + 1,
        "total_tokens": 2.5,
    }
    # A bad total is not replaced by a sum; a missing one still is.
    assert extract_usage({"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": -7}}) == (
        3,
        4,
        None,
    )
    assert extract_usage({"usage": {"input_tokens": 3, "output_tokens": 4}}) == (3, 4, 7)
    assert extract_usage({"usage": {"prompt_tokens": 10**9, "completion_tokens": 0}}) == (10**9, 0, 10**9)
    assert unusable_token_counts({"usage": {"prompt_tokens": 3, "total_tokens": None}}) == {}
    mapper = ResultMapper()
    line = ResultLine(custom_id="c", ok=True, status_code=200, body={"model": "m", **body})
    row = mapper.row(line, "b")
    assert row[7:10] == (None, None, None)  # prompt, completion, total
    assert mapper.bad_token_lines == 1 and mapper.total_tokens == 0
