"""The merge write path: stage keys and results, let the database join them, upsert once.

Everything happens on one connection in one transaction:

1. the write plan is decided once from the table's facts (``warehouse/plan.py``: insert into
   the new table, replace by key, update then insert, or upsert), creating the table if needed;
2. the manifest's keys, the build's rejects and the streamed result rows are bulk-loaded
   into temp tables (COPY on PostgreSQL, ``read_json`` on DuckDB, ``executemany`` elsewhere);
3. one ``INSERT ... SELECT keys LEFT JOIN results ...`` (as the plan says) writes one row per key,
   so a key with no result becomes ``missing`` without Python ever holding the key set;
4. counts, orphans and retryable keys are read back from the temp tables; then commit.

A failure anywhere rolls the whole merge back, leaving the table as it was.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson

from airflow_batch_provider.exceptions import WarehouseSchemaError
from airflow_batch_provider.jsonl import iter_objects
from airflow_batch_provider.models import ResultLine
from airflow_batch_provider.records import KeyRecord, RejectRecord, RetryKey
from airflow_batch_provider.warehouse.databases import SqlDialect, get_sql_dialect
from airflow_batch_provider.warehouse.lines import (
    ROW_COLUMNS,
    LineNumbers,
    RawResults,
    SharedParse,
    common_row_sql,
    result_row_sql,
)
from airflow_batch_provider.warehouse.plan import WriteMode, WritePlan, plan_write
from airflow_batch_provider.warehouse.rows import (
    ADDABLE_COLUMNS,
    ANSWERED_BY_COLUMNS,
    COST_COLUMN,
    REQUEST_COLUMNS,
    RETRYABLE_STATUSES,
    STATUSES,
    Column,
    ResultMapper,
)

if TYPE_CHECKING:
    from airflow_batch_provider.prices import Price

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_SAMPLES = 10
_FETCH = 10_000
#: Where result lines are parsed: ``auto`` (by the database where it can, see ``parses_lines``),
#: ``python`` or ``database`` (refused where the database cannot).
PARSE_IN_CHOICES = ("auto", "python", "database")


@dataclass(frozen=True)
class ShardOutcome:
    """What to call a key of a shard that has no result line.

    :param batch_id: the batch the shard went to.
    :param absent_status: ``missing`` for a completed batch; ``expired``/``cancelled``/``failed``
        when the batch itself ended that way (its unprocessed lines have no result).
    """

    batch_id: str | None
    absent_status: str = "missing"


@dataclass(frozen=True)
class SqlStaging:
    """The merge's staging filled by SQL run in the target database, from tables already there
    (the BigQuery route: request, rejects and prediction tables), so no row passes through the
    worker. Each SELECT gives its staging table's columns in order (see ``_key_staging_columns``,
    ``_stage_keyed`` and the results' ``custom_id, seq, <mapper columns>``).

    :param keys: the keys' staged rows (``custom_id, shard, seq, klen, rhash, rid, k0..``).
    :param rejects: the keyed rejects' staged rows (``custom_id, seq, code, reason, k0..``).
    :param unkeyed_rejects: one row, one count: the rejects without a usable key.
    :param results: the results' staged rows.
    """

    keys: str
    rejects: str
    unkeyed_rejects: str
    results: str


@dataclass
class MergeReport:
    """What one merge wrote and found."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    rows_written: int = 0
    result_lines: int = 0
    orphan_results: int = 0
    orphan_samples: list[str] = field(default_factory=list)
    duplicate_results: int = 0
    unkeyed_rejects: int = 0
    unkeyed_reject_samples: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    created_table: bool = False
    bad_result_lines: int = 0
    bad_result_samples: list[str] = field(default_factory=list)
    bad_token_counts: int = 0
    bad_token_samples: list[str] = field(default_factory=list)
    #: The cost of the rows this merge wrote (USD), None when the price is not known.
    cost: float | None = None
    cost_by_status: dict[str, float | None] = field(default_factory=dict)
    cached_tokens: int = 0
    #: Rows given the answer of another key's identical request (a deduplicated build).
    shared_answers: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "shared_answers": self.shared_answers,
            "cost": self.cost,
            "cost_by_status": dict(self.cost_by_status),
            "cached_tokens": self.cached_tokens,
            "counts": dict(self.counts),
            "rows_written": self.rows_written,
            "result_lines": self.result_lines,
            "orphan_results": self.orphan_results,
            "orphan_samples": list(self.orphan_samples),
            "duplicate_results": self.duplicate_results,
            "unkeyed_rejects": self.unkeyed_rejects,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "created_table": self.created_table,
            "bad_result_lines": self.bad_result_lines,
            "bad_result_samples": list(self.bad_result_samples),
            "bad_token_counts": self.bad_token_counts,
            "bad_token_samples": list(self.bad_token_samples),
        }


def cost_sql(price: Price | None, quote: Callable[[str], str]) -> str:
    """SQL of one results row's cost (USD) from its token columns, as :meth:`Price.cost` computes
    it: a long-context tier applies to the whole row over its threshold; cached input tokens at
    their own price; 0 for a row with no token counts (never sent, or not billed); NULL without
    a price. The prices are numbers of this package's own making, written as literals."""
    if price is None:
        return "NULL"
    prompt, completion, cached = quote("prompt_tokens"), quote("completion_tokens"), quote("cached_tokens")

    def priced(input_tokens: int) -> str:
        rate_in, rate_cached, rate_out = (repr(float(r)) for r in price.rates(input_tokens))
        return (
            f"((COALESCE({prompt}, 0) - COALESCE({cached}, 0)) * {rate_in} "
            f"+ COALESCE({cached}, 0) * {rate_cached} + COALESCE({completion}, 0) * {rate_out})"
        )

    expr = priced(0)
    for tier in price.tiers:  # by rising threshold: the highest one passed wins
        expr = f"CASE WHEN {prompt} > {int(tier.threshold)} THEN {priced(tier.threshold + 1)} ELSE {expr} END"
    return f"CASE WHEN {prompt} IS NULL AND {completion} IS NULL THEN 0 ELSE {expr} END"


#: Called before commit with the :class:`~airflow_batch_provider.records.RetryKey` of every
#: retryable key, in build order (by shard, then by line of keys.jsonl).
RetryCallback = Callable[[Iterator[RetryKey]], Any]


class ResultsWriter:
    """Upserts batch results into a results table, one row per input key.

    :param hook: the target connection's ``DbApiHook``.
    :param table: target table name (quoted, never split on dots).
    :param schema: optional schema / database of the table.
    :param key_columns: the manifest's key columns with their portable types; empty means
        ``custom_id`` is the only key (a hand-made input file without a manifest).
    :param mapper: turns result lines into rows (extra columns, structured output).
    :param create_table: create the table when it does not exist (else it must exist).
    :param session_settings: database settings for the merge's own session only, e.g.
        ``{"memory_limit": "256MB"}`` (DuckDB) or ``{"maintenance_work_mem": "256MB"}`` (PostgreSQL).
    :param parse_in: where raw result lines (:class:`~airflow_batch_provider.warehouse.lines.RawResults`)
        are parsed: ``auto`` (the database where it can), ``python`` or ``database``.
    :param vendor: the vendor (dialect name) whose batches this merge reads, written to the
        ``vendor`` column of every row it writes except rejected ones (never sent); None: NULL.
    :param batch_conn_id: the batch connection those batches were read through (``batch_conn_id``).
    :param price: prices the rows this merge writes (the ``cost`` column); None: cost unknown (NULL).
    """

    def __init__(
        self,
        hook: Any,
        table: str,
        *,
        schema: str | None = None,
        key_columns: Sequence[Column] = (),
        mapper: ResultMapper | None = None,
        create_table: bool = True,
        session_settings: Mapping[str, str] | None = None,
        parse_in: str = "auto",
        vendor: str | None = None,
        batch_conn_id: str | None = None,
        price: Price | None = None,
    ) -> None:
        if parse_in not in PARSE_IN_CHOICES:
            raise WarehouseSchemaError(
                f"parse_in must be one of {', '.join(PARSE_IN_CHOICES)}, not {parse_in!r}"
            )
        self.parse_in = parse_in
        self.hook = hook
        self.dialect: SqlDialect = get_sql_dialect(hook)
        self.table_name = table
        self.schema = schema
        self.qtable = self.dialect.table(table, schema)
        self.key_columns = list(key_columns)
        self.mapper = mapper or ResultMapper()
        self.create_table = create_table
        self.session_settings = dict(session_settings or {})
        # One value per column for the whole merge: bound as parameters, never pasted into SQL.
        self.answered_by: tuple[str | None, ...] = (vendor, batch_conn_id)
        self.price = price
        names = [c.name for c in self.key_columns]
        if len(set(names)) != len(names):
            raise WarehouseSchemaError(f"key columns repeat a name: {names}")
        clash = [
            n
            for n in names
            if n in {c.name for c in (*self.mapper.columns, *ANSWERED_BY_COLUMNS)}
            or n in ("merged_at", "custom_id")
        ]
        if clash:
            raise WarehouseSchemaError(
                f"key column(s) {clash} clash with results columns of the same name; rename them in the build"
            )
        self.manifest_mode = bool(self.key_columns)
        # Target layout: keys, custom_id, result columns, merged_at.
        self.target_columns: list[Column] = [
            *self.key_columns,
            Column("custom_id", "text"),
            *self.mapper.columns,
            *ANSWERED_BY_COLUMNS,
            COST_COLUMN,
            *REQUEST_COLUMNS,
            Column("merged_at", "timestamp"),
        ]
        self.target_keys = [c.name for c in self.key_columns] if self.manifest_mode else ["custom_id"]
        self.dialect.check_identifiers(
            [("target_table", table), *([("target_schema", schema)] if schema else [])], distinct=False
        )
        extra = {c.name for c in self.mapper.extra_columns}
        keys = {c.name for c in self.key_columns}
        self.dialect.check_identifiers(
            [
                (
                    "key column"
                    if c.name in keys
                    else "extra column"
                    if c.name in extra
                    else "results column",
                    c.name,
                )
                for c in self.target_columns
            ]
        )

    # ---- DDL --------------------------------------------------------------------------------
    def _create_sql(self, *, primary_key: bool = True) -> str:
        keys = set(self.target_keys)
        parts = []
        for col in self.target_columns:
            is_key = col.name in keys
            if col.name == "merged_at":
                sql_type = self.dialect.merged_at_type
            else:
                sql_type = self.dialect.sql_type(col.type, key=is_key or col.name == "custom_id")
            parts.append(f"{self.dialect.quote(col.name)} {sql_type}{' NOT NULL' if is_key else ''}")
        if primary_key:
            parts.append(f"PRIMARY KEY ({', '.join(self.dialect.quote(k) for k in self.target_keys)})")
        # IF NOT EXISTS: where merges are not serialised (MySQL), a concurrent merge may have
        # created it since the probe.
        return f"CREATE TABLE IF NOT EXISTS {self.qtable} ({', '.join(parts)})"

    def _add_primary_key_sql(self) -> str:
        keys = ", ".join(self.dialect.quote(k) for k in self.target_keys)
        return f"ALTER TABLE {self.qtable} ADD PRIMARY KEY ({keys})"

    def _plan(self, conn: Any, report: MergeReport) -> WritePlan:
        """Decide how this merge writes (see ``warehouse/plan.py``) and create the table if it must."""
        d = self.dialect
        existing = d.probe_columns(conn, self.table_name, self.schema)
        plan = plan_write(
            d.capabilities,
            table=self.qtable,
            columns=existing,
            unique_keys=None if existing is None else d.unique_key_sets(conn, self.table_name, self.schema),
            target_columns=[c.name for c in self.target_columns],
            target_keys=self.target_keys,
            create_table=self.create_table,
            addable_columns=[c.name for c in ADDABLE_COLUMNS],
        )
        log.debug("Write plan for %s: %s", self.qtable, plan)
        if plan.create_table:
            self._execute(conn, self._create_sql(primary_key=plan.key_in_create))
            report.created_table = True
        for name in plan.add_columns:
            # A table created by an earlier version: its rows keep NULL in the new column.
            log.info("Adding column %s to %s (a results column of this version)", name, self.qtable)
            (col,) = [c for c in self.target_columns if c.name == name]
            d.add_column(conn, self.table_name, self.schema, name, col.type)
        return plan

    # ---- the merge --------------------------------------------------------------------------
    def parses_lines(self, shape: Any) -> str | None:
        """Why the database cannot parse raw result lines of ``shape`` for this merge, or None when it can.

        It cannot without a line shape (a vendor whose lines only Python reads), without JSON
        primitives in its SQL dialect, or when the rows need Python: extra columns (JSON text of
        any value) and structured output (a pydantic or JSON-schema validation). ``auto`` also
        leaves the lines to Python where the database reads them slower (DuckDB).
        """
        if self.parse_in == "python":
            return "parse_in='python'"
        if shape is None:
            return "the vendor dialect declares no line shape"
        json = self.dialect.line_json
        if json is None:
            return f"{self.dialect.name} has no JSON line parsing"
        if self.parse_in == "auto" and json.not_auto:
            return json.not_auto
        if self.mapper.extra_paths:
            return "extra_columns are read in Python"
        if self.mapper.output_schema is not None:
            return "output_schema is validated in Python"
        return None

    def merge(
        self,
        results: Iterable[tuple[ResultLine, str | None]] | RawResults,
        *,
        keys: KeysSource | None = None,
        rejects: Iterable[RejectRecord | Mapping[str, Any]] | None = None,
        shards: Mapping[int, ShardOutcome] | None = None,
        on_retry: RetryCallback | None = None,
        merged_at: datetime | None = None,
        staged: SqlStaging | None = None,
    ) -> MergeReport:
        """Write one row per key in one transaction and return what happened.

        :param results: ``(result line, batch id)`` pairs, streamed; or the raw lines of the
            result files, parsed by the database where it can (see ``parses_lines``), else in Python.
        :param keys: keys.jsonl (a path / ObjectStoragePath, loaded by the database where it
            can) or its records (:class:`~airflow_batch_provider.records.KeyRecord` or their
            dicts; manifest mode only).
        :param rejects: rejects.jsonl records (:class:`~airflow_batch_provider.records.RejectRecord`
            or their dicts; manifest mode only).
        :param shards: per shard, its batch and the status of keys it has no result for.
        :param on_retry: receives the ``RetryKey`` (shard, custom_id, key values...) of every
            retryable key before commit; an exception from it rolls the merge back.
        :param merged_at: the ``merged_at`` value of every written row (default: now, UTC).
        :param staged: the staging filled by SQL in the database instead (``keys``, ``rejects``
            and ``results`` are then not read); the write that follows is the same.
        """
        if staged is not None:
            if self.mapper.extra_paths or self.mapper.output_schema is not None:
                raise WarehouseSchemaError(
                    "extra_columns and output_schema are read in Python, so a merge whose results "
                    "stay in the database cannot give them"
                )
            keys, rejects, results = (), (), iter(())
        if self.manifest_mode and keys is None:
            raise ValueError("key columns were given but no keys to merge")
        if on_retry is not None and not self.manifest_mode:
            raise ValueError("resubmission needs a manifest (the original shards and keys)")
        raw: RawResults | None = None
        if isinstance(results, RawResults):
            why_not = self.parses_lines(results.shape)
            if why_not is None:
                raw = results
            elif self.parse_in == "database":
                raise WarehouseSchemaError(f"parse_in='database': {why_not}")
            else:
                log.info("Result lines are parsed in Python: %s", why_not)
                results = results.parsed()
        self.mapper.reset()
        report = MergeReport()
        merged_at = merged_at or datetime.now(timezone.utc)
        run = uuid.uuid4().hex[:10]
        t_results, t_keys, t_rejects, t_shards = (
            f"abp_{name}_{run}" for name in ("res", "keys", "rej", "shards")
        )
        conn = self.hook.get_conn()
        created: list[str] = []
        try:
            self.dialect.begin(conn)
            for name, value in self.session_settings.items():
                self._execute(conn, self.dialect.set_setting(name, value))
            self.dialect.lock_table(conn, self.table_name, self.schema)
            plan = self._plan(conn, report)
            # Staging: results.
            res_cols = self._staging_columns(
                ["custom_id", "seq", *[c.name for c in self.mapper.columns]],
                ["text", "integer", *[c.type for c in self.mapper.columns]],
            )
            key_cols = self._key_staging_columns()
            load_keys = None
            keyed: _Keyed | None = None
            if self.manifest_mode:
                self._create_temp(conn, t_keys, key_cols, created)

                def load_keys() -> None:
                    if staged is not None:
                        self._insert_select(conn, t_keys, key_cols, staged.keys)
                    else:
                        self._load_keys(conn, t_keys, key_cols, keys or ())

                keyed = _Keyed(
                    plan,
                    self._stage_keyed(
                        conn,
                        report,
                        (t_results, t_keys, t_rejects, t_shards),
                        dict(shards or {}),
                        created,
                        rejects or (),
                        merged_at,
                    ),
                    _Rounds(),
                )
                if staged is not None:
                    t_rej = keyed.sql.t_rejects
                    rej_cols = self._staging_columns(
                        ["custom_id", "seq", "code", "reason", *keyed.sql.key_names],
                        ["text", "integer", "text", "text", *[c.type for c in self.key_columns]],
                    )
                    self._insert_select(conn, t_rej, rej_cols, staged.rejects)
                    report.unkeyed_rejects = int(self._fetchall(conn, staged.unkeyed_rejects)[0][0] or 0)

            # Where a second connection parses a share of the raw lines, the keys are staged
            # while it does (see _stage_raw); else after the lines.
            keys_staged: list[bool] = []

            def stage_keys() -> None:
                if load_keys is not None:
                    load_keys()
                keys_staged.append(True)

            sql_sums = None
            if raw is not None:
                sql_sums = self._stage_raw(conn, raw, t_results, res_cols, created, report, stage_keys)
                if sql_sums is None:
                    if self.parse_in == "database":
                        raise WarehouseSchemaError(
                            "parse_in='database': this connection cannot stream raw lines"
                        )
                    results, raw = raw.parsed(), None
            if raw is None:
                self._create_temp(conn, t_results, res_cols, created)
            if staged is not None:
                if load_keys is not None:
                    load_keys()
                self._insert_select(conn, t_results, res_cols, staged.results)
                q = self.dialect.quote
                counted = self._fetchall(
                    conn,
                    f"SELECT COUNT(*), SUM({q('prompt_tokens')}), SUM({q('completion_tokens')}), "
                    f"SUM({q('total_tokens')}) FROM {q(t_results)}",
                )[0]
                report.result_lines = int(counted[0] or 0)
                sql_sums = (int(counted[1] or 0), int(counted[2] or 0), int(counted[3] or 0))
            elif sql_sums is not None:
                if load_keys is not None and not keys_staged:
                    load_keys()
            else:
                rows = (self.mapper.row(line, batch_id) for line, batch_id in results)  # type: ignore[union-attr]
                # The keys are staged first; where the database parses them (PostgreSQL), that
                # runs while Python is still reading the results, and so do rounds of the upsert.
                report.result_lines = self.dialect.bulk_load(
                    conn,
                    t_results,
                    res_cols,
                    rows,
                    before=load_keys,
                    after_round=(lambda part: self._write_round(conn, keyed, part)) if keyed else None,
                )
            sums = sql_sums or (0, 0, 0)
            report.prompt_tokens = self.mapper.prompt_tokens + sums[0]
            report.completion_tokens = self.mapper.completion_tokens + sums[1]
            report.total_tokens = self.mapper.total_tokens + sums[2]
            report.bad_result_lines = self.mapper.bad_lines
            report.bad_result_samples = list(self.mapper.bad_line_samples)
            report.bad_token_counts = self.mapper.bad_token_lines
            report.bad_token_samples = list(self.mapper.bad_token_samples)
            self.dialect.begin_writes(conn)
            if keyed is not None:
                self._merge_keyed(conn, report, keyed, on_retry)
            else:
                self._merge_unkeyed(conn, report, plan, t_results, merged_at)
            self._cost_sums(conn, report, t_results)
            for name in created:
                drop = self.dialect.drop_temp_table(name)
                if drop:
                    self._execute(conn, drop)
            conn.commit()
        except BaseException:
            try:
                conn.rollback()
            except Exception:  # pragma: no cover - the original error matters more
                log.exception("rollback failed")
            raise
        finally:
            conn.close()
        return report

    # ---- raw lines parsed by the database ----------------------------------------------------
    def _stage_raw(
        self,
        conn: Any,
        raw: RawResults,
        t_results: str,
        res_cols: Sequence[Column],
        created: list[str],
        report: MergeReport,
        meanwhile: Callable[[], None] | None = None,
    ) -> tuple[int, int, int] | None:
        """Stage the raw lines, compute their rows in SQL into ``t_results`` and let Python read
        the lines the SQL flags; the token sums of the SQL rows. None, having staged nothing,
        where this connection cannot stream raw lines (the caller then parses in Python).
        ``meanwhile`` runs on ``conn`` while a second connection parses, where one does."""
        d = self.dialect
        q = d.quote
        shape, json = raw.shape, d.line_json
        assert shape is not None and json is not None
        t_raw = f"{t_results}_raw"
        # The staged raw lines (see lines.raw_records).
        raw_cols = self._staging_columns(["seq", "f", "n", "line", "hex"], ["integer"] * 3 + ["text"] * 2)
        self._create_temp(conn, t_raw, raw_cols, created)
        spec = [(c.name, d.sql_type(c.type, key=c.name == "custom_id")) for c in res_cols]
        spec += [("py", d.sql_type("boolean"))]
        # The second connection parsing a share of the lines (see lines.SharedParse) sends the
        # lines of the rows it flags for Python with them.
        sharing = json.common_rows and d.shares_parsing
        if sharing:
            spec += [("line", d.sql_type("text"))]
        self._execute(conn, d.create_temp_table(t_results, spec))
        created.append(t_results)
        columns = ", ".join(q(c) for c in (*ROW_COLUMNS, "py"))

        def insert(target: str, source: str, rows: Callable[..., str] = result_row_sql) -> str:
            select = rows(json, shape, source, [f.batch_id for f in raw.files])
            return f"INSERT INTO {target} ({columns}) {select}"

        def compute(on: Any, source: str, target: str) -> None:
            if not json.common_rows:
                self._execute(on, insert(target, source))
                return
            # Common lines from a few leaves; the others (py NULL) from every leaf, then their
            # placeholder rows go.
            self._execute(on, insert(target, source, common_row_sql))
            if self._fetchall(on, f"SELECT COUNT(*) FROM {target} WHERE py IS NULL")[0][0]:
                unread = f"SELECT seq FROM {target} WHERE py IS NULL"
                self._execute(on, insert(target, f"(SELECT o.* FROM {source} o WHERE o.seq IN ({unread}))"))
                self._execute(on, f"DELETE FROM {target} WHERE py IS NULL")

        def parse_rows(on: Any, source: str, target: str) -> None:
            """The rows of ``source``'s lines into ``target``, on connection ``on``."""
            if not d.capabilities.savepoints:
                compute(on, source, target)
                return
            ok, _ = self._attempt(on, "abp_lines", lambda: compute(on, source, target), lambda exc: True)
            if not ok:
                # A line the database cannot parse (not JSON): Python reads every line.
                log.info("A result line is not JSON to %s; the lines are read in Python", d.name)
                self._execute(on, f"INSERT INTO {target} (seq, py) SELECT seq, TRUE FROM {source} s")

        def per_chunk(source: str) -> list[str]:
            # The chunk's rows, then the chunk's lines that Python must read.
            keep = (
                f"INSERT INTO {q(t_raw)} SELECT c.* FROM {source} c "
                f"WHERE c.seq IN (SELECT seq FROM {q(t_results)} WHERE py)"
            )
            return [insert(q(t_results), source), keep]

        for statement in json.before:
            self._execute(conn, statement)
        numbers = LineNumbers()
        loaded = None
        if sharing:
            share = SharedParse(
                connect=self.hook.get_conn,
                parse=parse_rows,
                results=t_results,
                columns=", ".join(f"{q(name)} {sql_type}" for name, sql_type in spec),
                before=json.before,
                meanwhile=meanwhile,
            )
            loaded = d.load_raw_lines_shared(conn, t_raw, raw, numbers, share)
        parsed = loaded is not None or json.while_loading
        if loaded is None:
            loaded = d.load_raw_lines(
                conn, t_raw, raw.lines, numbers, per_chunk if json.while_loading else None
            )
        source = d.raw_source(q(t_raw), numbers)
        if loaded is None:
            for name in (t_raw, t_results):
                self._execute(conn, d.drop_temp_table(name) or f"DELETE FROM {q(name)}")
                created.remove(name)
            return None
        report.result_lines = loaded
        if not parsed:
            parse_rows(conn, source, q(t_results))
        for statement in json.after:
            self._execute(conn, statement)
        sums = self._fetchall(
            conn,
            f"SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
            f"COALESCE(SUM(total_tokens), 0) FROM {q(t_results)} WHERE NOT py",
        )[0]
        if self._fetchall(conn, f"SELECT COUNT(*) FROM {q(t_results)} WHERE py")[0][0]:
            flagged = t_raw
            if not json.while_loading:
                # Only the flagged lines, so that paging through them does not scan every line.
                flagged = f"{t_raw}_py"
                self._create_temp(conn, flagged, raw_cols, created)
                self._execute(
                    conn,
                    f"INSERT INTO {q(flagged)} SELECT w.* FROM {source} w "
                    f"WHERE w.seq IN (SELECT seq FROM {q(t_results)} WHERE py)",
                )
            self._python_rows(conn, raw, t_results, flagged, res_cols, numbers)
        self.mapper.lines = loaded
        return int(sums[0]), int(sums[1]), int(sums[2])

    def _python_rows(
        self,
        conn: Any,
        raw: RawResults,
        t_results: str,
        flagged: str,
        res_cols: Sequence[Column],
        numbers: LineNumbers,
    ) -> None:
        """Replace the rows of the lines the SQL flagged (staged in ``flagged``) by the rows Python
        reads from them, in line order (so the mapper's samples are the Python path's)."""
        q = self.dialect.quote
        last = 0
        while True:
            page = self._fetchall(
                conn,
                f"SELECT seq, f, n, line, hex FROM {q(flagged)} WHERE seq > {last} "
                f"ORDER BY seq LIMIT {_FETCH}",
            )
            if not page:
                break
            rows = []
            for seq, f, number, text, hexed in page:
                data = text.encode() if text is not None else bytes.fromhex(hexed)
                if number is None:
                    f, number = numbers.locate(int(seq))
                line = raw.parse(int(f), int(number), data)
                row = self.mapper.row(line, raw.files[int(f)].batch_id)
                rows.append((row[0], int(seq), *row[2:]))
            self.dialect.bulk_load(conn, t_results, res_cols, rows)
            last = int(page[-1][0])
        self._execute(conn, f"DELETE FROM {q(t_results)} WHERE py")

    # ---- manifest mode ----------------------------------------------------------------------
    def _stage_keyed(
        self,
        conn: Any,
        report: MergeReport,
        tables: tuple[str, str, str, str],
        shards: dict[int, ShardOutcome],
        created: list[str],
        rejects: Iterable[RejectRecord | Mapping[str, Any]],
        merged_at: datetime,
    ) -> _KeyedSql:
        """Stage rejects and shards and build the keyed upsert's SELECT list (before the results)."""
        d = self.dialect
        q = d.quote
        t_results, t_keys, t_rejects, t_shards = tables
        key_names = [f"k{i}" for i in range(len(self.key_columns))]
        key_types = [self._staging_type(c.type) for c in self.key_columns]
        rej_cols = self._staging_columns(
            ["custom_id", "seq", "code", "reason", *key_names],
            ["text", "integer", "text", "text", *key_types],
        )
        self._create_temp(conn, t_rejects, rej_cols, created)
        d.bulk_load(conn, t_rejects, rej_cols, self._reject_rows(rejects, report))

        shard_cols = self._staging_columns(["shard", "batch_id", "absent"], ["integer", "text", "text"])
        self._create_temp(conn, t_shards, shard_cols, created)
        d.bulk_load(
            conn,
            t_shards,
            shard_cols,
            ((i, s.batch_id, s.absent_status) for i, s in shards.items()),
        )

        status_expr = (
            f"CASE WHEN r.{q('custom_id')} IS NULL THEN COALESCE(s.{q('absent')}, 'missing') "
            f"ELSE r.{q('status')} END"
        )
        target = [c.name for c in self.key_columns]
        key_exprs = [
            self._cast_json(f"k.{q(n)}", c) for n, c in zip(key_names, self.key_columns, strict=True)
        ]
        select_cols = list(key_exprs)
        target.append("custom_id")
        select_cols.append(f"k.{q('custom_id')}")
        for col in self.mapper.columns:
            target.append(col.name)
            if col.name == "status":
                select_cols.append(status_expr)
            elif col.name == "batch_id":
                select_cols.append(f"COALESCE(r.{q('batch_id')}, s.{q('batch_id')})")
            else:
                select_cols.append(self._cast_json(f"r.{q(col.name)}", col))
        answered_by, answered_params = self._answered_by_sql()
        target.extend(c.name for c in ANSWERED_BY_COLUMNS)
        select_cols.extend(answered_by)
        # A key without a result line has NULL tokens: it cost 0 (NULL without a price). A key
        # sharing another's answer cost nothing more: the line sent for it carries the cost.
        shared = f"k.{q('rid')} <> k.{q('custom_id')}"
        target.append(COST_COLUMN.name)
        select_cols.append(
            f"CASE WHEN {shared} THEN {d.cast('0', COST_COLUMN.type)} ELSE {self._cost_select('r')} END"
        )
        target.extend(c.name for c in REQUEST_COLUMNS)
        select_cols.extend([f"k.{q('rhash')}", f"CASE WHEN {shared} THEN k.{q('rid')} END"])
        target.append("merged_at")
        select_cols.append(d.cast(d.placeholder, "timestamp"))
        return _KeyedSql(
            t_results=t_results,
            t_keys=t_keys,
            t_rejects=t_rejects,
            t_shards=t_shards,
            target=tuple(target),
            params=(*answered_params, d.merged_at_value(merged_at)),
            stamp=(d.merged_at_value(merged_at),),
            select_list=", ".join(select_cols),
            key_exprs=tuple(key_exprs),
            key_names=tuple(key_names),
            status_expr=status_expr,
            all_absent_missing=all(o.absent_status == "missing" for o in shards.values()),
            quote=q,
        )

    def _write_round(self, conn: Any, keyed: _Keyed, part: str) -> None:
        """Write the keys that have a result line in ``part`` (one round of staged results).

        Runs on the loading thread while Python still reads later results. A custom_id with
        two result lines in one round stops the rounds; one repeated across rounds is found
        after the load (see ``_finish_rounds``). Either way the one ranked statement then
        decides every key, as it does where rounds are not used.
        """
        sql, rounds = keyed.sql, keyed.rounds
        if rounds.done == 0:
            self._prepare_rounds(conn, keyed)
        rounds.done += 1
        if rounds.repeated:
            return
        select = f"SELECT {sql.select_list} {sql.from_clause(self.dialect.quote(part), join='JOIN')}"
        if keyed.plan.mode is WriteMode.INSERT:
            # No primary key yet: a repeated custom_id shows when it is added after the load.
            written = self._write_counted(conn, keyed, select)
        else:
            # One statement would update a row twice: a repeat within the round.
            ok, counted = self._attempt(
                conn,
                "abp_round",
                lambda: self._write_counted(conn, keyed, select),
                self.dialect.is_row_written_twice,
            )
            if not ok or counted is None:
                rounds.repeated = True
                return
            written = counted
        for status, n in written.items():
            rounds.counts[status] = rounds.counts.get(status, 0) + n

    def _write_counted(self, conn: Any, keyed: _Keyed, select: str) -> dict[str, int]:
        """Write ``select`` (keyed rows) into the target; the rows written per status."""
        written = self._write_select(conn, keyed.plan, select, keyed.sql.target, keyed.sql.params)
        assert written is not None, "rounds run only where the database counts while writing"
        return written

    def _write_select(
        self,
        conn: Any,
        plan: WritePlan,
        select: str,
        target: Sequence[str],
        params: Sequence[Any],
        keys_select: str | None = None,
    ) -> dict[str, int] | None:
        """Write the rows of ``select`` as the plan says: insert into a table this merge created,
        replace by key (``keys_select`` returns the keys), update then insert, or upsert.

        Returns the rows written per status where the database counts them while writing
        (RETURNING), else None.
        """
        d = self.dialect
        q = d.quote
        if plan.mode is WriteMode.INSERT:
            # The table was created by this transaction, so it is empty: nothing to update.
            sql = d.insert(self.qtable, target, select)
        elif plan.mode is WriteMode.REPLACE:
            # Delete the rows about to be written, then insert (see Capabilities.upsert_by_replace).
            if keys_select is None:
                raise ValueError("replacing rows needs the keys they are replaced by")
            self._execute(conn, d.delete_keys(self.qtable, self.target_keys, keys_select))
            sql = d.insert(self.qtable, target, select)
        elif plan.mode is WriteMode.UPDATE_INSERT:
            update, sql = d.update_then_insert(self.qtable, target, self.target_keys, select)
            if update is not None:
                self._execute(conn, update, params)
        else:
            sql = d.upsert(self.qtable, target, self.target_keys, select)
        if not d.capabilities.returning_counts:
            self._execute(conn, sql, params)
            return None
        # Count the written rows per status in the same statement, not a second join.
        rows = self._fetchall(
            conn,
            f"WITH abp_written AS ({sql} RETURNING {q('status')}) "
            f"SELECT {q('status')}, COUNT(*) FROM abp_written GROUP BY {q('status')}",
            params,
        )
        return {str(status): int(n) for status, n in rows}

    def _attempt(
        self, conn: Any, name: str, action: Callable[[], _T], expected: Callable[[BaseException], bool]
    ) -> tuple[bool, _T | None]:
        """Run ``action`` inside a savepoint: ``(True, its result)``, or ``(False, None)`` when it
        failed with an ``expected`` error, which is then undone alone (other errors propagate)."""
        d = self.dialect
        self._execute(conn, d.savepoint(name))
        try:
            result = action()
        except Exception as exc:
            if not expected(exc):
                raise
            self._execute(conn, d.rollback_to(name))
            self._execute(conn, d.release(name))
            return False, None
        self._execute(conn, d.release(name))
        return True, result

    def _prepare_rounds(self, conn: Any, keyed: _Keyed) -> None:
        """Before the first round (keys staged): statistics for the rounds' joins and, for an
        existing table, a unique index on the staged keys, so that two custom_ids with one key
        (a manifest no build writes) fail by line instead of updating one row in two rounds.
        A table this merge created gets its primary key after the load, which finds that too.
        """
        d = self.dialect
        q = d.quote
        if keyed.plan.mode is not WriteMode.INSERT:
            # Compared as the target compares them (JSON keys as JSON: {"a":1,"b":2} is one key
            # however its members are ordered).
            cols = ", ".join(f"({e})" for e in self._typed_key_exprs(keyed.sql))
            index = f"CREATE UNIQUE INDEX ON {q(keyed.sql.t_keys)} ({cols})"
            ok, _ = self._attempt(conn, "abp_keys", lambda: self._execute(conn, index), d.is_duplicate_key)
            if not ok:
                self._raise_repeated_key(conn, keyed.sql)
        d.analyze(conn, q(keyed.sql.t_keys))

    def _typed_key_exprs(self, sql: _KeyedSql) -> list[str]:
        q = self.dialect.quote
        return [self._cast_json(q(n), c) for n, c in zip(sql.key_names, self.key_columns, strict=True)]

    def _raise_repeated_key(self, conn: Any, sql: _KeyedSql) -> None:
        """Raise naming the first two keys.jsonl lines with one key, if there are such lines."""
        q = self.dialect.quote
        cols = ", ".join(self._typed_key_exprs(sql))
        repeated = self._fetchall(
            conn,
            f"SELECT MIN({q('seq')}), MAX({q('seq')}) FROM {q(sql.t_keys)} "
            f"GROUP BY {cols} HAVING COUNT(*) > 1 ORDER BY 1 LIMIT 1",
        )
        if repeated:
            first, second = repeated[0]
            raise WarehouseSchemaError(
                f"keys.jsonl lines {first} and {second} have the same key; every line of a build has "
                f"a key of its own"
            )

    def _finish_rounds(self, conn: Any, keyed: _Keyed) -> dict[str, int] | None:
        """After rounds: write the keys without a result line and check that no custom_id
        had two. Returns the rows written per status, or None when a repeat was found (the
        rows of the rounds are then rewritten by the ranked statement)."""
        d = self.dialect
        q = d.quote
        sql = keyed.sql
        counts = dict(keyed.rounds.counts)
        matched = sum(counts.values())
        total_keys = int(self._fetchall(conn, f"SELECT COUNT(*) FROM {q(sql.t_keys)}")[0][0])
        unmatched = 0
        # A new table without repeats has exactly ``matched`` keys with a result; an existing
        # table's upsert may have written one key in two rounds, which only this count shows.
        if total_keys > matched or keyed.plan.mode is not WriteMode.INSERT:
            without = (
                f"(SELECT * FROM {q(sql.t_keys)} x WHERE NOT EXISTS (SELECT 1 FROM {q(sql.t_results)} v "
                f"WHERE v.{q('custom_id')} = x.{q('rid')}))"
            )
            nothing = f"(SELECT * FROM {q(sql.t_results)} WHERE 1=0)"
            select = f"SELECT {sql.select_list} {sql.from_clause(nothing, keys=without)}"
            for status, n in self._write_counted(conn, keyed, select).items():
                counts[status] = counts.get(status, 0) + n
                unmatched += n
            if matched > total_keys - unmatched:
                # More result rows joined than keys have results: a custom_id repeated.
                return None
        if keyed.plan.key_after_load:
            ok, _ = self._attempt(
                conn, "abp_pk", lambda: self._execute(conn, self._add_primary_key_sql()), d.is_duplicate_key
            )
            if not ok:
                # Two rows with one key: a custom_id repeated (ranked below), or a bad manifest.
                self._raise_repeated_key(conn, sql)
                return None
        return counts

    def _merge_keyed(
        self, conn: Any, report: MergeReport, keyed: _Keyed, on_retry: RetryCallback | None
    ) -> None:
        d = self.dialect
        q = d.quote
        plan, sql = keyed.plan, keyed.sql
        t_results, t_keys, t_rejects = sql.t_results, sql.t_keys, sql.t_rejects
        status_expr = sql.status_expr
        target, stamp = sql.target, sql.stamp
        key_names = sql.key_names
        if keyed.rounds.done == 0:
            d.analyze(conn, q(t_keys))
        shared = f"k.{q('rid')} <> k.{q('custom_id')}"
        report.shared_answers = int(
            self._fetchall(conn, f"SELECT COUNT(*) FROM {q(t_keys)} k WHERE {shared}")[0][0]
        )
        if plan.check_repeated_keys:
            # Nothing in a table without a key would refuse two rows for one key.
            self._raise_repeated_key(conn, sql)
        matched_lines: int | None = None
        rounds_whole = keyed.rounds.done and not keyed.rounds.repeated
        written = self._finish_rounds(conn, keyed) if rounds_whole else None
        if written is not None:
            matched_lines = sum(keyed.rounds.counts.values())
            from_clause, deduplicated = sql.from_clause(q(t_results)), False
            if on_retry is not None:
                d.analyze(conn, q(t_results))
        elif keyed.rounds.done:
            # Rounds stopped at, or found, a repeated custom_id: every key of the manifest gets
            # its row from the ranked results (rewriting each row the rounds wrote).
            log.info("A custom_id has more than one result line; keeping one per key")
            if plan.mode is WriteMode.INSERT:
                # Named by line before the primary key would fail on it without a line.
                self._raise_repeated_key(conn, sql)
                # The ranked statement below writes every key of this merge's new table
                # again, so the rows of the rounds go.
                self._execute(conn, f"TRUNCATE {self.qtable}")
            d.analyze(conn, q(t_results))
            ranked = self._ranked_sql(t_results)
            written = self._write_rows(conn, plan, sql, ranked)
            from_clause, deduplicated = sql.source(ranked), True
        else:
            # Every key of the manifest gets a row.
            d.analyze(conn, q(t_results))
            from_clause, written, deduplicated = self._write_all(conn, plan, sql, t_results)

        # Rejects: one row per rejected key, unless the build also wrote that key.
        rej_exprs = [
            self._cast_json(f"j.{q(n)}", c) for n, c in zip(key_names, self.key_columns, strict=True)
        ]
        rej_exprs.append(f"j.{q('custom_id')}")
        for col in self.mapper.columns:
            if col.name == "status":
                rej_exprs.append("'rejected'")
            elif col.name == "error_code":
                rej_exprs.append(f"j.{q('code')}")
            elif col.name == "error_message":
                rej_exprs.append(f"j.{q('reason')}")
            else:
                rej_exprs.append(self._cast_json("NULL", col) if col.type == "json" else "NULL")
        # A rejected row was never sent: no vendor answered it.
        rej_exprs.extend("NULL" for _ in ANSWERED_BY_COLUMNS)
        # Never sent, so free; still NULL when nothing is priced (a cost is never claimed unknown-free).
        rej_exprs.append(d.cast("NULL" if self.price is None else "0", COST_COLUMN.type))
        rej_exprs.extend(d.cast("NULL", c.type) for c in REQUEST_COLUMNS)
        rej_exprs.append(d.cast(d.placeholder, "timestamp"))
        partition = ", ".join(f"x.{q(n)}" for n in key_names)
        key_match = " AND ".join(f"k.{q(n)} = y.{q(n)}" for n in key_names)
        # The filter sits inside the derived table, so the SELECT has no WHERE of its own and
        # writes like any other (see _write_select).
        rej_from = (
            f"FROM (SELECT y.* FROM (SELECT x.*, ROW_NUMBER() OVER (PARTITION BY {partition} "
            f"ORDER BY x.{q('seq')}) AS abp_rn FROM {q(t_rejects)} x) y "
            f"WHERE y.abp_rn = 1 AND NOT EXISTS (SELECT 1 FROM {q(t_keys)} k WHERE {key_match})) j"
        )
        # Rejected keys are not in keys.jsonl, so none of them was written above.
        self._write_select(
            conn,
            plan,
            f"SELECT {', '.join(rej_exprs)} {rej_from}",
            target,
            stamp,
            f"SELECT {', '.join(rej_exprs[: len(key_names)])} {rej_from}",
        )

        if written is not None and not deduplicated:
            # Counted by the upsert itself; every key had at most one result line.
            for status, n in written.items():
                report.counts[status] = report.counts.get(status, 0) + n
            known_orphans = None
            # Where a result line answers several keys (shared answers), the rows written say
            # nothing of the lines matched: the anti-join below counts the orphans.
            if matched_lines is not None and not report.shared_answers:
                # Rounds counted only the keys that had a result line.
                known_orphans = report.result_lines - matched_lines
            elif sql.all_absent_missing and not report.shared_answers:
                # No result line is ever "missing", so the keys with a result are all the others,
                # and every other staged line matched no key: no anti-join needed to count them.
                matched = sum(written.values()) - written.get("missing", 0)
                known_orphans = report.result_lines - matched
            self._orphans(conn, report, t_results, t_keys, known_orphans)
            matched = report.result_lines - report.orphan_results
        else:
            self._orphans(conn, report, t_results, t_keys)
            # Counts per status over the same join (with whether a result line was found for a
            # key's own request: one shared with other keys is counted once).
            has_result = f"CASE WHEN r.{q('custom_id')} IS NULL OR {shared} THEN 0 ELSE 1 END"
            matched = 0
            for status, found, n in self._fetchall(
                conn,
                f"SELECT {status_expr}, {has_result}, COUNT(*) {from_clause} "
                f"GROUP BY {status_expr}, {has_result}",
            ):
                report.counts[str(status)] = report.counts.get(str(status), 0) + int(n)
                matched += int(n) if int(found) else 0
        rejected = self._fetchall(conn, f"SELECT COUNT(*) {rej_from}")
        report.counts["rejected"] += int(rejected[0][0])
        report.rows_written = sum(report.counts.values())
        report.duplicate_results = max(report.result_lines - report.orphan_results - matched, 0)

        if on_retry is not None:
            wanted = ", ".join(f"'{s}'" for s in sorted(RETRYABLE_STATUSES))
            retry = (
                f"SELECT k.{q('shard')}, k.{q('custom_id')}, k.{q('rhash')}, k.{q('rid')}, "
                f"{', '.join('k.' + q(n) for n in key_names)} "
                f"{from_clause} WHERE {status_expr} IN ({wanted}) "
                f"ORDER BY k.{q('shard')}, k.{q('seq')}"
            )
            on_retry(self._stream(conn, retry))

    def _orphans(
        self, conn: Any, report: MergeReport, t_results: str, t_keys: str, known: int | None = None
    ) -> None:
        """Count (unless already ``known``) and sample the result lines that match no key."""
        q = self.dialect.quote
        where = f"WHERE NOT EXISTS (SELECT 1 FROM {q(t_keys)} k WHERE k.{q('rid')} = r.{q('custom_id')})"
        if known is None:
            known = int(self._fetchall(conn, f"SELECT COUNT(*) FROM {q(t_results)} r {where}")[0][0])
        report.orphan_results = known
        if report.orphan_results:
            sample = self._fetchall(
                conn,
                f"SELECT r.{q('custom_id')} FROM {q(t_results)} r {where} "
                f"ORDER BY r.{q('seq')} LIMIT {_SAMPLES}",
            )
            report.orphan_samples = [str(r[0]) for r in sample]
            log.warning(
                "%d result line(s) have a custom_id that is not in the manifest; they were not written. "
                "First ones: %s",
                report.orphan_results,
                ", ".join(report.orphan_samples),
            )

    # ---- no manifest ------------------------------------------------------------------------
    def _merge_unkeyed(
        self, conn: Any, report: MergeReport, plan: WritePlan, t_results: str, merged_at: datetime
    ) -> None:
        d = self.dialect
        q = d.quote
        answered_by, answered_params = self._answered_by_sql()
        select_cols = [
            f"r.{q('custom_id')}",
            *[self._cast_json(f"r.{q(c.name)}", c) for c in self.mapper.columns],
            *answered_by,
            self._cost_select("r"),
            *(d.cast("NULL", c.type) for c in REQUEST_COLUMNS),
        ]
        select_cols.append(d.cast(d.placeholder, "timestamp"))
        rows = _UnkeyedSql(
            target=(
                "custom_id",
                *[c.name for c in self.mapper.columns],
                *[c.name for c in ANSWERED_BY_COLUMNS],
                COST_COLUMN.name,
                *[c.name for c in REQUEST_COLUMNS],
                "merged_at",
            ),
            params=(*answered_params, d.merged_at_value(merged_at)),
            select_list=", ".join(select_cols),
            quote=q,
        )
        d.analyze(conn, q(t_results))
        ranked, written, _ = self._write_all(conn, plan, rows, t_results)
        if written is not None:
            counts = list(written.items())
        else:
            counts = self._fetchall(
                conn, f"SELECT r.{q('status')}, COUNT(*) FROM {ranked} r GROUP BY r.{q('status')}"
            )
        for status, n in counts:
            report.counts[str(status)] = report.counts.get(str(status), 0) + int(n)
        report.rows_written = sum(report.counts.values())
        report.duplicate_results = report.result_lines - report.rows_written

    def _cost_sums(self, conn: Any, report: MergeReport, t_results: str) -> None:
        """The cost per status and per run, and the cached tokens, over every result line read
        (what the vendor bills: a repeated or orphan line too; a key without one cost nothing)."""
        q = self.dialect.quote
        cost = self._cost_select("r")
        rows = self._fetchall(
            conn,
            f"SELECT r.{q('status')}, SUM({cost}), COALESCE(SUM(r.{q('cached_tokens')}), 0) "
            f"FROM {q(t_results)} r GROUP BY r.{q('status')}",
        )
        report.cached_tokens = sum(int(n) for _, _, n in rows)
        if self.price is None:
            report.cost, report.cost_by_status = None, {str(st): None for st, _, _ in rows}
            return
        report.cost_by_status = {str(st): round(float(c or 0.0), 6) for st, c, _ in rows}
        report.cost = round(sum(float(c or 0.0) for _, c, _ in rows), 6)

    def _cost_select(self, alias: str) -> str:
        """The SELECT expression of a written row's ``cost``, from the staged result ``alias``."""
        q = self.dialect.quote
        return self.dialect.cast(cost_sql(self.price, lambda c: f"{alias}.{q(c)}"), COST_COLUMN.type)

    # ---- helpers ----------------------------------------------------------------------------
    def _answered_by_sql(self) -> tuple[list[str], tuple[Any, ...]]:
        """The SELECT expressions of the answered-by columns and their parameters (a value is
        bound, never pasted; an unknown one is a typed NULL, which every driver can bind)."""
        d = self.dialect
        exprs: list[str] = []
        params: list[Any] = []
        for col, value in zip(ANSWERED_BY_COLUMNS, self.answered_by, strict=True):
            exprs.append(d.cast("NULL" if value is None else d.placeholder, col.type))
            if value is not None:
                params.append(value)
        return exprs, tuple(params)

    def _write_all(
        self, conn: Any, plan: WritePlan, rows: _Rows, t_results: str
    ) -> tuple[str, dict[str, int] | None, bool]:
        """Write every row of the merge from the staged results ``t_results``.

        Returns what later queries should read results from (``rows.source``), the rows written
        per status when the database counted them while writing (RETURNING), and whether
        repeated custom_ids had to be ranked.

        A custom_id normally has one result line, and then the staged table joins directly.
        Where a failed statement can be undone alone (a savepoint), the direct statement is
        tried first and a repeated custom_id (two rows for one key) falls back to a ranked
        source; elsewhere repeats are looked for before choosing.
        """
        d = self.dialect
        direct = d.quote(t_results)
        if d.capabilities.savepoints:
            ok, counts = self._attempt(
                conn,
                "abp_merge",
                lambda: self._write_rows(conn, plan, rows, direct),
                # A plain insert (its key added after the load) or an upsert that meets a key twice.
                lambda exc: d.is_duplicate_key(exc) or d.is_row_written_twice(exc),
            )
            if ok:
                return rows.source(direct), counts, False
            log.info("A custom_id has more than one result line; keeping one per key")
            ranked = self._ranked_sql(t_results)
        else:
            ranked = self._ranked_results(conn, t_results)
        counts = self._write_rows(conn, plan, rows, ranked)
        return rows.source(ranked), counts, ranked != direct

    def _write_rows(self, conn: Any, plan: WritePlan, rows: _Rows, results: str) -> dict[str, int] | None:
        """Write ``rows`` over the results source ``results``; then add the new table's primary
        key where the plan adds it after the load."""
        counts = self._write_select(
            conn, plan, rows.select(results), rows.target, rows.params, rows.keys(results)
        )
        if plan.key_after_load:
            self._execute(conn, self._add_primary_key_sql())
        return counts

    def _ranked_results(self, conn: Any, t_results: str) -> str:
        """Results with one line per custom_id: a success wins over an error, then the later line.

        The ranking sorts every staged line, so it is only used when a custom_id repeats.
        """
        q = self.dialect.quote
        repeated = self._fetchall(
            conn,
            f"SELECT COUNT(*) FROM (SELECT {q('custom_id')} FROM {q(t_results)} "
            f"GROUP BY {q('custom_id')} HAVING COUNT(*) > 1) d",
        )
        if not int(repeated[0][0]):
            return q(t_results)
        return self._ranked_sql(t_results)

    def _ranked_sql(self, t_results: str) -> str:
        q = self.dialect.quote
        return (
            f"(SELECT * FROM (SELECT x.*, ROW_NUMBER() OVER (PARTITION BY x.{q('custom_id')} "
            f"ORDER BY CASE WHEN "
            f"x.{q('status')} = 'succeeded' THEN 0 ELSE 1 END, x.{q('seq')} DESC) AS abp_rn "
            f"FROM {q(t_results)} x) y WHERE y.abp_rn = 1)"
        )

    def _cast_json(self, expression: str, col: Column) -> str:
        return self.dialect.cast(expression, "json") if col.type == "json" else expression

    @staticmethod
    def _staging_type(portable: str) -> str:
        # JSON travels as text through staging; the upsert casts it into the target's JSON type.
        return "text" if portable == "json" else portable

    def _key_staging_columns(self) -> list[Column]:
        """Staged keys.jsonl: ``custom_id, shard, seq, klen`` (length of the key), ``rhash`` (the
        request_hash), ``rid`` (the custom_id whose result the key takes: its own, or the one
        whose answer it shares), then ``k0..kN``."""
        return self._staging_columns(
            [
                "custom_id",
                "shard",
                "seq",
                "klen",
                "rhash",
                "rid",
                *[f"k{i}" for i in range(len(self.key_columns))],
            ],
            ["text", "integer", "integer", "integer", "text", "text", *[c.type for c in self.key_columns]],
        )

    def _staging_columns(self, names: Sequence[str], types: Sequence[str]) -> list[Column]:
        return [Column(n, self._staging_type(t)) for n, t in zip(names, types, strict=True)]

    def _create_temp(self, conn: Any, name: str, columns: Sequence[Column], created: list[str]) -> None:
        spec = [(c.name, self.dialect.sql_type(c.type, key=c.name == "custom_id")) for c in columns]
        self._execute(conn, self.dialect.create_temp_table(name, spec))
        created.append(name)

    def _load_keys(self, conn: Any, table: str, columns: Sequence[Column], keys: KeysSource) -> None:
        """Stage keys.jsonl (raw, parsed by the database where it can) and check every line."""
        d = self.dialect
        q = d.quote
        if _is_file(keys):
            with _open_binary(keys) as handle:
                loaded = d.load_keys_jsonl(conn, table, handle, [c.type for c in self.key_columns])
            if not loaded:
                with _open_binary(keys) as handle:
                    d.bulk_load(conn, table, columns, self._key_rows(_jsonl_records(handle)))
        else:
            d.bulk_load(conn, table, columns, self._key_rows(enumerate(keys, start=1)))
        nkeys = len(self.key_columns)
        null_key = " OR ".join(f"{q(f'k{i}')} IS NULL" for i in range(nkeys))
        bad = self._fetchall(
            conn,
            f"SELECT {q('seq')}, {q('custom_id')}, {q('klen')} FROM {q(table)} "
            f"WHERE {q('custom_id')} IS NULL "
            f"OR {q('custom_id')} = '' OR {q('klen')} IS NULL OR {q('klen')} <> {nkeys} OR {null_key} "
            f"ORDER BY {q('seq')} LIMIT 1",
        )
        if bad:
            seq, custom_id, klen = bad[0]
            names = [c.name for c in self.key_columns]
            if not custom_id:
                problem = "no custom_id"
            elif klen != nkeys:
                problem = (
                    f"custom_id {custom_id!r}: key has {klen or 0} value(s), expected {nkeys} for {names}"
                )
            else:
                problem = f"custom_id {custom_id!r}: a key value is null (key columns {names})"
            raise WarehouseSchemaError(f"keys.jsonl line {seq}: {problem}")

    def _key_values(self, key: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(key, list) or len(key) != len(self.key_columns):
            raise WarehouseSchemaError(
                f"{where}: key {key!r} does not have {len(self.key_columns)} value(s) for key columns "
                f"{[c.name for c in self.key_columns]}"
            )
        return tuple(
            orjson.dumps(v).decode() if c.type == "json" and v is not None else v
            for v, c in zip(key, self.key_columns, strict=True)
        )

    def _key_rows(
        self, keys: Iterable[tuple[int, KeyRecord | Mapping[str, Any]]]
    ) -> Iterator[tuple[Any, ...]]:
        """Staged rows of ``(line number, record)`` pairs of keys.jsonl."""
        nkeys = len(self.key_columns)
        blank = (None,) * nkeys
        for seq, record in keys:
            obj = record.as_dict() if isinstance(record, KeyRecord) else record
            custom_id, key, shard = KeyRecord.fields_of(obj)
            rhash, shared = KeyRecord.request_fields_of(obj)
            # A malformed line is staged as is and reported, with its line number, by _load_keys.
            yield (
                custom_id,
                shard,
                seq,
                None if key is None else len(key),
                rhash,
                shared or custom_id,
                *(self._key_values(key, f"keys.jsonl line {seq}") if key and len(key) == nkeys else blank),
            )

    def _reject_rows(
        self, rejects: Iterable[RejectRecord | Mapping[str, Any]], report: MergeReport
    ) -> Iterator[tuple[Any, ...]]:
        for seq, record in enumerate(rejects, start=1):
            reject = record if isinstance(record, RejectRecord) else RejectRecord.from_dict(record)
            if not reject.keyed:
                # A row without a usable key cannot be written to a keyed table: count and log it.
                report.unkeyed_rejects += 1
                if len(report.unkeyed_reject_samples) < _SAMPLES:
                    report.unkeyed_reject_samples.append(reject.as_dict())
                continue
            yield (
                reject.custom_id,
                seq,
                reject.code,
                reject.message,
                *self._key_values(reject.key, f"rejects.jsonl line {seq}"),
            )

    def _insert_select(self, conn: Any, table: str, columns: Sequence[Column], select: str) -> None:
        """Fill a staging table from a SELECT run in the database (``SqlStaging``)."""
        q = self.dialect.quote
        self._execute(conn, f"INSERT INTO {q(table)} ({', '.join(q(c.name) for c in columns)}) {select}")

    def _execute(self, conn: Any, sql: str, params: Sequence[Any] | None = None) -> None:
        cur = self.dialect.cursor(conn)
        started = time.perf_counter()
        try:
            if params is None:
                cur.execute(sql)
            else:
                cur.execute(self.dialect.bound(sql), tuple(params))
        finally:
            cur.close()
        log.debug("%.2fs: %s", time.perf_counter() - started, sql[:120])

    def _fetchall(self, conn: Any, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """For aggregate queries whose answer is a handful of rows."""
        cur = self.dialect.cursor(conn)
        started = time.perf_counter()
        try:
            if params is None:
                cur.execute(sql)
            else:
                cur.execute(self.dialect.bound(sql), tuple(params))
            return [tuple(r) for r in cur.fetchall()]
        finally:
            cur.close()
            log.debug("%.2fs: %s", time.perf_counter() - started, sql[:120])

    def _stream(self, conn: Any, sql: str) -> Iterator[RetryKey]:
        """Stream a large result in pages (a server-side cursor on PostgreSQL)."""
        cur = self.dialect.server_cursor(conn)
        json_keys = [i for i, c in enumerate(self.key_columns) if c.type == "json"]
        try:
            cur.execute(sql)
            while page := cur.fetchmany(_FETCH):
                for shard, custom_id, rhash, rid, *key in page:
                    for i in json_keys:
                        if isinstance(key[i], str):
                            key[i] = orjson.loads(key[i])
                    yield RetryKey(int(shard), str(custom_id), key, rhash, rid)
        finally:
            cur.close()


class _Rows(Protocol):
    """The rows one merge writes, as SQL over a results source (the staged table or a ranking of it)."""

    @property
    def target(self) -> tuple[str, ...]:
        """The target columns, in the SELECT's order."""
        ...

    @property
    def params(self) -> tuple[Any, ...]:
        """The SELECT's parameters."""
        ...

    def select(self, results: str) -> str:
        """The SELECT of the rows to write."""
        ...

    def source(self, results: str) -> str:
        """What later queries read the written rows' statuses from."""
        ...

    def keys(self, results: str) -> str:
        """A SELECT of the keys written (for replacing rows by key)."""
        ...


@dataclass(frozen=True)
class _UnkeyedSql:
    """Without a manifest: one row per custom_id of the results ``r``."""

    target: tuple[str, ...]
    params: tuple[Any, ...]
    select_list: str
    quote: Callable[[str], str]

    def select(self, results: str) -> str:
        return f"SELECT {self.select_list} FROM {results} r"

    def source(self, results: str) -> str:
        return results

    def keys(self, results: str) -> str:
        return f"SELECT r.{self.quote('custom_id')} FROM {results} r"


@dataclass(frozen=True)
class _KeyedSql:
    """One keyed merge's staging tables and the SQL of its upsert: one row per key ``k``
    (staged keys.jsonl) joined to its result ``r`` and its shard ``s``."""

    t_results: str
    t_keys: str
    t_rejects: str
    t_shards: str
    target: tuple[str, ...]
    #: The SELECT list's parameters: the answered-by values, then ``merged_at``.
    params: tuple[Any, ...]
    #: ``merged_at`` alone (the rejects' SELECT binds only it).
    stamp: tuple[Any, ...]
    #: The SELECT list of the keyed upsert over ``k`` (keys), ``r`` (results), ``s`` (shards).
    select_list: str
    key_exprs: tuple[str, ...]
    key_names: tuple[str, ...]
    status_expr: str
    #: Every shard's keys without a result are ``missing`` (no batch ended early).
    all_absent_missing: bool
    quote: Callable[[str], str]

    def from_clause(self, results_source: str, *, keys: str | None = None, join: str = "LEFT JOIN") -> str:
        """``FROM`` keys ``k`` (the staged keys, or ``keys``) joined to results ``r`` and shards ``s``."""
        q = self.quote
        return (
            f"FROM {keys or q(self.t_keys)} k "
            f"{join} {results_source} r ON r.{q('custom_id')} = k.{q('rid')} "
            f"LEFT JOIN {q(self.t_shards)} s ON s.{q('shard')} = k.{q('shard')}"
        )

    def select(self, results: str) -> str:
        return f"SELECT {self.select_list} {self.from_clause(results)}"

    def source(self, results: str) -> str:
        return self.from_clause(results)

    def keys(self, results: str) -> str:
        return f"SELECT {', '.join(self.key_exprs)} FROM {self.quote(self.t_keys)} k"


@dataclass
class _Rounds:
    """What the rounds written while the results load (PostgreSQL) have done so far."""

    done: int = 0
    #: Rows the rounds wrote per status.
    counts: dict[str, int] = field(default_factory=dict)
    #: A custom_id repeated within a round: the rounds stopped.
    repeated: bool = False


@dataclass(frozen=True)
class _Keyed:
    """A keyed merge: its plan, its SQL and the state of its rounds."""

    plan: WritePlan
    sql: _KeyedSql
    rounds: _Rounds


#: keys.jsonl as parsed records, or the file itself (a path or ObjectStoragePath).
KeysSource = Any


def _is_file(source: Any) -> bool:
    return isinstance(source, (str, os.PathLike)) or (
        hasattr(source, "open") and not isinstance(source, Mapping)
    )


def _open_binary(source: Any) -> Any:
    from airflow_batch_provider import staging

    return staging.open_read(staging.resolve_path(source))


def _jsonl_records(handle: Any) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(line number, record)`` of each line (blank lines are skipped, and counted)."""
    for number, obj in iter_objects(handle):
        if not isinstance(obj, dict):
            raise WarehouseSchemaError(f"keys.jsonl line {number} is not a JSON object")
        yield number, obj
