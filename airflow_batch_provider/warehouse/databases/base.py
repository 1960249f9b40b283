"""The generic warehouse SQL dialect: statement text, quoting, types, capabilities, inspection.

Like common-sql's ``hook.dialect``, one small object per database holds every piece of
database-specific SQL and every fact the merge and the row source need about a database
(declared as class attributes at the top of each class: ``name``, ``conn_types``,
``capabilities``...). It builds on the hook's own settings (``escape_word_format``,
``placeholder``) and on common-sql's ``Dialect.generate_insert_sql`` for the generic
``executemany`` path, so a connection that overrides those in its extras is honoured.
Bulk-load engines live beside the dialects, in ``warehouse/loaders/``.

Identifiers are always quoted here, and a quote character inside a name is doubled:
common-sql's ``escape_word`` only quotes reserved or unusual words and does not escape an
embedded quote, which is not enough for names taken from user input.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from typing import IO, Any, ClassVar

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.warehouse.lines import JsonSql, LineNumbers, RawResults, SharedParse
from airflow_batch_provider.warehouse.rows import Column

_BATCH_ROWS = 5000
_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


@dataclass(frozen=True)
class Capabilities:
    """What a database can do that changes how the merge writes (see ``warehouse/plan.py``).

    :param savepoints: a failed statement can be undone alone (``SAVEPOINT``/``ROLLBACK TO``),
        so a statement may be tried and, on a known error, retried another way.
    :param returning_counts: ``WITH w AS (INSERT ... RETURNING ...) SELECT ...`` works, so the
        rows written are counted per status while writing.
    :param exclusive_merge: the merge holds the table alone from ``lock_table`` to commit, so a
        table it created is known to be empty (then a plain INSERT is enough).
    :param upsert_by_replace: upsert by deleting the keys about to be written and inserting,
        where ``ON CONFLICT DO UPDATE`` holds every updated row in memory (only for tables with
        no columns of their own).
    :param keyless_tables: a table the merge creates goes without a primary key, its rows being
        replaced by key (``upsert_by_replace``) by merges that hold the table alone.
    :param enforces_unique_keys: a primary key refuses a second row with its key (Snowflake
        declares keys but never enforces them: a manifest's keys are then checked for repeats).
    :param upsert_by_update: upsert as ``UPDATE`` then ``INSERT`` in the merge's transaction
        instead of one statement (``update_then_insert``; no unique index needed).
    """

    savepoints: bool = False
    returning_counts: bool = False
    exclusive_merge: bool = False
    upsert_by_replace: bool = False
    keyless_tables: bool = False
    enforces_unique_keys: bool = True
    upsert_by_update: bool = False


class SqlDialect:
    """Generic SQL (SQLite flavoured), used to read from any DbApiHook without a dialect of
    its own; the merge refuses it (``merges`` is False).

    :param hook: the target connection's ``DbApiHook``.
    """

    name = "generic"
    #: Connection types (``hook.conn_type``) this dialect is picked for.
    conn_types: ClassVar[tuple[str, ...]] = ()
    #: Whether a results table can be merged into on this database.
    merges: ClassVar[bool] = False
    capabilities: Capabilities = Capabilities()
    #: Longest identifier in bytes the database keeps whole (PostgreSQL cuts longer ones).
    max_identifier_bytes: ClassVar[int | None] = None
    #: Whether a streaming cursor describes its columns only after the first fetch.
    describes_after_fetch: ClassVar[bool] = False
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
    #: A session setting (see ``set_setting``).
    set_format = "SET {} = {}"
    #: The JSON primitives with which the database reads result lines itself (see
    #: ``warehouse/lines.py``); None: Python reads them.
    line_json: ClassVar[JsonSql | None] = None

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

    def update_then_insert(
        self, table: str, columns: Sequence[str], keys: Sequence[str], select: str
    ) -> tuple[str | None, str]:
        """An upsert as two statements that need no unique index: ``UPDATE ... FROM`` the rows
        of ``select`` whose keys exist, then ``INSERT`` the others (each binds ``select``'s
        parameters once). No ``UPDATE`` (None) where the second statement does both (``MERGE``)."""
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

    # ---- savepoints and errors (only where ``capabilities.savepoints``) ----------------------
    def savepoint(self, name: str) -> str:
        return f"SAVEPOINT {name}"

    def rollback_to(self, name: str) -> str:
        return f"ROLLBACK TO SAVEPOINT {name}"

    def release(self, name: str) -> str:
        return f"RELEASE SAVEPOINT {name}"

    def is_duplicate_key(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a unique or primary key violation."""
        return False

    def is_row_written_twice(self, exc: BaseException) -> bool:
        """Whether ``exc`` says one statement would update the same row twice."""
        return False

    # ---- transactions ------------------------------------------------------------------------
    def cursor(self, conn: Any) -> Any:
        """A cursor that shares the connection's transaction and temp tables."""
        return conn.cursor()

    def server_cursor(self, conn: Any) -> Any:
        """A cursor for a large result read in pages (server-side where the database has one)."""
        return self.cursor(conn)

    def begin(self, conn: Any) -> None:
        """Start the one transaction of the merge (DB-API drivers open one implicitly)."""

    def begin_writes(self, conn: Any) -> None:
        """Called once staging is done, before the first write to the results table: where DDL
        commits an open transaction (Snowflake), the merge's transaction starts here instead."""

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

    def add_column(self, conn: Any, table: str, schema: str | None, name: str, portable: str) -> None:
        """Add the nullable column ``name`` (of portable type ``portable``) to an existing table.

        :param table: the table's name, unquoted; ``schema`` likewise.
        """
        cur = self.cursor(conn)
        try:
            column = f"{self.quote(name)} {self.sql_type(portable)}"
            cur.execute(f"ALTER TABLE {self.table(table, schema)} ADD COLUMN {column}")
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

    def load_raw_lines(
        self,
        conn: Any,
        table: str,
        lines: Iterable[tuple[int, int, bytes]],
        numbers: LineNumbers,
        parse: Callable[[str], Sequence[str]] | None = None,
    ) -> int | None:
        """Stage raw result lines ``(file index, line number, bytes)`` in ``table`` (``seq, f, n,
        line, hex``, read through ``raw_source``); the lines loaded, or None, loading nothing,
        where this connection cannot. A dialect that stages only the line text notes where each
        line came from in ``numbers``.

        Where ``line_json.while_loading``, the lines are not kept: ``parse`` is given the FROM
        item of each loaded chunk and returns the statements that read it (they put the lines
        Python must read into ``table``).
        """
        return None

    #: ``load_raw_lines_shared`` may load with a second connection of the same hook.
    shares_parsing: ClassVar[bool] = False

    def load_raw_lines_shared(
        self, conn: Any, table: str, raw: RawResults, numbers: LineNumbers, share: SharedParse
    ) -> int | None:
        """Like ``load_raw_lines`` (from ``raw.chunks`` where there are), with a second connection
        (``share``) parsing a share of the lines while they load; every line's row is then in
        ``share.results``, and the lines of the rows flagged for Python in ``table``; the lines
        that are not blank. None, loading nothing, where this is not done."""
        return None

    def raw_source(self, table: str, numbers: LineNumbers) -> str:
        """The staged raw lines of ``table`` as a FROM item with columns ``seq, f, n, line, hex``."""
        return table

    # ---- reading (the streaming row source) ---------------------------------------------------
    def stream_cursor(self, conn: Any, batch_size: int) -> Any:
        """A cursor that streams a query's rows instead of holding them all on the client."""
        cursor = conn.cursor()
        with contextlib.suppress(AttributeError, TypeError):
            cursor.arraysize = batch_size
        return cursor

    def read_settings(self, conn: Any, session_sql: Sequence[str]) -> list[str]:
        """Statements run before a streamed read, besides the caller's ``session_sql``."""
        return []

    def column_type(self, description_row: Sequence[Any]) -> str | None:
        """The portable type of one column of a cursor description (None when not known)."""
        from airflow_batch_provider.warehouse.read import portable_type_name

        code = description_row[1] if len(description_row) > 1 else None
        return None if code is None else portable_type_name(str(code))


def _nothing() -> None:
    """No work before a load."""


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
