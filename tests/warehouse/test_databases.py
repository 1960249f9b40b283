"""One registry of warehouse SQL dialects, one way to find a database's: reading and writing agree."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.warehouse.databases import SQL_DIALECTS, SqlDialect, detect_sql_dialect
from airflow_batch_provider.warehouse.read import stream_rows
from airflow_batch_provider.warehouse.write import ResultsWriter


@pytest.mark.parametrize("kind", ["postgres", "duckdb", "sqlite", "mysql"])
def test_read_and_write_find_the_same_dialect(kind: str, request: pytest.FixtureRequest) -> None:
    wh = request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_warehouse")
    writer = ResultsWriter(wh.hook, "t")
    with stream_rows(wh.hook, "SELECT 1") as stream:
        assert list(stream) == [(1,)]
        assert type(stream.dialect) is type(writer.dialect) is SQL_DIALECTS[kind]
        assert stream.driver == writer.dialect.name == kind


def test_an_unknown_database_is_read_with_the_generic_dialect(sqlite_warehouse: Any) -> None:
    """A connection type no dialect declares (here a SQLite hook under another name) streams
    through plain cursors, and the merge refuses it up front."""
    from airflow.providers.sqlite.hooks.sqlite import SqliteHook

    from airflow_batch_provider.exceptions import ConfigurationError

    class OtherHook(SqliteHook):
        conn_type = "libsql"

    hook = OtherHook(sqlite_conn_id=sqlite_warehouse.conn_id)
    assert type(detect_sql_dialect(hook)) is SqlDialect
    sqlite_warehouse.run("CREATE TABLE t (id INTEGER)")
    sqlite_warehouse.run_many("INSERT INTO t VALUES (?)", [(i,) for i in range(5)])
    with stream_rows(hook, "SELECT id FROM t ORDER BY id", batch_size=2) as stream:
        assert stream.driver == "generic"
        assert [r[0] for r in stream] == list(range(5))
    with pytest.raises(ConfigurationError, match="'libsql' connection is not supported yet"):
        ResultsWriter(hook, "t")
