"""The streaming JSONL reader and validator: every rule of seed 001, with the line it names."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.jsonl import (
    LineValidator,
    Problem,
    RawLine,
    dumps_line,
    iter_objects,
    iter_raw_lines,
    validate_stream,
)
from airflow_batch_provider.limits import Limits

CHAT = "/v1/chat/completions"
EMBED = {"model": "m", "input": "text"}


def line(cid: Any = "r1", *, url: str = CHAT, method: Any = "POST", body: Any = None, **extra: Any) -> bytes:
    obj: dict[str, Any] = {"custom_id": cid, "method": method, "url": url}
    obj["body"] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if body is None else body
    obj.update(extra)
    return orjson.dumps(obj)


def problems(
    data: bytes, dialect: str = "zerogpu", expected_url: str | None = None, **limits: int
) -> list[tuple[int | None, str]]:
    rules = get_dialect(dialect).validation_rules(
        get_dialect(dialect).limits.tightened(**limits) if limits else None
    )
    return [(p.line, p.code) for p in validate_stream(io.BytesIO(data), rules, expected_url)]


def lines(*items: bytes, sep: bytes = b"\n") -> bytes:
    return sep.join(items) + sep


def test_a_valid_file_has_no_problems() -> None:
    assert problems(lines(line("a"), line("b"), line("c"))) == []
    assert problems(lines(line("a"), line("b")).rstrip(b"\n")) == []  # no trailing newline


# ---- per-line rules --------------------------------------------------------------------------


def test_invalid_json_names_the_line() -> None:
    assert problems(lines(line("a"), b'{"custom_id": "b",', line("c"))) == [(2, "invalid_json")]


@pytest.mark.parametrize(("raw", "kind"), [(b"[1, 2]", "an array"), (b'"text"', "a str"), (b"42", "a int")])
def test_line_must_be_an_object(raw: bytes, kind: str) -> None:
    found = list(
        validate_stream(io.BytesIO(lines(line("a"), raw)), get_dialect("zerogpu").validation_rules())
    )
    assert [(p.line, p.code) for p in found] == [(2, "invalid_line")]
    assert kind in found[0].message


@pytest.mark.parametrize("cid", [None, "", 17, ["a"]])
def test_custom_id_must_be_a_non_empty_string(cid: Any) -> None:
    assert problems(lines(line("a"), line(cid))) == [(2, "invalid_custom_id")]


def test_custom_id_missing() -> None:
    raw = orjson.dumps({"method": "POST", "url": CHAT, "body": {"model": "m", "messages": []}})
    assert problems(lines(raw)) == [(1, "invalid_custom_id")]


def test_duplicate_custom_id_names_the_second_line() -> None:
    found = list(
        validate_stream(
            io.BytesIO(lines(line("a"), line("b"), line("a"))), get_dialect("openai").validation_rules()
        )
    )
    assert [(p.line, p.code, p.custom_id) for p in found] == [(3, "duplicate_custom_id", "a")]


def test_duplicate_custom_ids_are_allowed_for_doubleword() -> None:
    assert problems(lines(line("a"), line("a")), dialect="doubleword") == []
    assert problems(lines(line("a"), line("a")), dialect="xai") == [(2, "duplicate_custom_id")]


@pytest.mark.parametrize("method", ["POST", "post", "Post"])
def test_method_is_case_insensitive(method: str) -> None:
    assert problems(lines(line("a", method=method))) == []


@pytest.mark.parametrize("method", ["GET", "PUT", "", None, 1])
def test_method_must_be_post(method: Any) -> None:
    assert problems(lines(line("a"), line("b", method=method))) == [(2, "invalid_method")]


@pytest.mark.parametrize(
    "url", ["/v1/embeddings", "/v1/chat/completions/", "https://api.zerogpu.ai/v1/chat/completions", "", None]
)
def test_url_must_be_a_supported_endpoint_exactly(url: Any) -> None:
    assert problems(lines(line("a", url=url))) == [(1, "invalid_url")]


def test_url_must_be_the_same_on_every_line() -> None:
    data = lines(line("a", url="/v1/chat/completions"), line("b", url="/v1/embeddings", body=EMBED))
    assert problems(data, dialect="openai") == [(2, "mismatched_url")]


def test_url_must_match_the_batch_endpoint() -> None:
    data = lines(line("a", url="/v1/embeddings", body=EMBED), line("b", url="/v1/embeddings", body=EMBED))
    assert problems(data, dialect="openai", expected_url=CHAT) == [
        (1, "mismatched_url"),
        (2, "mismatched_url"),
    ]


def test_mixed_urls_are_allowed_for_xai_only() -> None:
    data = lines(line("a", url="/v1/responses"), line("b", url=CHAT), line("c", url="/v1/images/generations"))
    assert problems(data, dialect="xai") == []
    assert problems(data, dialect="xai", expected_url=CHAT) == []
    assert problems(lines(line("a", url="/v1/embeddings")), dialect="xai") == [(1, "invalid_url")]
    for other in ("openai", "doubleword"):
        assert (2, "mismatched_url") in problems(
            lines(line("a", url="/v1/responses"), line("b", url=CHAT)), other
        )


@pytest.mark.parametrize("body", [{}, [], "text", 3])
def test_body_must_be_a_non_empty_object(body: Any) -> None:
    assert problems(lines(line("a", body=body))) == [(1, "invalid_body")]


def test_body_missing() -> None:
    assert problems(lines(orjson.dumps({"custom_id": "a", "method": "POST", "url": CHAT}))) == [
        (1, "invalid_body")
    ]


def test_stream_true_is_rejected_but_false_is_fine() -> None:
    assert problems(lines(line("a", body={"model": "m", "messages": [], "stream": True}))) == [
        (1, "stream_not_supported")
    ]
    assert problems(lines(line("a", body={"model": "m", "messages": [], "stream": False}))) == []


def test_one_line_can_break_several_rules() -> None:
    raw = orjson.dumps({"custom_id": "", "method": "GET", "url": "/nope", "body": {}})
    assert problems(lines(raw)) == [
        (1, "invalid_custom_id"),
        (1, "invalid_method"),
        (1, "invalid_url"),
        (1, "invalid_body"),
    ]


# ---- format details --------------------------------------------------------------------------


def test_blank_lines_are_skipped_but_keep_line_numbers() -> None:
    data = b"\n" + line("a") + b"\n\n   \n" + line("a") + b"\n\n"
    assert problems(data) == [(5, "duplicate_custom_id")]


def test_crlf_line_endings_are_accepted() -> None:
    assert problems(lines(line("a"), line("b"), sep=b"\r\n")) == []
    assert problems(lines(line("a"), b"{bad", sep=b"\r\n")) == [(2, "invalid_json")]


def test_byte_order_mark_is_reported_on_line_1() -> None:
    found = list(
        validate_stream(
            io.BytesIO(b"\xef\xbb\xbf" + lines(line("a"))), get_dialect("zerogpu").validation_rules()
        )
    )
    assert [(p.line, p.code) for p in found] == [(1, "byte_order_mark")]
    assert "plain UTF-8" in found[0].message


def test_invalid_utf8() -> None:
    raw = line("a", body={"model": "m", "x": "PLACEHOLDER"}).replace(b"PLACEHOLDER", b"\xff\xfe")
    assert problems(lines(line("b"), raw)) == [(2, "invalid_utf8")]


def test_empty_file() -> None:
    assert problems(b"") == [(None, "empty_file")]
    assert problems(b"\n\n  \n") == [(None, "empty_file")]


# ---- limits (small, so the tests stay small) -------------------------------------------------


def test_line_at_the_limit_passes_and_one_byte_more_fails() -> None:
    base = line("a", body={"model": "m", "messages": [], "pad": ""})
    limit = len(base) + 10
    exact = line("a", body={"model": "m", "messages": [], "pad": "x" * 10})
    over = line("b", body={"model": "m", "messages": [], "pad": "x" * 11})
    assert len(exact) == limit and len(over) == limit + 1
    assert problems(lines(exact, over), max_line_bytes=limit) == [(2, "line_too_large")]


def test_oversize_line_is_streamed_not_loaded() -> None:
    huge = b'{"custom_id": "big", "pad": "' + b"x" * 3_000_000 + b'"}'
    data = lines(line("a"), huge, line("c"))

    class CountingStream(io.BytesIO):
        largest = 0

        def readline(self, size: int | None = -1) -> bytes:  # type: ignore[override]
            chunk = super().readline(size)
            CountingStream.largest = max(CountingStream.largest, len(chunk))
            return chunk

    raws = list(iter_raw_lines(CountingStream(data), max_line_bytes=1000))
    assert [(r.number, r.oversize) for r in raws] == [(1, False), (2, True), (3, False)]
    assert raws[1].size == len(huge) and raws[1].data == b""
    # Never more than the cap or one read chunk held at once, never the whole 3 MB line.
    assert CountingStream.largest <= 1 << 20
    assert problems(data, max_line_bytes=1000) == [(2, "line_too_large")]


def test_too_many_lines() -> None:
    data = lines(*(line(f"r{i}") for i in range(4)))
    assert problems(data, max_lines=4) == []
    assert problems(data, max_lines=3) == [(None, "too_many_lines")]


def test_file_too_large() -> None:
    data = lines(line("a"), line("b"))
    assert problems(data, max_file_bytes=len(data)) == []
    found = list(
        validate_stream(
            io.BytesIO(data), get_dialect("zerogpu").validation_rules(Limits(max_file_bytes=len(data) - 1))
        )
    )
    assert [(p.line, p.code) for p in found] == [(None, "file_too_large")]
    assert f"{len(data):,} bytes" in found[0].message


def test_line_problems_come_before_file_problems() -> None:
    data = lines(line("a"), b"oops", line("c"))
    assert problems(data, max_lines=2) == [(2, "invalid_json"), (None, "too_many_lines")]


def test_dialect_limits_are_each_vendors_own() -> None:
    # Only ZeroGPU documents a per-line limit (1 MB); Doubleword takes 10 MB request bodies;
    # OpenAI and xAI document none, so a line may be as large as the file.
    expected = {
        "openai": (50_000, 200 << 20, 200 << 20, 200 << 20),
        "xai": (50_000, 200 << 20, 200 << 20, 200 << 20),
        "doubleword": (50_000, 200 << 20, 10 << 20, 100 << 20),
        "zerogpu": (50_000, 200 << 20, 1 << 20, 100 << 20),
    }
    for name, limits_of in expected.items():
        limits = get_dialect(name).validation_rules().limits
        assert (
            limits.max_lines,
            limits.max_file_bytes,
            limits.max_line_bytes,
            limits.max_shard_bytes,
        ) == limits_of


@pytest.mark.parametrize("dialect", ["openai", "doubleword", "xai", "azure"])
def test_a_5mb_line_is_valid_where_no_1mb_limit_is_documented(dialect: str) -> None:
    big = line("a", body={"model": "m", "messages": [{"role": "user", "content": "x" * (5 << 20)}]})
    assert problems(lines(big), dialect) == []
    assert problems(lines(big), "zerogpu") == [(1, "line_too_large")]


def test_one_model_per_file_reports_the_first_differing_line() -> None:
    data = lines(
        line("a", body={"model": "m1", "messages": []}),
        line("b", body={"model": "m1", "messages": []}),
        line("c", body={"model": "m2", "messages": []}),
        line("d", body={"model": "m3", "messages": []}),
    )
    found = list(validate_stream(io.BytesIO(data), get_dialect("openai").validation_rules()))
    assert [(p.line, p.code) for p in found] == [(3, "mismatched_model"), (4, "mismatched_model")]
    assert "'m2' differs from 'm1' on line 1" in found[0].message and found[0].param == "body.model"
    # Dialects that route each request by its own model say so.
    assert problems(data, "doubleword") == [] and problems(data, "xai") == []


def test_custom_id_at_most_64_characters_where_documented() -> None:
    data = lines(line("x" * 64), line("y" * 65))
    found = list(validate_stream(io.BytesIO(data), get_dialect("doubleword").validation_rules()))
    assert [(p.line, p.code) for p in found] == [(2, "custom_id_too_long")]
    assert "65 characters; the limit is 64" in found[0].message
    assert problems(data, "openai") == [(2, "custom_id_too_long")]
    assert problems(data, "xai") == []


# ---- helpers ---------------------------------------------------------------------------------


def test_problem_text_and_error_shape() -> None:
    problem = Problem(3, "invalid_method", "method must be POST", "method", "r3")
    assert str(problem) == "line 3: method must be POST [invalid_method]"
    assert str(Problem(None, "empty_file", "file has no lines")) == "file: file has no lines [empty_file]"
    assert problem.as_error() == {
        "code": "invalid_method",
        "line": 3,
        "message": "method must be POST",
        "param": "method",
    }


def test_check_raw_returns_the_object() -> None:
    validator = LineValidator(get_dialect("openai").validation_rules())
    obj, found = validator.check_raw(RawLine(1, line("a"), len(line("a"))))
    assert obj is not None and obj["custom_id"] == "a" and found == []
    assert validator.check_raw(RawLine(2, b"  ", 2)) == (None, [])
    assert validator.lines == 1


def test_iter_objects() -> None:
    data = lines(line("a"), b"", line("b"))
    assert [(n, o["custom_id"]) for n, o in iter_objects(io.BytesIO(data))] == [(1, "a"), (3, "b")]
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        list(iter_objects(io.BytesIO(lines(line("a"), b"{x"))))
    with pytest.raises(ValueError, match="line 1: 2,001 bytes"):
        list(iter_objects(io.BytesIO(b"x" * 2001 + b"\n"), max_line_bytes=1000))


def test_dumps_line_has_no_newline() -> None:
    assert dumps_line({"a": "é"}) == '{"a":"é"}'.encode()


# ---- repeated keys in a result line (jsonl.repeated_key) ------------------------------------------

REPEATS = [
    (b'{"a": 1, "a": 2}', "a"),
    (b'{"a": {"x": 1, "y": {"x": 2}}, "b": {"x": 3, "x": 4}}', "x"),
    (b'{"custom_id": "a", "custom\\u005fid": "b"}', "custom_id"),
    # The dropped repeat's quotes made up by a value spelling two quotes \u0022 (equal counts).
    (b'{"a": 1, "a": "\\u0022\\u0022"}', "a"),
    # A key followed by blanks before its colon, and a string ending in an escaped backslash.
    (b'{"k" :"\\\\", "k"\t: 2}', "k"),
    (b'[{"a": 1}, {"a": 2}, {"b": [{"c": 1, "c": 1}]}]', "c"),
    # Deeper than orjson writes (255 levels), still read (1024).
    (b'{"d": ' + b"[" * 600 + b'{"e": 1, "e": 2}' + b"]" * 600 + b"}", "e"),
]
NO_REPEATS = [
    b'{"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]}',
    b'{"a": "\\u0022:", "b": "say \\"a\\": 1", "c": "\\\\"}',
    b'{"a": "x", "A": "y", "a ": "z"}',
    b'{"d": ' + b"[" * 1000 + b'{"e": "\\u0022"}' + b"]" * 1000 + b"}",
]


@pytest.mark.parametrize(("line", "key"), REPEATS)
def test_a_repeated_key_is_named(line: bytes, key: str) -> None:
    from airflow_batch_provider.jsonl import repeated_key

    assert repeated_key(line, orjson.loads(line)) == f"repeats the key {key!r}"


@pytest.mark.parametrize("line", NO_REPEATS)
def test_a_line_without_a_repeat_passes(line: bytes) -> None:
    from airflow_batch_provider.jsonl import repeated_key

    assert repeated_key(line, orjson.loads(line)) is None


def test_repeated_key_agrees_with_the_json_module_on_random_lines() -> None:
    import json
    import random

    from airflow_batch_provider.jsonl import repeated_key

    def has_repeat(line: bytes) -> bool:
        found = []

        def pairs(items: list[tuple[str, object]]) -> None:
            keys = [k for k, _ in items]
            found.append(len(keys) != len(set(keys)))

        json.loads(line, object_pairs_hook=pairs)
        return any(found)

    rng = random.Random(23)
    keys = ["a", "b", "a\\u0062", 'q\\"', "\\\\", "\\u0022"]
    scalars = ["1", '"s"', '"\\\\"', '"q\\":"', '"\\u0022:"', "null", "[]", "{}"]

    def value(depth: int) -> str:
        roll = rng.random()
        if depth > 3 or roll < 0.3:
            return rng.choice(scalars)
        if roll < 0.5:
            return "[" + ", ".join(value(depth + 1) for _ in range(rng.randint(0, 3))) + "]"
        members = (
            f'"{rng.choice(keys)}"{rng.choice(["", " ", chr(10)])}:{value(depth + 1)}'
            for _ in range(rng.randint(0, 4))
        )
        return "{" + ",".join(members) + "}"

    seen = {True: 0, False: 0}
    for _ in range(3000):
        line = value(0).encode()
        expected = has_repeat(line)
        seen[expected] += 1
        assert (repeated_key(line, orjson.loads(line)) is not None) == expected, line
    assert min(seen.values()) > 300  # both kinds of line were tried


def test_a_model_is_needed_per_endpoint_of_a_line_model_dialect() -> None:
    bare = {"messages": [{"role": "user", "content": "hi"}]}
    assert problems(lines(line("a", body=bare)), dialect="openai") == [(1, "missing_model")]
    assert problems(lines(line("a", body={**bare, "model": " "})), dialect="openai") == [(1, "missing_model")]
    # Moderations run on the vendor's default model; a job-model dialect takes it from the job.
    assert problems(lines(line("a", url="/v1/moderations", body={"input": "x"})), dialect="openai") == []
    assert problems(lines(line("a", body=bare)), dialect="mistral") == []


def test_the_body_fields_an_endpoint_needs_are_checked_per_line_of_a_mixed_file() -> None:
    chat = {"model": "m", "messages": []}
    data = lines(line("a", body=chat), line("b", url="/v1/responses", body={"model": "m", "input": "x"}))
    assert problems(data, dialect="xai") == []
    assert problems(lines(line("a", body={"model": "m", "input": "x"})), dialect="xai") == [
        (1, "missing_body_field")
    ]
