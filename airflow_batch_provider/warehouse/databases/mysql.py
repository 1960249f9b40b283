"""MySQL/MariaDB: ``ON DUPLICATE KEY UPDATE``, VARCHAR keys (TEXT cannot be a primary key)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect

# MySQL FIELD_TYPE codes (mysqlclient, PyMySQL and mysql-connector share them).
_MYSQL_CODES: dict[int, str] = {
    1: "integer",
    2: "integer",
    3: "integer",
    8: "integer",
    9: "integer",
    13: "integer",
    4: "float",
    5: "float",
    0: "float",
    246: "float",
    10: "date",
    7: "timestamp",
    12: "timestamp",
    245: "json",
}


class MySqlSqlDialect(SqlDialect):
    """MySQL/MariaDB: ``ON DUPLICATE KEY UPDATE``, VARCHAR keys (TEXT cannot be a primary key)."""

    name = "mysql"
    conn_types = ("mysql", "mariadb")
    merges = True
    capabilities = Capabilities()
    temp_table = "CREATE TEMPORARY TABLE {} ({})"
    types = {
        **SqlDialect.types,
        "float": "DOUBLE",
        "text": "LONGTEXT",
        "json": "LONGTEXT",
        "timestamp": "DATETIME(6)",
    }
    key_types = {"text": "VARCHAR(255)", "json": "VARCHAR(255)"}
    merged_at_type = "DATETIME(6)"

    def begin(self, conn: Any) -> None:
        cur = conn.cursor()
        try:
            cur.execute("START TRANSACTION")
        finally:
            cur.close()

    def cast(self, expression: str, portable: str) -> str:
        return expression

    def drop_temp_table(self, name: str) -> str | None:
        return f"DROP TEMPORARY TABLE IF EXISTS {self.quote(name)}"

    def unique_key_sets(self, conn: Any, table: str, schema: str | None) -> list[frozenset[str]] | None:
        # ON DUPLICATE KEY UPDATE without a matching unique key would silently add rows.
        rows = self._rows(
            conn,
            "SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS "
            "WHERE TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s AND NON_UNIQUE = 0",
            [schema, table],
        )
        sets: dict[str, set[str]] = {}
        for index, column in rows:
            sets.setdefault(str(index), set()).add(str(column))
        return [frozenset(v) for v in sets.values()]

    def upsert(self, table: str, columns: Sequence[str], keys: Sequence[str], select: str) -> str:
        cols = ", ".join(self.quote(c) for c in columns)
        updates = ", ".join(f"{self.quote(c)} = VALUES({self.quote(c)})" for c in columns if c not in keys)
        return f"INSERT INTO {table} ({cols}) {select} ON DUPLICATE KEY UPDATE {updates}"

    def stream_cursor(self, conn: Any, batch_size: int) -> Any:
        # An unbuffered cursor: mysqlclient and PyMySQL buffer the whole result by default;
        # mysql-connector cursors are unbuffered already.
        module = type(conn).__module__.split(".")[0].lower()
        if module == "mysqldb":
            import MySQLdb.cursors

            return conn.cursor(MySQLdb.cursors.SSCursor)
        if module == "pymysql":
            import pymysql.cursors

            return conn.cursor(pymysql.cursors.SSCursor)
        return conn.cursor()

    def column_type(self, description_row: Sequence[Any]) -> str | None:
        code = description_row[1] if len(description_row) > 1 else None
        if isinstance(code, int):
            return _MYSQL_CODES.get(code, "text")
        return super().column_type(description_row)
