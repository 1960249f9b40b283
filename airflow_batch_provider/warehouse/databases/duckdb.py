"""DuckDB: rows staged as JSONL chunk files read with ``read_json``; keyless tables replaced by key."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import IO, Any

from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect
from airflow_batch_provider.warehouse.lines import JsonSql, LineNumbers, beyond_orjson, literal, raw_records
from airflow_batch_provider.warehouse.loaders import duckdb_files
from airflow_batch_provider.warehouse.rows import Column

# DuckDB spills what does not fit to its temp directory, so a query that needs more still runs.
READ_MEMORY_LIMIT = "32MB"


class DuckDBJson(JsonSql):
    """DuckDB json: every leaf of a line is extracted in one ``json_extract`` (one parse)."""

    # The staged rows carry their order (seq): keeping insertion order only costs memory.
    before = ("SET preserve_insertion_order = false",)
    after = ("RESET preserve_insertion_order",)
    # Temp tables live in memory: every raw line kept until the end would hold the result files.
    while_loading = True
    # DuckDB inlines each shared clause into every use (no OFFSET 0 fence): measured on 100k
    # chat lines, ~44 us a line on one thread and over 64 MB of memory_limit, against ~14 us a
    # line of Python parsing in the same process (DuckDB runs in the worker: no CPU is saved).
    not_auto = "DuckDB reads result lines slower than Python does, in the same process"

    _KINDS = (
        "CASE json_type({0}) WHEN 'OBJECT' THEN 'object' WHEN 'ARRAY' THEN 'array' WHEN 'VARCHAR' "
        "THEN 'string' WHEN 'BIGINT' THEN 'integer' WHEN 'UBIGINT' THEN 'integer' WHEN 'DOUBLE' "
        "THEN 'number' WHEN 'BOOLEAN' THEN 'boolean' WHEN 'NULL' THEN 'null' END"
    )

    def leaves(self, raw: str, paths: Sequence[tuple[str | int, ...]]) -> str:
        def json_path(path: tuple[str | int, ...]) -> str:
            return "$" + "".join(f"[{p}]" if isinstance(p, int) else f'."{p}"' for p in path)

        extract = ", ".join(literal(json_path(p)) for p in paths)
        values = ", ".join(["ex", "amb", *(f"v[{i + 1}] AS l{i}" for i in range(len(paths)))])
        kinds = ", ".join(self._KINDS.format(f"l{i}") + f" AS k{i}" for i in range(len(paths)))
        parsed = (
            f"SELECT seq, f, {self.spelled('line')} AS ex, "
            f"CASE WHEN json_valid(line) THEN {self.ambiguous('line', 'line')} END AS amb, "
            f"CASE WHEN json_valid(line) THEN json_extract(line, [{extract}]) END AS v "
            f"FROM {raw} r"
        )
        return f"(SELECT b.*, {kinds} FROM (SELECT seq, f, {values} FROM ({parsed}) a) b)"

    def ambiguous(self, line: str, doc: str) -> str:
        # DuckDB keeps every value of a repeated key (and reads the first): the keys of the line
        # and of each object in it (json_keys gives them decoded, repeats kept). NaN and
        # Infinity are JSON to DuckDB, not to orjson. (Surrogate escapes never get here: see
        # lines.raw_records.)
        repeats = "len({0}) <> len(list_distinct({0}))"
        import duckdb

        # DuckDB 1.3 brought ``lambda k:``, and deprecates ``k ->`` since.
        arrow = "lambda k:" if version_tuple(duckdb.__version__) >= (1, 3) else "k ->"
        nested = f"list_bool_or(list_transform(json_keys({doc}, '$..*'), {arrow} {repeats.format('k')}))"
        return (
            f"({repeats.format(f'json_keys({doc})')} OR COALESCE({nested}, FALSE) "
            f"OR regexp_matches({line}, 'NaN|Infinity') "
            f"OR {beyond_orjson(line, lambda text, pattern: f'regexp_matches({text}, {pattern})', 'strlen')})"
        )

    def digits(self, text: str) -> str:
        return f"regexp_full_match({text}, '[0-9]+')"

    def text(self, leaf: str) -> str:
        return f"({leaf} ->> '$')"

    def number(self, leaf: str) -> str:
        return f"TRY_CAST(CAST({leaf} AS VARCHAR) AS DOUBLE)"

    def integer(self, leaf: str) -> str:
        return f"TRY_CAST(CAST({leaf} AS VARCHAR) AS HUGEINT)"

    def length(self, leaf: str) -> str:
        return f"json_array_length({leaf})"

    def json_text(self, leaf: str) -> str:
        return f"CAST({leaf} AS VARCHAR)"


class DuckDBSqlDialect(SqlDialect):
    """DuckDB: rows are staged as JSONL files in chunks and read with ``read_json`` (its bulk path)."""

    name = "duckdb"
    conn_types = ("duckdb",)
    merges = True
    # One process writes a DuckDB file at a time (exclusive_merge).
    # upsert_by_replace: DuckDB's ON CONFLICT DO UPDATE keeps each updated row's old version in
    # memory: re-merging 1M rows failed at memory_limit=256MB, while DELETE + INSERT in the same
    # transaction (the insert is written to the file as it goes) used ~96 MB.
    # keyless_tables: DuckDB keeps a primary key's index (ART) in memory, and a merge loads and
    # grows it: its memory would follow the table's size, and re-merging 1M rows needed over
    # 96MB of memory_limit for it. Merges replace rows by key and run alone on a DuckDB file, so
    # a table they create does not need it; a table created with one keeps it.
    # Both need DuckDB 1.2 (see __init__).
    capabilities = Capabilities(exclusive_merge=True, upsert_by_replace=True, keyless_tables=True)
    types = {**SqlDialect.types, "json": "JSON", "float": "DOUBLE", "text": "VARCHAR"}
    merged_at_type = "TIMESTAMP WITH TIME ZONE"
    chunk_rows = 100_000
    line_json = DuckDBJson()

    def __init__(self, hook: Any) -> None:
        super().__init__(hook)
        import duckdb

        if version_tuple(duckdb.__version__) < (1, 2):
            # Before 1.2, DuckDB refused to re-insert a key deleted in the same transaction,
            # and had no multi-column ``IN (SELECT ...)``.
            self.capabilities = replace(self.capabilities, upsert_by_replace=False, keyless_tables=False)

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
        keys = ", ".join(self._key_expr(i, t) for i, t in enumerate(key_types))
        with duckdb_files.numbered_lines(handle) as (path, longest):
            conn.execute(
                # Each line arrives as ``[n, line]``. A line that is not one JSON value
                # (``{...},{...}``) wraps into a longer array: no custom_id, reported by number.
                f"INSERT INTO {self.quote(table)} SELECT CASE WHEN json_array_length(j) = 2 "
                f"THEN j->1->>'custom_id' END, CAST(j->1->>'shard' AS BIGINT), "
                f"CAST(j->>0 AS BIGINT), json_array_length(j->1->'key'), "
                # request_hash and the custom_id whose result the key takes (see KeyRecord).
                f"CASE WHEN json_type(j->1->'request_hash') = 'VARCHAR' THEN j->1->>'request_hash' END, "
                f"CASE WHEN json_type(j->1->'shared_answer') = 'VARCHAR' AND j->1->>'shared_answer' <> '' "
                f"THEN j->1->>'shared_answer' ELSE CASE WHEN json_array_length(j) = 2 "
                f"THEN j->1->>'custom_id' END END"
                f"{', ' + keys if keys else ''} "
                f"FROM read_json(?, format='newline_delimited', records=false, columns={{'j': 'JSON'}}, "
                f"maximum_object_size={duckdb_files.json_buffer(longest + 32)})",
                [path],
            )
        return True

    def _key_expr(self, index: int, portable: str) -> str:
        key = "j->1->'key'"
        if portable == "json":
            return f"CAST({key}->{index} AS VARCHAR)"
        if portable == "text":
            return f"{key}->>{index}"
        return f"CAST({key}->>{index} AS {self.sql_type(portable)})"

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
        # Read as a list of text values (JSON strings unescaped, numbers and booleans as their
        # text, null as NULL) and cast per column: extracting from a JSON column instead held
        # ~60 MB per statement outside what spills, whatever the chunk size.
        extract = ", ".join(
            f"CAST(j[{i + 1}] AS {self.sql_type(c.type)})" if c.type != "text" else f"j[{i + 1}]"
            for i, c in enumerate(columns)
        )
        sql = (
            f"INSERT INTO {self.quote(table)} ({', '.join(self.quote(c.name) for c in columns)}) "
            f"SELECT {extract} FROM read_json(?, format='newline_delimited', "
            "records=false, columns={'j': 'VARCHAR[]'}, maximum_object_size=?)"
        )
        return duckdb_files.load_chunks(conn, sql, rows, self.chunk_rows)

    def load_raw_lines(
        self,
        conn: Any,
        table: str,
        lines: Iterable[tuple[int, int, bytes]],
        numbers: LineNumbers,
        parse: Callable[[str], Sequence[str]] | None = None,
    ) -> int | None:
        # The records' separator never travels raw (lines holding it go as hex); no quoting.
        source = (
            "read_csv(?, delim='\x01', quote='', escape='', header=false, auto_detect=false, "
            "max_line_size=?, columns={'seq': 'BIGINT', 'f': 'INTEGER', 'n': 'BIGINT', 'line': 'VARCHAR', "
            "'hex': 'VARCHAR'})"
        )
        if parse is None:
            sql: Any = f"INSERT INTO {self.quote(table)} SELECT * FROM {source}"
        else:

            def sql() -> Sequence[str]:
                return parse(source)

        return duckdb_files.load_lines(conn, sql, raw_records(lines), self.chunk_rows)

    # ---- reading ------------------------------------------------------------------------------
    def read_settings(self, conn: Any, session_sql: Sequence[str]) -> list[str]:
        """The bounded buffer pool for a read of a file-backed DuckDB, unless the caller chose one.

        By default DuckDB keeps every scanned block cached, so the worker would grow with the
        table (measured: +124 MB at 3M rows, +197 MB at 6M; capped: +56 MB and +58 MB). An
        in-memory database keeps its data in that pool, so it is left alone.
        """
        return read_settings(conn, session_sql)


class _SameConnection:
    """DuckDB connection used as a cursor: execute/fetch on it, and closing it does nothing."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def close(self) -> None:
        """The connection is closed by the merge, not by its cursors."""


def read_settings(conn: Any, session_sql: Sequence[str]) -> list[str]:
    """See :meth:`DuckDBSqlDialect.read_settings`."""
    if any("memory_limit" in s.lower() or "max_memory" in s.lower() for s in session_sql):
        return []
    try:
        row = conn.execute(
            "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"
        ).fetchone()
    except Exception:  # an older DuckDB without duckdb_databases(): keep its defaults
        return []
    if not row or not row[0]:
        return []
    return [f"SET memory_limit = '{READ_MEMORY_LIMIT}'"]


def version_tuple(text: str) -> tuple[int, ...]:
    """``(1, 2)`` from ``"1.2.0"`` or ``"1.2.0.dev1"`` (leading numeric parts only)."""
    parts = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)
