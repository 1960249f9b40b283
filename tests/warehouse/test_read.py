"""The streaming row source: DuckDB reads get a bounded buffer pool unless the caller chose one."""

from __future__ import annotations

from typing import Any

import duckdb

from airflow_batch_provider.warehouse.databases.duckdb import READ_MEMORY_LIMIT as DUCKDB_READ_MEMORY_LIMIT
from airflow_batch_provider.warehouse.read import stream_rows


def _limit_bytes(conn: Any) -> int:
    # memory_limit reads back as e.g. "30.5 MiB"; compare it in bytes.
    (value,) = conn.execute("SELECT current_setting('memory_limit')").fetchone()
    number, unit = value.split()
    scale = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "bytes": 1}[unit]
    return int(float(number) * scale)


def test_a_file_backed_duckdb_read_has_a_bounded_buffer_pool(duckdb_warehouse: Any) -> None:
    duckdb_warehouse.run("CREATE TABLE t AS SELECT range AS id FROM range(10)")
    with stream_rows(duckdb_warehouse.hook, "SELECT id FROM t ORDER BY id", batch_size=4) as stream:
        assert _limit_bytes(stream._conn) <= int(DUCKDB_READ_MEMORY_LIMIT.removesuffix("MB")) * 1_000_000
        assert [r[0] for r in stream] == list(range(10))


def test_the_callers_own_duckdb_limit_wins(duckdb_warehouse: Any) -> None:
    duckdb_warehouse.run("CREATE TABLE t AS SELECT range AS id FROM range(3)")
    with stream_rows(
        duckdb_warehouse.hook, "SELECT id FROM t", session_sql=["SET memory_limit = '500MB'"]
    ) as stream:
        assert _limit_bytes(stream._conn) > 400 * (1 << 20)
        assert len(list(stream)) == 3


def test_an_in_memory_duckdb_keeps_its_defaults() -> None:
    from airflow_batch_provider.warehouse.databases.duckdb import read_settings as _duckdb_read_settings

    memory = duckdb.connect()
    assert _duckdb_read_settings(memory, []) == []
    memory.close()
