"""Snowflake specifics (fakesnow + the real connector): the streamed read, the stage load, column types.

The merge's behaviour (every status, re-runs, NULLs, awkward names, rollback) is tested on Snowflake
by the parametrised ``tests/warehouse/test_write.py``; this file covers what only Snowflake has.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_batch_provider.warehouse.databases import SnowflakeSqlDialect, get_sql_dialect
from airflow_batch_provider.warehouse.loaders import snowflake_stage
from airflow_batch_provider.warehouse.read import stream_rows
from airflow_batch_provider.warehouse.rows import Column
from airflow_batch_provider.warehouse.write import ResultsWriter
from tests.warehouse.test_write import chat_line, embedding_line, keys_for, with_batch


def test_the_provider_hook_gets_the_snowflake_dialect(snowflake_warehouse: Any) -> None:
    from airflow.providers.snowflake.hooks.snowflake import SnowflakeHook

    assert isinstance(snowflake_warehouse.hook, SnowflakeHook)
    assert isinstance(get_sql_dialect(snowflake_warehouse.hook), SnowflakeSqlDialect)


def test_read_streams_in_batches_and_never_fetches_all(
    snowflake_warehouse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wh = snowflake_warehouse
    wh.run(
        "CREATE TABLE src (id NUMBER(38, 0), score NUMBER(10, 2), name VARCHAR, ok BOOLEAN, "
        "born DATE, seen TIMESTAMP_NTZ, doc VARIANT)"
    )
    wh.run_many(
        "INSERT INTO src (id, score, name, ok, born, seen) VALUES (%s, %s, %s, %s, %s, %s)",
        [(i, i / 4, f"n{i}", i % 2 == 0, "2024-01-02", "2024-01-02 03:04:05") for i in range(1, 26)],
    )
    calls: list[tuple[str, Any]] = []
    from snowflake.connector.cursor import SnowflakeCursor

    real_fetchmany = SnowflakeCursor.fetchmany

    def fetchmany(self: Any, size: Any = None) -> Any:
        calls.append(("fetchmany", size))
        return real_fetchmany(self, size)

    def fetchall(self: Any) -> Any:
        raise AssertionError("the row source must not fetch the whole result")

    monkeypatch.setattr(SnowflakeCursor, "fetchmany", fetchmany)
    monkeypatch.setattr(SnowflakeCursor, "fetchall", fetchall)
    with stream_rows(wh.hook, "SELECT * FROM src ORDER BY id", batch_size=10) as stream:
        types = {c.name: c.type for c in stream.columns}
        batches = [len(b) for b in stream.batches()]
    assert stream.driver == "snowflake"
    assert batches == [10, 10, 5]
    assert calls and all(size == 10 for _, size in calls)
    assert types == {
        "ID": "integer",
        "SCORE": "float",
        "NAME": "text",
        "OK": "boolean",
        "BORN": "date",
        "SEEN": "timestamp",
        "DOC": "json",
    }


def test_results_are_staged_in_chunks_put_on_a_stage_and_copied(
    snowflake_warehouse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several chunk files go through PUT + one COPY INTO; every row lands once, embeddings as arrays."""
    wh = snowflake_warehouse
    statements: list[str] = []
    real_load = snowflake_stage.load

    def spying_load(conn: Any, rows: Any, **kwargs: Any) -> int:
        class Spy:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def cursor(self) -> Any:
                cur = self.inner.cursor()
                execute = cur.execute

                def spy(sql: str, *args: Any, **kw: Any) -> Any:
                    statements.append(sql)
                    return execute(sql, *args, **kw)

                cur.execute = spy
                return cur

        return real_load(Spy(conn), rows, **kwargs)

    monkeypatch.setattr(snowflake_stage, "load", spying_load)
    monkeypatch.setattr(SnowflakeSqlDialect, "chunk_bytes", 200)  # a few rows per file
    n = 30
    writer = ResultsWriter(wh.hook, "emb", key_columns=[Column("id", "integer")])
    lines = [embedding_line(f"c{i}", [i / 10, -1.5, 2.0]) for i in range(n)]
    for _ in range(2):
        report = writer.merge(with_batch(lines), keys=keys_for([(f"c{i}", i) for i in range(n)]))
        assert report.counts["succeeded"] == n
    puts = [s for s in statements if s.startswith("PUT ")]
    copies = [s for s in statements if s.startswith("COPY INTO")]
    assert len(puts) > 4 * 2  # the results alone took several files, in each merge
    # One COPY per staged table with rows (results and keys; no rejects, no shards here).
    assert len(copies) == 2 * 2
    rows = wh.rows(f"SELECT {wh.quote('id')}, {wh.quote('embedding')} FROM {wh.quote('emb')} ORDER BY 1")
    assert [r[0] for r in rows] == list(range(n))
    assert [json.loads(r[1]) for r in rows] == [[i / 10, -1.5, 2.0] for i in range(n)]


def test_repeated_keys_in_a_manifest_are_refused_though_snowflake_enforces_no_key(
    snowflake_warehouse: Any,
) -> None:
    from airflow_batch_provider.exceptions import WarehouseSchemaError

    writer = ResultsWriter(snowflake_warehouse.hook, "dup", key_columns=[Column("id", "integer")])
    with pytest.raises(WarehouseSchemaError, match="lines 1 and 2 have the same key"):
        writer.merge(
            with_batch([chat_line("a", "x"), chat_line("b", "y")]), keys=keys_for([("a", 1), ("b", 1)])
        )
    assert snowflake_warehouse.rows(f"SELECT COUNT(*) FROM {snowflake_warehouse.quote('dup')}") == [(0,)]


def test_session_settings_point_to_the_connections_session_parameters(snowflake_warehouse: Any) -> None:
    from airflow_batch_provider.exceptions import ConfigurationError

    writer = ResultsWriter(
        snowflake_warehouse.hook,
        "s",
        key_columns=[Column("id", "integer")],
        session_settings={"QUERY_TAG": "x"},
    )
    with pytest.raises(ConfigurationError, match="session_parameters"):
        writer.merge(with_batch([chat_line("a", "x")]), keys=keys_for([("a", 1)]))
