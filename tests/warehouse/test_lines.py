"""The warehouse parses result lines: the SQL rendering of a LineShape writes exactly the rows
of the Python path (dialect.parse_result_line + ResultMapper.row), line by line."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import BatchApiResponseError, WarehouseSchemaError
from airflow_batch_provider.warehouse.lines import RawResults, ResultFile, file_line_reader
from airflow_batch_provider.warehouse.rows import OutputSchema, ResultMapper
from airflow_batch_provider.warehouse.write import ResultsWriter

CHAT = {"object": "chat.completion", "model": "gpt-test"}


def chat(content: Any, **message: Any) -> dict[str, Any]:
    return {
        **CHAT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def ok(body: Any, status: Any = 200) -> dict[str, Any]:
    return {"response": {"status_code": status, "request_id": "req", "body": body}, "error": None}


def usage(**counts: Any) -> dict[str, Any]:
    return {**chat("x"), "usage": counts}


#: (what, line) pairs: a line is a dict (written as JSON) or the raw bytes of the line.
CORPUS: list[tuple[str, Any]] = [
    ("chat", ok(chat('héllo wörld ✓ 🚀 "quoted" \\ back\nnew line\ttab'))),
    ("huge content", ok(chat("x" * 300_000))),
    ("empty content", ok(chat(""))),
    (
        "tool calls",
        ok(
            chat(
                None,
                tool_calls=[
                    {"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            )
        ),
    ),
    ("empty tool calls", ok(chat(None, tool_calls=[]))),
    ("refusal", ok(chat(None, refusal="no, sorry"))),
    ("content parts", ok(chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))),
    ("content number", ok(chat(5))),
    ("legacy completion", ok({"model": "m", "choices": [{"text": "done", "finish_reason": "length"}]})),
    ("message not object", ok({"choices": [{"message": "hi", "text": "t", "finish_reason": 3}]})),
    ("empty choices", ok({"choices": [], "model": "m"})),
    (
        "embedding",
        ok(
            {
                "object": "list",
                "model": "e",
                "data": [{"embedding": [0.25, -1.5, 3e-5, 1e21]}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        ),
    ),
    ("two embeddings", ok({"object": "list", "data": [{"embedding": [1.0]}, {"embedding": [2.0]}]})),
    ("embedding null", ok({"object": "list", "data": [{"embedding": None}]})),
    (
        "responses text",
        ok(
            {
                "object": "response",
                "status": "completed",
                "output_text": "out",
                "output": [],
                "usage": {"input_tokens": 4, "output_tokens": 6, "total_tokens": 10},
            }
        ),
    ),
    (
        "responses parts",
        ok(
            {
                "status": "completed",
                "output": [
                    {
                        "type": "message",
                        "content": [
                            {"type": "output_text", "text": "p1"},
                            {"type": "output_text", "text": "p2"},
                        ],
                    }
                ],
            }
        ),
    ),
    (
        "responses incomplete",
        ok(
            {
                "status": "incomplete",
                "output_text": "half",
                "incomplete_details": {"reason": "max_output_tokens"},
            }
        ),
    ),
    (
        "responses empty reason",
        ok({"status": "incomplete", "output_text": None, "incomplete_details": {"reason": ""}}),
    ),
    ("moderation", ok({"id": "modr", "results": [{"flagged": False}]})),
    (
        "http 500",
        {
            "response": {"status_code": 500, "body": {"error": {"code": "server_error", "message": "died"}}},
            "error": None,
        },
    ),
    ("http 429 string", {"response": {"status_code": 429, "body": {"error": "slow down"}}, "error": None}),
    (
        "http 400 empty code",
        {"response": {"status_code": 400, "body": {"error": {"code": "", "message": None}}}},
    ),
    ("http 404 no body", {"response": {"status_code": 404, "body": None}}),
    ("http numeric code", {"response": {"status_code": 400, "body": {"error": {"code": 7, "message": "m"}}}}),
    ("status string", ok(chat("s"), "200")),
    ("status float", ok(chat("f"), 200.0)),
    ("status 204 null body", ok(None, 204)),
    ("status missing", {"response": {"body": chat("b")}}),
    ("response string", {"response": "nope", "error": None}),
    ("body array", ok([1, 2])),
    ("expired", {"response": None, "error": {"code": "batch_expired", "message": "late"}}),
    ("cancelled", {"response": None, "error": {"code": "batch_cancelled", "message": None}}),
    ("error string", {"response": None, "error": "went wrong"}),
    ("error empty string", {"response": None, "error": ""}),
    ("error empty object", {"response": None, "error": {}}),
    ("error numeric code", {"response": None, "error": {"code": 429, "message": "m"}}),
    ("error on 200", {"response": {"status_code": 200, "body": chat("x")}, "error": {"code": "odd"}}),
    ("error false on 200", ok(chat("y")) | {"error": False}),
    ("tokens odd", ok(usage(prompt_tokens=-1, completion_tokens=True, total_tokens=10**12))),
    ("tokens float", ok(usage(prompt_tokens=5.0, completion_tokens="5"))),
    ("tokens input/output", ok(usage(input_tokens=4, output_tokens=6))),
    ("tokens total null", ok(usage(prompt_tokens=4, completion_tokens=6, total_tokens=None))),
    ("tokens only total", ok(usage(total_tokens=9))),
    ("tokens not object", ok({**chat("u"), "usage": [1]})),
    ("model number", ok({**chat("m"), "model": 5})),
    ("no custom_id", b'{"response": {"status_code": 200, "body": {}}}'),
    ("null custom_id", b'{"custom_id": null, "response": null, "error": {"code": "x"}}'),
    ("not json", b'{"custom_id": "cut", "response": {"status'),
    ("array line", b"[1, 2]"),
    ("not utf-8", b'{"custom_id": "bytes", "response": null, "error": "\xff\xfe"}'),
    ("carriage return", b'{"custom_id": "cr",\r "response": null, "error": "x"}'),
    (
        "spaced json",
        b'{ "custom_id" : "spaced" , "response" : { "status_code" : 200 , "body" : '
        b'{ "choices" : [ { "message" : { "content" : "s p" } } ] } } }',
    ),
]

#: Lines at the edges of what the database reads alone (its fast path for common lines, and
#: numbers whose spelling jsonb does not keep: 1e2 is 100 there, a float to Python).
EDGES: list[tuple[str, Any]] = [
    ("tokens at the limits", ok(usage(prompt_tokens=0, completion_tokens=10**9, total_tokens=10**9 + 1))),
    ("tokens 9 digits", ok(usage(prompt_tokens=999_999_999, completion_tokens=1))),
    (
        "tokens negative zero",
        b'{"custom_id": "nz", "response": {"status_code": 200, "body": {"choices": '
        b'[{"message": {"content": "z"}}], "usage": {"prompt_tokens": -0, "completion_tokens": 1.50}}}}',
    ),
    ("status 299", ok(chat("edge"), 299)),
    ("status 300", ok(chat("edge"), 300)),
    ("status 199", ok(chat("edge"), 199)),
    ("error absent", {"response": {"status_code": 200, "body": chat("no error key")}}),
    ("error code null", {"response": None, "error": {"code": None, "message": "m"}}),
    ("error message absent", {"response": None, "error": {"code": "c"}}),
    (
        "error invalid_result_line",
        {"response": None, "error": {"code": "invalid_result_line", "message": "m"}},
    ),
    ("error with a body", {"response": {"status_code": 200, "body": chat("z")}, "error": {"code": "e"}}),
    ("error with an empty body", {"response": {"status_code": 500, "body": {}}, "error": {"code": "e"}}),
    ("choices object", ok({**chat("o"), "choices": {"0": {"message": {"content": "not a list"}}}})),
    (
        "finish and model not text",
        ok({**chat("f"), "model": None, "choices": [{"message": {"content": "c"}, "finish_reason": 1}]}),
    ),
    ("no usage", ok({"choices": [{"message": {"content": "c"}}]})),
    ("custom_id empty", {"custom_id": "", "response": None, "error": {"code": "x"}}),
    # PostgreSQL's COPY (csv) ends the data at a line \. : the lines after it must still arrive.
    ("end of copy data", b"\\."),
    (
        "tokens exponent",
        b'{"custom_id": "exp", "response": {"status_code": 200, "body": {"choices": [{"message": '
        b'{"content": "e"}}], "usage": {"prompt_tokens": 1e2, "completion_tokens": 2, '
        b'"total_tokens": 1.02E2}}}}',
    ),
    (
        "status exponent",
        b'{"custom_id": "sexp", "response": {"status_code": 2e2, "body": {"choices": [{"message": '
        b'{"content": "e"}}]}}}',
    ),
    (
        "an exponent elsewhere",
        b'{"custom_id": "e1", "x": [1E+3], "response": {"status_code": 200, "body": {"choices": '
        b'[{"message": {"content": "e"}}], "usage": {"prompt_tokens": 5}}}}',
    ),
    (
        "exponent under an escaped key",
        b'{"custom_id": "u1", "response": {"status_code": 200, "body": {"choices": [{"message": '
        b'{"content": "e"}}], "usage": {"prompt\\u005ftokens": 1e2, "total\\u005Ftokens": 3}}}}',
    ),
    (
        "escapes in text",
        b'{"custom_id": "u2", "response": {"status_code": 200, "body": {"choices": [{"message": '
        b'{"content": "caf\\u00e9 \\"a\\": 1e2"}}], "usage": {"prompt_tokens": 4}}}}',
    ),
    (
        "exponent-like text",
        b'{"custom_id": "e2", "id": "req_1e5", "response": {"status_code": 200, "body": {"choices": '
        b'[{"message": {"content": "3e8 m/s, :1e9"}}], "usage": {"prompt_tokens": 5}}}}',
    ),
]


ANSWER = b'{"model": "m", "choices": [{"message": {"content": "yes"}, "finish_reason": "stop"}]}'


def answered(cid: bytes, head: bytes = b"", status: bytes = b"200", body: bytes = ANSWER) -> bytes:
    return (
        b'{"custom_id": "'
        + cid
        + b'", '
        + head
        + b'"response": {"status_code": '
        + status
        + b', "body": '
        + body
        + b'}, "error": null}'
    )


#: Lines that parsers read differently: (what, line, the rows' status and error code Python gives
#: them). A line repeating a key is unreadable wherever it is read; so is one orjson refuses.
HOSTILE: list[tuple[str, bytes, tuple[str, str | None]]] = [
    (
        "repeated custom_id",
        b'{"custom_id": "h-cid-1", "custom_id": "h-cid-2", "response": {"status_code": 200, '
        b'"body": ' + ANSWER + b'}, "error": null}',
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "repeated status_code",
        b'{"custom_id": "h-status", "response": {"status_code": 500, "status_code": 200, "body": '
        + ANSWER
        + b"}}",
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "repeated content",
        answered(b"h-content", body=b'{"choices": [{"message": {"content": "first", "content": "second"}}]}'),
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "repeated key nothing reads",
        answered(b"h-meta", b'"meta": {"a": 1, "a": 2}, '),
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "repeated key spelled otherwise",
        answered(b"h-esc-1", b'"custom\\u005fid": "h-esc-2", '),
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "repeated equal value",
        answered(b"h-same", b'"custom_id": "h-same", '),
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "repeated error code",
        b'{"custom_id": "h-err", "response": null, "error": {"code": "a", "message": "m", "code": "b"}}',
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "a quote spelled u0022 (no repeat)",
        answered(b"h-u0022", body=b'{"choices": [{"message": {"content": "say \\u0022hi\\u0022"}}]}'),
        ("succeeded", None),
    ),
    (
        "nesting orjson reads",
        answered(b"h-1000", b'"x": ' + b"[" * 1000 + b"]" * 1000 + b", "),
        ("succeeded", None),
    ),
    (
        "nesting past orjson's 1024",
        answered(b"h-1025", b'"x": ' + b"[" * 1025 + b"]" * 1025 + b", "),
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "surrogate pair",
        answered(b"h-pair", body=b'{"choices": [{"message": {"content": "\\ud83d\\ude00"}}]}'),
        ("succeeded", None),
    ),
    (
        "integer status past 64 bits",
        answered(b"h-big", status=b"123456789012345678901234567890"),
        ("failed", "unknown_error"),
    ),
    (
        "digit-string status past 128 bits",
        answered(b"h-bigtext", status=b'"1234567890123456789012345678901234567890"'),
        ("failed", "http_1234567890123456789012345678901234567890"),
    ),
    (
        "a number past a double",
        answered(b"h-inf", b'"x": [1e400], '),
        ("invalid_output", "invalid_result_line"),
    ),
    (
        "token count past 64 bits",
        answered(
            b"h-tokens",
            body=b'{"choices": [{"message": {"content": "t"}}], "usage": {"prompt_tokens": '
            b"18446744073709551616}}",
        ),
        ("succeeded", None),
    ),
]

#: Lines PostgreSQL refuses to cast to jsonb (its merge then reads every line in Python).
UNCASTABLE: list[tuple[str, bytes, tuple[str, str | None]]] = [
    (
        "lone surrogate",
        answered(b"h-lone", body=b'{"choices": [{"message": {"content": "bad \\ud800"}}]}'),
        ("invalid_output", "invalid_result_line"),
    ),
    ("NaN", answered(b"h-nan", b'"x": NaN, '), ("invalid_output", "invalid_result_line")),
]


def corpus_lines(corpus: list[tuple[str, Any]]) -> list[bytes]:
    lines = []
    for number, (what, line) in enumerate(corpus):
        if isinstance(line, dict):
            line = orjson.dumps({"id": f"r{number}", "custom_id": f"c{number}-{what}", **line})
        lines.append(line)
    return lines


def raw_results(
    dialect: Any, lines: list[bytes], on_bad_line: str = "record", chunk: int | None = None
) -> RawResults:
    """The lines of one result file; with ``chunk``, also as the file's bytes in chunks of that
    size (a blank line is then skipped, as the hook skips it, and counted in line numbers)."""
    files = [ResultFile("file-out", "output", "batch_1")]
    chunks = None
    if chunk is not None:
        data = b"\n".join(lines) + b"\n"
        chunks = [(0, data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return RawResults(
        files,
        ((0, n, data) for n, data in enumerate(lines, start=1) if data.strip()),
        dialect.line_shape,
        file_line_reader(dialect, files, on_bad_line),
        chunks,
    )


def merge_both(
    warehouse: Any, lines: list[bytes], dialect: str = "openai", chunk: int | None = None, **kwargs: Any
) -> Any:
    """Merge ``lines`` once per path into its own table; both tables' rows and reports."""
    vendor = get_dialect(dialect)
    out = []
    for parse_in in ("python", "database"):
        table = f"r_{parse_in}"
        writer = ResultsWriter(warehouse.hook, table, parse_in=parse_in, **kwargs)
        report = writer.merge(raw_results(vendor, lines, chunk=chunk)).as_dict()
        rows = warehouse.rows(
            "SELECT custom_id, status, content, embedding, finish_reason, model, prompt_tokens, "
            "completion_tokens, total_tokens, error_code, error_message, batch_id "
            f"FROM {warehouse.quote(table)} ORDER BY custom_id"
        )
        # DuckDB keeps JSON as text and spells some numbers its own way (1e21 / 1e+21): the
        # embedding is compared as the JSON value both paths wrote.
        rows = [(*r[:3], orjson.loads(r[3]) if isinstance(r[3], str) else r[3], *r[4:]) for r in rows]
        out.append((rows, report))
    return out


@pytest.fixture(params=["postgres", "duckdb"])
def parsing_warehouse(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{'pg' if request.param == 'postgres' else 'duckdb'}_warehouse")


@pytest.mark.parametrize("dialect", ["openai", "doubleword", "zerogpu", "azure"])
@pytest.mark.parametrize("with_bad_json", [False, True], ids=["json", "a line not json"])
def test_the_database_writes_the_rows_of_the_python_path(
    parsing_warehouse: Any, dialect: str, with_bad_json: bool
) -> None:
    # A line that is not JSON makes PostgreSQL (15 has no pg_input_is_valid) hand every line to Python.
    corpus = [(w, line) for w, line in CORPUS if with_bad_json or w != "not json"]
    (python_rows, python_report), (sql_rows, sql_report) = merge_both(
        parsing_warehouse, corpus_lines(corpus), dialect
    )
    assert len(python_rows) == len(corpus) - 2  # three unreadable lines without a custom_id share ""
    assert sql_rows == python_rows
    assert sql_report == python_report
    assert python_report["bad_result_lines"] == 4 + with_bad_json
    assert python_report["bad_token_counts"] == 2


def test_lines_at_the_edges_of_the_fast_path_write_the_rows_of_the_python_path(
    parsing_warehouse: Any,
) -> None:
    corpus = CORPUS[:3] + EDGES + CORPUS[-1:]
    (python_rows, python_report), (sql_rows, sql_report) = merge_both(parsing_warehouse, corpus_lines(corpus))
    assert len(python_rows) == len(corpus) - 1  # two lines without a custom_id share ""
    assert sql_rows == python_rows
    assert sql_report == python_report


@pytest.fixture
def shared_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of a few bytes, every other one parsed by PostgreSQL's second connection."""
    from airflow_batch_provider.warehouse.loaders import pg_copy

    monkeypatch.setattr(pg_copy, "SHARED_ROUND_BYTES", 1)
    monkeypatch.setattr(pg_copy, "SHARED_MAIN", 1)
    monkeypatch.setattr(pg_copy, "SHARED_CYCLE", 2)


@pytest.mark.parametrize("with_bad_json", [False, True], ids=["json", "a line not json"])
@pytest.mark.parametrize("chunk", [1, 97, 1 << 20])
def test_lines_sent_in_chunks_and_parsed_by_two_connections_write_the_rows_of_the_python_path(
    pg_warehouse: Any, shared_rounds: None, chunk: int, with_bad_json: bool
) -> None:
    # Blank lines (skipped, still counted in line numbers), a carriage return and bytes that
    # are not UTF-8 (their chunk goes line by line).
    blanks = [b"", b"   ", b"\t \x0b\x0c", b"\r"]
    corpus = [(w, line) for w, line in CORPUS + EDGES if with_bad_json or w != "not json"]
    lines = []
    for i, data in enumerate(corpus_lines(corpus)):
        lines.append(data)
        if i % 7 < len(blanks):
            lines.append(blanks[i % 7])
    connections = []
    get_conn = pg_warehouse.hook.get_conn

    def counted() -> Any:
        connections.append(get_conn())
        return connections[-1]

    pg_warehouse.hook.get_conn = counted
    try:
        (python_rows, python_report), (sql_rows, sql_report) = merge_both(pg_warehouse, lines, chunk=chunk)
    finally:
        pg_warehouse.hook.get_conn = get_conn
    # Per path a merge and a read of its table, and the database path's second connection.
    assert len(connections) == 5
    assert sql_rows == python_rows
    assert sql_report == python_report
    assert python_report["result_lines"] == len(corpus)


def test_without_a_second_connection_one_parses_every_line(pg_warehouse: Any, shared_rounds: None) -> None:
    get_conn = pg_warehouse.hook.get_conn
    opened = []

    def one_only() -> Any:
        if opened:
            raise RuntimeError("too many connections")
        opened.append(get_conn())
        return opened[-1]

    pg_warehouse.hook.get_conn = one_only
    try:
        report = ResultsWriter(pg_warehouse.hook, "t", parse_in="database").merge(
            raw_results(get_dialect("openai"), corpus_lines(CORPUS[:20]), chunk=50)
        )
    finally:
        pg_warehouse.hook.get_conn = get_conn
    assert report.rows_written == 20


def test_a_failure_of_the_second_connection_fails_the_merge_and_writes_nothing(
    pg_warehouse: Any, shared_rounds: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_batch_provider.warehouse.loaders import pg_copy

    spool = pg_copy.tempfile.TemporaryFile

    def no_space(*args: Any, prefix: str = "", **kwargs: Any) -> Any:
        if prefix == "abp-rows-":  # the rows the second connection parsed
            raise OSError("No space left on device")
        return spool(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(pg_copy.tempfile, "TemporaryFile", no_space)
    raw = raw_results(get_dialect("openai"), corpus_lines(CORPUS[:20]), chunk=50)
    with pytest.raises(OSError, match="No space left"):
        ResultsWriter(pg_warehouse.hook, "t", parse_in="database").merge(raw)
    assert not pg_warehouse.rows("SELECT COUNT(*) FROM information_schema.tables WHERE table_name = 't'")[0][
        0
    ]


def test_chunks_are_sent_whole_unless_a_line_cannot_travel() -> None:
    from airflow_batch_provider.warehouse.lines import LineNumbers, raw_blocks

    files = [ResultFile("a", "output", None), ResultFile("b", "error", None)]
    chunks = [(0, b'{"a": 1}\n\n{"b"'), (0, b': 2}\n{"c": 3}'), (1, b"x\r\n  \n\xff\ny\n"), (1, b"z")]
    raw = RawResults(files, iter(()), None, lambda f, n, d: None, chunks)  # type: ignore[arg-type,return-value]
    numbers = LineNumbers()
    blocks = list(raw_blocks(raw, numbers))
    assert blocks == [
        (b'{"a": 1}\n\n', 2),
        (b'{"b": 2}\n', 1),
        (b'{"c": 3}\n', 1),
        (b"\x03" + b"x\r".hex().encode() + b"\n\x03ff\ny\n", 3),
        (b"z\n", 1),
    ]
    # Staged rows 1-4 are lines 1-4 of file a (row 2 blank); 5-8 are lines 1, 3, 4, 5 of file b.
    assert [numbers.locate(seq) for seq in range(1, 9)] == [
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (1, 1),
        (1, 3),
        (1, 4),
        (1, 5),
    ]


def test_common_lines_are_parsed_by_the_database_alone(parsing_warehouse: Any) -> None:
    vendor = get_dialect("openai")
    names = {
        "chat",
        "huge content",
        "legacy completion",
        "embedding",
        "responses text",
        "http 500",
        "expired",
        "error string",
        "status string",
        "tokens input/output",
        "spaced json",
    }
    lines = corpus_lines([(w, line) for w, line in CORPUS if w in names])
    raw = raw_results(vendor, lines)
    parsed: list[int] = []
    read = raw.parse
    raw.parse = lambda f, n, data: parsed.append(n) or read(f, n, data)  # type: ignore[func-returns-value]
    report = ResultsWriter(parsing_warehouse.hook, "t", parse_in="database").merge(raw)
    assert parsed == []
    assert report.rows_written == len(names)
    assert report.prompt_tokens == 7 + 7 + 3 + 4 + 7 + 4


def test_an_unreadable_line_fails_the_merge_as_on_the_python_path(parsing_warehouse: Any) -> None:
    vendor = get_dialect("openai")
    lines = corpus_lines(CORPUS[:3]) + [b'{"custom_id": "cut", "resp']
    errors = []
    for parse_in in ("python", "database"):
        with pytest.raises(BatchApiResponseError) as caught:
            ResultsWriter(parsing_warehouse.hook, "t", parse_in=parse_in).merge(
                raw_results(vendor, lines, on_bad_line="fail")
            )
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "file 'file-out' line 4" in errors[0]
    assert not parsing_warehouse.rows(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = 't'"
    )[0][0]


def test_options_only_python_reads_fall_back_and_database_refuses(pg_warehouse: Any) -> None:
    schema = OutputSchema({"type": "object", "properties": {"a": {"type": "integer"}}})
    for mapper in (ResultMapper(extra_columns={"x": "$.model"}), ResultMapper(output_schema=schema)):
        writer = ResultsWriter(pg_warehouse.hook, "t", mapper=mapper)
        assert writer.parses_lines(get_dialect("openai").line_shape) is not None
        with pytest.raises(WarehouseSchemaError, match="parse_in='database'"):
            ResultsWriter(pg_warehouse.hook, "t", mapper=mapper, parse_in="database").merge(
                raw_results(get_dialect("openai"), corpus_lines(CORPUS[:1]))
            )
    assert get_dialect("xai").line_shape is None


def test_auto_leaves_lines_to_python_where_the_database_measured_slower(
    pg_warehouse: Any, duckdb_warehouse: Any
) -> None:
    shape = get_dialect("openai").line_shape
    for warehouse in (pg_warehouse, duckdb_warehouse):
        assert "slower" in str(ResultsWriter(warehouse.hook, "t").parses_lines(shape))
        assert ResultsWriter(warehouse.hook, "t", parse_in="database").parses_lines(shape) is None
    assert ResultsWriter(pg_warehouse.hook, "t", parse_in="python").parses_lines(shape) == "parse_in='python'"


def test_lines_after_a_blank_line_or_in_a_second_file_keep_their_file_and_number(
    parsing_warehouse: Any,
) -> None:
    vendor = get_dialect("openai")
    good = corpus_lines(CORPUS[:2])
    files = [ResultFile("file-out", "output", "b1"), ResultFile("file-err", "error", "b2")]
    # Line 2 of the output file was blank (the hook skips it); the bad line is line 2 of file-err.
    numbered = [(0, 1, good[0]), (0, 3, good[1]), (1, 1, corpus_lines(CORPUS[30:31])[0]), (1, 2, b"[1]")]
    raw = RawResults(files, iter(numbered), vendor.line_shape, file_line_reader(vendor, files, "record"))
    report = ResultsWriter(parsing_warehouse.hook, "t", parse_in="database").merge(raw)
    assert report.bad_result_samples == ["file 'file-err' line 2 is not a JSON object"]
    rows = parsing_warehouse.rows("SELECT custom_id, batch_id FROM t ORDER BY custom_id")
    assert dict(rows) == {"": "b2", "c0-chat": "b1", "c1-huge content": "b1", f"c0-{CORPUS[30][0]}": "b2"}


def test_line_numbers_are_kept_as_runs() -> None:
    from airflow_batch_provider.warehouse.lines import LineNumbers, bare_records

    numbers = LineNumbers()
    lines = [(0, 1, b"{}"), (0, 2, b"a\rb"), (0, 5, b"{}"), (1, 1, b"\xff"), (1, 2, b"{}")]
    assert list(bare_records(lines, numbers)) == [
        b"{}",
        b"\x03" + b"a\rb".hex().encode(),
        b"{}",
        b"\x03ff",
        b"{}",
    ]
    assert numbers.runs == [(1, 0, 1), (3, 0, 5), (4, 1, 1)]
    assert [numbers.locate(s) for s in range(1, 6)] == [(0, 1), (0, 2), (0, 5), (1, 1), (1, 2)]
    assert numbers.file_sql("seq") == "CASE WHEN seq >= 4 THEN 1 WHEN seq >= 1 THEN 0 END"


def merged_rows(warehouse: Any, lines: list[bytes], parse_in: str, chunk: int | None = None) -> Any:
    """The rows (sorted) and report of one merge of ``lines`` into a table of its own."""
    table = f"r_{parse_in}_{chunk or 0}"
    writer = ResultsWriter(warehouse.hook, table, parse_in=parse_in)
    report = writer.merge(raw_results(get_dialect("openai"), lines, chunk=chunk)).as_dict()
    rows = warehouse.rows(
        "SELECT custom_id, status, content, finish_reason, model, prompt_tokens, completion_tokens, "
        f"total_tokens, error_code, error_message, batch_id FROM {warehouse.quote(table)}"
    )
    return sorted(tuple(r) for r in rows), report


@pytest.mark.parametrize("uncastable", [False, True], ids=["jsonb casts every line", "lines jsonb refuses"])
def test_a_hostile_corpus_writes_the_same_rows_on_every_path(
    request: pytest.FixtureRequest, uncastable: bool
) -> None:
    hostile = HOSTILE + (UNCASTABLE if uncastable else [])
    lines = corpus_lines(CORPUS[:2]) + [line for _, line, _ in hostile]
    paths: dict[str, Any] = {}
    for kind in ("postgres", "duckdb", "sqlite", "mysql"):
        try:
            warehouse = request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_warehouse")
        except pytest.skip.Exception:  # no MySQL driver here (under CI, the fixture fails instead)
            continue
        paths[f"{kind} python"] = merged_rows(warehouse, lines, "python")
        if warehouse.hook and kind in ("postgres", "duckdb"):
            paths[f"{kind} database"] = merged_rows(warehouse, lines, "database")
        if kind == "postgres":
            paths["postgres database, in chunks"] = merged_rows(warehouse, lines, "database", chunk=97)
    assert {
        "postgres python",
        "postgres database",
        "duckdb python",
        "duckdb database",
        "sqlite python",
    } <= set(paths)
    rows, report = paths.pop("duckdb python")
    for path, (other_rows, other_report) in paths.items():
        assert other_rows == rows, path
        assert other_report == report, path
    # What Python reads, every path wrote: each line's row, by its number in the file.
    by_id = {r[0]: r for r in rows}
    for number, (what, _, (status, code)) in enumerate(hostile, start=3):
        cid = re.search(rb'"custom_id": "([^"]*)"', hostile[number - 3][1]).group(1).decode()  # type: ignore[union-attr]
        row = by_id[cid]
        assert (row[1], row[8]) == (status, code), what
        if what.startswith("repeated"):
            assert f"file 'file-out' line {number} repeats the key" in row[9], what
    assert by_id["h-status"][9].endswith("repeats the key 'status_code'")
    assert by_id["h-cid-1"][9].endswith("repeats the key 'custom_id'")
    assert by_id["h-pair"][2] == "\U0001f600"


#: Response bodies sent as JSON text (an OpenAI-compatible server in wide use writes them so).
TEXT_BODIES: list[tuple[str, Any]] = [
    ("chat as text", ok(orjson.dumps(chat("from text")).decode())),
    ("chat as spaced text", ok(" " + orjson.dumps(chat("spaced")).decode() + "\n")),
    ("text not json", ok("the model said hi")),
    ("text broken json", ok('{"choices": [')),
    ("text of an array", ok("[1, 2]")),
    ("text of a string", ok('"hi"')),
    (
        "http 500 error as text",
        {"response": {"status_code": 500, "body": '{"error": {"code": "server_error", "message": "died"}}'}},
    ),
    (
        "error object, body text",
        {
            "response": {"status_code": 400, "body": orjson.dumps(chat("n")).decode()},
            "error": {"code": "e", "message": "m"},
        },
    ),
]


def test_a_body_sent_as_json_text_is_decoded_by_the_python_parser() -> None:
    dialect = get_dialect("openai")
    lines = [dialect.parse_result_line({"custom_id": w, **line}, "output") for w, line in TEXT_BODIES]
    decoded = lines[0]
    assert decoded.ok and decoded.body == chat("from text")
    assert lines[1].ok and lines[1].body == chat("spaced")
    # Text that is not a JSON object stays no body (the merge records invalid_output).
    assert [line.body for line in lines[2:6]] == [None] * 4 and all(line.ok for line in lines[2:6])
    assert lines[6].error is not None and lines[6].error.code == "server_error"
    assert lines[7].error is not None and lines[7].error.code == "e" and lines[7].body == chat("n")


def test_a_body_sent_as_json_text_writes_the_same_rows_on_both_paths(parsing_warehouse: Any) -> None:
    (python_rows, python_report), (sql_rows, sql_report) = merge_both(
        parsing_warehouse, corpus_lines(TEXT_BODIES)
    )
    by_id = {row[0].split("-", 1)[1]: row for row in python_rows}
    assert by_id["chat as text"][1:3] == ("succeeded", "from text")
    assert by_id["chat as spaced text"][1:3] == ("succeeded", "spaced")
    for what in ("text not json", "text broken json", "text of an array", "text of a string"):
        assert by_id[what][1] == "invalid_output", by_id[what]
    assert (
        by_id["http 500 error as text"][1] == "failed"
        and by_id["http 500 error as text"][9] == "server_error"
    )
    assert sql_rows == python_rows
    assert sql_report == python_report
