"""ResultsWriter against real databases: every status, re-runs, rollback, awkward identifiers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import WarehouseSchemaError
from airflow_batch_provider.models import ResultLine
from airflow_batch_provider.warehouse.rows import Column, OutputSchema, ResultMapper
from airflow_batch_provider.warehouse.write import MergeReport, ResultsWriter, ShardOutcome

OPENAI = get_dialect("openai")


@pytest.fixture(
    params=[
        "postgres",
        "postgres_rounds",
        "postgres_sql",
        "duckdb",
        "duckdb_sql",
        "sqlite",
        "mysql",
        "bigquery",
        "snowflake",
    ]
)
def warehouse(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every results database; ``postgres_rounds`` writes each result line in a round of its own;
    ``*_sql``: the result lines reach the writer raw and the database parses them."""
    kind = request.param
    if kind == "postgres_rounds":
        round_per_line(monkeypatch)
        kind = "postgres"
    if kind.endswith("_sql"):
        lines_parsed_by_the_database(monkeypatch)
        kind = kind.removesuffix("_sql")
    return request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_warehouse")


def lines_parsed_by_the_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand every merge its results as the raw lines of OpenAI result files (one per batch id)."""
    from airflow_batch_provider.warehouse.lines import RawResults, ResultFile, file_line_reader

    merge = ResultsWriter.merge

    def raw_merge(self: ResultsWriter, results: Any, **kwargs: Any) -> MergeReport:
        files: list[ResultFile] = []
        index: dict[Any, int] = {}

        def lines() -> Iterator[tuple[int, int, bytes]]:
            for number, (line, batch_id) in enumerate(results, start=1):
                if batch_id not in index:
                    index[batch_id] = len(files)
                    files.append(ResultFile(f"file-{len(files)}", line.source, batch_id))
                error = line.error.model_dump(exclude_none=True) if line.error else None
                response = {"status_code": line.status_code, "body": line.body}
                obj = {"custom_id": line.custom_id, "response": response, "error": error}
                yield index[batch_id], number, orjson.dumps(obj)

        raw = RawResults(files, lines(), OPENAI.line_shape, file_line_reader(OPENAI, files))
        # The database parses every merge it can (not structured output or extra columns).
        self.parse_in = "database"
        if self.parses_lines(OPENAI.line_shape) is not None:
            self.parse_in = "auto"
        return merge(self, raw, **kwargs)

    monkeypatch.setattr(ResultsWriter, "merge", raw_merge)


def round_per_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL loads results in rounds of about ROUND_BYTES; make every line a round of its own."""
    import psycopg._copy_base

    from airflow_batch_provider.warehouse.loaders import pg_copy as wd

    # psycopg hands its buffer over after every row, and every hand-over is a round.
    monkeypatch.setattr(psycopg._copy_base, "BUFFER_SIZE", 0)
    monkeypatch.setattr(wd, "ROUND_BYTES", 1)


def chat_line(custom_id: str, content: str, *, prompt: int = 10, completion: int = 5) -> ResultLine:
    raw = {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{custom_id}",
            "body": {
                "object": "chat.completion",
                "model": "gpt-test",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            },
        },
        "error": None,
    }
    return OPENAI.parse_result_line(raw, "output")


def error_line(custom_id: str, code: str, message: str = "boom") -> ResultLine:
    raw = {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return OPENAI.parse_result_line(raw, "error")


def http_error_line(custom_id: str, status: int = 500) -> ResultLine:
    raw = {
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "body": {"error": {"code": "server_error", "message": "upstream died"}},
        },
        "error": None,
    }
    return OPENAI.parse_result_line(raw, "error")


def embedding_line(custom_id: str, vector: list[float]) -> ResultLine:
    raw = {
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "body": {
                "object": "list",
                "model": "emb-test",
                "data": [{"object": "embedding", "index": 0, "embedding": vector}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            },
        },
    }
    return OPENAI.parse_result_line(raw, "output")


def with_batch(lines: list[ResultLine], batch_id: str = "batch_1") -> Iterator[tuple[ResultLine, str]]:
    for line in lines:
        yield line, batch_id


def keys_for(ids: list[tuple[str, Any]], shard: int = 0) -> list[dict[str, Any]]:
    return [{"custom_id": cid, "key": [k], "shard": shard} for cid, k in ids]


def table_rows(wh: Any, table: str, columns: str) -> list[tuple[Any, ...]]:
    return wh.rows(f"SELECT {columns} FROM {wh.quote(table)} ORDER BY 1")


def test_every_status_lands_once(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([("c1", 1), ("c2", 2), ("c3", 3), ("c4", 4), ("c5", 5), ("c6", 6)])
    rejects = [
        {
            "row": 7,
            "key": [7],
            "custom_id": None,
            "code": "too_long",
            "reason": "prompt over limit",
            "column": "text",
        },
        {
            "row": 8,
            "key": None,
            "custom_id": None,
            "code": "null_key",
            "reason": "key is null",
            "column": "id",
        },
    ]
    results = [
        chat_line("c1", "hello"),
        error_line("c2", "batch_expired"),
        error_line("c3", "batch_cancelled"),
        http_error_line("c4"),
        chat_line("zz-unknown", "stray"),
    ]
    report = writer.merge(
        with_batch(results), keys=keys, rejects=rejects, shards={0: ShardOutcome("batch_1")}
    )
    assert report.counts == {
        "succeeded": 1,
        "failed": 1,
        "expired": 1,
        "cancelled": 1,
        "missing": 2,
        "rejected": 1,
        "invalid_output": 0,
    }
    assert report.orphan_results == 1 and report.orphan_samples == ["zz-unknown"]
    assert report.unkeyed_rejects == 1
    assert report.prompt_tokens == 20 and report.completion_tokens == 10
    rows = table_rows(
        warehouse,
        "results",
        "id, custom_id, status, content, finish_reason, model, prompt_tokens, error_code, batch_id",
    )
    assert rows == [
        (1, "c1", "succeeded", "hello", "stop", "gpt-test", 10, None, "batch_1"),
        (2, "c2", "expired", None, None, None, None, "batch_expired", "batch_1"),
        (3, "c3", "cancelled", None, None, None, None, "batch_cancelled", "batch_1"),
        (4, "c4", "failed", None, None, None, None, "server_error", "batch_1"),
        (5, "c5", "missing", None, None, None, None, None, "batch_1"),
        (6, "c6", "missing", None, None, None, None, None, "batch_1"),
        (7, None, "rejected", None, None, None, None, "too_long", None),
    ]
    assert warehouse.rows(f"SELECT error_message FROM {warehouse.quote('results')} WHERE id = 7") == [
        ("prompt over limit (column text)",)
    ]


def test_rerun_upserts_without_duplicates(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([("c1", 1), ("c2", 2)])
    writer.merge(with_batch([chat_line("c1", "first")]), keys=keys)
    # The second run finds c2 too and a new answer for c1: rows are updated, never added.
    report = writer.merge(
        with_batch([chat_line("c1", "second"), chat_line("c2", "late")], "batch_2"), keys=keys
    )
    assert report.counts["succeeded"] == 2
    assert report.prompt_tokens == 20 and report.result_lines == 2  # this run's figures only
    assert table_rows(warehouse, "results", "id, content, batch_id") == [
        (1, "second", "batch_2"),
        (2, "late", "batch_2"),
    ]
    assert warehouse.rows(f"SELECT COUNT(*) FROM {warehouse.quote('results')}") == [(2,)]


def test_crash_mid_write_rolls_back(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([(f"c{i}", i) for i in range(50)])
    writer.merge(with_batch([chat_line(f"c{i}", "v1") for i in range(50)]), keys=keys)

    def exploding() -> Iterator[tuple[ResultLine, str]]:
        for i in range(50):
            if i == 30:
                raise RuntimeError("connection to the API dropped mid-stream")
            yield chat_line(f"c{i}", "v2"), "batch_2"

    with pytest.raises(RuntimeError, match="dropped"):
        writer.merge(exploding(), keys=keys)
    assert warehouse.rows(f"SELECT content, COUNT(*) FROM {warehouse.quote('results')} GROUP BY content") == [
        ("v1", 50)
    ]

    if warehouse.kind == "bigquery":
        # No transaction spans BigQuery's jobs: the MERGE, atomic on its own, has landed
        # (a re-run upserts the same rows); see databases/bigquery.py.
        return

    # A failure after the upsert statement ran (before commit) is rolled back too.
    def fail_in_retry(pairs: Iterator[tuple[int, str, list[Any]]]) -> None:
        raise RuntimeError("could not write the resubmission shard")

    with pytest.raises(RuntimeError, match="resubmission"):
        writer.merge(
            with_batch([chat_line(f"c{i}", "v3") for i in range(40)]), keys=keys, on_retry=fail_in_retry
        )
    assert warehouse.rows(f"SELECT content, COUNT(*) FROM {warehouse.quote('results')} GROUP BY content") == [
        ("v1", 50)
    ]


def test_crash_on_first_merge_leaves_no_table_rows(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "fresh", key_columns=[Column("id", "integer")])

    def exploding() -> Iterator[tuple[ResultLine, str]]:
        yield chat_line("c1", "x"), "b"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        writer.merge(exploding(), keys=keys_for([("c1", 1)]))
    # MySQL's, BigQuery's and Snowflake's CREATE TABLE commits by itself, so the table may exist; it
    # must be empty.
    if warehouse.kind in ("mysql", "bigquery", "snowflake"):
        assert warehouse.rows(f"SELECT COUNT(*) FROM {warehouse.quote('fresh')}") == [(0,)]
    else:
        assert (
            ResultsWriter(warehouse.hook, "fresh").dialect.probe_columns(
                warehouse.hook.get_conn(), "fresh", None
            )
            is None
        )


def test_awkward_identifiers(warehouse: Any) -> None:
    if warehouse.kind == "bigquery":
        pytest.skip("BigQuery refuses quotes in names, before any work (tests/warehouse/test_bigquery.py)")
    table = 'my "results" table'
    key_cols = [Column("select", "text"), Column('we"ird col', "integer")]
    writer = ResultsWriter(warehouse.hook, table, key_columns=key_cols)
    keys = [
        {"custom_id": "a", "key": ["x y", 1], "shard": 0},
        {"custom_id": "b", "key": ["x'y", 2], "shard": 0},
    ]
    report = writer.merge(with_batch([chat_line("a", "A"), chat_line("b", "B")]), keys=keys)
    assert report.counts["succeeded"] == 2
    q = warehouse.quote
    weird = q('we"ird col')
    rows = warehouse.rows(f"SELECT {q('select')}, {weird}, content FROM {q(table)} ORDER BY 2")
    assert rows == [("x y", 1, "A"), ("x'y", 2, "B")]
    writer.merge(with_batch([chat_line("a", "A2")]), keys=keys)
    assert warehouse.rows(f"SELECT COUNT(*) FROM {q(table)}") == [(2,)]


def test_without_manifest_custom_id_is_the_key(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "plain")
    lines = [
        chat_line("a", "1"),
        error_line("b", "rate_limit"),
        chat_line("a", "1-again"),
        error_line("c", "x"),
    ]
    report = writer.merge(with_batch(lines))
    assert report.counts["succeeded"] == 1 and report.counts["failed"] == 2
    assert report.duplicate_results == 1
    assert table_rows(warehouse, "plain", "custom_id, status, content") == [
        ("a", "succeeded", "1-again"),
        ("b", "failed", None),
        ("c", "failed", None),
    ]
    writer.merge(with_batch(lines))
    assert warehouse.rows(f"SELECT COUNT(*) FROM {warehouse.quote('plain')}") == [(3,)]


def test_success_wins_over_an_earlier_error_for_the_same_key(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    lines = [chat_line("c1", "ok"), error_line("c1", "server_error")]
    report = writer.merge(with_batch(lines), keys=keys_for([("c1", 1)]))
    assert report.counts["succeeded"] == 1 and report.duplicate_results == 1
    assert table_rows(warehouse, "results", "status, content") == [("succeeded", "ok")]


def test_embeddings_land_as_json(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "emb", key_columns=[Column("id", "integer")])
    writer.merge(with_batch([embedding_line("e1", [0.25, -1.5, 3.0])]), keys=keys_for([("e1", 1)]))
    (value,) = warehouse.rows(f"SELECT embedding FROM {warehouse.quote('emb')}")[0]
    parsed = value if isinstance(value, list) else orjson.loads(value)
    assert parsed == [0.25, -1.5, 3.0]
    assert warehouse.rows(f"SELECT total_tokens, model FROM {warehouse.quote('emb')}") == [(3, "emb-test")]


def test_structured_output_valid_and_invalid(warehouse: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "label": {"type": "string"},
            "score": {"type": "number"},
            "urgent": {"type": "boolean"},
            "count": {"type": "integer"},
        },
        "required": ["label", "score"],
    }
    mapper = ResultMapper(output_schema=OutputSchema(schema), extra_columns={"req_model": "$.model"})
    writer = ResultsWriter(warehouse.hook, "structured", key_columns=[Column("id", "integer")], mapper=mapper)
    lines = [
        chat_line("s1", '{"label": "bug", "score": 0.9, "urgent": true, "count": 3}'),
        chat_line("s2", '{"label": "bug"}'),
        chat_line("s3", "not json at all"),
    ]
    report = writer.merge(with_batch(lines), keys=keys_for([("s1", 1), ("s2", 2), ("s3", 3)]))
    assert report.counts["succeeded"] == 1 and report.counts["invalid_output"] == 2
    rows = table_rows(warehouse, "structured", "id, status, label, score, urgent, count, req_model")
    assert (
        rows[0][:4] == (1, "succeeded", "bug", 0.9)
        and bool(rows[0][4]) is True
        and rows[0][5:] == (3, "gpt-test")
    )
    assert rows[1][:3] == (2, "invalid_output", None)
    messages = dict(
        warehouse.rows(f"SELECT id, error_message FROM {warehouse.quote('structured')} WHERE id > 1")
    )
    assert "score" in messages[2] and "not valid JSON" in messages[3]


def test_existing_table_missing_column_is_named(warehouse: Any) -> None:
    warehouse.run(
        f"CREATE TABLE {warehouse.quote('old')} (id INTEGER PRIMARY KEY, custom_id TEXT, status TEXT)"
    )
    writer = ResultsWriter(warehouse.hook, "old", key_columns=[Column("id", "integer")])
    with pytest.raises(WarehouseSchemaError, match="'content'"):
        writer.merge(with_batch([chat_line("c1", "x")]), keys=keys_for([("c1", 1)]))


def test_shard_of_an_expired_batch_marks_absent_keys_expired(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([("a", 1), ("b", 2)], shard=0) + keys_for([("c", 3)], shard=1)
    report = writer.merge(
        with_batch([chat_line("a", "done")]),
        keys=keys,
        shards={0: ShardOutcome("batch_a", "expired"), 1: ShardOutcome("batch_b", "missing")},
    )
    assert report.counts["succeeded"] == 1 and report.counts["expired"] == 1 and report.counts["missing"] == 1
    assert table_rows(warehouse, "results", "id, status, batch_id") == [
        (1, "succeeded", "batch_1"),
        (2, "expired", "batch_a"),
        (3, "missing", "batch_b"),
    ]


def test_retry_callback_gets_retryable_keys_in_shard_order(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([("b", 2), ("a", 1)], shard=0) + keys_for([("c", 3), ("d", 4)], shard=1)
    seen: list[tuple[int, str, list[Any]]] = []
    writer.merge(
        with_batch([chat_line("a", "ok"), error_line("c", "server_error")]),
        keys=keys,
        on_retry=lambda pairs: seen.extend(r[:3] for r in pairs),
    )
    assert seen == [(0, "b", [2]), (1, "c", [3]), (1, "d", [4])]


def write_keys(path: Any, records: list[Any]) -> Any:
    with open(path, "wb") as out:
        for record in records:
            out.write(record if isinstance(record, bytes) else orjson.dumps(record))
            out.write(b"\n")
    return path


def test_keys_file_is_loaded_with_typed_keys(warehouse: Any, tmp_path: Any) -> None:
    key_cols = [Column("region", "text"), Column("day", "date"), Column("attrs", "json")]
    path = write_keys(
        tmp_path / "keys.jsonl",
        [
            {"custom_id": "a", "key": ['eu\\west "1"', "2026-01-02", {"x": [1, 2]}], "shard": 0},
            b"",  # a blank line is skipped
            {"custom_id": "b", "key": ["us", "2026-01-03", {"x": []}], "shard": 0, "future_field": 1},
        ],
    )
    writer = ResultsWriter(warehouse.hook, "typed", key_columns=key_cols)
    report = writer.merge(with_batch([chat_line("a", "A")]), keys=path)
    assert report.counts["succeeded"] == 1 and report.counts["missing"] == 1
    rows = warehouse.rows(
        f"SELECT region, day, attrs, status FROM {warehouse.quote('typed')} ORDER BY custom_id"
    )
    assert rows[0][0] == 'eu\\west "1"' and str(rows[0][1]).startswith("2026-01-02")
    attrs = rows[0][2] if isinstance(rows[0][2], dict) else orjson.loads(rows[0][2])
    assert attrs == {"x": [1, 2]} and rows[0][3] == "succeeded" and rows[1][3] == "missing"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"custom_id": "b", "key": [1, 2], "shard": 0}, "line 2: custom_id 'b': key has 2 value"),
        ({"custom_id": "b", "key": [None], "shard": 0}, "line 2: custom_id 'b': a key value is null"),
        ({"key": [2], "shard": 0}, "line 2: no custom_id"),
        (b"[1, 2]", "keys.jsonl line 2"),  # not an object: no custom_id, or said so
    ],
)
def test_bad_keys_line_is_named(warehouse: Any, tmp_path: Any, bad: Any, message: str) -> None:
    path = write_keys(tmp_path / "keys.jsonl", [{"custom_id": "a", "key": [1], "shard": 0}, bad])
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    with pytest.raises(WarehouseSchemaError, match=message):
        writer.merge(with_batch([chat_line("a", "A")]), keys=path)


def test_keys_file_line_numbers_count_blank_lines(warehouse: Any, tmp_path: Any) -> None:
    """A bad line is named by its line in the file, blank lines included."""
    path = write_keys(
        tmp_path / "keys.jsonl",
        [{"custom_id": "a", "key": [1], "shard": 0}, b"", b"  ", {"custom_id": "b", "key": [], "shard": 0}],
    )
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    with pytest.raises(WarehouseSchemaError, match="keys.jsonl line 4: custom_id 'b': key has 0 value"):
        writer.merge(with_batch([chat_line("a", "A")]), keys=path)


def test_awkward_text_lands_exactly(warehouse: Any) -> None:
    """Quotes, backslashes, control characters, non-ASCII and JSON-looking text survive staging."""
    texts = [
        'say "hi"\\n',
        "tab\there\nnew line\r\n",
        "ünïcödé 😀",
        '{"a": [1, 2]}',
        "null",
        "",
        "\\N",
        "[1]",
    ]
    writer = ResultsWriter(warehouse.hook, "awkward", key_columns=[Column("id", "integer")])
    keys = keys_for([(f"c{i}", i) for i in range(len(texts))])
    writer.merge(with_batch([chat_line(f"c{i}", t) for i, t in enumerate(texts)]), keys=keys)
    assert [r[0] for r in table_rows(warehouse, "awkward", "id, content")] == list(range(len(texts)))
    assert [r[1] for r in table_rows(warehouse, "awkward", "id, content")] == texts


def test_existing_table_without_a_unique_key_is_refused(warehouse: Any) -> None:
    first = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    first.merge(with_batch([chat_line("c1", "x")]), keys=keys_for([("c1", 1)]))
    # The same columns plus one of its own, without a primary key: an upsert, which keeps that
    # column's values, could not find the row to update.
    q = warehouse.quote
    text = {"mysql": "VARCHAR(255)", "bigquery": "STRING"}.get(warehouse.kind, "TEXT")
    warehouse.run(f"CREATE TABLE {q('copy')} AS SELECT * FROM {q('results')}")
    warehouse.run(f"ALTER TABLE {q('copy')} ADD COLUMN {q('note')} {text}")
    writer = ResultsWriter(warehouse.hook, "copy", key_columns=[Column("id", "integer")])
    if warehouse.kind in ("duckdb", "bigquery", "snowflake"):
        # DuckDB and BigQuery tables need no key (see keyless_tables), and Snowflake never enforces
        # one (upsert_by_update): rows are updated by key, the new keys inserted, and the table's
        # own column keeps its values.
        warehouse.run(f"UPDATE {q('copy')} SET {q('note')} = 'seen'")
        for answer in ("y", "z"):
            writer.merge(
                with_batch([chat_line("c1", answer), chat_line("c2", answer)]),
                keys=keys_for([("c1", 1), ("c2", 2)]),
            )
        assert table_rows(warehouse, "copy", "id, content, note") == [(1, "z", "seen"), (2, "z", None)]
        return
    with pytest.raises(WarehouseSchemaError, match=r"no primary key or unique index on exactly \(id\)"):
        writer.merge(with_batch([chat_line("c1", "y")]), keys=keys_for([("c1", 1)]))


def test_duckdb_tables_are_replaced_by_key_without_a_primary_key(duckdb_warehouse: Any) -> None:
    """A DuckDB table the merge creates has no primary key (its index would live in memory and
    grow with the table); merges replace its rows by key, so re-runs never duplicate a row. A
    table created with a primary key keeps it and merges into it the same way."""
    wh = duckdb_warehouse
    writer = ResultsWriter(wh.hook, "plain", key_columns=[Column("id", "integer")])
    keys = keys_for([("c1", 1), ("c2", 2)])
    rejects = [{"custom_id": "r9", "key": [9], "code": "too_long", "reason": "long"}]
    for answer in ("x", "y", "z"):
        writer.merge(with_batch([chat_line("c1", answer)]), keys=keys, rejects=rejects)
    unique = (
        "SELECT COUNT(*) FROM duckdb_constraints() WHERE table_name = ? AND constraint_type = 'PRIMARY KEY'"
    )
    assert wh.rows(unique, ["plain"]) == [(0,)]
    assert table_rows(wh, "plain", "id, status, content") == [
        (1, "succeeded", "z"),
        (2, "missing", None),
        (9, "rejected", None),
    ]
    first = ResultsWriter(wh.hook, "keyed", key_columns=[Column("id", "integer")])
    wh.run(first._create_sql(primary_key=True))
    for answer in ("x", "y"):
        first.merge(with_batch([chat_line("c1", answer)]), keys=keys, rejects=rejects)
    assert table_rows(wh, "keyed", "id, content") == [(1, "y"), (2, None), (9, None)]
    assert wh.rows(unique, ["keyed"]) == [(1,)]


def test_existing_table_with_the_key_as_unique_index_is_accepted(warehouse: Any) -> None:
    q = warehouse.quote
    text = "VARCHAR(255)" if warehouse.kind == "mysql" else "TEXT"
    warehouse.run(
        f"CREATE TABLE {q('mine')} (id BIGINT NOT NULL, custom_id {text}, status {text}, content {text}, "
        f"embedding {text}, finish_reason {text}, model {text}, prompt_tokens BIGINT, "
        f"completion_tokens BIGINT, total_tokens BIGINT, error_code {text}, error_message {text}, "
        f"batch_id {text}, merged_at {text}, note {text})"
    )
    if warehouse.kind == "snowflake":
        # No indexes on Snowflake: a unique constraint, declared (never enforced).
        warehouse.run(f"ALTER TABLE {q('mine')} ADD CONSTRAINT {q('mine_id')} UNIQUE (id)")
    else:
        warehouse.run(f"CREATE UNIQUE INDEX {q('mine_id')} ON {q('mine')} (id)")
    writer = ResultsWriter(warehouse.hook, "mine", key_columns=[Column("id", "integer")])
    writer.merge(with_batch([chat_line("c1", "x")]), keys=keys_for([("c1", 1)]))
    writer.merge(with_batch([chat_line("c1", "y")]), keys=keys_for([("c1", 1)]))
    assert warehouse.rows(f"SELECT id, content, note FROM {q('mine')}") == [(1, "y", None)]


def test_postgres_through_psycopg2(pg_warehouse: Any) -> None:
    """The COPY path also works on a psycopg2 connection (older PostgresHook installs)."""
    psycopg2 = pytest.importorskip("psycopg2")
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    class Psycopg2Hook(PostgresHook):
        def get_conn(self) -> Any:
            return psycopg2.connect(
                host="127.0.0.1",
                user="postgres",
                dbname="test",
                options=f"-c search_path={pg_warehouse.schema}",
            )

    hook = Psycopg2Hook(postgres_conn_id=pg_warehouse.conn_id)
    writer = ResultsWriter(hook, "p2", key_columns=[Column("id", "integer")])
    lines = [chat_line("a", "tab\there\nnew line \\ backslash"), error_line("b", "batch_expired")]
    seen: list[tuple[int, str, list[Any]]] = []
    report = writer.merge(
        with_batch(lines),
        keys=keys_for([("a", 1), ("b", 2), ("c", 3)]),
        on_retry=lambda p: seen.extend(r[:3] for r in p),
    )
    assert report.counts["succeeded"] == 1 and report.counts["expired"] == 1 and report.counts["missing"] == 1
    assert pg_warehouse.rows("SELECT content FROM p2 WHERE id = 1") == [("tab\there\nnew line \\ backslash",)]
    assert seen == [(0, "b", [2]), (0, "c", [3])]


def test_nul_in_an_answer_lands_on_postgres_as_a_replacement_character(pg_warehouse: Any) -> None:
    """PostgreSQL text cannot hold NUL (JSON can, as \\u0000): the answer lands, the run is not aborted."""
    writer = ResultsWriter(pg_warehouse.hook, "nul", key_columns=[Column("id", "integer")])
    report = writer.merge(
        with_batch([chat_line("a", "before\x00after"), chat_line("b", "clean")]),
        keys=keys_for([("a", 1), ("b", 2)]),
    )
    assert report.counts["succeeded"] == 2
    assert pg_warehouse.rows("SELECT id, content FROM nul ORDER BY id") == [
        (1, "before\ufffdafter"),
        (2, "clean"),
    ]


def test_session_settings_apply_to_the_merge_only(pg_warehouse: Any, duckdb_warehouse: Any) -> None:
    for wh, settings in ((pg_warehouse, {"work_mem": "8MB"}), (duckdb_warehouse, {"memory_limit": "200MB"})):
        writer = ResultsWriter(wh.hook, "s", key_columns=[Column("id", "integer")], session_settings=settings)
        assert (
            writer.merge(with_batch([chat_line("a", "x")]), keys=keys_for([("a", 1)])).counts["succeeded"]
            == 1
        )
    with pytest.raises(Exception, match="invalid setting name"):
        ResultsWriter(pg_warehouse.hook, "s", session_settings={"work_mem; DROP TABLE s": "1"}).merge(
            with_batch([chat_line("a", "x")])
        )
    assert pg_warehouse.rows("SELECT COUNT(*) FROM s") == [(1,)]


# DuckDB is not here: one process owns a DuckDB file, so there is no second writer to race.
@pytest.mark.parametrize("kind", ["pg_warehouse", "sqlite_warehouse", "mysql_warehouse"])
def test_concurrent_first_merges_create_the_table_once(kind: str, request: pytest.FixtureRequest) -> None:
    """Merges racing into a table nobody has created yet: one creates it, the others upsert."""
    from concurrent.futures import ThreadPoolExecutor

    warehouse = request.getfixturevalue(kind)

    def one(n: int) -> MergeReport:
        writer = ResultsWriter(warehouse.hook, "raced", key_columns=[Column("id", "integer")])
        ids = [(f"c{n}-{i}", n * 100 + i) for i in range(20)]
        return writer.merge(with_batch([chat_line(cid, "x") for cid, _ in ids]), keys=keys_for(ids))

    with ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(one, range(4)))
    assert [r.counts["succeeded"] for r in reports] == [20] * 4
    assert warehouse.rows(f"SELECT COUNT(*), COUNT(DISTINCT id) FROM {warehouse.quote('raced')}") == [
        (80, 80)
    ]


@pytest.mark.parametrize("conn_type", ["redshift", "databricks", "mssql"])
def test_unsupported_results_database_is_refused_before_any_work(conn_type: str) -> None:
    """Their upsert syntax differs; the merge says so up front instead of failing after staging."""
    from airflow.providers.common.sql.hooks.sql import DbApiHook

    from airflow_batch_provider.exceptions import ConfigurationError
    from airflow_batch_provider.warehouse.databases import get_sql_dialect as get_warehouse_dialect

    class OtherHook(DbApiHook):
        conn_name_attr = "other_conn_id"
        default_conn_name = "other_default"

        def get_conn(self) -> Any:
            raise AssertionError("no connection may be opened")

    OtherHook.conn_type = conn_type
    with pytest.raises(ConfigurationError, match=f"'{conn_type}' connection is not supported yet"):
        get_warehouse_dialect(OtherHook())


# ---- PostgreSQL: keys parsed by the database while Python formats the results -------------------
def test_postgres_keys_load_overlaps_results_and_every_row_lands(pg_warehouse: Any, tmp_path: Any) -> None:
    """Thousands of rows (many spool chunks) with awkward text; the keys file is loaded alongside."""
    n = 6000
    path = write_keys(
        tmp_path / "keys.jsonl", [{"custom_id": f"c{i}", "key": [i], "shard": 0} for i in range(n)]
    )
    lines = [
        chat_line(f"c{i}", f"row {i}: tab\there\nnewline \\ backslash é 漢 \x00 end")
        if i % 7
        else error_line(f"c{i}", "x")
        for i in range(n - 10)
    ]
    writer = ResultsWriter(pg_warehouse.hook, "overlap", key_columns=[Column("id", "integer")])
    report = writer.merge(with_batch(lines), keys=path)
    failed = len([i for i in range(n - 10) if i % 7 == 0])
    assert report.result_lines == n - 10
    assert report.counts["succeeded"] == n - 10 - failed
    assert report.counts["failed"] == failed and report.counts["missing"] == 10
    assert pg_warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM overlap") == [(n, n)]
    assert pg_warehouse.rows("SELECT content FROM overlap WHERE id = 4001") == [
        ("row 4001: tab\there\nnewline \\ backslash é 漢 \ufffd end",)
    ]


def test_postgres_results_failing_while_keys_load_rolls_back(pg_warehouse: Any, tmp_path: Any) -> None:
    path = write_keys(
        tmp_path / "keys.jsonl", [{"custom_id": f"c{i}", "key": [i], "shard": 0} for i in range(3000)]
    )
    writer = ResultsWriter(pg_warehouse.hook, "overlap_fail", key_columns=[Column("id", "integer")])
    writer.merge(with_batch([chat_line(f"c{i}", "v1") for i in range(3000)]), keys=path)

    def exploding() -> Iterator[tuple[ResultLine, str]]:
        for i in range(3000):
            if i == 2500:
                raise RuntimeError("download dropped")
            yield chat_line(f"c{i}", "v2"), "b2"

    with pytest.raises(RuntimeError, match="download dropped"):
        writer.merge(exploding(), keys=path)
    assert pg_warehouse.rows("SELECT content, COUNT(*) FROM overlap_fail GROUP BY content") == [("v1", 3000)]


def test_postgres_bad_keys_file_stops_the_results_stream(pg_warehouse: Any, tmp_path: Any) -> None:
    """A keys error found by the database ends the merge with that error, not a hang or a COPY error."""
    records: list[Any] = [{"custom_id": f"c{i}", "key": [i], "shard": 0} for i in range(100)]
    records[41] = {"custom_id": "c41", "key": [41, 42], "shard": 0}
    path = write_keys(tmp_path / "keys.jsonl", records)
    writer = ResultsWriter(pg_warehouse.hook, "bad_keys", key_columns=[Column("id", "integer")])
    lines = (chat_line(f"c{i % 100}", "x" * 200) for i in range(200_000))
    with pytest.raises(WarehouseSchemaError, match="keys.jsonl line 42: custom_id 'c41': key has 2 value"):
        writer.merge(((line, "b") for line in lines), keys=path)
    assert (
        ResultsWriter(pg_warehouse.hook, "bad_keys").dialect.probe_columns(
            pg_warehouse.hook.get_conn(), "bad_keys", None
        )
        is None
    )


def test_postgres_non_utf8_connection_loads_serially(pg_warehouse: Any, tmp_path: Any) -> None:
    """The spool is formatted as UTF-8; a connection in another encoding takes the plain COPY path."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    class Latin1Hook(PostgresHook):
        def get_conn(self) -> Any:
            conn = super().get_conn()
            conn.execute("SET client_encoding TO 'LATIN1'")
            conn.commit()
            return conn

    hook = Latin1Hook(postgres_conn_id=pg_warehouse.conn_id)
    from airflow_batch_provider.warehouse.loaders import pg_copy as wd

    assert not wd._utf8(hook.get_conn()) and wd._utf8(pg_warehouse.hook.get_conn())
    path = write_keys(tmp_path / "keys.jsonl", [{"custom_id": "a", "key": [1], "shard": 0}])
    writer = ResultsWriter(hook, "latin", key_columns=[Column("id", "integer")])
    assert writer.merge(with_batch([chat_line("a", "café")]), keys=path).counts["succeeded"] == 1
    assert pg_warehouse.rows("SELECT content FROM latin") == [("café",)]


def test_spool_hands_every_byte_to_a_concurrent_reader_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import threading

    from airflow_batch_provider.warehouse.loaders import pg_copy as wd

    # Short writes (as on a full disk) are completed, never counted as written.
    real_write = os.write
    monkeypatch.setattr(wd.os, "write", lambda fd, data: real_write(fd, bytes(data[:300])))
    spool = wd.Spool(segment=10_000)  # many segment files, each freed once read
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.extend(c for f in spool.files() for c in f))
    reader.start()
    expected = b"".join(f"{i:06d}\n".encode() for i in range(20_000))
    for start in range(0, len(expected), 777):
        spool.write(expected[start : start + 777])
    spool.finish()
    reader.join(10)
    assert not reader.is_alive() and b"".join(received) == expected
    # Every segment was deleted once read.
    assert spool._files == []
    spool.close()


def test_spool_files_are_read_one_by_one_as_rounds() -> None:
    """A reader taking one file at a time gets every byte in order, each file holding whole writes."""
    import threading

    from airflow_batch_provider.warehouse.loaders import pg_copy as wd

    spool = wd.Spool(segment=5_000)
    rounds: list[bytes] = []
    reader = threading.Thread(target=lambda: rounds.extend(b"".join(f) for f in spool.files()))
    reader.start()
    writes = [f"{i:06d}\n".encode() * 10 for i in range(2_000)]  # 70-byte "rows" of 10 lines
    for data in writes:
        spool.write(data)
    spool.finish()
    reader.join(10)
    assert not reader.is_alive()
    assert b"".join(rounds) == b"".join(writes)
    # A file is closed to writes once it reaches the segment size: 5,000 bytes rounded up to
    # whole writes, so every round but the last is 72 writes.
    assert [len(r) for r in rounds[:-1]] == [72 * 70] * (len(rounds) - 1)
    assert len(rounds) == -(-len(writes) // 72)
    assert spool._files == []
    spool.close()


def test_spool_failure_on_either_side_stops_the_other() -> None:
    import threading

    from airflow_batch_provider.warehouse.loaders.pg_copy import Spool, SpoolAborted

    spool = Spool(segment=1000)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for file in spool.files():
                list(file)
        except SpoolAborted as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    spool.write(b"partial")
    spool.finish(RuntimeError("the results stream broke"))
    reader.join(10)
    assert len(errors) == 1 and spool.first_failure == "writer"
    spool.close()

    spool = Spool(segment=1000)
    spool.fail("reader")
    with pytest.raises(SpoolAborted):
        spool.write(b"more")
    spool.fail("writer")
    assert spool.first_failure == "reader"
    spool.close()


def test_postgres_results_failing_during_a_long_keys_load_cancel_it(pg_warehouse: Any, tmp_path: Any) -> None:
    """The results break while PostgreSQL is still parsing the keys: that statement is cancelled,
    the results' error is raised, and nothing is written."""
    n = 300_000
    path = write_keys(
        tmp_path / "keys.jsonl", [{"custom_id": f"c{i}", "key": [i], "shard": 0} for i in range(n)]
    )

    def broken() -> Iterator[tuple[ResultLine, str]]:
        yield chat_line("c0", "x"), "b"
        yield chat_line("c1", "x"), "b"
        raise RuntimeError("the output file download failed")

    writer = ResultsWriter(pg_warehouse.hook, "cancelled", key_columns=[Column("id", "integer")])
    with pytest.raises(RuntimeError, match="download failed"):
        writer.merge(broken(), keys=path)
    assert writer.dialect.probe_columns(pg_warehouse.hook.get_conn(), "cancelled", None) is None


# ---- DuckDB: a re-merge replaces rows instead of updating them in memory -------------------------
def test_duckdb_remerge_of_many_rows_fits_a_small_memory_limit(duckdb_warehouse: Any) -> None:
    """DuckDB's ON CONFLICT DO UPDATE keeps every updated row's old version in memory; the merge
    deletes the keys it writes and inserts them instead, so a re-merge needs no more than the first."""
    # At 96MB with one thread, ON CONFLICT DO UPDATE of these 100k rows runs out of memory;
    # so did delete + insert at 64MB while the table had a primary key (its index in memory).
    n = 100_000
    keys = keys_for([(f"c{i}", i) for i in range(n)])
    writer = ResultsWriter(
        duckdb_warehouse.hook,
        "big",
        key_columns=[Column("id", "integer")],
        session_settings={"memory_limit": "64MB", "threads": "1"},
    )
    for answer in ("first answer", "second answer"):
        lines = (chat_line(f"c{i}", f"{answer} {i} " + "x" * 100) for i in range(n))
        report = writer.merge(with_batch(lines), keys=keys)
        assert report.counts["succeeded"] == n
    assert duckdb_warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM big") == [(n, n)]
    assert duckdb_warehouse.rows("SELECT content FROM big WHERE id = 7") == [
        ("second answer 7 " + "x" * 100,)
    ]


def test_duckdb_first_merge_fits_64mb(duckdb_warehouse: Any) -> None:
    """Keys are numbered outside SQL and rows read as text lists: a first merge of many rows
    runs at memory_limit 64MB (it needed 96MB when keys were numbered by a window function
    and rows extracted from a JSON column)."""
    n = 150_000
    writer = ResultsWriter(
        duckdb_warehouse.hook,
        "small",
        key_columns=[Column("id", "integer")],
        session_settings={"memory_limit": "64MB", "threads": "1"},
    )
    lines = (chat_line(f"c{i}", f"answer {i} " + "x" * 100) for i in range(n))
    report = writer.merge(with_batch(lines), keys=keys_for([(f"c{i}", i) for i in range(n)]))
    assert report.counts["succeeded"] == n
    assert duckdb_warehouse.rows("SELECT COUNT(*), MAX(content) FROM small WHERE id = 9") == [
        (1, "answer 9 " + "x" * 100)
    ]


def test_duckdb_table_with_columns_of_its_own_keeps_their_values_on_remerge(duckdb_warehouse: Any) -> None:
    writer = ResultsWriter(duckdb_warehouse.hook, "reviewed", key_columns=[Column("id", "integer")])
    keys = keys_for([("a", 1), ("b", 2)])
    writer.merge(with_batch([chat_line("a", "v1"), chat_line("b", "v1")]), keys=keys)
    duckdb_warehouse.run("ALTER TABLE reviewed ADD COLUMN reviewer VARCHAR")
    duckdb_warehouse.run("UPDATE reviewed SET reviewer = 'ana' WHERE id = 1")
    writer.merge(with_batch([chat_line("a", "v2"), chat_line("b", "v2")]), keys=keys)
    assert duckdb_warehouse.rows("SELECT id, content, reviewer FROM reviewed ORDER BY id") == [
        (1, "v2", "ana"),
        (2, "v2", None),
    ]


def test_remerge_with_multi_column_typed_keys_replaces_each_row(warehouse: Any, tmp_path: Any) -> None:
    """Text, date and JSON key columns together; a re-merge rewrites every row once (DuckDB deletes
    and re-inserts them, the others update in place)."""
    key_cols = [Column("region", "text"), Column("day", "date"), Column("attrs", "json")]
    records = [
        {
            "custom_id": f"c{i}",
            "key": [f"r{i % 3}", f"2026-01-0{1 + i % 5}", {"n": i, "tags": ["a"]}],
            "shard": 0,
        }
        for i in range(30)
    ]
    path = write_keys(tmp_path / "keys.jsonl", records)
    writer = ResultsWriter(warehouse.hook, "multi", key_columns=key_cols)
    for answer in ("v1", "v2"):
        report = writer.merge(with_batch([chat_line(f"c{i}", f"{answer}-{i}") for i in range(25)]), keys=path)
        assert report.counts["succeeded"] == 25 and report.counts["missing"] == 5
    rows = warehouse.rows(
        f"SELECT custom_id, content, status FROM {warehouse.quote('multi')} ORDER BY custom_id"
    )
    assert len(rows) == 30
    assert {r[0]: r[1] for r in rows}["c7"] == "v2-7"
    assert sorted(r[2] for r in rows).count("missing") == 5


def test_duckdb_version_gates_the_replace_upsert() -> None:
    from airflow_batch_provider.warehouse.databases.duckdb import version_tuple

    assert version_tuple("1.1.3") < (1, 2) <= version_tuple("1.2.0") < version_tuple("2.0.1")
    assert version_tuple("1.2.0.dev123") == (1, 2, 0)


# ---- PostgreSQL: results written in rounds while they load ------------------------------------
def spy_rounds(monkeypatch: pytest.MonkeyPatch, writer: ResultsWriter, table: str) -> list[int]:
    """Rows in ``table`` after each round, read on the loading thread inside the merge."""
    after: list[int] = []
    real = writer._write_round

    def spy(conn: Any, keyed: Any, part: str) -> None:
        real(conn, keyed, part)
        cur = conn.cursor()
        cur.execute(f'SELECT COUNT(*) FROM "{table}"')
        after.append(cur.fetchone()[0])
        cur.close()

    monkeypatch.setattr(writer, "_write_round", spy)
    return after


def test_postgres_rounds_write_results_while_they_load(
    pg_warehouse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round writes its keys as it lands; the keys without a result, orphans, absent
    statuses of an expired batch and rejects are settled after the last round."""
    round_per_line(monkeypatch)
    writer = ResultsWriter(pg_warehouse.hook, "rounds", key_columns=[Column("id", "integer")])
    after = spy_rounds(monkeypatch, writer, "rounds")
    keys = keys_for([(f"c{i}", i) for i in range(17)], shard=0) + keys_for(
        [(f"c{i}", i) for i in range(17, 20)], shard=1
    )
    lines = [chat_line(f"c{i}", f"answer {i}") for i in range(12)]
    lines += [error_line("c12", "server_error"), http_error_line("c13"), error_line("c14", "batch_expired")]
    lines.append(chat_line("stray", "not ours"))
    report = writer.merge(
        with_batch(lines),
        keys=keys,
        rejects=[{"custom_id": "r1", "key": [99], "code": "too_long", "reason": "over the limit"}],
        shards={0: ShardOutcome("batch_0"), 1: ShardOutcome("batch_1", absent_status="expired")},
    )
    # One round per line, each writing its key (the stray line writes nothing) during the load.
    assert len(after) == len(lines) == 16
    assert after == [*range(1, 16), 15]
    assert report.counts == {
        "succeeded": 12,
        "failed": 2,
        "expired": 4,
        "cancelled": 0,
        "missing": 2,
        "rejected": 1,
        "invalid_output": 0,
    }
    assert report.orphan_results == 1 and report.orphan_samples == ["stray"]
    assert report.duplicate_results == 0 and report.rows_written == 21
    rows = dict(pg_warehouse.rows("SELECT id, status FROM rounds"))
    assert len(rows) == 21
    assert [rows[i] for i in (0, 12, 13, 14, 15, 16, 17, 18, 19, 99)] == [
        "succeeded",
        "failed",
        "failed",
        "expired",
        "missing",
        "missing",
        "expired",
        "expired",
        "expired",
        "rejected",
    ]
    assert pg_warehouse.rows("SELECT batch_id FROM rounds WHERE id = 17") == [("batch_1",)]


@pytest.mark.parametrize("existing", [False, True], ids=["new_table", "existing_table"])
def test_postgres_custom_id_repeated_across_rounds_is_ranked(
    pg_warehouse: Any, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """A custom_id whose lines land in different rounds: a success wins over an error in either
    order, counted once, whether the table is new (rows of the rounds are dropped) or not (the
    ranked upsert rewrites them)."""
    writer = ResultsWriter(pg_warehouse.hook, "ranked", key_columns=[Column("id", "integer")])
    keys = keys_for([(f"c{i}", i) for i in range(5)])
    if existing:
        writer.merge(with_batch([chat_line(f"c{i}", "v1") for i in range(5)]), keys=keys)
    round_per_line(monkeypatch)
    after = spy_rounds(monkeypatch, writer, "ranked")
    lines = [
        chat_line("c1", "v2"),
        error_line("c3", "server_error"),
        error_line("c1", "server_error"),
        chat_line("c3", "fixed"),
        chat_line("c4", "v2"),
    ]
    report = writer.merge(with_batch(lines, "b2"), keys=keys)
    assert len(after) == 5
    assert report.counts["succeeded"] == 3 and report.counts["missing"] == 2
    assert report.duplicate_results == 2 and report.orphan_results == 0 and report.rows_written == 5
    assert table_rows(pg_warehouse, "ranked", "id, status, content") == [
        (0, "missing", None),
        (1, "succeeded", "v2"),
        (2, "missing", None),
        (3, "succeeded", "fixed"),
        (4, "succeeded", "v2"),
    ]


@pytest.mark.parametrize("existing", [False, True], ids=["new_table", "existing_table"])
def test_postgres_two_custom_ids_with_one_key_are_named(
    pg_warehouse: Any, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """A manifest no build writes (two lines, one key) fails by line instead of one row taking
    whichever line's round came last."""
    writer = ResultsWriter(pg_warehouse.hook, "twice", key_columns=[Column("id", "integer")])
    if existing:
        writer.merge(with_batch([chat_line("c0", "v1")]), keys=keys_for([("c0", 0)]))
    round_per_line(monkeypatch)
    keys = keys_for([("c0", 0), ("c1", 1), ("c2", 1)])
    with pytest.raises(WarehouseSchemaError, match="keys.jsonl lines 2 and 3 have the same key"):
        writer.merge(with_batch([chat_line("c1", "a"), chat_line("c2", "b")]), keys=keys)
    # Rolled back: the first merge's row, or no table at all.
    assert pg_warehouse.rows("SELECT to_regclass('twice') IS NOT NULL") == [(existing,)]
    if existing:
        assert table_rows(pg_warehouse, "twice", "id, content") == [(0, "v1")]


def test_postgres_round_failing_mid_load_rolls_back(
    pg_warehouse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round the database refuses (here the table's own CHECK) ends the merge with that error
    and leaves the table as it was, rounds before it included."""
    from airflow_batch_provider.warehouse.loaders import pg_copy as wd

    writer = ResultsWriter(pg_warehouse.hook, "checked", key_columns=[Column("id", "integer")])
    keys = keys_for([(f"c{i}", i) for i in range(3000)])
    writer.merge(with_batch([chat_line(f"c{i}", "v1") for i in range(3000)]), keys=keys)
    pg_warehouse.run("ALTER TABLE checked ADD CONSTRAINT polite CHECK (content IS DISTINCT FROM 'rude')")
    monkeypatch.setattr(wd, "ROUND_BYTES", 64 << 10)  # a round per psycopg buffer or two
    after = spy_rounds(monkeypatch, writer, "checked")
    lines = [chat_line(f"c{i}", "rude" if i == 2500 else "v2") for i in range(3000)]
    with pytest.raises(Exception, match="polite"):
        writer.merge(with_batch(lines, "b2"), keys=keys)
    assert len(after) >= 2  # rounds were written before the one that failed
    assert pg_warehouse.rows("SELECT content, COUNT(*) FROM checked GROUP BY content") == [("v1", 3000)]


@pytest.mark.parametrize("kind", ["postgres", "duckdb"])
@pytest.mark.parametrize("existing", [False, True], ids=["new_table", "existing_table"])
def test_one_key_on_two_lines_is_named_where_no_constraint_would(
    kind: str, existing: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON keys compare as JSON (member order aside); a repeated custom_id on top of the
    repeated key still gets the lines named, not a bare constraint error; DuckDB tables the
    merge creates have no key, so the check is the merge's own."""
    wh = request.getfixturevalue("pg_warehouse" if kind == "postgres" else "duckdb_warehouse")
    writer = ResultsWriter(wh.hook, "jkeys", key_columns=[Column("attrs", "json")])
    if existing:
        writer.merge(
            with_batch([chat_line("c0", "v1")]), keys=[{"custom_id": "c0", "key": [{"z": 0}], "shard": 0}]
        )
    if kind == "postgres":
        round_per_line(monkeypatch)
    keys = [
        {"custom_id": "c1", "key": [{"a": 1, "b": 2}], "shard": 0},
        # PostgreSQL's JSONB ignores member order; DuckDB's JSON compares as (minified) text.
        {
            "custom_id": "c2",
            "key": [{"b": 2, "a": 1} if kind == "postgres" else {"a": 1, "b": 2}],
            "shard": 0,
        },
        {"custom_id": "c3", "key": [{"a": 3}], "shard": 0},
        {"custom_id": "c4", "key": [{"a": 4}], "shard": 0},
    ]
    lines = [chat_line("c1", "a"), chat_line("c2", "b"), chat_line("c2", "again")]
    with pytest.raises(WarehouseSchemaError, match="keys.jsonl lines 1 and 2 have the same key"):
        writer.merge(with_batch(lines), keys=keys)
    if existing:  # rolled back to the first merge's row
        assert wh.rows("SELECT COUNT(*) FROM jkeys") == [(1,)]


def test_duckdb_keys_line_of_two_values_is_named(duckdb_warehouse: Any, tmp_path: Any) -> None:
    path = write_keys(
        tmp_path / "keys.jsonl",
        [{"custom_id": "a", "key": [1], "shard": 0}, b'{"custom_id": "b", "key": [2], "shard": 0},{"x": 1}'],
    )
    writer = ResultsWriter(duckdb_warehouse.hook, "two", key_columns=[Column("id", "integer")])
    with pytest.raises(WarehouseSchemaError, match="keys.jsonl line 2: no custom_id"):
        writer.merge(with_batch([chat_line("a", "A")]), keys=path)


def test_spool_rounds_double_in_size_every_n_files() -> None:
    """Rounds grow (each becomes a table held until commit): 100 GB makes hundreds, not thousands."""
    from airflow_batch_provider.warehouse.loaders import pg_copy as wd

    spool = wd.Spool(segment=100, double_every=2)
    for _ in range(100):
        spool.write(b"x" * 10)
    spool.finish()
    sizes = [len(b"".join(f)) for f in spool.files()]
    assert sizes == [100, 100, 200, 200, 400]
    spool.close()


# ---- answers the merge has no reader for (issue #13 point 6) ----------------------------------


def ok_line(custom_id: str, body: Any) -> ResultLine:
    raw = {"custom_id": custom_id, "response": {"status_code": 200, "body": body}, "error": None}
    return OPENAI.parse_result_line(raw, "output")


MODERATION = {
    "id": "modr-1",
    "model": "omni-moderation-latest",
    "results": [{"flagged": True, "categories": {"violence": True}, "category_scores": {"violence": 0.91}}],
}
IMAGE = {"created": 1700000000, "data": [{"url": "https://example.invalid/a.png", "revised_prompt": "a cat"}]}


def test_answers_of_other_endpoints_land_whole_as_json(warehouse: Any) -> None:
    writer = ResultsWriter(warehouse.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([("c1", 1), ("c2", 2), ("c3", 3), ("c4", 4)])
    results = [
        ok_line("c1", MODERATION),
        ok_line("c2", IMAGE),
        ok_line("c3", None),  # a 200 without a body: nothing to land
        chat_line("c4", "plain chat"),
    ]
    report = writer.merge(with_batch(results), keys=keys)
    assert report.counts["succeeded"] == 3 and report.counts["invalid_output"] == 1
    rows = {r[0]: r[1:] for r in table_rows(warehouse, "results", "id, status, content, model, error_code")}
    assert rows[1][0] == "succeeded" and orjson.loads(rows[1][1]) == MODERATION
    assert rows[1][2] == "omni-moderation-latest"
    assert rows[2][0] == "succeeded" and orjson.loads(rows[2][1]) == IMAGE
    assert rows[3] == ("invalid_output", None, None, "empty_response")
    assert rows[4] == ("succeeded", "plain chat", "gpt-test", None)
    # Never a success without content.
    assert warehouse.rows(
        f"SELECT COUNT(*) FROM {warehouse.quote('results')} WHERE status = 'succeeded' AND content IS NULL"
    ) == [(0,)]


# ---- who answered each row (issue #24 section 3) ---------------------------------------------


def test_each_row_records_the_vendor_and_connection_that_answered_it(warehouse: Any) -> None:
    """Every row a merge writes records its vendor and batch connection; a rejected row (never
    sent) records none; a later merge from another vendor changes only the rows it wrote."""
    keys = keys_for([("c1", 1), ("c2", 2), ("c3", 3)])
    rejects = [{"custom_id": "r9", "key": [9], "code": "too_long", "reason": "long"}]
    first = ResultsWriter(
        warehouse.hook,
        "answered",
        key_columns=[Column("id", "integer")],
        vendor="openai",
        batch_conn_id="primary_api",
    )
    first.merge(
        with_batch([chat_line("c1", "one"), error_line("c2", "server_error")]), keys=keys, rejects=rejects
    )
    # The second vendor answers the failed and the missing key (attempt 2's manifest).
    second = ResultsWriter(
        warehouse.hook, "answered", key_columns=[Column("id", "integer")], vendor="xai", batch_conn_id="fb"
    )
    second.merge(with_batch([chat_line("c2", "two"), chat_line("c3", "three")]), keys=keys[1:])
    assert table_rows(warehouse, "answered", "id, status, vendor, batch_conn_id") == [
        (1, "succeeded", "openai", "primary_api"),
        (2, "succeeded", "xai", "fb"),
        (3, "succeeded", "xai", "fb"),
        (9, "rejected", None, None),
    ]


def test_a_results_table_of_an_earlier_version_gets_the_new_columns(warehouse: Any) -> None:
    """A results table created before the vendor columns existed still merges: the merge adds
    them (nullable); the rows it did not write keep NULL there."""
    q = warehouse.quote
    text = "VARCHAR(255)" if warehouse.kind == "mysql" else "TEXT"
    key = "" if warehouse.kind in ("bigquery", "snowflake") else " PRIMARY KEY"
    warehouse.run(
        f"CREATE TABLE {q('earlier')} (id BIGINT NOT NULL{key}, custom_id {text}, status {text}, "
        f"content {text}, embedding {text}, finish_reason {text}, model {text}, prompt_tokens BIGINT, "
        f"completion_tokens BIGINT, total_tokens BIGINT, error_code {text}, error_message {text}, "
        f"batch_id {text}, merged_at {text})"
    )
    warehouse.run(f"INSERT INTO {q('earlier')} (id, custom_id, status) VALUES (1, 'c1', 'succeeded')")
    writer = ResultsWriter(
        warehouse.hook, "earlier", key_columns=[Column("id", "integer")], vendor="mistral", batch_conn_id="m"
    )
    report = writer.merge(with_batch([chat_line("c2", "two")]), keys=keys_for([("c2", 2)]))
    assert report.counts["succeeded"] == 1
    # A second merge finds the columns there and adds nothing.
    writer.merge(with_batch([chat_line("c2", "again")]), keys=keys_for([("c2", 2)]))
    assert table_rows(warehouse, "earlier", "id, status, content, vendor, batch_conn_id") == [
        (1, "succeeded", None, None, None),
        (2, "succeeded", "again", "mistral", "m"),
    ]


def cached_line(custom_id: str, prompt: int, completion: int, cached: int) -> ResultLine:
    """A chat answer whose usage says ``cached`` of its prompt tokens came from the prompt cache."""
    line = chat_line(custom_id, "ok", prompt=prompt, completion=completion)
    assert line.body is not None
    line.body["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    return line


def test_every_row_is_priced_with_cached_tokens_apart_and_long_context_per_row(warehouse: Any) -> None:
    from airflow_batch_provider.prices import Price, Tier

    # Half-price batch; requests over 1,000 input tokens pay the long-context tier on every token.
    price = Price(2.0, 0.5, 8.0, 0.5, (Tier(1000, 4.0, 1.0, 16.0),))
    writer = ResultsWriter(warehouse.hook, "priced", key_columns=[Column("id", "integer")], price=price)
    lines = [
        cached_line("c1", 800, 100, 600),
        cached_line("c2", 1500, 100, 0),
        error_line("c3", "server_error"),
    ]
    rejects = [{"row": 5, "key": [5], "custom_id": "c5", "code": "null_value", "reason": "NULL"}]
    report = writer.merge(
        with_batch(lines),
        keys=keys_for([("c1", 1), ("c2", 2), ("c3", 3), ("c4", 4)]),
        rejects=rejects,
    )
    c1 = (200 * 2.0 + 600 * 0.5 + 100 * 8.0) / 2e6
    c2 = (1500 * 4.0 + 100 * 16.0) / 2e6
    rows = table_rows(warehouse, "priced", "id, status, cached_tokens, cost")
    assert [(r[0], r[1]) for r in rows] == [
        (1, "succeeded"),
        (2, "succeeded"),
        (3, "failed"),
        (4, "missing"),
        (5, "rejected"),
    ]
    costs = {r[0]: float(r[3]) for r in rows}
    assert costs == pytest.approx({1: c1, 2: c2, 3: 0.0, 4: 0.0, 5: 0.0})
    assert {r[0]: r[2] for r in rows if r[2] is not None} == {1: 600, 2: 0}
    assert report.cost == pytest.approx(c1 + c2)
    assert report.cost_by_status["succeeded"] == pytest.approx(c1 + c2)
    assert report.cached_tokens == 600
    # A re-merge at other prices re-prices its rows; without a price the cost is NULL, not 0.
    ResultsWriter(warehouse.hook, "priced", key_columns=[Column("id", "integer")]).merge(
        with_batch([cached_line("c1", 800, 100, 600)]), keys=keys_for([("c1", 1)])
    )
    assert table_rows(warehouse, "priced", "id, cost")[0] == (1, None)


def test_a_shared_answer_fans_out_to_every_key_that_asked_for_it(warehouse: Any, tmp_path: Any) -> None:
    """A deduplicated build sends c1 for keys 1, 2 and 3 (keys.jsonl names it as their
    shared_answer): every key gets the answer and its request_hash, only c1 pays, and the
    report counts one result line matched (no orphan, no repeat) and two shared answers."""
    from airflow_batch_provider.prices import Price

    h1, h4 = "a" * 32, "b" * 32
    records = [
        {"custom_id": "c1", "key": [1], "shard": 0, "request_hash": h1},
        {"custom_id": "c2", "key": [2], "shard": 0, "request_hash": h1, "shared_answer": "c1"},
        {"custom_id": "c4", "key": [4], "shard": 0, "request_hash": h4},
        {"custom_id": "c3", "key": [3], "shard": 0, "request_hash": h1, "shared_answer": "c1"},
        {"custom_id": "c5", "key": [5], "shard": 0, "request_hash": h4, "shared_answer": "c4"},
    ]
    # From the file (parsed by the database where it can) and from records (parsed in Python).
    for table, keys in (
        ("shared_file", write_keys(tmp_path / "keys.jsonl", records)),
        ("shared_rec", records),
    ):
        writer = ResultsWriter(
            warehouse.hook, table, key_columns=[Column("id", "integer")], price=Price(2.0, 0.5, 8.0)
        )
        seen: list[Any] = []
        report = writer.merge(
            with_batch([chat_line("c1", "yes"), error_line("c4", "server_error")]),
            keys=keys,
            on_retry=lambda retry: seen.extend(retry),
        )
        rows = table_rows(
            warehouse, table, "id, status, content, request_hash, shared_answer, cost, prompt_tokens"
        )
        paid = (10 * 2.0 + 5 * 8.0) / 1e6
        assert [r[:5] for r in rows] == [
            (1, "succeeded", "yes", h1, None),
            (2, "succeeded", "yes", h1, "c1"),
            (3, "succeeded", "yes", h1, "c1"),
            (4, "failed", None, h4, None),
            (5, "failed", None, h4, "c4"),
        ]
        # The answer's tokens are on every row; its cost only on the row that was sent.
        assert [r[6] for r in rows] == [10, 10, 10, None, None]
        assert [float(r[5]) for r in rows] == pytest.approx([paid, 0, 0, 0, 0])
        assert report.counts["succeeded"] == 3 and report.counts["failed"] == 2
        assert (report.shared_answers, report.orphan_results, report.duplicate_results) == (3, 0, 0)
        assert report.cost == pytest.approx(paid) and report.prompt_tokens == 10
        # Both failed keys are retried, the shared one through the line sent for it.
        assert [(r.custom_id, r.sent_as, r.request_hash) for r in seen] == [
            ("c4", "c4", h4),
            ("c5", "c4", h4),
        ]
