"""Warehouse SQL dialects (not vendor dialects: those are in ``airflow_batch_provider/dialects``).

One registry, one way to find a database's dialect, for reading and writing alike: the hook's
connection type (``hook.conn_type``), matched against each dialect's declared ``conn_types``.
"""

from __future__ import annotations

from typing import Any

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect
from airflow_batch_provider.warehouse.databases.bigquery import BigQuerySqlDialect
from airflow_batch_provider.warehouse.databases.duckdb import DuckDBSqlDialect
from airflow_batch_provider.warehouse.databases.mysql import MySqlSqlDialect
from airflow_batch_provider.warehouse.databases.postgres import PostgresSqlDialect
from airflow_batch_provider.warehouse.databases.snowflake import SnowflakeSqlDialect
from airflow_batch_provider.warehouse.databases.sqlite import SqliteSqlDialect

SQL_DIALECTS: dict[str, type[SqlDialect]] = {
    conn_type: cls
    for cls in (
        PostgresSqlDialect,
        DuckDBSqlDialect,
        SqliteSqlDialect,
        MySqlSqlDialect,
        BigQuerySqlDialect,
        SnowflakeSqlDialect,
    )
    for conn_type in cls.conn_types
}


def detect_sql_dialect(hook: Any) -> SqlDialect:
    """The SQL dialect of a hook's database, by its connection type; generic when none is known."""
    return _dialect_class(hook)(hook)


def _dialect_class(hook: Any) -> type[SqlDialect]:
    return SQL_DIALECTS.get(str(getattr(hook, "conn_type", "") or "").lower(), SqlDialect)


def get_sql_dialect(hook: Any) -> SqlDialect:
    """The SQL dialect of a results table's database; refuses what the merge cannot write to."""
    from airflow.providers.common.sql.hooks.sql import DbApiHook

    if not isinstance(hook, DbApiHook):
        raise ConfigurationError(
            f"the target connection's hook {type(hook).__name__} is not a common-sql DbApiHook"
        )
    cls = _dialect_class(hook)
    if not cls.merges:
        # Refused up front: a database without a tested write path (Redshift, Databricks, MSSQL)
        # would reject the upsert only after every result was staged (and paid for).
        conn_type = str(getattr(hook, "conn_type", "") or "").lower()
        raise ConfigurationError(
            f"merging into a {conn_type or type(hook).__name__!r} connection is not supported yet; "
            "the results table can be PostgreSQL, DuckDB, SQLite, MySQL/MariaDB, BigQuery or Snowflake "
            "(building batches reads from any common-sql database)"
        )
    return cls(hook)


__all__ = [
    "SQL_DIALECTS",
    "BigQuerySqlDialect",
    "Capabilities",
    "DuckDBSqlDialect",
    "MySqlSqlDialect",
    "PostgresSqlDialect",
    "SnowflakeSqlDialect",
    "SqlDialect",
    "SqliteSqlDialect",
    "detect_sql_dialect",
    "get_sql_dialect",
]
