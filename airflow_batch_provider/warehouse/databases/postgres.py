"""PostgreSQL: COPY into ON COMMIT DROP temp tables, then ``INSERT ... ON CONFLICT``; savepoints."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import IO, Any

from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect
from airflow_batch_provider.warehouse.lines import (
    ROW_COLUMNS,
    JsonSql,
    LineNumbers,
    RawResults,
    SharedParse,
    bare_records,
    beyond_orjson,
    literal,
    raw_blocks,
)
from airflow_batch_provider.warehouse.loaders import pg_copy
from airflow_batch_provider.warehouse.rows import Column

log = logging.getLogger(__name__)

# PostgreSQL type OIDs -> portable type names (psycopg 3 and psycopg2 both report the OID).
_PG_OIDS: dict[int, str] = {
    16: "boolean",
    20: "integer",
    21: "integer",
    23: "integer",
    26: "integer",
    700: "float",
    701: "float",
    1700: "float",
    18: "text",
    19: "text",
    25: "text",
    1042: "text",
    1043: "text",
    2950: "text",
    1082: "date",
    1114: "timestamp",
    1184: "timestamp",
    114: "json",
    3802: "json",
}


class PostgresJson(JsonSql):
    """jsonb: each line is parsed once (``OFFSET 0`` keeps the planner from inlining the cast
    into every leaf), then read with ``#>`` paths."""

    fence = " OFFSET 0"
    # The statement's cost estimate is high enough for JIT, whose compiling of this many
    # expressions took longer than running them (17 s against 4 s for 100k lines).
    before = ("SET LOCAL jit = off",)
    after = ("RESET jit",)
    # Measured by bench_merge (1M chat lines, two connections parsing): the merge runs at
    # ~0.55-0.75x of the Python path. Staging a raw line and casting it to jsonb alone cost the
    # server ~4.4 us (the cast ~2.4), more than COPY of a parsed row, and the common-line SQL
    # ~7.4 us; on 2 cores that extra work cannot be hidden. It saves ~3/4 of worker CPU.
    not_auto = "PostgreSQL parses result lines slower than the worker's overlapped Python path"

    common_rows = True

    def parse(self, line: str) -> str:
        return f"CAST({line} AS jsonb)"

    def value(self, doc: str, path: tuple[str | int, ...]) -> str:
        # One lookup of the whole path: ``->`` steps would each copy the value they go through.
        return f"({doc} #> ARRAY[{', '.join(literal(str(p)) for p in path)}]::text[])" if path else doc

    def kind(self, value: str) -> str:
        return f"jsonb_typeof({value})"

    def numeric(self, value: str) -> str:
        return f"CAST({value} AS numeric)"

    def whole(self, numeric: str) -> str:
        # jsonb keeps a number's digits after the point (1.0 stays 1.0), never an exponent.
        return f"(scale({numeric}) = 0)"

    def spelled(self, line: str) -> str:
        # A member (``"key": value``, whatever the key's spelling) whose number has an exponent.
        # Cheaper than naming the keys: an alternation of the six keys took ~5 us a line, this ~1.
        return f"({line} ~ E'\"[[:space:]]*:[[:space:]]*-?[0-9.]+[eE]')"

    def ambiguous(self, line: str, doc: str) -> str:
        # jsonb keeps one value of a repeated key: its text has fewer string tokens, so fewer
        # quotes (a quote inside text is written \" on both sides, unless the line spelled it
        # \u0022: then Python reads it). The cost: writing each line's jsonb as text again;
        # measured on bench_merge's chat lines, the common-line SQL went from ~11 to ~21 us a
        # line (the quote counts ~5, the regular expression ~3).
        # octet_length, not length: a text's length in characters scans it (UTF-8).
        quotes = "octet_length({0}) - octet_length(replace({0}, '\"', ''))"
        fewer = f"{quotes.format(line)} <> {quotes.format(f'CAST({doc} AS text)')}"
        odd = beyond_orjson(line, lambda text, pattern: f"({text} ~ {pattern})", "octet_length")
        return f"(strpos({line}, '\\u0022') > 0 OR {fewer} OR {odd})"

    def leaves(self, raw: str, paths: Sequence[tuple[str | int, ...]]) -> str:
        values = ", ".join(f"{self.value('j', path)} AS l{i}" for i, path in enumerate(paths))
        kinds = ", ".join(
            f"CASE jsonb_typeof(l{i}) WHEN 'number' THEN CASE WHEN CAST(l{i} AS text) ~ '^-?[0-9]+$' "
            f"THEN 'integer' ELSE 'number' END ELSE jsonb_typeof(l{i}) END AS k{i}"
            for i in range(len(paths))
        )
        spelled = self.spelled("line")
        parsed = f"SELECT seq, f, line, {spelled} AS ex, CAST(line AS jsonb) AS j FROM {raw} r OFFSET 0"
        amb = self.ambiguous("line", "j")
        level = f"SELECT seq, f, ex, {amb} AS amb, {values} FROM ({parsed}) a OFFSET 0"
        return f"(SELECT b.*, {kinds} FROM ({level}) b OFFSET 0)"

    def digits(self, text: str) -> str:
        return f"({text} ~ '^[0-9]+$')"

    def text(self, leaf: str) -> str:
        return f"({leaf} #>> '{{}}')"

    def number(self, leaf: str) -> str:
        return f"CAST(CAST({leaf} AS text) AS numeric)"

    def integer(self, leaf: str) -> str:
        return self.number(leaf)

    def length(self, leaf: str) -> str:
        return f"jsonb_array_length({leaf})"

    def json_text(self, leaf: str) -> str:
        return f"CAST({leaf} AS text)"

    def int_text(self, expression: str) -> str:
        return f"CAST({expression} AS text)"


class PostgresSqlDialect(SqlDialect):
    """PostgreSQL: COPY into an ON COMMIT DROP temp table, then one ``INSERT ... ON CONFLICT``."""

    name = "postgres"
    conn_types = ("postgres", "postgresql")
    merges = True
    capabilities = Capabilities(savepoints=True, returning_counts=True, exclusive_merge=True)
    max_identifier_bytes = 63
    describes_after_fetch = True  # psycopg 3 declares a named cursor's portal lazily
    temp_table = "CREATE TEMP TABLE {} ({}) ON COMMIT DROP"
    line_json = PostgresJson()
    shares_parsing = True
    types = {**SqlDialect.types, "json": "JSONB"}
    merged_at_type = "TIMESTAMP WITH TIME ZONE"
    # Only for this transaction: the connection may come back from a pool.
    set_format = "SET LOCAL {} = {}"

    def merged_at_value(self, when: datetime) -> Any:
        return when.astimezone(timezone.utc)

    def cast(self, expression: str, portable: str) -> str:
        if portable == "timestamp":
            return f"CAST({expression} AS TIMESTAMP WITH TIME ZONE)"
        return super().cast(expression, portable)

    def drop_temp_table(self, name: str) -> str | None:
        return None  # ON COMMIT DROP

    def is_duplicate_key(self, exc: BaseException) -> bool:
        return _sqlstate(exc) == "23505"  # unique_violation

    def is_row_written_twice(self, exc: BaseException) -> bool:
        # cardinality_violation: ON CONFLICT DO UPDATE would affect one row a second time.
        return _sqlstate(exc) == "21000"

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

    def load_keys_jsonl(self, conn: Any, table: str, handle: IO[bytes], key_types: Sequence[str]) -> bool:
        raw = self.quote(f"{table}_raw")
        create = (
            f"CREATE TEMP TABLE {raw} (seq BIGINT GENERATED ALWAYS AS IDENTITY, line TEXT) ON COMMIT DROP"
        )
        # CSV with delimiter and quote bytes that valid JSON never contains raw (control
        # characters must be escaped inside JSON strings): each line arrives verbatim,
        # backslashes included, and PostgreSQL parses the JSON on its own core.
        copy = f"COPY {raw} (line) FROM STDIN WITH (FORMAT csv, DELIMITER E'\\x01', QUOTE E'\\x02')"
        keys = ", ".join(self._key_expr(i, t) for i, t in enumerate(key_types))
        parse = (
            f"INSERT INTO {self.quote(table)} SELECT j->>'custom_id', CAST(j->>'shard' AS BIGINT), seq, "
            f"CASE WHEN jsonb_typeof(j->'key') = 'array' THEN jsonb_array_length(j->'key') END, "
            # request_hash and the custom_id whose result the key takes (see KeyRecord).
            f"CASE WHEN jsonb_typeof(j->'request_hash') = 'string' THEN j->>'request_hash' END, "
            f"CASE WHEN jsonb_typeof(j->'shared_answer') = 'string' AND j->>'shared_answer' <> '' "
            f"THEN j->>'shared_answer' ELSE j->>'custom_id' END"
            f"{', ' + keys if keys else ''} "
            f"FROM (SELECT seq, CAST(line AS JSONB) AS j FROM {raw} WHERE btrim(line) <> '' OFFSET 0) x"
        )
        # psycopg2 has no streaming COPY writer: the caller parses the lines in Python instead.
        return pg_copy.copy_file(
            conn, handle, before=create, copy_sql=copy, after=[parse, f"DROP TABLE {raw}"]
        )

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
        # Without rounds to run, there is nothing to overlap but ``before``: load plainly.
        if after_round is None or not pg_copy.can_load_in_rounds(conn):
            return None

        def round_sql(number: int) -> tuple[str, str, str]:
            # A round's rows go into a child table of ``table``, so ``table`` reads every row.
            part = f"{table}_{number}"
            create = f"CREATE TEMP TABLE {self.quote(part)} () INHERITS ({self.quote(table)}) ON COMMIT DROP"
            return part, create, self._copy_sql(part, columns)

        return pg_copy.load_in_rounds(conn, rows, before, round_sql, after_round)

    def _load_rows(
        self, conn: Any, table: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]
    ) -> int:
        return pg_copy.copy_rows(conn, self._copy_sql(table, columns), rows)

    def load_raw_lines(
        self,
        conn: Any,
        table: str,
        lines: Iterable[tuple[int, int, bytes]],
        numbers: LineNumbers,
        parse: Callable[[str], Sequence[str]] | None = None,
    ) -> int | None:
        # Only the text travels (formatting seq, file and line number took ~1.5 us a line):
        # PostgreSQL numbers the lines, and ``numbers`` says where each came from. CSV whose
        # delimiter and quote bytes never travel raw (lines holding them go hex, see bare_records).
        if not pg_copy.can_copy_records(conn):
            return None
        cur = conn.cursor()
        try:
            cur.execute(
                f"ALTER TABLE {self.quote(table)} ALTER COLUMN seq SET NOT NULL, "
                f"ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY"
            )
        finally:
            cur.close()
        copy = (
            f"COPY {self.quote(table)} (line) FROM STDIN "
            f"WITH (FORMAT csv, DELIMITER E'\\x01', QUOTE E'\\x02')"
        )
        return pg_copy.copy_records(conn, copy, bare_records(lines, numbers))

    def load_raw_lines_shared(
        self, conn: Any, table: str, raw: RawResults, numbers: LineNumbers, share: SharedParse
    ) -> int | None:
        # Casting lines to jsonb is most of the work and a backend uses one core: a second
        # connection loads and parses some rounds and sends their rows back (COPY TO STDOUT,
        # spooled, then COPY FROM STDIN here), while this one loads and parses the others.
        # Each round's lines are numbered from where the round starts (RESTART), so ``seq``
        # is the line's place in the whole stream on both.
        if not pg_copy.can_copy_records(conn):
            return None
        q = self.quote
        try:
            helper = share.connect()
        except Exception:
            # One connection then does it all (the pool or the server may allow no second one).
            log.warning("No second connection to parse result lines with; parsing them on one", exc_info=True)
            return None
        try:
            if not pg_copy.can_copy_records(helper):
                return None
            h_raw, h_rows = q(f"{table}_h"), q(f"{table}_hrows")
            cur = helper.cursor()
            try:
                for statement in (
                    *share.before,
                    # The columns of ``table`` (read through raw_source).
                    f"CREATE TEMP TABLE {h_raw} (seq BIGINT GENERATED ALWAYS AS IDENTITY, "
                    "f BIGINT, n BIGINT, line TEXT, hex TEXT)",
                    f"CREATE TEMP TABLE {h_rows} ({share.columns})",
                ):
                    cur.execute(statement)
            finally:
                cur.close()
            cur = conn.cursor()
            try:
                cur.execute(
                    f"ALTER TABLE {q(table)} ALTER COLUMN seq SET NOT NULL, "
                    f"ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY"
                )
            finally:
                cur.close()
            csv = "WITH (FORMAT csv, DELIMITER E'\\x01', QUOTE E'\\x02')"
            columns = ", ".join(q(c) for c in (*ROW_COLUMNS, "py"))

            def first_round(cursor: Any, first: int) -> str:
                cursor.execute(f"ALTER TABLE {q(table)} ALTER COLUMN seq RESTART WITH {first}")
                return f"COPY {q(table)} (line) FROM STDIN {csv}"

            def second_round(first: int) -> tuple[Sequence[str], str, Callable[[], Any], str]:
                readying = (
                    f"TRUNCATE {h_raw}, {h_rows}",
                    f"ALTER TABLE {h_raw} ALTER COLUMN seq RESTART WITH {first}",
                )
                # The rows, and the lines of those flagged for Python (to be read from ``table``).
                rows = (
                    f"SELECT {columns}, NULL FROM {h_rows} WHERE NOT py UNION ALL "
                    f"SELECT {', '.join(f'r.{c}' for c in columns.split(', '))}, w.line "
                    f"FROM {h_rows} r JOIN {h_raw} w ON w.seq = r.seq WHERE r.py"
                )
                source = self.raw_source(h_raw, numbers)
                return (
                    readying,
                    f"COPY {h_raw} (line) FROM STDIN {csv}",
                    lambda: share.parse(helper, source, h_rows),
                    rows,
                )

            def mine() -> None:
                share.parse(conn, self.raw_source(q(table), numbers), q(share.results))
                if share.meanwhile is not None:
                    share.meanwhile()

            _, spooled = pg_copy.copy_shared(
                conn,
                helper,
                raw_blocks(raw, numbers),
                first_round,
                second_round,
                mine,
            )
            cur = conn.cursor()
            try:
                for rows_file in spooled:
                    with rows_file, cur.copy(f"COPY {q(share.results)} ({columns}, line) FROM STDIN") as copy:
                        while chunk := rows_file.read(1 << 20):
                            copy.write(chunk)
                cur.execute(
                    f"INSERT INTO {q(table)} (seq, line) OVERRIDING SYSTEM VALUE "
                    f"SELECT seq, line FROM {q(share.results)} WHERE line IS NOT NULL"
                )
                # One row per line that is not blank.
                cur.execute(f"SELECT COUNT(*) FROM {q(share.results)}")
                lines = int(cur.fetchone()[0])
            finally:
                cur.close()
                for rows_file in spooled:
                    rows_file.close()
            return lines
        finally:
            helper.close()

    def raw_source(self, table: str, numbers: LineNumbers) -> str:
        hexed = "left(line, 1) = E'\\x03'"
        # Blank lines staged from chunks (see lines.raw_blocks): empty (NULL), or only the
        # blanks bytes.strip drops (a carriage return never travels as text).
        blank = "line IS NULL OR (ascii(line) IN (9, 11, 12, 32) AND btrim(line, E' \\t\\x0b\\x0c') = '')"
        return (
            f"(SELECT seq, {numbers.file_sql('seq')} AS f, n, "
            f"CASE WHEN {hexed} THEN NULL ELSE line END AS line, "
            f"CASE WHEN {hexed} THEN substr(line, 2) ELSE hex END AS hex FROM {table} "
            f"WHERE NOT ({blank}))"
        )

    # ---- reading ------------------------------------------------------------------------------
    def server_cursor(self, conn: Any) -> Any:
        return conn.cursor(name=f"abp_retry_{uuid.uuid4().hex[:8]}")

    def stream_cursor(self, conn: Any, batch_size: int) -> Any:
        # A named, server-side cursor: rows arrive ``batch_size`` at a time from a portal, as
        # plain tuples whatever row factory the connection's "cursor" extra chose (dict rows...).
        name = f"abp_{uuid.uuid4().hex}"
        if type(conn).__module__.startswith("psycopg2"):
            import psycopg2.extensions

            cursor = conn.cursor(name=name, cursor_factory=psycopg2.extensions.cursor)
        else:
            from psycopg.rows import tuple_row

            cursor = conn.cursor(name=name, row_factory=tuple_row)
        with contextlib.suppress(AttributeError):
            cursor.itersize = batch_size
        return cursor

    def column_type(self, description_row: Sequence[Any]) -> str | None:
        code = description_row[1] if len(description_row) > 1 else None
        if not isinstance(code, int):
            return super().column_type(description_row)
        kind = _PG_OIDS.get(code)
        if kind == "float" and code == 1700 and len(description_row) > 5 and description_row[5] == 0:
            return "integer"  # numeric(p, 0)
        return kind or "text"


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg (3: ``sqlstate``) or psycopg2 (``pgcode``) error."""
    return getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
