"""SqlToBatchJsonlOperator: stream warehouse rows into validated, sharded batch JSONL files in staging."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook, BaseOperator

from airflow_batch_provider import keys as keymod
from airflow_batch_provider import staging
from airflow_batch_provider.assets import attach_outlet_extra, build_event_extra
from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.estimate import EstimateTally, describe_estimate, resolve_counter
from airflow_batch_provider.exceptions import (
    ConfigurationError,
    EmptyBatchError,
    RejectRatioExceededError,
)
from airflow_batch_provider.models import Manifest, Shard
from airflow_batch_provider.prices import PriceBook, spend_settings
from airflow_batch_provider.rendering import BodySource
from airflow_batch_provider.rows_to_lines import (
    ON_NULL_CHOICES,
    BuildResult,
    BuildSpec,
    NullValueError,
    build_lines,
)
from airflow_batch_provider.warehouse.databases import SqlDialect, detect_sql_dialect
from airflow_batch_provider.warehouse.read import RowStream, stream_rows
from airflow_batch_provider.warehouse.unchanged import (
    LOOKUP_CHOICES,
    HashLookup,
    UnchangedRows,
    joined_query,
    target_has_hashes,
)

if TYPE_CHECKING:
    from airflow.sdk import Context, ObjectStoragePath

    from airflow_batch_provider.dialects import Dialect
    from airflow_batch_provider.limits import Limits

__all__ = ["NullValueError", "SqlToBatchJsonlOperator", "default_staging_path", "manifest_xcom"]


class SqlToBatchJsonlOperator(BaseOperator):
    """Build batch JSONL shards from a SQL query or table, ready for :class:`SubmitBatchOperator`.

    Rows are streamed from any common-sql ``DbApiHook`` connection and turned into one request
    line each. Every line is validated against the dialect's rules; rows that cannot become a
    valid line are written to ``rejects.jsonl`` with their key and a reason. Output (shards,
    ``keys.jsonl``, ``rejects.jsonl`` and ``manifest.json``, written last) goes to
    ``staging_path``. The return value (XCom) is the manifest plus ``staging_path``,
    ``manifest_path`` and a ``uri`` on every shard, so ``.expand()`` can map over ``["shards"]``.

    :param conn_id: connection of the source database (any ``DbApiHook``) (templated).
    :param sql: the query (templated; ``.sql`` files are read). Give ``sql`` or ``table``.
    :param table: a table to read whole (templated): one identifier, quoted (a dot or ``%`` in
        it is part of the name), like the merge's ``target_table``. Use ``sql`` for anything custom.
    :param schema: the schema / database of ``table`` (templated), quoted the same way.
    :param where: optional filter for ``table`` (templated).
    :param parameters: query parameters, in the driver's style (templated).
    :param key_columns: column(s) whose values identify a row; they make the custom_id.
    :param messages: chat messages whose strings are Jinja row templates (a list of
        ``{"role", "content"}``), or one template string rendering a JSON list of messages.
    :param body_template: a Jinja row template rendering the whole body as a JSON object. In it
        (and in a string ``messages``) every ``{{ ... }}`` output is JSON-escaped, so write
        ``"content": "{{ text }}"`` (or ``"content": {{ text | tojson }}``): a row value never
        changes the JSON structure. A ``model`` it renders that differs from ``model`` rejects
        the row (``model_conflict``); its other keys take precedence over ``body``.
    :param body_callable: a Python callable ``row dict -> body dict``.
    :param input_column: for embeddings: the column holding the text to embed.
    :param body: body defaults merged into every line (max_tokens, temperature, response_format...),
        over the batch connection's extra ``request_defaults`` when ``batch_conn_id`` is given.
    :param endpoint: the url every line targets (templated); default chat completions, or
        embeddings when ``input_column`` is given.
    :param model: the model (templated). A dialect whose vendor runs each line on its own model
        refuses a line without one (reject code ``missing_model``); give it here, in ``body`` or
        the template, or (a job-model dialect such as Mistral) on the submit.
    :param dialect: vendor dialect whose rules and limits apply (default ``openai``) (templated).
    :param batch_conn_id: a batch API connection to read the dialect from, when ``dialect`` is
        not given (templated).
    :param staging_path: where to write (templated; a URI or ObjectStoragePath). Default:
        ``[batch_provider] staging_root`` (or ``$AIRFLOW_HOME/batch-staging``) / dag / run / task.
    :param max_lines: lower the dialect's lines-per-shard limit.
    :param max_file_bytes: lower the dialect's bytes-per-shard limit.
    :param max_line_bytes: lower the dialect's bytes-per-line limit.
    :param on_null: a NULL in a column the body uses: ``reject`` the row (default), render it
        as ``empty`` text, or ``fail`` the task.
    :param allow_empty: succeed when no row becomes a line (default: fail).
    :param max_reject_ratio: fail when rejected / read exceeds this (0..1); None = no limit.
    :param custom_id_prefix: text put in front of every custom_id (templated).
    :param fetch_batch_size: rows per fetch from the database.
    :param session_sql: statements run on the source connection before the query, e.g.
        ``["SET memory_limit = '512MB'"]`` to bound DuckDB's cache of scanned table blocks.
    :param token_counter: how input tokens are counted per line (see
        :mod:`airflow_batch_provider.estimate`): a callable ``body -> int``, ``"auto"`` (exact
        for OpenAI encodings when ``bpe-openai`` is installed, else the script-aware heuristic
        with the dialect's factor), ``"heuristic"``, ``"exact"``, an encoding name, a dotted
        path ``"module:function"``, or ``"none"`` (no estimate); default: the batch connection's
        extra ``token_counter``, else auto.
    :param default_max_output_tokens: the worst-case output of a line that sets no
        ``max_tokens`` / ``max_completion_tokens``; default: the batch connection's extra
        ``default_max_output_tokens``, else none (the worst case is then unknown).
    :param prices: ``{model: {input, cached_input, output, batch_discount, long_context}}`` in
        USD per 1M tokens (see :mod:`airflow_batch_provider.prices`), over the batch connection's
        extra ``prices``.
    :param price_table: ``auto``, ``genai-prices`` or ``none``: whether the optional
        genai-prices table prices a model nobody set; default: the connection's, else auto.
    :param skip_unchanged: leave out the rows whose key already has a ``succeeded`` row with the
        same ``request_hash`` (the hash of the canonical request: endpoint and body, model
        included) in ``target_table``; they are counted in the manifest (``rows_unchanged``),
        not sent, and the merge leaves their rows as they are. A run where nothing changed
        writes no shard and succeeds; submit then creates no batch.
    :param target_table: the merge's results table, for ``skip_unchanged`` (templated). A table
        that does not exist yet (or has no ``request_hash`` column) leaves nothing out.
    :param target_schema: its schema (templated).
    :param target_conn_id: its connection; default ``conn_id`` (templated).
    :param unchanged_lookup: how ``skip_unchanged`` reads the target (see
        :mod:`airflow_batch_provider.warehouse.unchanged`): ``join`` (the source query is joined
        to the target inside the database: one connection), ``lookup`` (the target's hashes are
        read per fetched batch, by key), or ``auto`` (join when ``target_conn_id`` is ``conn_id``).
    :param deduplicate: send each distinct request (same ``request_hash``) once per run: the
        rows that repeat it go to keys.jsonl naming the custom_id sent, and the merge gives
        them its answer (column ``shared_answer``). Off by default: with a temperature,
        identical requests may be meant to differ. Holds one small entry per distinct request
        in memory (about 200 bytes).
    :param requests_table: ``dataset.prefix`` (or ``project.dataset.prefix``): write the requests
        as BigQuery tables instead of files, by SQL run inside BigQuery, so no row passes through
        the worker (templated). For a BigQuery source connection and a dialect whose jobs read
        BigQuery (``vertex``); tables ``prefix_<token>_shard_000``... (key columns,
        ``custom_id``, ``request_hash``, ``request``) and ``prefix_<token>_rejects``, in
        ``dataset``, where the job's prediction tables also go (``<token>``: the run's, from its
        staging directory, so overlapping runs keep their own tables). Restrictions, refused by
        name: ``messages`` as a list whose strings are plain text plus ``{{ column }}`` (STRING
        or INT64 columns; no filters, blocks or ``row[...]``: compute such text in ``sql``),
        INT64 or STRING key columns, no
        ``parameters``, ``skip_unchanged`` or ``deduplicate``; no estimate is made. See
        :mod:`airflow_batch_provider.warehouse.bigquery_requests`.
    :param list outlets: (a BaseOperator argument) every ``Asset`` among them gets the build's figures
        as its event extra: shard count, rows read / written / rejected, the staging URI.
    """

    template_fields: Sequence[str] = (
        "conn_id",
        "batch_conn_id",
        "dialect",
        "sql",
        "table",
        "schema",
        "where",
        "parameters",
        "staging_path",
        "model",
        "endpoint",
        "custom_id_prefix",
        "target_table",
        "target_schema",
        "target_conn_id",
        "requests_table",
    )
    template_ext: Sequence[str] = (".sql",)
    template_fields_renderers = {"sql": "sql", "parameters": "json"}
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        conn_id: str,
        key_columns: str | Sequence[str],
        sql: str | None = None,
        table: str | None = None,
        schema: str | None = None,
        where: str | None = None,
        parameters: Sequence[Any] | Mapping[str, Any] | None = None,
        messages: Sequence[Mapping[str, Any]] | str | None = None,
        body_template: str | None = None,
        body_callable: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
        input_column: str | None = None,
        body: Mapping[str, Any] | None = None,
        endpoint: str | None = None,
        model: str | None = None,
        dialect: str | None = None,
        batch_conn_id: str | None = None,
        staging_path: Any = None,
        max_lines: int | None = None,
        max_file_bytes: int | None = None,
        max_line_bytes: int | None = None,
        on_null: str = "reject",
        allow_empty: bool = False,
        max_reject_ratio: float | None = None,
        custom_id_prefix: str = "",
        fetch_batch_size: int = 5_000,
        session_sql: str | Sequence[str] | None = None,
        token_counter: Any = None,
        default_max_output_tokens: int | None = None,
        prices: Mapping[str, Any] | None = None,
        price_table: str | None = None,
        skip_unchanged: bool = False,
        target_table: str | None = None,
        target_schema: str | None = None,
        target_conn_id: str | None = None,
        unchanged_lookup: str = "auto",
        deduplicate: bool = False,
        requests_table: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if skip_unchanged and not target_table:
            raise ConfigurationError("skip_unchanged needs target_table (the merge's results table)")
        if unchanged_lookup not in LOOKUP_CHOICES:
            raise ConfigurationError(
                f"unchanged_lookup must be one of {', '.join(LOOKUP_CHOICES)}, not {unchanged_lookup!r}"
            )
        if (sql is None) == (table is None):
            raise ConfigurationError("give exactly one of sql or table")
        if schema is not None and table is None:
            raise ConfigurationError("schema applies to table; qualify the names in sql instead")
        if where is not None and table is None:
            raise ConfigurationError("where applies to table; put the filter in sql instead")
        modes = [
            n
            for n, v in (
                ("messages", messages),
                ("body_template", body_template),
                ("body_callable", body_callable),
                ("input_column", input_column),
            )
            if v is not None
        ]
        if len(modes) != 1:
            raise ConfigurationError(
                "give exactly one body source: messages, body_template, body_callable or input_column"
                + (f" (got {', '.join(modes)})" if modes else "")
            )
        if on_null not in ON_NULL_CHOICES:
            raise ConfigurationError(f"on_null must be one of {', '.join(ON_NULL_CHOICES)}, not {on_null!r}")
        if max_reject_ratio is not None and not 0 <= max_reject_ratio <= 1:
            raise ConfigurationError(f"max_reject_ratio must be between 0 and 1, not {max_reject_ratio!r}")
        key_list = [key_columns] if isinstance(key_columns, str) else list(key_columns)
        if not key_list:
            raise ConfigurationError("key_columns needs at least one column")
        if body is not None and body.get("stream") is True:
            raise ConfigurationError("body has stream=true, which no batch accepts")
        self.conn_id = conn_id
        self.sql = sql
        self.table = table
        self.schema = schema
        self.where = where
        self.parameters = parameters
        self.key_columns = key_list
        self.messages = messages
        self.body_template = body_template
        self.body_callable = body_callable
        self.input_column = input_column
        self.body = dict(body or {})
        self.endpoint = endpoint
        self.model = model
        self.dialect = dialect
        self.batch_conn_id = batch_conn_id
        self.staging_path = staging_path
        self.max_lines = max_lines
        self.max_file_bytes = max_file_bytes
        self.max_line_bytes = max_line_bytes
        self.on_null = on_null
        self.allow_empty = allow_empty
        self.max_reject_ratio = max_reject_ratio
        self.custom_id_prefix = custom_id_prefix
        self.fetch_batch_size = fetch_batch_size
        self.session_sql = [session_sql] if isinstance(session_sql, str) else list(session_sql or [])
        if default_max_output_tokens is not None and (
            type(default_max_output_tokens) is not int or default_max_output_tokens < 0
        ):
            raise ConfigurationError(
                f"default_max_output_tokens must be a token count, not {default_max_output_tokens!r}"
            )
        self.token_counter = token_counter
        self.default_max_output_tokens = default_max_output_tokens
        self.prices = dict(prices or {})
        self.price_table = price_table
        self.skip_unchanged = skip_unchanged
        self.target_table = target_table
        self.target_schema = target_schema
        self.target_conn_id = target_conn_id
        self.unchanged_lookup = unchanged_lookup
        self.deduplicate = deduplicate
        self.requests_table = requests_table
        if requests_table is not None:
            refused = [
                name
                for name, given in (
                    ("skip_unchanged", skip_unchanged),
                    ("deduplicate", deduplicate),
                    ("parameters", parameters is not None),
                    ("body_template", body_template is not None),
                    ("body_callable", body_callable is not None),
                    ("input_column", input_column is not None),
                )
                if given
            ]
            if refused:
                raise ConfigurationError(
                    f"requests_table (requests written in BigQuery) does not take {', '.join(refused)}; "
                    "give messages, and compute any other text in sql"
                )
        # What this try wrote (its XCom), for lineage; None until the build succeeds.
        self.built: dict[str, Any] | None = None

    # ---- configuration resolved at run time -------------------------------------------------

    def _dialect(self) -> Dialect:
        if self.dialect is None and self.batch_conn_id:
            # The hook reads the connection's extra in every spelling it accepts.
            from airflow_batch_provider.hooks.batch import BatchApiHook

            return BatchApiHook(self.batch_conn_id).dialect
        return get_dialect(self.dialect or "openai")

    def _body_source(self) -> BodySource:
        return BodySource(
            messages=self.messages,
            body_template=self.body_template,
            body_callable=self.body_callable,
            input_column=self.input_column,
            defaults={**self._connection_defaults(), **self.body},
            model=self.model,
        )

    def _connection_defaults(self) -> dict[str, Any]:
        """The batch connection's ``request_defaults`` (e.g. a vendor's required ``max_tokens``),
        under the operator's ``body``; none without a ``batch_conn_id``."""
        if not self.batch_conn_id:
            return {}
        from airflow_batch_provider.hooks.batch import BatchApiHook
        from airflow_batch_provider.hooks.settings import request_defaults

        extra = BatchApiHook(self.batch_conn_id).get_settings().extra.get("request_defaults")
        return request_defaults(extra, f"connection {self.batch_conn_id!r}")

    def _tally(self, dialect: Dialect, endpoint: str) -> tuple[EstimateTally | None, PriceBook]:
        """The estimate's counter and price, from this operator over the batch connection's extra."""
        extra: Mapping[str, Any] = {}
        if self.batch_conn_id:
            from airflow_batch_provider.hooks.batch import BatchApiHook

            extra = BatchApiHook(self.batch_conn_id).get_settings().extra
        spend = spend_settings(extra, f"connection {self.batch_conn_id!r}")
        model = self.model or self.body.get("model") or self._connection_defaults().get("model")
        counter = resolve_counter(
            self.token_counter if self.token_counter is not None else spend.token_counter, dialect, model
        )
        book = PriceBook.for_dialect(
            dialect,
            {**spend.prices, **self.prices},
            "prices",
            self.price_table or spend.price_table,
        )
        if counter is None:
            return None, book
        default_out = self.default_max_output_tokens
        if default_out is None:
            default_out = spend.default_max_output_tokens
        tally = EstimateTally(counter, endpoint, default_out, book.price(model))
        return tally, book

    def _endpoint(self) -> str:
        return self.endpoint or self._body_source().default_endpoint()

    def _limits(self, dialect: Dialect) -> Limits:
        return dialect.limits.tightened(
            max_lines=self.max_lines, max_file_bytes=self.max_file_bytes, max_line_bytes=self.max_line_bytes
        )

    def _query(self, hook: Any) -> str:
        if self.sql is not None:
            return self.sql
        assert self.table is not None
        quoting = _identifiers(hook)
        source = quoting.table(self.table, self.schema)
        if self.parameters is not None:
            source = quoting.bound(source)  # a % in a name must not read as a placeholder
        query = f"SELECT * FROM {source}"
        return f"{query} WHERE {self.where}" if self.where else query

    def _check_names(self, hook: Any) -> None:
        """Names the source database would not keep as given fail here, before any work."""
        quoting = _identifiers(hook)
        if self.table is not None:
            names = [("table", self.table), *([("schema", self.schema)] if self.schema else [])]
            quoting.check_identifiers(names, distinct=False)
        quoting.check_identifiers([("key column", k) for k in self.key_columns])

    def _staging_dir(self, context: Context | Mapping[str, Any]) -> ObjectStoragePath:
        if self.staging_path:
            return staging.resolve_path(self.staging_path)
        return staging.resolve_path(default_staging_path(context, self.task_id))

    def _hook(self, conn_id: str | None = None) -> Any:
        from airflow.providers.common.sql.hooks.sql import DbApiHook

        conn_id = conn_id or self.conn_id
        hook = BaseHook.get_connection(conn_id).get_hook()
        if not isinstance(hook, DbApiHook):
            raise ConfigurationError(
                f"connection {conn_id!r} gives a {type(hook).__name__}, not a common-sql DbApiHook"
            )
        return hook

    def _unchanged_mode(self) -> tuple[str | None, Any]:
        """How this build finds unchanged rows (``join``, ``lookup`` or None: it does not) and
        the target's hook."""
        if not self.skip_unchanged:
            return None, None
        assert self.target_table is not None
        target_conn = self.target_conn_id or self.conn_id
        hook = self._hook(target_conn)
        columns = target_has_hashes(hook, self.target_table, self.target_schema)
        where = f"{self.target_table} on {target_conn}"
        if columns is None:
            self.log.info("skip_unchanged: %s has no request_hash yet; every row is sent", where)
            return None, None
        missing = [k for k in self.key_columns if k not in columns]
        if missing:
            raise ConfigurationError(
                f"skip_unchanged: target {where} has no key column(s) {', '.join(missing)}"
            )
        mode = self.unchanged_lookup
        if mode == "auto":
            mode = "join" if target_conn == self.conn_id else "lookup"
        if mode == "join" and target_conn != self.conn_id:
            raise ConfigurationError(
                "unchanged_lookup='join' needs the target on the source connection "
                f"({target_conn!r} is not {self.conn_id!r})"
            )
        self.log.info("skip_unchanged: rows answered alike in %s are left out (%s)", where, mode)
        return mode, hook

    # ---- execution ----------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        if self.requests_table is not None:
            return self._execute_in_bigquery(context)
        directory = self._staging_dir(context)
        # Before any work: on a distributed executor, local staging would strand the next task.
        staging.check_shared(directory)
        dialect = self._dialect()
        endpoint = self._endpoint()
        dialect.check_endpoint(endpoint)
        limits = self._limits(dialect)
        rules = dataclasses.replace(dialect.validation_rules(limits), unique_custom_ids=False)
        prefix = keymod.check_prefix(self.custom_id_prefix or "")
        hook = self._hook()
        self._check_names(hook)
        query = self._query(hook)
        staging.mkdirs(directory)
        # A manifest left by an earlier try would describe shards this try is about to replace.
        manifest_file = directory / staging.MANIFEST_NAME
        if manifest_file.exists():
            manifest_file.unlink()
        self.log.info(
            "Building %s batch lines for %s from %s into %s", dialect.name, endpoint, self.conn_id, directory
        )
        tally, book = self._tally(dialect, endpoint)
        spec = BuildSpec(
            directory=directory,
            endpoint=endpoint,
            limits=limits,
            rules=rules,
            key_columns=tuple(self.key_columns),
            body=self._body_source(),
            on_null=self.on_null,
            prefix=prefix,
            unsupported=dialect.unsupported,
            tally=tally,
            skip_unchanged=False,
            deduplicate=self.deduplicate,
        )
        unchanged, target_hook = self._unchanged_mode()
        if unchanged == "join":
            assert self.target_table is not None
            query = joined_query(hook, query, self.target_table, self.target_schema, self.key_columns)
        with stream_rows(
            hook, query, self.parameters, batch_size=self.fetch_batch_size, session_sql=self.session_sql
        ) as rows:
            build = self._build(spec, rows, unchanged, target_hook)
        manifest = Manifest(
            source=f"{self.conn_id}: {self.table or _one_line(query)}",
            dialect=dialect.name,
            endpoint=endpoint,
            model=self.model or None,
            key_columns=self.key_columns,
            key_types=build.key_types,
            custom_id_prefix=prefix,
            shards=build.shards,
            rows_read=build.rows_read,
            rows_written=build.rows_written,
            rows_rejected=build.rows_rejected,
            rows_unchanged=build.rows_unchanged,
            rows_shared=build.rows_shared,
            rejects_path=staging.REJECTS_NAME,
            keys_path=staging.KEYS_NAME,
            estimate=tally.summary(book, self.model or None) if tally is not None else None,
            extra={
                "rejects_by_code": dict(build.reject_codes),
                "columns": build.column_names,
                "on_null": self.on_null,
                "limits": dataclasses.asdict(limits),
            },
        )
        self._check_outcome(build, directory)
        written = staging.write_manifest(directory, manifest)
        staging.remove_stale_shards(directory, {s.path for s in manifest.shards})
        self.log.info(
            "Wrote %d lines in %d shard(s); %d row(s) rejected of %d read; manifest %s",
            manifest.rows_written,
            len(manifest.shards),
            manifest.rows_rejected,
            manifest.rows_read,
            written,
        )
        if self.skip_unchanged:
            self.log.info(
                "skip_unchanged: %d row(s) unchanged (already answered alike), not sent%s",
                build.rows_unchanged,
                "; nothing to send: no shard, submit creates no batch" if not manifest.shards else "",
            )
        if self.deduplicate:
            self.log.info(
                "deduplicate: %d row(s) repeat a request sent for another row and share its answer",
                build.rows_shared,
            )
        self.log.info("Estimate: %s", describe_estimate(manifest.estimate or {}))
        self.built = manifest_xcom(manifest, directory)
        attach_outlet_extra(context, self.outlets, build_event_extra(self.built))
        return self.built

    def _execute_in_bigquery(self, context: Context) -> dict[str, Any]:
        """The ``requests_table`` route: SQL run inside BigQuery writes the request and rejects
        tables; the manifest (counts and table names) is the only thing written to staging."""
        from airflow_batch_provider.hooks.bigquery import BigQuerySqlHook
        from airflow_batch_provider.jsonl import LineValidator
        from airflow_batch_provider.rendering import body_builder
        from airflow_batch_provider.warehouse import bigquery_requests as bq

        assert self.requests_table is not None
        directory = self._staging_dir(context)
        staging.check_shared(directory)
        dialect = self._dialect()
        if not dialect.bigquery_io:
            raise ConfigurationError(
                f"requests_table: dialect {dialect.name!r} has no job that reads BigQuery tables "
                "(vertex does); leave requests_table out to write files"
            )
        hook = self._hook()
        if not isinstance(hook, BigQuerySqlHook):
            raise ConfigurationError(
                f"requests_table: connection {self.conn_id!r} gives a {type(hook).__name__}, not "
                "BigQuery (type bigquery): the requests are written by SQL in the source database"
            )
        endpoint = self._endpoint()
        dialect.check_endpoint(endpoint)
        limits = self._limits(dialect)
        prefix = keymod.check_prefix(self.custom_id_prefix or "")
        self._check_names(hook)
        query = self._query(hook)
        client = hook.get_client()
        project, dataset, name = bq.split_requests_table(self.requests_table, client.project)
        quoting = _identifiers(hook)
        schema = {
            f.name: f.field_type for f in client.query(f"SELECT * FROM ({query}) LIMIT 0").result().schema
        }
        source = self._body_source()

        def canonical_body(compiled: list[Any]) -> dict[str, Any]:
            # The file route's body builder, given the compiled messages as constant text.
            constant = dataclasses.replace(source, messages=compiled)
            return body_builder(constant, [], endpoint).build(())

        plan = bq.plan_requests(
            source=query,
            schema=schema,
            key_columns=self.key_columns,
            messages=self.messages,
            canonical_body=canonical_body,
            endpoint=endpoint,
            encode_request=lambda line: _encoded_request(dialect, line),
            prefix=prefix,
            on_null=self.on_null,
            max_line=min(limits.max_line_bytes, limits.max_file_bytes - 1),
            quote=quoting.quote,
        )
        # Every row's line has the same shape (only text changes): its verdict is the first's.
        sample_body = plan.body
        sample: dict[str, Any] = {"custom_id": "x", "method": "POST", "url": endpoint, "body": sample_body}
        rules = dataclasses.replace(dialect.validation_rules(limits), unique_custom_ids=False)
        problems = LineValidator(rules, endpoint).check_object(sample, 1)
        reason = problems[0].message if problems else dialect.unsupported(sample)
        if reason is not None:
            raise ConfigurationError(f"requests_table: every line would be rejected: {reason}")
        model = sample_body.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigurationError(
                f"requests_table: no model in the body; dialect {dialect.name!r} runs one model per job "
                "(give model=)"
            )
        staging.mkdirs(directory)
        manifest_file = directory / staging.MANIFEST_NAME
        if manifest_file.exists():
            manifest_file.unlink()
        self.log.info(
            "Writing %s request tables %s.%s.%s_%s_* from %s",
            dialect.name,
            project,
            dataset,
            name,
            bq.run_token(str(directory)),
            self.conn_id,
        )
        try:
            built = bq.write_tables(
                client,
                plan,
                project=project,
                dataset=dataset,
                name=name,
                # The run's own tables (a prefix of at most 200 characters, an 11-character token
                # and a suffix stay far within BigQuery's 1,024-character table names).
                token=bq.run_token(str(directory)),
                max_lines=limits.max_lines,
                log=self.log,
            )
        finally:
            client.close()
        manifest = Manifest(
            source=f"{self.conn_id}: {self.table or _one_line(query)}",
            dialect=dialect.name,
            endpoint=endpoint,
            model=model,
            key_columns=self.key_columns,
            key_types=[bq.key_type(kind) for _, kind in plan.keys],
            custom_id_prefix=prefix,
            shards=[
                Shard(
                    index=index,
                    path=f"bigquery/{uri.rsplit('.', 1)[-1]}",
                    lines=lines,
                    bytes=size,
                    fingerprint=fingerprint,
                    endpoint=endpoint,
                    table=uri,
                )
                for index, uri, lines, size, fingerprint in built.shards
            ],
            rows_read=built.rows_read,
            rows_written=built.rows_written,
            rows_rejected=built.rows_rejected,
            rejects_path=None,
            keys_path=None,
            extra={
                "rejects_by_code": built.reject_codes,
                "columns": list(schema),
                "on_null": self.on_null,
                "limits": dataclasses.asdict(limits),
                "bigquery": {
                    "rejects_table": built.rejects_table,
                    "output_dataset": f"bq://{project}.{dataset}",
                    "body_keys": sorted(sample_body),
                    # Checked again (with each shard's fingerprint) by the submit and the merge.
                    "template": plan.template,
                    "conn_id": self.conn_id,
                },
            },
        )
        result = BuildResult(
            rows_read=built.rows_read,
            rows_written=built.rows_written,
            rows_rejected=built.rows_rejected,
            reject_codes=Counter(built.reject_codes),
            first_reasons=built.first_reasons,
        )
        self._check_outcome(result, directory)
        written = staging.write_manifest(directory, manifest)
        self.log.info(
            "Wrote %d request(s) in %d table(s); %d row(s) rejected of %d read (%s); manifest %s",
            manifest.rows_written,
            len(manifest.shards),
            manifest.rows_rejected,
            manifest.rows_read,
            built.rejects_table,
            written,
        )
        self.built = manifest_xcom(manifest, directory)
        for shard in self.built["shards"]:
            shard["uri"] = shard["table"]
        attach_outlet_extra(context, self.outlets, build_event_extra(self.built))
        return self.built

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: tables read, SQL, shard files written (:mod:`airflow_batch_provider.lineage`)."""
        from airflow_batch_provider.lineage import build_lineage

        return build_lineage(conn_id=self.conn_id, hook=self._hook, query=self._query, output=self.built)

    def _build(
        self, spec: BuildSpec, rows: RowStream, unchanged: str | None, target_hook: Any
    ) -> BuildResult:
        """The row loop over ``rows``, with the target's previous hashes when skipping unchanged rows."""
        if unchanged is None:
            return build_lines(spec, rows, self.log)
        spec = dataclasses.replace(spec, skip_unchanged=True)
        if unchanged == "join":
            return build_lines(spec, UnchangedRows(rows), self.log)
        names = rows.column_names
        if any(k not in names for k in self.key_columns):
            return build_lines(dataclasses.replace(spec, skip_unchanged=False), rows, self.log)  # names them
        assert self.target_table is not None
        lookup = HashLookup(
            target_hook,
            self.target_table,
            self.target_schema,
            self.key_columns,
            [names.index(k) for k in self.key_columns],
        )
        try:
            return build_lines(spec, UnchangedRows(rows, lookup), self.log)
        finally:
            lookup.close()

    def _check_outcome(self, build: BuildResult, directory: ObjectStoragePath) -> None:
        summary = ", ".join(f"{code}: {n}" for code, n in build.reject_codes.most_common())
        where = f"see {directory / staging.REJECTS_NAME}"
        # An incremental run over unchanged rows has nothing to send, and that is fine.
        if build.rows_written == 0 and not build.rows_unchanged and not self.allow_empty:
            detail = ""
            if build.rows_read:
                top = build.reject_codes.most_common(1)[0][0]
                first = build.first_reasons.get(top)
                detail = f"; all {build.rows_read} row(s) rejected ({summary}), {where}" + (
                    f"; the first {top}: {first}" if first else ""
                )
            raise EmptyBatchError(f"the query returned no row that makes a valid line{detail}")
        if self.max_reject_ratio is not None and build.rows_read:
            ratio = build.rows_rejected / build.rows_read
            if ratio > self.max_reject_ratio:
                raise RejectRatioExceededError(
                    f"{build.rows_rejected} of {build.rows_read} rows rejected ({ratio:.1%}), over "
                    f"max_reject_ratio {self.max_reject_ratio:.1%} ({summary}); {where}"
                )


def _encoded_request(dialect: Dialect, line: dict[str, Any]) -> Any:
    """The request object a job reads from a table row: the ``request`` of the encoded line."""
    encoded = dialect.encode_line(line)
    if not isinstance(encoded, dict) or "request" not in encoded:
        raise ConfigurationError(
            f"requests_table: dialect {dialect.name!r} does not encode a line as {{key, request}}"
        )
    return encoded["request"]


def _identifiers(hook: Any) -> SqlDialect:
    """Identifier quoting (and limits) for the source database: the merge's own for the databases
    it writes to, the hook's quote format for any other."""
    return detect_sql_dialect(hook)


def _one_line(sql: str, limit: int = 200) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def default_staging_path(context: Context | Mapping[str, Any], task_id: str) -> str:
    """The default staging directory of a task instance: root / dag / run / task[-map_index].

    The root is ``[batch_provider] staging_root`` (see :func:`staging.staging_root`).
    """
    root = staging.staging_root()
    ti = context.get("ti") or context.get("task_instance")
    dag_id = getattr(ti, "dag_id", None) or getattr(context.get("dag"), "dag_id", None) or "dag"
    run_id = context.get("run_id") or getattr(ti, "run_id", None) or "manual"
    map_index = getattr(ti, "map_index", -1)
    task = task_id if map_index is None or map_index < 0 else f"{task_id}-{map_index}"
    parts = [staging.safe_segment(str(p)) for p in (dag_id, run_id, task)]
    return root.rstrip("/") + "/" + "/".join(parts)


def manifest_xcom(manifest: Manifest, directory: ObjectStoragePath) -> dict[str, Any]:
    """The XCom value of a build: the manifest, where it lives, and an absolute ``uri`` per shard."""
    data = manifest.model_dump(mode="json")
    for shard in data["shards"]:
        shard["uri"] = str(directory / shard["path"])
    data["staging_path"] = str(directory)
    data["manifest_path"] = str(directory / staging.MANIFEST_NAME)
    return data
