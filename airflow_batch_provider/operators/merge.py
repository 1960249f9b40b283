"""MergeBatchResultsOperator: batch results back into a warehouse table, one row per input key."""

from __future__ import annotations

import ast
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from airflow.sdk import BaseHook, BaseOperator

from airflow_batch_provider.assets import attach_outlet_extra, merge_event_extra
from airflow_batch_provider.constants import DEFAULT_CONN_ID, SHARD_TAG
from airflow_batch_provider.estimate import describe_estimate
from airflow_batch_provider.exceptions import BatchProviderError, ConfigurationError
from airflow_batch_provider.ids import check_id
from airflow_batch_provider.jsonl import iter_objects
from airflow_batch_provider.models import BatchState, Manifest, ResultLine
from airflow_batch_provider.prices import Price, PriceBook, spend_settings
from airflow_batch_provider.records import KeyRecord, RetryKey
from airflow_batch_provider.request_hash import request_hash
from airflow_batch_provider.warehouse.lines import RawResults, ResultFile, file_line_reader
from airflow_batch_provider.warehouse.rows import (
    RESULT_COLUMNS,
    STATUSES,
    Column,
    OutputSchema,
    ResultMapper,
)
from airflow_batch_provider.warehouse.write import (
    PARSE_IN_CHOICES,
    MergeReport,
    ResultsWriter,
    ShardOutcome,
    SqlStaging,
)

if TYPE_CHECKING:
    from airflow.sdk import Context, ObjectStoragePath

    from airflow_batch_provider.dialects.base import Dialect
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.staging import ModelShardWriter, ShardedJsonlWriter

BAD_RESULT_LINE_CHOICES = ("fail", "record")

# A key of a shard whose batch ended this way, with no result line, gets this status.
_ABSENT_STATUS = {
    BatchState.EXPIRED: "expired",
    BatchState.CANCELLED: "cancelled",
    BatchState.FAILED: "failed",
}


def batches_with_shards(value: Any) -> list[tuple[str, int | None]]:
    """``(batch_id, shard or None)`` pairs from ids, a submit XCom, a terminal event, or a list of those."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "["):
            # A templated XCom rendered without native objects arrives as its repr.
            try:
                return batches_with_shards(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                raise ConfigurationError(f"batches: cannot read {text[:200]!r}") from None
        return [(check_id(text, "batches"), None)] if text else []
    if isinstance(value, Mapping):
        entries = value.get("batches")
        if isinstance(entries, Sequence) and not isinstance(entries, str) and entries:
            pairs: list[tuple[str, int | None]] = []
            for entry in entries:
                if isinstance(entry, Mapping):
                    batch_id = entry.get("batch_id") or entry.get("id")
                    shard = entry.get("shard")
                    if batch_id:
                        pairs.append((str(batch_id), shard if isinstance(shard, int) else None))
                elif isinstance(entry, str):
                    pairs.append((entry, None))
            return _unique(pairs)
        ids = value.get("batch_ids")
        if ids is None and value.get("batch_id"):
            ids = [value["batch_id"]]
        return _unique([(str(i), None) for i in ids or []])
    # Any sequence, not only list/tuple: a mapped task's XCom arrives as a lazy sequence.
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        out: list[tuple[str, int | None]] = []
        for item in value:
            out.extend(batches_with_shards(item))
        return _unique(out)
    raise ConfigurationError(f"batches: cannot read batch ids from a {type(value).__name__}")


def manifest_reference(value: Any) -> Any:
    """The manifest path (or staging directory) in ``manifest_path``: a path, or the build's XCom.

    The build's XCom (a dict, or its rendering as text) carries ``manifest_path`` and
    ``staging_path``; anything else that is not a path is an error naming what to pass.
    """
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            return text or None
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            # A templated XCom rendered without native objects arrives as its repr.
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ConfigurationError(
                    f"manifest_path: cannot read {text[:200]!r}; pass the build's XCom, its "
                    "manifest_path, or the staging directory"
                ) from None
    if isinstance(value, Mapping):
        ref = value.get("manifest_path") or value.get("staging_path")
        if not ref:
            raise ConfigurationError(
                "manifest_path got a mapping without 'manifest_path' or 'staging_path' "
                f"(keys: {', '.join(sorted(map(str, value))[:20])}); pass the build task's XCom "
                "(e.g. build.output), its ['manifest_path'], or the staging directory"
            )
        return ref
    if value is None or isinstance(value, os.PathLike) or hasattr(value, "protocol"):
        return value  # a local path or an ObjectStoragePath
    raise ConfigurationError(
        f"manifest_path: cannot use a {type(value).__name__}; pass the build task's XCom, its "
        "['manifest_path'], or the staging directory"
    )


def _unique(pairs: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    seen: dict[str, int | None] = {}
    for batch_id, shard in pairs:
        # The ids may come from ``dag_run.conf`` and are placed in URLs sent with the key.
        check_id(batch_id, "batches")
        if batch_id not in seen or seen[batch_id] is None:
            seen[batch_id] = shard
    return list(seen.items())


class MergeBatchResultsOperator(BaseOperator):
    """Merge batch results into ``target_table``: one row per input key, upserted in one transaction.

    Every result line of every batch (output and error files, or the vendor's results
    endpoint) is streamed through :class:`~airflow_batch_provider.hooks.batch.BatchApiHook`
    and bulk-loaded; the build manifest's keys are joined to them in the database, so a key
    without a result is ``missing`` and a rejected row is ``rejected``. Every row this merge
    writes records ``vendor`` (the batch connection's dialect) and ``batch_conn_id``: for a
    succeeded row, who answered it (with ``model`` from the answer); for a failed, expired,
    cancelled or missing one, where it was sent; NULL for a rejected row (never sent). A
    results table from an earlier version without these columns gets them added (nullable).

    :param target_table: the results table (created if missing; never split on dots). (templated)
    :param conn_id: connection of the warehouse (any common-sql ``DbApiHook``). (templated)
    :param batches: batch ids, the submit task's XCom, or the trigger's terminal event;
        default: the return value of the upstream task ``submit_task_id``. (templated)
    :param manifest_path: the build's XCom, staging directory or manifest.json; default: the
        ``manifest_path`` in the submit XCom; without one ``custom_id`` is the only key. (templated)
    :param submit_task_id: task whose XCom is read when ``batches`` is not given.
    :param batch_conn_id: the batch API connection (templated).
    :param dialect: override the connection's vendor dialect.
    :param target_schema: schema / database of the table. (templated)
    :param create_table: create the table when it does not exist.
    :param extra_columns: ``{column: JSON path into the response body}``, e.g.
        ``{"cached_tokens": "$.usage.prompt_tokens_details.cached_tokens"}``.
    :param output_schema: pydantic model class, its dotted path, or a JSON schema dict; the
        answer is parsed and its fields land in typed columns (else ``invalid_output``).
    :param output_column_prefix: prefix for the structured-output columns.
    :param input_price_per_1m: price of one million input (prompt) tokens, for every model, as
        billed (no batch discount taken); prefer ``prices``.
    :param output_price_per_1m: price of one million output (completion) tokens; prefer ``prices``.
    :param prices: ``{model: {input, cached_input, output, batch_discount, long_context}}`` in USD
        per 1M tokens over the batch connection's extra ``prices`` (see
        :mod:`airflow_batch_provider.prices`); the manifest's model is priced. Every row gets its
        ``cost`` (cached tokens priced apart, long-context tiers per row); the XCom gives the
        cost per status and per run next to the build's estimate, and what priced it. A model
        with no price gets cost NULL, never 0.
    :param price_table: ``auto``, ``genai-prices`` or ``none`` (see the build's); default: the
        connection's extra ``price_table``, else auto.
    :param resubmit_failed: write a new shard set (``attempt-N/`` beside the manifest) of the
        lines whose status is failed, expired, cancelled or missing.
    :param max_attempts: the attempt number after which nothing more is resubmitted.
    :param fallback_conn_id: batch API connection (any vendor dialect) that the resubmitted
        lines go to: attempt 2 and every later attempt, so rows the first vendor could not
        answer are sent to a second one (the first vendor is not tried again). The attempt's
        manifest records it, and the XCom carries it as ``resubmit_conn_id`` (without a
        fallback: this merge's ``batch_conn_id``) for the next submit's and merge's
        ``batch_conn_id``. Before anything is written, every resubmitted line is checked
        against the fallback's dialect (endpoint, what it cannot express, custom_id length, one
        model per batch where the model goes on the job); a line it cannot take fails the merge
        (rolled back), naming the line, the feature and the vendor. (templated)
    :param fallback_model: the model name at the fallback vendor: replaces ``body.model`` in
        every resubmitted line and is recorded in the manifest (``model``) and the XCom
        (``resubmit_model``). Needed when the vendors name models differently. (templated)
    :param results_mode: force ``files`` or ``results_endpoint`` when reading results.
    :param session_settings: settings for the merge's own database session, e.g.
        ``{"memory_limit": "256MB"}`` on DuckDB (which runs inside the worker process).
    :param list outlets: (a BaseOperator argument) every ``Asset`` among them gets the merge's figures as
        its event extra: rows per status, tokens, cost, batch ids (see
        :func:`airflow_batch_provider.assets.results_table_asset` for the table's URI).
    :param on_bad_result_line: a line of a result file that is not JSON, not an object or has
        no custom_id: ``fail`` the merge naming it (default), or ``record`` it as
        ``invalid_output`` with the reason (file and line) and go on; one whose custom_id is
        not in the manifest is counted with the orphan results.
    :param parse_in: where result-file lines are parsed: ``auto`` (by the warehouse where it can:
        PostgreSQL with psycopg 3 and DuckDB, for a vendor whose lines have a ``line_shape``,
        without ``extra_columns`` or ``output_schema``; else in Python), ``python``, or
        ``database`` (fail where the warehouse cannot). Both write the same rows.
    """

    template_fields: Sequence[str] = (
        "target_table",
        "conn_id",
        "batch_conn_id",
        "batches",
        "manifest_path",
        "target_schema",
        "fallback_conn_id",
        "fallback_model",
    )
    ui_color = "#d5e8d4"

    def __init__(
        self,
        *,
        target_table: str,
        conn_id: str,
        batches: Any = None,
        manifest_path: Any = None,
        submit_task_id: str | None = None,
        batch_conn_id: str = DEFAULT_CONN_ID,
        dialect: str | None = None,
        target_schema: str | None = None,
        create_table: bool = True,
        extra_columns: Mapping[str, str] | None = None,
        output_schema: Any = None,
        output_column_prefix: str = "",
        input_price_per_1m: float | None = None,
        output_price_per_1m: float | None = None,
        prices: Mapping[str, Any] | None = None,
        price_table: str | None = None,
        resubmit_failed: bool = False,
        max_attempts: int = 3,
        results_mode: str | None = None,
        session_settings: Mapping[str, str] | None = None,
        on_bad_result_line: str = "fail",
        parse_in: str = "auto",
        fallback_conn_id: str | None = None,
        fallback_model: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.target_table = target_table
        self.conn_id = conn_id
        self.batches = batches
        self.manifest_path = manifest_path
        self.submit_task_id = submit_task_id
        self.batch_conn_id = batch_conn_id
        self.dialect = dialect
        self.target_schema = target_schema
        self.create_table = create_table
        self.extra_columns = dict(extra_columns or {})
        self.output_schema = output_schema
        self.output_column_prefix = output_column_prefix
        self.input_price_per_1m = input_price_per_1m
        self.output_price_per_1m = output_price_per_1m
        self.prices = dict(prices or {})
        self.price_table = price_table
        # What priced this merge's rows (for the XCom); set as the merge runs.
        self.price: Price | None = None
        self.resubmit_failed = resubmit_failed
        if max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        self.max_attempts = max_attempts
        self.results_mode = results_mode
        self.session_settings = dict(session_settings or {})
        if on_bad_result_line not in BAD_RESULT_LINE_CHOICES:
            raise ConfigurationError(
                f"on_bad_result_line must be one of {', '.join(BAD_RESULT_LINE_CHOICES)}, "
                f"not {on_bad_result_line!r}"
            )
        self.on_bad_result_line = on_bad_result_line
        # For lineage: the columns this try writes and its summary (XCom); set as the merge runs.
        self.merge_columns: list[tuple[str, str]] = []
        self.merge_summary: dict[str, Any] | None = None
        if parse_in not in PARSE_IN_CHOICES:
            raise ConfigurationError(
                f"parse_in must be one of {', '.join(PARSE_IN_CHOICES)}, not {parse_in!r}"
            )
        self.parse_in = parse_in
        self.fallback_conn_id = fallback_conn_id
        self.fallback_model = fallback_model

    # ---- inputs -----------------------------------------------------------------------------
    def _batch_input(self, context: Context) -> Any:
        if self.batches is not None:
            return self.batches
        if self.submit_task_id:
            return context["ti"].xcom_pull(task_ids=self.submit_task_id)
        raise ConfigurationError("give batches (ids, submit XCom or terminal event) or submit_task_id")

    def get_batch_hook(self) -> BatchApiHook:
        from airflow_batch_provider.hooks.batch import BatchApiHook

        return BatchApiHook(self.batch_conn_id, dialect=self.dialect)

    def get_warehouse_hook(self) -> Any:
        return BaseHook.get_connection(self.conn_id).get_hook()

    # ---- execute ----------------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any]:
        from airflow_batch_provider import staging

        raw = self._batch_input(context)
        pairs = batches_with_shards(raw)
        manifest_ref = manifest_reference(self.manifest_path)
        if manifest_ref is None and isinstance(raw, Mapping):
            manifest_ref = raw.get("manifest_path")
        manifest: Manifest | None = None
        staging_dir: ObjectStoragePath | None = None
        manifest_file: ObjectStoragePath | None = None
        if manifest_ref:
            manifest_file = staging.manifest_path(manifest_ref)
            manifest = staging.read_manifest(manifest_file)
            staging_dir = staging.staging_dir_of(manifest_file)
        if not pairs and (manifest is None or manifest.shards):
            raise ConfigurationError(f"no batch ids found in batches={raw!r}")
        if not pairs and manifest is not None:
            # An incremental run where nothing changed: no batch; the rows it left out keep
            # their results, and its rejects (if any) are still written.
            self.log.info(
                "The build sent nothing (%d row(s) unchanged, %d rejected): no batch to read",
                manifest.rows_unchanged,
                manifest.rows_rejected,
            )
        if self.resubmit_failed and manifest is None:
            raise ConfigurationError("resubmit_failed needs the build manifest (manifest_path)")
        if (self.fallback_conn_id or self.fallback_model) and not self.resubmit_failed:
            raise ConfigurationError("fallback_conn_id and fallback_model need resubmit_failed=True")
        resubmit_to: ResubmitTarget | None = None
        if self.resubmit_failed and manifest is not None:
            # Checked before any row is written: a fallback that cannot take the endpoint fails now.
            resubmit_to = self._resubmit_target(manifest)

        hook = self.get_batch_hook()
        batches = {batch_id: hook.get_batch(batch_id) for batch_id, _ in pairs}
        running = [b.id for b in batches.values() if not b.is_terminal]
        if running:
            # Merging now would call every unanswered line missing.
            raise BatchProviderError(
                f"batch(es) {', '.join(running)} have not ended yet; merge after they complete, fail, "
                f"expire or are cancelled"
            )
        shards: dict[int, ShardOutcome] = {}
        for batch_id, shard in pairs:
            batch = batches[batch_id]
            if shard is None:
                # The terminal event carries no shard numbers; the submit tagged each batch.
                tagged = hook.dialect.metadata_of(batch).get(SHARD_TAG)
                shard = int(tagged) if tagged is not None and tagged.isdigit() else None
            if shard is not None:
                shards[shard] = ShardOutcome(batch_id, _ABSENT_STATUS.get(batch.state, "missing"))
            self.log.info("Batch %s is %s (%s)", batch.id, batch.state.value, batch.request_counts)

        schema = OutputSchema(self.output_schema, self.output_column_prefix) if self.output_schema else None
        mapper = ResultMapper(extra_columns=self.extra_columns, output_schema=schema)
        key_columns: list[Column] = []
        keys_file = rejects_file = None
        # The route is the build's (its manifest says BigQuery), not the shards': an all-rejected
        # build has no shard, and its rejects are in a table too.
        in_tables = manifest is not None and isinstance(manifest.extra.get("bigquery"), Mapping)
        if not in_tables:
            tabled = [b.id for b in batches.values() if hook.dialect.output_table(b) is not None]
            if tabled:
                raise ConfigurationError(
                    f"batch(es) {', '.join(tabled)} wrote their predictions to BigQuery tables: the "
                    "BigQuery route's merge needs the build's manifest (give manifest_path or the "
                    "build's XCom)"
                )
        if in_tables:
            assert manifest is not None
            types = list(manifest.key_types) or ["text"] * len(manifest.key_columns)
            key_columns = [Column(n, t) for n, t in zip(manifest.key_columns, types, strict=True)]
        elif manifest is not None and staging_dir is not None and manifest.key_columns and manifest.keys_path:
            types = list(manifest.key_types) or ["text"] * len(manifest.key_columns)
            key_columns = [Column(n, t) for n, t in zip(manifest.key_columns, types, strict=True)]
            keys_file = staging_dir / manifest.keys_path
            rejects_file = staging_dir / manifest.rejects_path if manifest.rejects_path else None
        elif manifest is not None:
            self.log.warning("The manifest has no key columns or keys file; custom_id is the only key")

        model = manifest.model if manifest is not None else None
        self.price, price_note = self._price(hook, model)
        if self.price is None:
            self.log.warning("Row costs are unknown (NULL): %s", price_note)
        writer = ResultsWriter(
            self.get_warehouse_hook(),
            self.target_table,
            schema=self.target_schema,
            key_columns=key_columns,
            mapper=mapper,
            create_table=self.create_table,
            session_settings=self.session_settings,
            parse_in=self.parse_in,
            vendor=hook.dialect.name,
            batch_conn_id=self.batch_conn_id,
            price=self.price,
        )
        self.merge_columns = [(c.name, c.type) for c in writer.target_columns]
        resubmission: dict[str, Any] = {}

        def on_retry(retryable: Iterator[RetryKey]) -> None:
            assert manifest is not None and staging_dir is not None and manifest_file is not None
            assert resubmit_to is not None
            resubmission.update(self._resubmit(retryable, manifest, staging_dir, manifest_file, resubmit_to))

        def results() -> Iterator[tuple[ResultLine, str]]:
            for batch in batches.values():
                count = 0
                for line in hook.iter_results(
                    batch, mode=self.results_mode, on_bad_line=self.on_bad_result_line
                ):
                    count += 1
                    yield line, batch.id
                self.log.info("Read %d result line(s) of batch %s", count, batch.id)

        if in_tables:
            assert manifest is not None
            report = writer.merge(
                iter(()),
                staged=self._tables_staging(hook, manifest, batches, len(mapper.columns)),
                shards=shards,
            )
            self.merge_summary = self._summarise(report, list(batches), resubmission, manifest, price_note)
            attach_outlet_extra(
                context, self.outlets, merge_event_extra(self.merge_summary, self.target_schema)
            )
            return self.merge_summary
        report = writer.merge(
            self._raw_results(hook, batches, writer) or results(),
            keys=keys_file,
            rejects=_records(rejects_file) if rejects_file is not None else None,
            shards=shards,
            on_retry=on_retry if self.resubmit_failed and key_columns else None,
        )
        self.merge_summary = self._summarise(report, list(batches), resubmission, manifest, price_note)
        attach_outlet_extra(context, self.outlets, merge_event_extra(self.merge_summary, self.target_schema))
        return self.merge_summary

    def _tables_staging(
        self, hook: BatchApiHook, manifest: Manifest, batches: Mapping[str, Any], columns: int
    ) -> SqlStaging:
        """The staging SQL of a build that wrote its requests in BigQuery (``requests_table``):
        request, rejects and prediction tables read inside BigQuery by the results table's
        connection (see ``warehouse/bigquery_results.py``)."""
        from airflow_batch_provider.hooks.bigquery import BigQuerySqlHook
        from airflow_batch_provider.warehouse import bigquery_results as bq
        from airflow_batch_provider.warehouse.bigquery_requests import check_table

        refused = [
            name
            for name, given in (
                ("resubmit_failed", self.resubmit_failed),
                ("extra_columns", bool(self.extra_columns)),
                ("output_schema", self.output_schema is not None),
            )
            if given
        ]
        if refused:
            raise ConfigurationError(
                f"the build wrote its requests in BigQuery (requests_table): the merge reads them "
                f"there, and cannot give {', '.join(refused)} (they need the rows in Python)"
            )
        warehouse = self.get_warehouse_hook()
        if not isinstance(warehouse, BigQuerySqlHook):
            raise ConfigurationError(
                f"the build wrote its requests in BigQuery (requests_table): the results table must be "
                f"on a BigQuery connection too, and {self.conn_id!r} gives a {type(warehouse).__name__}"
            )
        found = manifest.extra.get("bigquery")
        tables: dict[str, Any] = found if isinstance(found, dict) else {}
        rejects = str(tables.get("rejects_table") or "")
        outputs = []
        for batch in batches.values():
            table = hook.dialect.output_table(batch)
            if table is not None:
                outputs.append((batch.id, table))
            else:
                self.log.info("Batch %s wrote no prediction table (%s)", batch.id, batch.state.value)
        keys = manifest.key_columns
        template = tables.get("template")
        if template:
            # The tables the jobs read are the ones the build wrote (same check as the submit's).
            client = warehouse.get_client()
            try:
                for shard in manifest.shards:
                    if shard.table:
                        check_table(client, str(shard.table), str(template), shard.fingerprint)
            finally:
                client.close()
        return SqlStaging(
            keys=bq.keys_select(
                [(s.index, str(s.table)) for s in manifest.shards if s.table], keys, manifest.key_types
            ),
            rejects=bq.rejects_select(rejects, keys),
            unkeyed_rejects=bq.unkeyed_rejects_select(rejects, keys),
            results=bq.results_select(outputs, columns - len(RESULT_COLUMNS)),
        )

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: batches read, table written, figures (:mod:`airflow_batch_provider.lineage`)."""
        from airflow_batch_provider.lineage import merge_lineage

        return merge_lineage(
            conn_id=self.conn_id,
            warehouse_hook=self.get_warehouse_hook,
            batch_hook=self.get_batch_hook,
            table=self.target_table,
            schema=self.target_schema,
            columns=self.merge_columns,
            summary=self.merge_summary,
        )

    def _raw_results(
        self, hook: BatchApiHook, batches: Mapping[str, Any], writer: ResultsWriter
    ) -> RawResults | None:
        """The result files' raw lines, when every batch's results are files and the warehouse
        may parse them (else None: the hook parses each line)."""
        from airflow_batch_provider.hooks.results import result_files, results_mode

        dialect = hook.dialect
        if writer.parses_lines(dialect.line_shape) is not None:
            return None
        if any(results_mode(dialect, b, self.results_mode) != "files" for b in batches.values()):
            return None
        files = [
            ResultFile(file_id, source, batch.id)
            for batch in batches.values()
            for file_id, source in result_files(batch)
        ]

        def lines() -> Iterator[tuple[int, int, bytes]]:
            for index, file in enumerate(files):
                for number, data in hook.iter_raw_lines(file.file_id):
                    yield index, number, data

        return RawResults(
            files, lines(), dialect.line_shape, file_line_reader(dialect, files, self.on_bad_result_line)
        )

    # ---- resubmission -----------------------------------------------------------------------
    def _resubmit(
        self,
        retryable: Iterator[RetryKey],
        manifest: Manifest,
        staging_dir: ObjectStoragePath,
        manifest_file: ObjectStoragePath,
        to: ResubmitTarget,
    ) -> dict[str, Any]:
        from airflow_batch_provider import staging

        attempt = int(manifest.extra.get("attempt", 1))
        next_attempt = attempt + 1
        info: dict[str, Any] = {"attempt": attempt, "next_attempt": None, "resubmit_lines": 0}
        first = next(retryable, None)
        if first is None:
            return info
        if next_attempt > self.max_attempts:
            # Count what is left so the XCom says how much stays unanswered.
            info["unresubmitted"] = 1 + sum(1 for _ in retryable)
            self.log.warning(
                "%d line(s) still failed after attempt %d of %d; not resubmitting",
                info["unresubmitted"],
                attempt,
                self.max_attempts,
            )
            return info
        # Every attempt's directory sits beside the first manifest, never nested in the previous one.
        root = staging.resolve_path(manifest.extra["root"]) if manifest.extra.get("root") else staging_dir
        target = root / f"attempt-{next_attempt}"
        staging.mkdirs(target)
        limits = to.dialect.limits
        written = shared = 0
        shard_paths = {s.index: s.path for s in manifest.shards}
        # Failed lines of several one-model shards must not share a shard where the target
        # vendor runs one model per batch.
        writer: staging.ShardedJsonlWriter | staging.ModelShardWriter = (
            staging.ShardedJsonlWriter(target, limits, endpoint=manifest.endpoint)
            if to.dialect.mixed_models
            else staging.ModelShardWriter(target, limits, endpoint=manifest.endpoint)
        )
        with (
            writer,
            staging.atomic_writer(target / staging.KEYS_NAME) as keys_out,
        ):
            for shard, wanted in _group_by_shard(first, retryable):
                if shard not in shard_paths:
                    raise ConfigurationError(
                        f"keys.jsonl names shard {shard}, which the manifest does not list"
                    )
                with staging.open_read(staging_dir / shard_paths[shard]) as handle:
                    for _, obj in iter_objects(handle):
                        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
                        asking = wanted.pop(custom_id, None) if isinstance(custom_id, str) else None
                        if asking is None:
                            continue
                        # The build's hash (of the request before a fallback model), so the next
                        # incremental run finds the row unchanged.
                        body = obj.get("body")
                        rhash = asking[0].request_hash or (
                            request_hash(obj.get("url") or manifest.endpoint, body)
                            if isinstance(body, dict)
                            else None
                        )
                        to.take(obj, f"shard {shard_paths[shard]}")
                        new_shard = _add_line(writer, obj)
                        for retry in asking:
                            # A key sharing this line's answer keeps sharing it in the attempt.
                            own = retry.custom_id == custom_id
                            record = KeyRecord(
                                retry.custom_id, retry.key, new_shard, rhash, None if own else custom_id
                            )
                            keys_out.write(orjson.dumps(record.as_dict()))
                            keys_out.write(b"\n")
                            shared += 0 if own else 1
                        written += 1
                if wanted:
                    raise ConfigurationError(
                        f"shard {shard_paths[shard]} lacks {len(wanted)} line(s) listed in keys.jsonl, "
                        f"e.g. custom_id {next(iter(wanted))!r}"
                    )
        shards = writer.shards
        staging.remove_stale_shards(target, {s.path for s in shards})
        new_manifest = manifest.model_copy(
            update={
                "dialect": to.dialect.name,
                "model": self.fallback_model or manifest.model,
                "shards": shards,
                "rows_read": written + shared,
                "rows_written": written,
                "rows_rejected": 0,
                "rows_unchanged": 0,
                "rows_shared": shared,
                "rejects_path": None,
                "keys_path": staging.KEYS_NAME,
                # The first build's estimate covers every row, not these: a capped submit of the
                # attempt estimates its files itself.
                "estimate": None,
                "extra": {
                    **manifest.extra,
                    "attempt": next_attempt,
                    "root": str(root),
                    "parent_manifest": str(manifest_file),
                    "batch_conn_id": to.conn_id,
                    **({"fallback_model": self.fallback_model} if self.fallback_model else {}),
                },
            }
        )
        new_manifest_file = staging.write_manifest(target, new_manifest)
        self.log.info(
            "Wrote %d line(s) to resubmit as attempt %d through connection %r (%s): %s",
            written,
            next_attempt,
            to.conn_id,
            to.dialect.name,
            new_manifest_file,
        )
        info.update(
            {
                "next_attempt": next_attempt,
                "resubmit_lines": written,
                "resubmit_manifest_path": str(new_manifest_file),
                "resubmit_conn_id": to.conn_id,
                "resubmit_model": self.fallback_model,
            }
        )
        return info

    def _resubmit_target(self, manifest: Manifest) -> ResubmitTarget:
        """Where the next attempt goes (the fallback, else this merge's connection), with the
        manifest's endpoints checked against its dialect."""
        from airflow_batch_provider.hooks.batch import BatchApiHook

        if self.fallback_conn_id:
            conn_id, dialect = self.fallback_conn_id, BatchApiHook(self.fallback_conn_id).dialect
        else:
            conn_id, dialect = self.batch_conn_id, self.get_batch_hook().dialect
        for endpoint in {manifest.endpoint, *(s.endpoint for s in manifest.shards if s.endpoint)}:
            dialect.check_endpoint(endpoint)
        return ResubmitTarget(conn_id, dialect, self.fallback_model)

    # ---- report -----------------------------------------------------------------------------
    def _price(self, hook: BatchApiHook, model: str | None) -> tuple[Price | None, str]:
        """The price of this merge's rows and, without one, why."""
        if self.input_price_per_1m is not None or self.output_price_per_1m is not None:
            # The older, flat figures: as billed, for every model (cached tokens as input).
            rate_in = float(self.input_price_per_1m or 0.0)
            return Price(rate_in, rate_in, float(self.output_price_per_1m or 0.0), model=model), ""
        spend = spend_settings(hook.get_settings().extra, f"connection {self.batch_conn_id!r}")
        book = PriceBook.for_dialect(
            hook.dialect, {**spend.prices, **self.prices}, "prices", self.price_table or spend.price_table
        )
        price = book.price(model)
        return price, "" if price is not None else book.why_unknown(model)

    def _summarise(
        self,
        report: MergeReport,
        batch_ids: list[str],
        resubmission: Mapping[str, Any],
        manifest: Manifest | None,
        price_note: str = "",
    ) -> dict[str, Any]:
        cost = report.cost
        summary = {
            "table": self.target_table,
            "batch_ids": batch_ids,
            **report.as_dict(),
            "cost": cost,
            # What priced the rows (source and version), or why nothing did.
            "price": self.price.describe()
            if self.price is not None
            else {"source": "unknown", "why": price_note},
            # The build's estimate (worst case), to read next to the actual cost.
            "estimate": manifest.estimate if manifest is not None else None,
            "attempt": int(manifest.extra.get("attempt", 1)) if manifest else 1,
            "max_attempts": self.max_attempts,
            "resubmit": bool(resubmission.get("resubmit_lines")),
            "resubmit_lines": int(resubmission.get("resubmit_lines", 0)),
            "resubmit_manifest_path": resubmission.get("resubmit_manifest_path"),
            # For the next attempt's submit and merge: ``batch_conn_id="{{ ti.xcom_pull(...)[
            # 'resubmit_conn_id'] }}"``; None when nothing was resubmitted.
            "resubmit_conn_id": resubmission.get("resubmit_conn_id"),
            "resubmit_model": resubmission.get("resubmit_model"),
            "unresubmitted": int(resubmission.get("unresubmitted", 0)),
        }
        counts = ", ".join(f"{s}={report.counts.get(s, 0)}" for s in STATUSES)
        self.log.info(
            "Merged %d row(s) into %s from %d result line(s): %s; tokens prompt=%d completion=%d total=%d%s",
            report.rows_written,
            self.target_table,
            report.result_lines,
            counts,
            report.prompt_tokens,
            report.completion_tokens,
            report.total_tokens,
            _cost_line(cost, report.cost_by_status),
        )
        estimate = manifest.estimate if manifest is not None else None
        if estimate:
            self.log.info(
                "Estimated at build: %s; actual: %d input tokens (%d cached), %d output tokens, cost %s",
                describe_estimate(estimate),
                report.prompt_tokens,
                report.cached_tokens,
                report.completion_tokens,
                "unknown" if cost is None else f"${cost:,.6f}",
            )
        if report.orphan_results:
            self.log.warning(
                "%d result line(s) matched no key of the manifest and were not written (e.g. %s)",
                report.orphan_results,
                ", ".join(report.orphan_samples),
            )
        if report.unkeyed_rejects:
            self.log.warning(
                "%d rejected row(s) have no key and cannot be written to the table; see the rejects file",
                report.unkeyed_rejects,
            )
        if report.bad_result_lines:
            self.log.warning(
                "%d result line(s) could not be read and were recorded as invalid_output: %s",
                report.bad_result_lines,
                "; ".join(report.bad_result_samples),
            )
        if report.bad_token_counts:
            self.log.warning(
                "%d result line(s) had negative, absurd or non-integer token counts, stored as NULL "
                "(e.g. %s)",
                report.bad_token_counts,
                "; ".join(report.bad_token_samples),
            )
        if report.duplicate_results:
            self.log.warning(
                "%d result line(s) repeated a custom_id; the success (else the last line) was kept",
                report.duplicate_results,
            )
        return summary


def _cost_line(cost: float | None, by_status: Mapping[str, float | None]) -> str:
    if cost is None:
        return "; cost unknown"
    parts = ", ".join(f"{status}=${value:,.6f}" for status, value in by_status.items() if value)
    return f"; cost=${cost:,.6f}" + (f" ({parts})" if parts else "")


def _records(path: ObjectStoragePath) -> Iterator[dict[str, Any]]:
    """The objects of a staged JSONL file, streamed; a non-object line is an error naming it."""
    from airflow_batch_provider import staging

    with staging.open_read(path) as handle:
        for number, obj in iter_objects(handle):
            if not isinstance(obj, dict):
                raise ConfigurationError(f"{path}: line {number} is not a JSON object")
            yield obj


def _group_by_shard(
    first: RetryKey, rest: Iterator[RetryKey]
) -> Iterator[tuple[int, dict[str, list[RetryKey]]]]:
    """Group the (ordered) retryable keys per shard, by the custom_id of the line that answers
    them (several keys share one line in a deduplicated build); one shard's worth is bounded by
    the shard limits."""
    shard: int = first.shard
    group: dict[str, list[RetryKey]] = {}
    for item in itertools.chain((first,), rest):
        if item.shard != shard:
            yield shard, group
            shard, group = item.shard, {}
        group.setdefault(item.sent_as or item.custom_id, []).append(item)
    yield shard, group


class ResubmitTarget:
    """The connection the next attempt goes to, and the check of each line resubmitted there.

    :param conn_id: the batch API connection of the next attempt.
    :param dialect: its vendor dialect.
    :param model: replaces ``body.model`` in every line (the fallback vendor's name), or None.
    """

    def __init__(self, conn_id: str, dialect: Dialect, model: str | None = None) -> None:
        self.conn_id = conn_id
        self.dialect = dialect
        self.model = model

    def take(self, obj: dict[str, Any], where: str) -> None:
        """Rewrite ``obj``'s model if asked, then refuse a line the dialect cannot express.

        :param obj: a canonical line of the original shard (changed in place).
        :param where: the shard, for messages.
        :raises ConfigurationError: naming the line, what the vendor lacks and the vendor.
        """
        dialect = self.dialect
        custom_id = obj["custom_id"]
        body = obj.get("body")
        if not isinstance(body, dict):
            raise ConfigurationError(f"{where}: line {custom_id!r} has no body object")
        if self.model:
            body["model"] = self.model
        what = f"cannot resubmit line {custom_id!r} of {where} through connection {self.conn_id!r}"
        limit = dialect.max_custom_id_chars
        if limit is not None and len(custom_id) > limit:
            raise ConfigurationError(
                f"{what}: its custom_id is longer than the {limit} characters {dialect.label} accepts"
            )
        if obj.get("url") and obj["url"] not in dialect.endpoints:
            raise ConfigurationError(f"{what}: endpoint {obj['url']!r} is not supported by {dialect.label}")
        reason = dialect.unsupported(obj)
        if reason is not None:
            raise ConfigurationError(f"{what}: {reason}")
        if dialect.model_placement == "job":
            # Lines of several models are fine: each model gets shards (and jobs) of its own.
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise ConfigurationError(
                    f"{what}: body.model is missing and {dialect.label} needs one model per batch"
                )


def _add_line(writer: ShardedJsonlWriter | ModelShardWriter, obj: dict[str, Any]) -> int:
    """Write one line to its shard (by its ``body.model`` for a per-model writer)."""
    from airflow_batch_provider.staging import ModelShardWriter

    line = orjson.dumps(obj)
    if isinstance(writer, ModelShardWriter):
        body = obj.get("body")
        model = body.get("model") if isinstance(body, dict) else None
        return writer.add(line, model if isinstance(model, str) else None)
    return writer.add(line)
