"""What differs per database for the merge: quoting, types, upsert syntax, transactions, bulk load.

Like common-sql's ``hook.dialect``, one small object per database holds every piece of
database-specific SQL. It builds on the hook's own settings (``escape_word_format``,
``placeholder``) and on common-sql's ``Dialect.generate_insert_sql`` for the generic
``executemany`` path, so a connection that overrides those in its extras is honoured.

Identifiers are always quoted here, and a quote character inside a name is doubled:
common-sql's ``escape_word`` only quotes reserved or unusual words and does not escape an
embedded quote, which is not enough for names taken from user input.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from itertools import islice
from typing import IO, Any

import orjson

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.warehouse.rows import Column

log = logging.getLogger(__name__)

_BATCH_ROWS = 5000
_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


class WarehouseDialect:
    """Generic SQL (SQLite flavoured), used for any DbApiHook without a specific dialect.

    :param hook: the target connection's ``DbApiHook``.
    """

    name = "generic"
    temp_table = "CREATE TEMP TABLE {} ({})"
    types = {
        "integer": "BIGINT",
        "float": "DOUBLE PRECISION",
        "text": "TEXT",
        "boolean": "BOOLEAN",
        "date": "DATE",
        "timestamp": "TIMESTAMP",
        "json": "TEXT",
    }
    key_types: dict[str, str] = {}
    merged_at_type = "TIMESTAMP"

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        fmt = getattr(hook, "escape_word_format", None) or '"{}"'
        if "{}" not in fmt or len(fmt) < 3:
            fmt = '"{}"'
        self._quote_format = fmt
        self._close = fmt[-1]

    # ---- identifiers and types -------------------------------------------------------------
    def quote(self, name: str) -> str:
        """Quote one identifier, doubling any quote character inside it."""
        if not name or "\x00" in name:
            raise ConfigurationError(f"invalid identifier {name!r}")
        return self._quote_format.format(name.replace(self._close, self._close * 2))

    #: Longest identifier in bytes the database keeps whole (PostgreSQL cuts longer ones).
    max_identifier_bytes: int | None = None

    def check_identifiers(self, names: Sequence[tuple[str, str]], *, distinct: bool = True) -> None:
        """Refuse names this database would not keep as given, before any work.

        :param names: ``(what, name)`` pairs, e.g. ``("key column", "id")``.
        :param distinct: also refuse two names that differ only by case (columns of one table:
            DuckDB, SQLite and MySQL match column names without regard to case).
        """
        limit = self.max_identifier_bytes
        seen: dict[str, tuple[str, str]] = {}
        for what, name in names:
            if limit is not None and len(name.encode("utf-8")) > limit:
                raise ConfigurationError(
                    f"{what} {name!r} is {len(name.encode('utf-8'))} bytes long; {self.name} cuts "
                    f"identifiers at {limit} bytes, so use a shorter name"
                )
            if not distinct:
                continue
            other = seen.get(name.casefold())
            if other is not None and other[1] != name:
                raise ConfigurationError(
                    f"{other[0]} {other[1]!r} and {what} {name!r} differ only by case; "
                    "not every database tells them apart, so rename one"
                )
            seen[name.casefold()] = (what, name)

    def bound(self, sql: str) -> str:
        """``sql`` ready to run with parameters.

        Where the driver's placeholder is ``%s`` (psycopg, MySQL drivers), a ``%`` inside a
        quoted identifier would be read as a placeholder once parameters are passed, so it is
        doubled there (and only there: the statement's own placeholders are never quoted).
        """
        if "%" not in self.placeholder or "%" not in sql:
            return sql
        return _double_percent_in_quotes(sql, self._quote_format[0], self._close)

    def table(self, table: str, schema: str | None = None) -> str:
        """The quoted (optionally schema-qualified) table name; the table name is never split on dots."""
        return f"{self.quote(schema)}.{self.quote(table)}" if schema else self.quote(table)

    @property
    def placeholder(self) -> str:
        return str(getattr(self.hook, "placeholder", "%s"))

    def sql_type(self, portable: str, *, key: bool = False) -> str:
        if key and portable in self.key_types:
            return self.key_types[portable]
        try:
            return self.types[portable]
        except KeyError:
            raise ConfigurationError(
                f"unknown column type {portable!r}; known: {', '.join(sorted(self.types))}"
            ) from None

    def merged_at_value(self, when: datetime) -> Any:
        return when.astimezone(timezone.utc).replace(tzinfo=None).isoformat(sep=" ")

    def cast(self, expression: str, portable: str) -> str:
        """Cast a bound parameter so every database knows its type in a SELECT list."""
        return f"CAST({expression} AS {self.sql_type(portable)})"

    # ---- statements --------------------------------------------------------------------------
    def create_temp_table(self, name: str, columns: Sequence[tuple[str, str]]) -> str:
        body = ", ".join(f"{self.quote(col)} {sql_type}" for col, sql_type in columns)
        return self.temp_table.format(self.quote(name), body)

    def drop_temp_table(self, name: str) -> str | None:
        return f"DROP TABLE IF EXISTS {self.quote(name)}"

    def insert(self, table: str, columns: Sequence[str], select: str) -> str:
        """A plain ``INSERT INTO table (columns) <select>``."""
        return f"INSERT INTO {table} ({', '.join(self.quote(c) for c in columns)}) {select}"

    def upsert(self, table: str, columns: Sequence[str], keys: Sequence[str], select: str) -> str:
        """``INSERT INTO table (columns) <select>`` that updates rows whose keys already exist."""
        cols = ", ".join(self.quote(c) for c in columns)
        key_list = ", ".join(self.quote(k) for k in keys)
        updates = ", ".join(f"{self.quote(c)} = excluded.{self.quote(c)}" for c in columns if c not in keys)
        # "WHERE 1=1" keeps SQLite from reading ON CONFLICT as part of the SELECT's join.
        return (
            f"INSERT INTO {table} ({cols}) {select} WHERE 1=1 "
            f"ON CONFLICT ({key_list}) DO UPDATE SET {updates}"
        )

    #: Upsert by deleting the keys about to be written and inserting, where ``ON CONFLICT DO
    #: UPDATE`` holds every updated row in memory (only for tables with no columns of their own).
    upsert_by_replace = False
    #: Whether a table the merge creates goes without a primary key, its rows being replaced by
    #: key (``upsert_by_replace``) by merges that hold the table alone (``exclusive_merge``).
    keyless_tables = False

    def update_then_insert(
        self, table: str, columns: Sequence[str], keys: Sequence[str], select: str
    ) -> tuple[str, str]:
        """An upsert as two statements that need no unique index: ``UPDATE ... FROM`` the rows
        of ``select`` whose keys exist, then ``INSERT`` the others (each binds ``select``'s
        parameters once)."""
        source = f"({select}) AS abp_s({', '.join(self.quote(c) for c in columns)})"
        match = " AND ".join(f"{table}.{self.quote(k)} = abp_s.{self.quote(k)}" for k in keys)
        sets = ", ".join(f"{self.quote(c)} = abp_s.{self.quote(c)}" for c in columns if c not in keys)
        exists = " AND ".join(f"abp_t.{self.quote(k)} = abp_s.{self.quote(k)}" for k in keys)
        return (
            f"UPDATE {table} SET {sets} FROM {source} WHERE {match}",
            f"INSERT INTO {table} ({', '.join(self.quote(c) for c in columns)}) SELECT * FROM {source} "
            f"WHERE NOT EXISTS (SELECT 1 FROM {table} abp_t WHERE {exists})",
        )

    def delete_keys(self, table: str, keys: Sequence[str], select: str) -> str:
        """``DELETE`` the rows whose keys ``select`` returns (columns in the order of ``keys``)."""
        return f"DELETE FROM {table} WHERE ({', '.join(self.quote(k) for k in keys)}) IN ({select})"

    def analyze(self, conn: Any, table: str) -> None:
        """Give the planner statistics of a freshly loaded temp table (where that matters)."""

    def unique_key_sets(self, conn: Any, table: str, schema: str | None) -> list[frozenset[str]] | None:
        """Column sets of the table's primary key and unique indexes; None when not known here."""
        return None

    def _rows(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self.cursor(conn)
        try:
            cur.execute(self.bound(sql), tuple(params)) if params else cur.execute(sql)
            return [tuple(r) for r in cur.fetchall()]
        finally:
            cur.close()

    set_format = "SET {} = {}"

    def set_setting(self, name: str, value: Any) -> str:
        """A statement changing one setting for this session (or transaction, where possible)."""
        if not _SETTING_NAME.fullmatch(name):
            raise ConfigurationError(f"invalid setting name {name!r}")
        literal = "'" + str(value).replace("'", "''") + "'"
        return self.set_format.format(name, literal)

    def load_keys_jsonl(self, conn: Any, table: str, handle: IO[bytes], key_types: Sequence[str]) -> bool:
        """Load keys.jsonl into the keys staging table letting the database parse the JSON.

        The table has columns ``custom_id, shard, seq, klen, k0..kN``; ``klen`` is the length
        of the line's key array (checked by the caller). Returns False when this database has
        no such path, and the caller parses the lines in Python instead.
        """
        return False

    #: Statement that sets a savepoint, or None when a failed statement cannot be undone alone.
    savepoint: str | None = None
    #: Whether ``WITH w AS (INSERT ... RETURNING ...) SELECT ...`` works (counts while writing).
    returning_counts = False

    # ---- transactions ------------------------------------------------------------------------
    def cursor(self, conn: Any) -> Any:
        """A cursor that shares the connection's transaction and temp tables."""
        return conn.cursor()

    def begin(self, conn: Any) -> None:
        """Start the one transaction of the merge (DB-API drivers open one implicitly)."""

    #: Whether the merge holds the table alone from ``lock_table`` to commit, so a table it
    #: created is known to be empty (then a plain INSERT is enough).
    exclusive_merge = False

    def lock_table(self, conn: Any, table: str, schema: str | None) -> None:
        """Serialise merges into one table (concurrent first merges would race on CREATE TABLE)."""

    def probe_columns(self, conn: Any, table: str, schema: str | None) -> list[str] | None:
        """The column names of the table, or None when it does not exist (inside the transaction).

        A failed statement does not abort a transaction on SQLite or MySQL, so the probe may fail.
        """
        cur = self.cursor(conn)
        try:
            cur.execute(f"SELECT * FROM {self.table(table, schema)} WHERE 1=0")
            return [d[0] for d in cur.description or ()]
        except Exception:
            return None
        finally:
            cur.close()

    # ---- bulk load ---------------------------------------------------------------------------
    def bulk_load(
        self,
        conn: Any,
        table: str,
        columns: Sequence[Column],
        rows: Iterable[Sequence[Any]],
        *,
        before: Callable[[], Any] | None = None,
        after_round: Callable[[str], Any] | None = None,
    ) -> int:
        """Load rows into a staging table; the generic path is batched ``executemany``.

        :param before: work on the same connection that must be done before the rows are
            loaded (e.g. staging the keys); a dialect may run it while the rows are produced.
        :param after_round: where a dialect loads the rows in rounds while they are still being
            produced (PostgreSQL), it calls this after each round, on the loading thread, with
            the name of a table holding just that round's rows (they are also in ``table``).
            Dialects that load in one go never call it.
        """
        if before is not None or after_round is not None:
            loaded = self._load_while(conn, table, columns, rows, before or _nothing, after_round)
            if loaded is not None:
                return loaded
        if before is not None:
            before()
        return self._load_rows(conn, table, columns, rows)

    def _load_while(
        self,
        conn: Any,
        table: str,
        columns: Sequence[Column],
        rows: Iterable[Sequence[Any]],
        before: Callable[[], Any],
        after_round: Callable[[str], Any] | None,
    ) -> int | None:
        """Run ``before`` and load the rows at the same time, or return None where that is not done."""
        return None

    def _load_rows(
        self, conn: Any, table: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]
    ) -> int:
        names = [self.quote(c.name) for c in columns]
        sql = self.bound(self.hook.dialect.generate_insert_sql(self.quote(table), names, names))
        count = 0
        cur = self.cursor(conn)
        try:
            iterator = iter(rows)
            while chunk := list(islice(iterator, _BATCH_ROWS)):
                cur.executemany(sql, chunk)
                count += len(chunk)
        finally:
            cur.close()
        return count


class SqliteWarehouseDialect(WarehouseDialect):
    """SQLite: ``ON CONFLICT`` upserts (3.24+), explicit ``BEGIN``, JSON as TEXT."""

    name = "sqlite"
    types = {**WarehouseDialect.types, "integer": "INTEGER", "float": "REAL"}
    merged_at_type = "TEXT"

    exclusive_merge = True

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


class PostgresWarehouseDialect(WarehouseDialect):
    """PostgreSQL: COPY into an ON COMMIT DROP temp table, then one ``INSERT ... ON CONFLICT``."""

    name = "postgres"
    max_identifier_bytes = 63
    temp_table = "CREATE TEMP TABLE {} ({}) ON COMMIT DROP"
    types = {**WarehouseDialect.types, "json": "JSONB"}
    merged_at_type = "TIMESTAMP WITH TIME ZONE"

    def merged_at_value(self, when: datetime) -> Any:
        return when.astimezone(timezone.utc)

    def cast(self, expression: str, portable: str) -> str:
        if portable == "timestamp":
            return f"CAST({expression} AS TIMESTAMP WITH TIME ZONE)"
        return super().cast(expression, portable)

    def drop_temp_table(self, name: str) -> str | None:
        return None  # ON COMMIT DROP

    savepoint = "SAVEPOINT {}"
    returning_counts = True
    exclusive_merge = True

    def lock_table(self, conn: Any, table: str, schema: str | None) -> None:
        # A transaction-scoped advisory lock on the table's name: a second merge into the same
        # table waits here until the first commits, then finds the table it created.
        self._rows(
            conn, "SELECT pg_advisory_xact_lock(hashtext(%s))", [f"abp-merge:{self.table(table, schema)}"]
        )

    def probe_columns(self, conn: Any, table: str, schema: str | None) -> list[str] | None:
        # A failed statement would abort the transaction: look the table up first.
        if self._rows(conn, "SELECT to_regclass(%s)", [self.table(table, schema)])[0][0] is None:
            return None
        return super().probe_columns(conn, table, schema)

    def unique_key_sets(self, conn: Any, table: str, schema: str | None) -> list[frozenset[str]] | None:
        rows = self._rows(
            conn,
            "SELECT array_agg(a.attname::text) FROM pg_index i "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = to_regclass(%s) AND i.indisunique GROUP BY i.indexrelid",
            [self.table(table, schema)],
        )
        return [frozenset(r[0]) for r in rows]

    # Only for this transaction: the connection may come back from a pool.
    set_format = "SET LOCAL {} = {}"

    def load_keys_jsonl(self, conn: Any, table: str, handle: IO[bytes], key_types: Sequence[str]) -> bool:
        raw = self.quote(f"{table}_raw")
        cur = conn.cursor()
        if not hasattr(cur, "copy"):  # psycopg2: parse in Python instead
            cur.close()
            return False
        try:
            cur.execute(
                f"CREATE TEMP TABLE {raw} (seq BIGINT GENERATED ALWAYS AS IDENTITY, line TEXT) ON COMMIT DROP"
            )
            # CSV with delimiter and quote bytes that valid JSON never contains raw (control
            # characters must be escaped inside JSON strings): each line arrives verbatim,
            # backslashes included, and PostgreSQL parses the JSON on its own core.
            with cur.copy(
                f"COPY {raw} (line) FROM STDIN WITH (FORMAT csv, DELIMITER E'\\x01', QUOTE E'\\x02')"
            ) as copy:
                while chunk := handle.read(1 << 20):
                    copy.write(chunk)
            keys = ", ".join(self._key_expr(i, t) for i, t in enumerate(key_types))
            cur.execute(
                f"INSERT INTO {self.quote(table)} SELECT j->>'custom_id', CAST(j->>'shard' AS BIGINT), seq, "
                f"CASE WHEN jsonb_typeof(j->'key') = 'array' THEN jsonb_array_length(j->'key') END"
                f"{', ' + keys if keys else ''} "
                f"FROM (SELECT seq, CAST(line AS JSONB) AS j FROM {raw} WHERE btrim(line) <> '' OFFSET 0) x"
            )
            cur.execute(f"DROP TABLE {raw}")
        finally:
            cur.close()
        return True

    def _key_expr(self, index: int, portable: str) -> str:
        if portable == "json":
            return f"CAST(j->'key'->{index} AS TEXT)"
        if portable == "text":
            return f"j->'key'->>{index}"
        return f"CAST(j->'key'->>{index} AS {self.sql_type(portable)})"

    def analyze(self, conn: Any, table: str) -> None:
        # Autovacuum never sees temp tables: without statistics the join plan is a guess.
        cur = conn.cursor()
        try:
            cur.execute(f"ANALYZE {table}")
        finally:
            cur.close()

    def _copy_sql(self, table: str, columns: Sequence[Column]) -> str:
        return f"COPY {self.quote(table)} ({', '.join(self.quote(c.name) for c in columns)}) FROM STDIN"

    def _load_while(
        self,
        conn: Any,
        table: str,
        columns: Sequence[Column],
        rows: Iterable[Sequence[Any]],
        before: Callable[[], Any],
        after_round: Callable[[str], Any] | None,
    ) -> int | None:
        # psycopg 3 only (psycopg2 has no COPY formatter to spool with), and UTF-8 only (the
        # spool is formatted before the connection would transcode it).
        # Without rounds to run, there is nothing to overlap but ``before``: load plainly.
        if after_round is None or type(conn).__module__.split(".")[0] != "psycopg" or not _utf8(conn):
            return None

        def load_rounds(spool: _Spool) -> None:
            # One spool file is one round: its rows go into a child table of ``table`` (so
            # ``table`` still reads every row), then the caller works on them while Python
            # formats the next round.
            for number, chunks in enumerate(spool.files(), start=1):
                part = f"{table}_{number}"
                cur = conn.cursor()
                try:
                    cur.execute(
                        f"CREATE TEMP TABLE {self.quote(part)} () "
                        f"INHERITS ({self.quote(table)}) ON COMMIT DROP"
                    )
                finally:
                    cur.close()
                _copy_from(conn, self._copy_sql(part, columns), chunks)
                after_round(part)

        return _overlapped_copy(
            conn, _without_nul(rows), before, load_rounds, segment=ROUND_BYTES, double_every=ROUNDS_PER_SIZE
        )

    def _load_rows(
        self, conn: Any, table: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]
    ) -> int:
        sql = self._copy_sql(table, columns)
        cur = conn.cursor()
        count = 0
        try:
            if not hasattr(cur, "copy"):  # psycopg2
                reader = _CopyTextReader(_without_nul(rows))
                cur.copy_expert(sql, reader)
                return reader.rows
            with cur.copy(sql) as copy:
                for row in _without_nul(rows):
                    copy.write_row(row)
                    count += 1
        finally:
            cur.close()
        return count


class DuckDBWarehouseDialect(WarehouseDialect):
    """DuckDB: rows are staged as JSONL files in chunks and read with ``read_json`` (its bulk path)."""

    name = "duckdb"
    types = {**WarehouseDialect.types, "json": "JSON", "float": "DOUBLE", "text": "VARCHAR"}
    merged_at_type = "TIMESTAMP WITH TIME ZONE"
    chunk_rows = 100_000

    def begin(self, conn: Any) -> None:
        conn.execute("BEGIN TRANSACTION")

    def cursor(self, conn: Any) -> Any:
        # DuckDB's cursor() opens a second connection with its own transaction and temp
        # tables; the merge must stay on the one connection.
        return _SameConnection(conn)

    def merged_at_value(self, when: datetime) -> Any:
        return when.astimezone(timezone.utc)

    def cast(self, expression: str, portable: str) -> str:
        if portable == "timestamp":
            return f"CAST({expression} AS TIMESTAMP WITH TIME ZONE)"
        return super().cast(expression, portable)

    def unique_key_sets(self, conn: Any, table: str, schema: str | None) -> list[frozenset[str]] | None:
        rows = self._rows(
            conn,
            "SELECT constraint_column_names FROM duckdb_constraints() WHERE table_name = ? "
            "AND schema_name = COALESCE(?, current_schema()) "
            "AND constraint_type IN ('PRIMARY KEY', 'UNIQUE')",
            [table, schema],
        )
        indexes = self._rows(
            conn,
            "SELECT COUNT(*) FROM duckdb_indexes() WHERE table_name = ? "
            "AND schema_name = COALESCE(?, current_schema()) AND is_unique",
            [table, schema],
        )
        if indexes[0][0]:
            # A unique index lists its columns only as SQL text; ON CONFLICT itself will say
            # clearly if none of them matches the keys.
            return None
        return [frozenset(r[0]) for r in rows]

    def load_keys_jsonl(self, conn: Any, table: str, handle: IO[bytes], key_types: Sequence[str]) -> bool:
        # The keys file may live on an object store: its lines go to a local temp file, each
        # wrapped with its line number as ``[n, line]`` (no parsing in Python), for read_json:
        # it has no line numbers, and numbering in SQL (ROW_NUMBER() OVER ()) would hold every
        # key in memory at once.
        fd, path = tempfile.mkstemp(prefix="abp-keys-", suffix=".jsonl")
        try:
            longest = 0
            with os.fdopen(fd, "wb", buffering=1 << 20) as out:
                write = out.write
                for number, line in enumerate(handle, start=1):
                    line = line.strip()
                    if line:
                        longest = max(longest, len(line))
                        write(b"[%d,%s]\n" % (number, line))
            keys = ", ".join(self._key_expr(i, t) for i, t in enumerate(key_types))
            conn.execute(
                # A line that is not one JSON value (``{...},{...}``) wraps into a longer array:
                # no custom_id, reported with its line number.
                f"INSERT INTO {self.quote(table)} SELECT CASE WHEN json_array_length(j) = 2 "
                f"THEN j->1->>'custom_id' END, CAST(j->1->>'shard' AS BIGINT), "
                f"CAST(j->>0 AS BIGINT), json_array_length(j->1->'key')"
                f"{', ' + keys if keys else ''} "
                f"FROM read_json(?, format='newline_delimited', records=false, columns={{'j': 'JSON'}}, "
                f"maximum_object_size={_json_buffer(longest + 32)})",
                [path],
            )
        finally:
            os.unlink(path)
        return True

    def _key_expr(self, index: int, portable: str) -> str:
        key = "j->1->'key'"
        if portable == "json":
            return f"CAST({key}->{index} AS VARCHAR)"
        if portable == "text":
            return f"{key}->>{index}"
        return f"CAST({key}->>{index} AS {self.sql_type(portable)})"

    # One process writes a DuckDB file at a time.
    exclusive_merge = True

    @property
    def upsert_by_replace(self) -> bool:  # type: ignore[override]
        # DuckDB's ON CONFLICT DO UPDATE keeps each updated row's old version in memory:
        # re-merging 1M rows failed at memory_limit=256MB, while DELETE + INSERT in the same
        # transaction (the insert is written to the file as it goes) used ~96 MB. Before 1.2,
        # DuckDB refused to re-insert a key deleted in the same transaction, and had no
        # multi-column ``IN (SELECT ...)``.
        import duckdb

        return _version(duckdb.__version__) >= (1, 2)

    @property
    def keyless_tables(self) -> bool:  # type: ignore[override]
        # DuckDB keeps a primary key's index (ART) in memory, and a merge loads and grows it: its
        # memory would follow the table's size, and re-merging 1M rows needed over 96MB of
        # memory_limit for it. Merges replace rows by key and run alone on a DuckDB file, so a
        # table they create does not need it; a table created with one keeps it.
        return self.upsert_by_replace

    def probe_columns(self, conn: Any, table: str, schema: str | None) -> list[str] | None:
        # A failed statement would abort the transaction: look the table up first.
        found = self._rows(
            conn,
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = ? "
            "AND table_schema = COALESCE(?, current_schema())",
            [table, schema],
        )
        if not found[0][0]:
            return None
        cur = conn.execute(f"SELECT * FROM {self.table(table, schema)} WHERE 1=0")
        return [d[0] for d in cur.description or ()]

    def _load_rows(
        self, conn: Any, table: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]
    ) -> int:
        # Rows are written as JSON arrays (the cheapest thing to produce in Python) to chunk
        # files; DuckDB loads one chunk in a worker thread (it releases the GIL) while Python
        # writes the next, so parsing and loading overlap on two cores.
        # Read as a list of text values (JSON strings unescaped, numbers and booleans as their
        # text, null as NULL) and cast per column: extracting from a JSON column instead held
        # ~60 MB per statement outside what spills, whatever the chunk size.
        extract = ", ".join(
            f"CAST(j[{i + 1}] AS {self.sql_type(c.type)})" if c.type != "text" else f"j[{i + 1}]"
            for i, c in enumerate(columns)
        )
        sql = (
            f"INSERT INTO {self.quote(table)} SELECT {extract} FROM read_json(?, format='newline_delimited', "
            "records=false, columns={'j': 'VARCHAR[]'}, maximum_object_size=?)"
        )
        paths = []
        for _ in range(2):
            fd, path = tempfile.mkstemp(prefix="abp-merge-", suffix=".jsonl")
            os.close(fd)
            paths.append(path)
        count = 0
        iterator = iter(rows)
        pending: Future[Any] | None = None
        dumps = orjson.dumps
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="abp-duckdb-load") as loader:
                for turn in itertools.count():
                    path = paths[turn % 2]
                    written = longest = 0
                    with open(path, "wb", buffering=1 << 20) as fh:
                        write = fh.write
                        for row in islice(iterator, self.chunk_rows):
                            line = dumps(row)
                            if len(line) > longest:
                                longest = len(line)
                            write(line)
                            write(b"\n")
                            written += 1
                    if pending is not None:
                        pending.result()  # the other file is free again (and errors surface here)
                        pending = None
                    if not written:
                        break
                    pending = loader.submit(conn.execute, sql, [path, _json_buffer(longest)])
                    count += written
                if pending is not None:
                    pending.result()
        finally:
            for path in paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return count


def _json_buffer(longest: int) -> int:
    """``maximum_object_size`` for read_json over lines no longer than ``longest`` bytes.

    DuckDB sizes each reading thread's buffer from it (16 MB by default, two per thread),
    memory the buffer manager's limit does not cover; the longest line is known here.
    """
    return max(1 << 20, 2 * longest)


class MySqlWarehouseDialect(WarehouseDialect):
    """MySQL/MariaDB: ``ON DUPLICATE KEY UPDATE``, VARCHAR keys (TEXT cannot be a primary key)."""

    name = "mysql"
    temp_table = "CREATE TEMPORARY TABLE {} ({})"
    types = {
        **WarehouseDialect.types,
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


class _SameConnection:
    """DuckDB connection used as a cursor: execute/fetch on it, and closing it does nothing."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def close(self) -> None:
        """The connection is closed by the merge, not by its cursors."""


def _double_percent_in_quotes(sql: str, open_quote: str, close_quote: str) -> str:
    """Double every ``%`` inside quoted identifiers (and string literals) of ``sql``."""
    out: list[str] = []
    closing: str | None = None  # the character ending the quoted part we are in
    for char in sql:
        if closing is None:
            if char == open_quote:
                closing = close_quote
            elif char == "'":
                closing = "'"
        elif char == closing:
            # A doubled quote closes and reopens at once, which leaves the state as it was.
            closing = None
        elif char == "%":
            out.append("%")
        out.append(char)
    return "".join(out)


def _version(text: str) -> tuple[int, ...]:
    """``(1, 2)`` from ``"1.2.0"`` or ``"1.2.0.dev1"`` (leading numeric parts only)."""
    parts = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def get_warehouse_dialect(hook: Any) -> WarehouseDialect:
    """Pick the dialect for a DbApiHook by its connection type / SQLAlchemy dialect name."""
    from airflow.providers.common.sql.hooks.sql import DbApiHook

    if not isinstance(hook, DbApiHook):
        raise ConfigurationError(
            f"the target connection's hook {type(hook).__name__} is not a common-sql DbApiHook"
        )
    conn_type = str(getattr(hook, "conn_type", "") or "").lower()
    if conn_type in ("postgres", "postgresql"):
        return PostgresWarehouseDialect(hook)
    if conn_type == "duckdb":
        return DuckDBWarehouseDialect(hook)
    if conn_type == "sqlite":
        return SqliteWarehouseDialect(hook)
    if conn_type in ("mysql", "mariadb"):
        return MySqlWarehouseDialect(hook)
    # Refused up front: the upsert is ON CONFLICT / ON DUPLICATE KEY, which Redshift, Snowflake,
    # MSSQL or BigQuery reject only after every result was staged (and the run paid for).
    raise ConfigurationError(
        f"merging into a {conn_type or type(hook).__name__!r} connection is not supported yet; "
        "the results table can be PostgreSQL, DuckDB, SQLite or MySQL/MariaDB "
        "(building batches reads from any common-sql database)"
    )


# ---- overlapped COPY (psycopg 3) -----------------------------------------------------------
class _SpoolAborted(Exception):
    """The other side of a spool gave up; the real error is reported by whoever failed."""


#: Bytes of COPY text per round when rows are loaded in rounds (one spool file each): small
#: enough that the last round, the only one nothing overlaps, is short; large enough that
#: per-round statements stay a small share of the work. A file is deleted once its round is
#: loaded, so the disk holds what is not loaded yet.
ROUND_BYTES = 24 << 20
#: Rounds of each size before the size doubles (each round is a table until commit).
ROUNDS_PER_SIZE = 16


def _nothing() -> None:
    """No work before a load."""


class _Spool:
    """Temp files one thread appends to while another reads them in order and then deletes them.

    It lets Python format COPY rows at full speed while the connection is still busy with
    earlier work, without holding the rows in memory: what is not yet sent waits on disk.
    The writer side is a psycopg ``copy.Writer`` (``write``/``finish``).
    """

    def __init__(self, segment: int, *, double_every: int | None = None) -> None:
        self._segment = segment
        # With ``double_every``, files get twice as large after that many: a reader that loads
        # each file into a table of its own (rounds) then makes a few hundred tables for 100 GB,
        # not thousands (each holds locks until commit).
        self._double_every = double_every
        self._created = 0
        # Each entry: [file, bytes written]; the last one is being written.
        self._files: list[list[Any]] = []
        self._done = False
        self._failed = False
        #: Which side failed first: "writer" or "reader" (None while both are fine).
        self.first_failure: str | None = None
        self._cond = threading.Condition()

    def write(self, data: Any) -> None:
        if self._failed:
            raise _SpoolAborted("the COPY reading this spool failed")
        with self._cond:
            if not self._files or self._files[-1][1] >= self._segment_size():
                self._files.append([tempfile.TemporaryFile(prefix="abp-copy-"), 0])  # noqa: SIM115
                self._created += 1
            current = self._files[-1]
        view = memoryview(data)
        fd = current[0].fileno()
        while view:
            # os.write may write less than asked (a full disk); never count what was not written.
            view = view[os.write(fd, view) :]
        with self._cond:
            current[1] += len(data)
            self._cond.notify()

    def _segment_size(self) -> int:
        """Size at which the current file is complete."""
        if not self._double_every:
            return self._segment
        return self._segment << ((self._created - 1) // self._double_every)

    def finish(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self.fail("writer")
        with self._cond:
            self._done = True
            self._cond.notify()

    def fail(self, side: str) -> None:
        """Stop both sides; ``side`` ("writer" or "reader") is the one that failed."""
        with self._cond:
            self._failed = True
            self.first_failure = self.first_failure or side
            self._cond.notify_all()

    def files(self) -> Iterator[Iterator[bytes]]:
        """The chunks of each spool file in turn, for a reader that loads every file on its own.

        Each file holds whole rows: psycopg's formatter hands over its buffer only after a row.
        """
        while True:
            with self._cond:
                while not self._failed and not self._files and not self._done:
                    self._cond.wait()
                if self._failed:
                    raise _SpoolAborted("the rows could not all be produced")
                if not self._files:
                    return
            yield self._file_chunks()

    def _file_chunks(self, size: int = 1 << 20) -> Iterator[bytes]:
        """The next file's bytes as they are written, until it is complete; it is then freed."""
        offset = 0
        while True:
            with self._cond:
                while (
                    not self._failed
                    and (not self._files or offset >= self._files[0][1])
                    and not (self._done or len(self._files) > 1)
                ):
                    self._cond.wait()
                if self._failed:
                    raise _SpoolAborted("the rows could not all be produced")
                if not self._files:
                    return  # done, nothing was ever written
                handle, available = self._files[0]
                if offset >= available:
                    # Complete (another file follows, or the writer is done) and read: free it.
                    self._files.pop(0)[0].close()
                    return
            # pread: the writer's file position is never touched from this thread.
            data = os.pread(handle.fileno(), min(size, available - offset), offset)
            if not data:
                raise OSError(f"spool file ended at byte {offset} of {available}")
            offset += len(data)
            yield data

    def close(self) -> None:
        with self._cond:
            for handle, _ in self._files:
                handle.close()
            self._files = []


def _utf8(conn: Any) -> bool:
    return str(getattr(getattr(conn, "info", None), "encoding", "")).replace("_", "-").lower() == "utf-8"


def _copy_from(conn: Any, sql: str, chunks: Iterable[bytes]) -> None:
    cur = conn.cursor()
    try:
        with cur.copy(sql) as copy:
            for chunk in chunks:
                copy.write(chunk)
    finally:
        cur.close()


def _overlapped_copy(
    conn: Any,
    rows: Iterable[Sequence[Any]],
    before: Callable[[], Any],
    load: Callable[[_Spool], Any],
    *,
    segment: int,
    double_every: int | None = None,
) -> int:
    """Run ``before`` and then ``load`` (COPYs reading the spool) on ``conn`` in a worker thread
    while this thread formats ``rows`` into a spool the COPYs read as it grows.

    The connection is only ever used by the worker; this thread only formats (psycopg's
    C formatter) and writes local files. ``before`` is typically PostgreSQL parsing the keys
    file, which otherwise leaves Python idle for seconds per million keys. Either side's
    error stops the other (a failure here also cancels the worker's statement), and the
    error of the side that failed first is raised.
    """
    from psycopg import Copy

    spool = _Spool(segment, double_every=double_every)
    count = 0
    iterator = iter(rows)
    formatting = conn.cursor()
    try:
        # Built before the worker starts, with the first row's dumpers: those read the
        # connection's client encoding, which nothing changes during the merge; a type first
        # seen later reads it once more, and that read touches no state the worker changes.
        formatter = Copy(formatting, writer=spool, binary=False)  # type: ignore[arg-type]
        first = next(iterator, None)
        if first is not None:
            formatter.write_row(first)
            count = 1

        def work() -> None:
            try:
                started = time.perf_counter()
                before()
                log.debug("%.2fs: staged before the rows", time.perf_counter() - started)
                load(spool)
                log.debug("%.2fs: loaded the rows", time.perf_counter() - started)
            except BaseException:
                spool.fail("reader")
                raise

        formatted = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="abp-pg-load") as pool:
            loading = pool.submit(work)
            try:
                with formatter:
                    for row in iterator:
                        formatter.write_row(row)
                        count += 1
                log.debug("%.2fs: %d rows formatted", time.perf_counter() - formatted, count)
            except BaseException as exc:
                if not isinstance(exc, _SpoolAborted):
                    spool.fail("writer")
                if spool.first_failure == "writer":
                    # Do not wait for the worker's statement (keys can take minutes) to finish.
                    cancel = getattr(conn, "cancel_safe", None) or getattr(conn, "cancel", None)
                    if cancel is not None:
                        with contextlib.suppress(Exception):
                            cancel()
                worker_error = None
                try:
                    loading.result()
                except Exception as error:
                    worker_error = error
                if spool.first_failure == "reader" and worker_error is not None:
                    raise worker_error from (None if isinstance(exc, _SpoolAborted) else exc)
                raise
            loading.result()
    finally:
        formatting.close()
        spool.close()
    return count


# ---- psycopg2 COPY text format -------------------------------------------------------------
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _without_nul(rows: Iterable[Sequence[Any]]) -> Iterator[Sequence[Any]]:
    """Rows with NUL characters in text replaced by U+FFFD.

    PostgreSQL text cannot hold NUL (valid in JSON as ``\\u0000``, so a model can answer with
    one); left in, one such answer would abort the whole merge transaction.
    """
    for row in rows:
        for value in row:
            if type(value) is str and "\x00" in value:
                row = tuple(v.replace("\x00", "\ufffd") if type(v) is str else v for v in row)
                break
        yield row


def _copy_field(value: Any) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value).translate(_COPY_ESCAPES)


class _CopyTextReader:
    """A file-like view of rows in COPY text format, produced as psycopg2 reads it."""

    def __init__(self, rows: Iterable[Sequence[Any]]) -> None:
        self._rows: Iterator[Sequence[Any]] = iter(rows)
        self._buffer = b""
        self.rows = 0

    def read(self, size: int = -1) -> bytes:
        size = 1 << 16 if size is None or size < 0 else size
        parts = [self._buffer]
        have = len(self._buffer)
        while have < size:
            row = next(self._rows, None)
            if row is None:
                break
            line = ("\t".join(map(_copy_field, row)) + "\n").encode()
            parts.append(line)
            have += len(line)
            self.rows += 1
        data = b"".join(parts)
        self._buffer = data[size:]
        return data[:size]

    readline = read
