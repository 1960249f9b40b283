"""SQLite: ``ON CONFLICT`` upserts (3.24+), explicit ``BEGIN IMMEDIATE``, JSON as TEXT."""

from __future__ import annotations

from typing import Any

from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect


class SqliteSqlDialect(SqlDialect):
    """SQLite: ``ON CONFLICT`` upserts (3.24+), explicit ``BEGIN``, JSON as TEXT."""

    name = "sqlite"
    conn_types = ("sqlite",)
    merges = True
    capabilities = Capabilities(exclusive_merge=True)
    types = {**SqlDialect.types, "integer": "INTEGER", "float": "REAL"}
    merged_at_type = "TEXT"

    def begin(self, conn: Any) -> None:
        # The sqlite3 module only opens a transaction before DML; DDL must be inside it too.
        # IMMEDIATE takes the write lock now, so concurrent merges queue instead of racing.
        conn.isolation_level = None
        conn.execute("BEGIN IMMEDIATE")

    def cast(self, expression: str, portable: str) -> str:
        return expression

    def unique_key_sets(self, conn: Any, table: str, schema: str | None) -> list[frozenset[str]] | None:
        prefix = f"{self.quote(schema)}." if schema else ""
        # An INTEGER PRIMARY KEY is the rowid and has no index: read it from table_info.
        sets = [
            frozenset(
                r[1] for r in self._rows(conn, f"PRAGMA {prefix}table_info({self.quote(table)})") if r[5]
            )
        ]
        for _, name, unique, *_ in self._rows(conn, f"PRAGMA {prefix}index_list({self.quote(table)})"):
            if unique:
                sets.append(
                    frozenset(
                        r[2] for r in self._rows(conn, f"PRAGMA {prefix}index_info({self.quote(name)})")
                    )
                )
        return [s for s in sets if s]

    def stream_cursor(self, conn: Any, batch_size: int) -> Any:
        conn.text_factory = _sqlite_text
        return super().stream_cursor(conn, batch_size)


def _sqlite_text(data: bytes) -> str | bytes:
    # SQLite accepts any bytes as TEXT; the stdlib raises mid-stream on invalid UTF-8 and
    # kills the whole read. Hand such a value through as bytes so the row can be rejected.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data
