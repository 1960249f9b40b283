"""Bad input: every awkward value gets a clear error or a rejects row, and the rest lands.

Rows go through the whole pipeline (build -> submit -> trigger -> merge) from a PostgreSQL
table whose name and columns need quoting; hand-made JSONL files go to the submit operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.exceptions import ConfigurationError, DuplicateKeyError, JsonlValidationError
from tests.fixtures.reliability import Pipeline

SOURCE = 'tickets "raw" select'  # quotes, spaces and an SQL keyword
TARGET = 'results "final" from'
KEY, PROMPT, EXTRA = "key id", "select", "my col"
RTL = "\u0645\u0631\u062d\u0628\u0627 \U0001f44b\U0001f3fd \u05e9\u05dc\u05d5\u05dd \u202bmixed\u202c"
BIG = "x" * (2 * 1024 * 1024)

# key -> (prompt, extra bytes, the status the row must end with, reject code or None)
CORPUS: dict[int, tuple[str | None, bytes | None, str, str | None]] = {
    1: ("plain ascii", b"ok", "succeeded", None),
    2: (None, b"ok", "rejected", "null_value"),
    3: ("", b"ok", "succeeded", None),
    4: (BIG, b"ok", "rejected", "line_too_large"),
    5: ("bytes below are not UTF-8", b"\xff\xfe\xfa", "rejected", "invalid_utf8"),
    6: (RTL, b"ok", "succeeded", None),
    7: ("quotes \" and ' and \\ backslash", b"caf\xc3\xa9", "succeeded", None),
    8: ("null in the bytes column", None, "rejected", "null_value"),
}


@pytest.fixture
def server(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    handle = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", handle.connection_json())
    return handle


def seed(pipeline: Pipeline) -> None:
    wh = pipeline.warehouse
    q = wh.quote
    wh.run(f"CREATE TABLE {q(SOURCE)} ({q(KEY)} INTEGER, {q(PROMPT)} TEXT, {q(EXTRA)} BYTEA)")
    wh.run_many(
        f"INSERT INTO {q(SOURCE)} VALUES (%s, %s, %s)",
        [(k, p, e) for k, (p, e, _, _) in CORPUS.items()],
    )


BUILD = {
    "table": SOURCE,  # quoted by the build, like the merge's target_table
    "key_columns": KEY,
    "messages": [{"role": "user", "content": "{{ select }}{{ row['my col'] }}"}],
    # OpenAI documents no per-line limit; a user may set one, and the 2 MB row must meet it.
    "max_line_bytes": 1024 * 1024,
}


async def test_row_corpus_rejects_each_bad_row_and_lands_the_rest(server: Any, pipeline: Pipeline) -> None:
    seed(pipeline)
    record = await pipeline.run("corpus", TARGET, build=BUILD)
    assert record.manifest is not None and record.submit_error is None
    rejects_file = staging.resolve_path(record.manifest["staging_path"]) / "rejects.jsonl"
    rejects = {r["key"][0]: r for r in map(orjson.loads, rejects_file.read_bytes().splitlines())}
    expected_rejects = {k: code for k, (_, _, _, code) in CORPUS.items() if code}
    assert {k: r["code"] for k, r in rejects.items()} == expected_rejects
    # A clear reason: the column for value problems, the sizes for the oversize line.
    assert rejects[2]["column"] == PROMPT and PROMPT in rejects[2]["reason"]
    assert rejects[8]["column"] == EXTRA
    assert rejects[5]["column"] == EXTRA and "UTF-8" in rejects[5]["reason"]
    assert "limit" in rejects[4]["reason"]
    wh = pipeline.warehouse
    q = wh.quote
    got = {r[0]: r[1:] for r in wh.rows(f"SELECT {q(KEY)}, status, content, error_code FROM {q(TARGET)}")}
    # Every input row is in the table exactly once, with its status.
    assert {k: v[0] for k, v in got.items()} == {k: status for k, (_, _, status, _) in CORPUS.items()}
    for key, (prompt, extra, status, code) in CORPUS.items():
        if status == "succeeded":
            assert got[key][1] == f"echo: {prompt}{(extra or b'').decode()}", key  # exact round trip
        else:
            assert got[key][2] == code, (key, got[key])
    assert record.merge is not None
    assert record.merge["counts"]["succeeded"] == 4 and record.merge["counts"]["rejected"] == 4


async def test_duplicate_keys_fail_the_build_naming_them(server: Any, pipeline: Pipeline) -> None:
    seed(pipeline)
    q = pipeline.warehouse.quote
    pipeline.warehouse.run(f"INSERT INTO {q(SOURCE)} VALUES (6, 'again', 'ok'), (1, 'and again', 'ok')")
    with pytest.raises(DuplicateKeyError) as info:
        pipeline.build("dups", **BUILD)
    text = str(info.value)
    assert "2 key(s)" in text and "{'key id': 6} x2" in text and "{'key id': 1} x2" in text, text
    assert server.stats()["counters"].get("files_uploaded", 0) == 0


async def test_template_naming_a_missing_column_is_a_clear_error(server: Any, pipeline: Pipeline) -> None:
    seed(pipeline)
    with pytest.raises(ConfigurationError) as info:
        pipeline.build("missing", **{**BUILD, "messages": [{"role": "user", "content": "{{ subject }}"}]})
    text = str(info.value)
    assert "subject" in text and "key id" in text and "my col" in text, text


def jsonl_line(i: int) -> bytes:
    body = {"model": "echo-1", "messages": [{"role": "user", "content": f"line {i}"}]}
    return orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def write(path: Path, lines: list[bytes], sep: bytes = b"\n", prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + sep.join(lines) + sep)
    return path


# name -> (file bytes builder, None if the file lands, else (error code, line number))
FILES: dict[str, tuple[Any, tuple[str, int] | None]] = {
    "blank_line": (lambda p: write(p, [jsonl_line(0), b"", jsonl_line(1), jsonl_line(2)]), None),
    "crlf": (lambda p: write(p, [jsonl_line(i) for i in range(3)], sep=b"\r\n"), None),
    "bom": (
        lambda p: write(p, [jsonl_line(i) for i in range(3)], prefix=b"\xef\xbb\xbf"),
        ("byte_order_mark", 1),
    ),
    "array_line": (lambda p: write(p, [jsonl_line(0), b"[1, 2]", jsonl_line(2)]), ("invalid_line", 2)),
    "over_1mb": (
        lambda p: write(
            p, [jsonl_line(0), jsonl_line(1), b'{"custom_id": "big", "pad": "' + b"y" * 1_100_000 + b'"}']
        ),
        # 1.1 MB is within OpenAI's limits (it documents none per line): the line is refused for
        # what it lacks, not for its size.
        ("invalid_method", 3),
    ),
    "not_utf8": (
        lambda p: write(p, [jsonl_line(0), b'{"custom_id": "\xff\xfe"}', jsonl_line(2)]),
        ("invalid_utf8", 2),
    ),
}


@pytest.mark.parametrize("name", list(FILES))
async def test_handmade_jsonl_corpus(server: Any, pipeline: Pipeline, tmp_path: Path, name: str) -> None:
    make, problem = FILES[name]
    path = make(tmp_path / f"{name}.jsonl")
    if problem is not None:
        code, line = problem
        with pytest.raises(JsonlValidationError) as info:
            await pipeline.submit_and_wait(str(path), f"jsonl-{name}")
        text = str(info.value)
        assert f"line {line}" in text and code in text and str(path) in text, text
        # Refused before paying: nothing was uploaded, no batch exists.
        counters = server.stats()["counters"]
        assert counters.get("files_uploaded", 0) == 0 and counters.get("batches_created", 0) == 0
        return
    record = await pipeline.submit_and_wait(str(path), f"jsonl-{name}")
    assert record.event is not None and record.event["status"] == "success", record.event
    summary = pipeline.merge(record.submission, {"manifest_path": None}, f"jsonl {name}")
    assert summary["counts"]["succeeded"] == 3
    q = pipeline.warehouse.quote
    got = dict(pipeline.warehouse.rows(f"SELECT custom_id, content FROM {q('jsonl ' + name)}"))
    assert got == {f"c{i}": f"echo: line {i}" for i in range(3)}
