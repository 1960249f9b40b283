"""SqlToBatchJsonlOperator: stream warehouse rows into validated, sharded batch JSONL files in staging."""

from __future__ import annotations

import dataclasses
import operator
import os
import tempfile
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from airflow.sdk import BaseHook, BaseOperator

from airflow_batch_provider import keys as keymod
from airflow_batch_provider import staging
from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import (
    BatchProviderError,
    ConfigurationError,
    DuplicateKeyError,
    EmptyBatchError,
    RejectRatioExceededError,
)
from airflow_batch_provider.jsonl import LineValidator
from airflow_batch_provider.models import Manifest
from airflow_batch_provider.warehouse.dialect import WarehouseDialect, get_warehouse_dialect
from airflow_batch_provider.warehouse.read import stream_rows, value_type

if TYPE_CHECKING:
    from airflow.sdk import Context, ObjectStoragePath

    from airflow_batch_provider.dialects import Dialect, Limits

ON_NULL_CHOICES = ("reject", "empty", "fail")
DEFAULT_ENDPOINT = "/v1/chat/completions"
EMBEDDINGS_ENDPOINT = "/v1/embeddings"
RESPONSES_ENDPOINT = "/v1/responses"
# Names a row template may use besides the result columns.
_TEMPLATE_GLOBALS = frozenset({"row"})
_DUPLICATES_SHOWN = 10
_LOG_EVERY = 100_000


class NullValueError(BatchProviderError):
    """A column the request body uses is NULL and ``on_null='fail'``."""


class RowRejected(Exception):
    """A row cannot become a valid line; carries what goes into ``rejects.jsonl``."""

    def __init__(
        self, code: str, reason: str, column: str | None = None, cause: BaseException | None = None
    ) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.column = column
        self.cause = cause


# ---------------------------------------------------------------------------------------------
# Row templates
# ---------------------------------------------------------------------------------------------


class _JsonValue(str):
    """Text that already is one JSON value (the ``tojson`` filter's output): written as is."""


def json_text_value(value: Any) -> str:
    """How one ``{{ ... }}`` output lands in a template that renders JSON text.

    Escaped as the inside of a JSON string (``"`` -> ``\\"``, ``\\`` -> ``\\\\``, newline -> ``\\n``),
    so a row value can only ever be text inside a string: it cannot close the string and add
    keys (``model``, ``n``, ``max_tokens``...). Outside a string, escaped text that is not a
    JSON value of its own (a number) leaves invalid JSON, and the row is rejected. ``tojson``
    output is kept as is: it is one JSON value.
    """
    if type(value) is _JsonValue:
        return value
    text = value if isinstance(value, str) else str(value)
    return orjson.dumps(text)[1:-1].decode()


def _tojson(value: Any, indent: int | None = None) -> _JsonValue:
    import json

    return _JsonValue(json.dumps(value, ensure_ascii=False, default=str, indent=indent))


def _jinja_env(*, json_text: bool = False) -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Sandboxed: templates come from DAG authors but render warehouse data; StrictUndefined
    # turns a misspelt column into an error instead of an empty prompt.
    if not json_text:
        return ImmutableSandboxedEnvironment(
            undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True
        )
    # A template rendering JSON text: every expression's output is JSON-escaped (finalize).
    env = ImmutableSandboxedEnvironment(
        undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True, finalize=json_text_value
    )
    env.filters["tojson"] = _tojson
    return env


class RowTemplate:
    """One Jinja template rendered per row, with a fast path for plain ``{{ column }}`` substitution.

    :param source: the template text.
    :param columns: the result's column names (a reference to anything else is an error).
    :param env: the sandboxed Jinja environment (``_jinja_env(json_text=...)``).
    :param json_text: the template renders JSON text: each value is JSON-escaped (see
        :func:`json_text_value`); ``env`` must be the matching environment.
    """

    def __init__(self, source: str, columns: Sequence[str], env: Any, *, json_text: bool = False) -> None:
        from jinja2 import meta, nodes
        from jinja2.exceptions import SecurityError, TemplateError

        self.source = source
        ast = env.parse(source)
        names = meta.find_undeclared_variables(ast)
        missing = sorted(n for n in names if n not in columns and n not in _TEMPLATE_GLOBALS)
        if missing:
            raise ConfigurationError(
                f"template {source[:80]!r} uses {', '.join(missing)}, which the query does not return "
                f"(columns: {', '.join(columns)})"
            )
        index = {c: i for i, c in enumerate(columns)}
        self.column_indexes = sorted(index[n] for n in names if n in index)
        self.uses_row = "row" in names
        # Fast path: text and bare names only (no filters, loops or attribute access); rendering
        # is then a string join, identical to Jinja's str() conversion of each value.
        parts: list[str | int] = []
        simple = True
        for node in ast.body:
            if not isinstance(node, nodes.Output):
                simple = False
                break
            for child in node.nodes:
                if isinstance(child, nodes.TemplateData):
                    parts.append(child.data)
                elif isinstance(child, nodes.Name) and child.name in index:
                    parts.append(index[child.name])
                else:
                    simple = False
                    break
            if not simple:
                break
        self._columns = list(columns)
        self.render: Callable[[Sequence[Any]], str]
        if simple and any(isinstance(p, int) for p in parts):
            # "%s" % value is str(value), exactly what Jinja outputs for a bare name.
            fmt = "".join(p.replace("%", "%%") if isinstance(p, str) else "%s" for p in parts)
            idx = [p for p in parts if isinstance(p, int)]
            if json_text:
                escape = json_text_value
                self.render = lambda row: fmt % tuple(escape(row[i]) for i in idx)
            elif len(idx) == 1:
                only = idx[0]
                self.render = lambda row: fmt % (row[only],)
            else:
                getter = operator.itemgetter(*idx)
                self.render = lambda row: fmt % getter(row)
        else:
            template = env.from_string(source)
            names_ = self._columns

            def render_jinja(row: Sequence[Any]) -> str:
                values = dict(zip(names_, row, strict=False))
                try:
                    return str(template.render(values, row=values))
                except SecurityError as exc:
                    # A safe template can still hit the sandbox through one row's value (a
                    # format string in the data reaching for attributes): that row is
                    # rejected. A template unsafe on every row still fails the task (see
                    # _Build.run).
                    raise RowRejected(
                        "template_unsafe", f"template blocked by the sandbox: SecurityError: {exc}", cause=exc
                    ) from None
                except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError) as exc:
                    # Data-dependent failures (a filter given NULL, a missing key in a JSON
                    # column) reject the row and say why.
                    raise RowRejected(
                        "template_error", f"template failed: {type(exc).__name__}: {exc}"
                    ) from None

            self.render = render_jinja


def _compile_structure(
    value: Any, columns: Sequence[str], env: Any, templates: list[RowTemplate]
) -> tuple[bool, Any]:
    """Compile a JSON-like structure holding template strings.

    Returns ``(True, value)`` for a constant subtree (shared by every line: it is only ever
    serialised, never mutated) or ``(False, function row -> rendered subtree)``.
    """
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value:
            return True, value
        tpl = RowTemplate(value, columns, env)
        templates.append(tpl)
        return False, tpl.render
    if isinstance(value, Mapping):
        items = [(str(k), *_compile_structure(v, columns, env, templates)) for k, v in value.items()]
        if all(const for _, const, _ in items):
            return True, {k: v for k, _, v in items}
        first_dynamic = next(i for i, (_, const, _) in enumerate(items) if not const)
        if all(not const for _, const, _ in items[first_dynamic:]):
            # Common shape {"role": "user", "content": "{{ ... }}"}: copy the constant head.
            head = {k: v for k, _, v in items[:first_dynamic]}
            tail = [(k, f) for k, _, f in items[first_dynamic:]]
            if len(tail) == 1:
                key, func = tail[0]
                return False, lambda row: {**head, key: func(row)}
            return False, lambda row: {**head, **{k: f(row) for k, f in tail}}
        return False, lambda row: {k: (v if const else v(row)) for k, const, v in items}
    if isinstance(value, (list, tuple)):
        elems = [_compile_structure(v, columns, env, templates) for v in value]
        if all(const for const, _ in elems):
            return True, [v for _, v in elems]
        return False, lambda row: [v if const else v(row) for const, v in elems]
    return True, value


# ---------------------------------------------------------------------------------------------
# Body builders: row tuple -> request body
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BodyBuilder:
    """How a body is made from a row, and which columns it reads (for NULL and bytes checks).

    ``fixed_shape`` is True when only string values inside a fixed structure change from row
    to row (a messages list, an embeddings input): the validator's verdict on the line's
    structure (method, url, body a non-empty object, no stream) is then the same for every row.
    """

    build: Callable[[Sequence[Any]], dict[str, Any]]
    columns: list[int]
    checks_all_columns: bool = False
    fixed_shape: bool = False


def _decode_bytes(value: Any, column: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RowRejected(
            "invalid_utf8",
            f"column {column!r} holds bytes that are not valid UTF-8 (byte {exc.start}); "
            "cast or convert it in the query",
            column,
        ) from None


# ---------------------------------------------------------------------------------------------
# The operator
# ---------------------------------------------------------------------------------------------


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
    :param body: body defaults merged into every line (max_tokens, temperature, response_format...).
    :param endpoint: the url every line targets (templated); default chat completions, or
        embeddings when ``input_column`` is given.
    :param model: the model (templated); omit it to set it later with ``airflow-batch prepare``.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
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

    # ---- configuration resolved at run time -------------------------------------------------

    def _dialect(self) -> Dialect:
        if self.dialect is None and self.batch_conn_id:
            # The hook reads the connection's extra in every spelling it accepts.
            from airflow_batch_provider.hooks.batch import BatchApiHook

            return BatchApiHook(self.batch_conn_id).dialect
        return get_dialect(self.dialect or "openai")

    def _endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint
        return EMBEDDINGS_ENDPOINT if self.input_column is not None else DEFAULT_ENDPOINT

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

    def _hook(self) -> Any:
        from airflow.providers.common.sql.hooks.sql import DbApiHook

        hook = BaseHook.get_connection(self.conn_id).get_hook()
        if not isinstance(hook, DbApiHook):
            raise ConfigurationError(
                f"connection {self.conn_id!r} gives a {type(hook).__name__}, not a common-sql DbApiHook"
            )
        return hook

    def _body_builder(self, columns: list[str], endpoint: str) -> BodyBuilder:
        defaults = dict(self.body)
        if self.model:
            defaults = {"model": self.model, **{k: v for k, v in defaults.items() if k != "model"}}
        index = {c: i for i, c in enumerate(columns)}
        if self.input_column is not None:
            if self.input_column not in index:
                raise ConfigurationError(
                    f"input_column {self.input_column!r} is not in the query result "
                    f"(columns: {', '.join(columns)})"
                )
            i = index[self.input_column]

            def build_embedding(row: Sequence[Any]) -> dict[str, Any]:
                value = row[i]
                if not isinstance(value, (str, list)):
                    value = str(value)
                return {**defaults, "input": value}

            return BodyBuilder(build_embedding, [i], fixed_shape=True)
        if self.body_callable is not None:
            func = self.body_callable

            def build_callable(row: Sequence[Any]) -> dict[str, Any]:
                try:
                    result = func(dict(zip(columns, row, strict=False)))
                except Exception as exc:
                    raise RowRejected(
                        "callable_error", f"body_callable raised {type(exc).__name__}: {exc}"
                    ) from None
                if not isinstance(result, Mapping):
                    raise RowRejected(
                        "invalid_body", f"body_callable returned a {type(result).__name__}, not a dict"
                    )
                return {**defaults, **result}

            # The callable decides what to do with NULLs itself.
            return BodyBuilder(build_callable, [])
        env = _jinja_env()
        templates: list[RowTemplate] = []
        model = self.model
        if self.body_template is not None:
            tpl = RowTemplate(self.body_template, columns, _jinja_env(json_text=True), json_text=True)
            templates.append(tpl)

            def build_from_template(row: Sequence[Any]) -> dict[str, Any]:
                text = tpl.render(row)
                try:
                    parsed = orjson.loads(text)
                except orjson.JSONDecodeError as exc:
                    raise RowRejected("invalid_json", f"body_template rendered invalid JSON: {exc}") from None
                if not isinstance(parsed, dict):
                    raise RowRejected(
                        "invalid_body", f"body_template rendered a {type(parsed).__name__}, not an object"
                    )
                if model and "model" in parsed and parsed["model"] != model:
                    raise RowRejected(
                        "model_conflict",
                        f"body_template sets model {parsed['model']!r} but the operator's model is "
                        f"{model!r}; set the model in one place only",
                        "model",
                    )
                return {**defaults, **parsed}

            builder = build_from_template
        else:
            field = "input" if endpoint == RESPONSES_ENDPOINT else "messages"
            if isinstance(self.messages, str):
                tpl = RowTemplate(self.messages, columns, _jinja_env(json_text=True), json_text=True)
                templates.append(tpl)

                def build_from_text(row: Sequence[Any]) -> dict[str, Any]:
                    text = tpl.render(row)
                    try:
                        parsed = orjson.loads(text)
                    except orjson.JSONDecodeError as exc:
                        raise RowRejected(
                            "invalid_json", f"messages template rendered invalid JSON: {exc}"
                        ) from None
                    if not isinstance(parsed, list) or not parsed:
                        raise RowRejected(
                            "invalid_body", "messages template must render a non-empty JSON list"
                        )
                    return {**defaults, field: parsed}

                builder = build_from_text
            else:
                const, compiled = _compile_structure(list(self.messages or []), columns, env, templates)
                render = (lambda row: compiled) if const else compiled

                def build_messages(row: Sequence[Any]) -> dict[str, Any]:
                    return {**defaults, field: render(row)}

                builder = build_messages
        used = sorted({i for t in templates for i in t.column_indexes})
        return BodyBuilder(
            builder,
            used,
            checks_all_columns=any(t.uses_row for t in templates),
            fixed_shape=self.body_template is None and not isinstance(self.messages, str),
        )

    # ---- execution ----------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        dialect = self._dialect()
        endpoint = self._endpoint()
        dialect.check_endpoint(endpoint)
        limits = self._limits(dialect)
        rules = dataclasses.replace(dialect.validation_rules(limits), unique_custom_ids=False)
        prefix = keymod.check_prefix(self.custom_id_prefix or "")
        hook = self._hook()
        self._check_names(hook)
        query = self._query(hook)
        directory = self._staging_dir(context)
        staging.mkdirs(directory)
        # A manifest left by an earlier try would describe shards this try is about to replace.
        manifest_file = directory / staging.MANIFEST_NAME
        if manifest_file.exists():
            manifest_file.unlink()
        self.log.info(
            "Building %s batch lines for %s from %s into %s", dialect.name, endpoint, self.conn_id, directory
        )
        build = _Build(
            operator=self,
            directory=directory,
            endpoint=endpoint,
            limits=limits,
            validator=LineValidator(rules, endpoint),
            prefix=prefix,
        )
        with stream_rows(
            hook, query, self.parameters, batch_size=self.fetch_batch_size, session_sql=self.session_sql
        ) as rows:
            build.run(rows)
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
            rejects_path=staging.REJECTS_NAME,
            keys_path=staging.KEYS_NAME,
            extra={
                "rejects_by_code": dict(build.reject_codes),
                "columns": build.column_names,
                "on_null": self.on_null,
                "limits": dataclasses.asdict(limits),
            },
        )
        self._check_outcome(build)
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
        return manifest_xcom(manifest, directory)

    def _check_outcome(self, build: _Build) -> None:
        summary = ", ".join(f"{code}: {n}" for code, n in build.reject_codes.most_common())
        where = f"see {build.directory / staging.REJECTS_NAME}"
        if build.rows_written == 0 and not self.allow_empty:
            detail = (
                f"; all {build.rows_read} row(s) rejected ({summary}), {where}" if build.rows_read else ""
            )
            raise EmptyBatchError(f"the query returned no row that makes a valid line{detail}")
        if self.max_reject_ratio is not None and build.rows_read:
            ratio = build.rows_rejected / build.rows_read
            if ratio > self.max_reject_ratio:
                raise RejectRatioExceededError(
                    f"{build.rows_rejected} of {build.rows_read} rows rejected ({ratio:.1%}), over "
                    f"max_reject_ratio {self.max_reject_ratio:.1%} ({summary}); {where}"
                )


def _identifiers(hook: Any) -> WarehouseDialect:
    """Identifier quoting (and limits) for the source database: the merge's own for the databases
    it writes to, the hook's quote format for any other."""
    try:
        return get_warehouse_dialect(hook)
    except ConfigurationError:
        return WarehouseDialect(hook)


def _one_line(sql: str, limit: int = 200) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def default_staging_path(context: Context | Mapping[str, Any], task_id: str) -> str:
    """The default staging directory of a task instance: root / dag / run / task[-map_index]."""
    from airflow.sdk import conf

    root = conf.get("batch_provider", "staging_root", fallback=None) or os.environ.get(
        "AIRFLOW_BATCH_STAGING_ROOT"
    )
    if not root:
        home = os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
        root = "file://" + os.path.join(os.path.abspath(home), "batch-staging")
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


class _Build:
    """The row loop of one build: lines into shards, keys and rejects, counts and duplicate tracking."""

    def __init__(
        self,
        *,
        operator: SqlToBatchJsonlOperator,
        directory: ObjectStoragePath,
        endpoint: str,
        limits: Limits,
        validator: LineValidator,
        prefix: str,
    ) -> None:
        self.op = operator
        self.directory = directory
        self.endpoint = endpoint
        self.limits = limits
        self.validator = validator
        self.prefix = prefix
        # A line must also fit an otherwise empty shard.
        self.max_line = min(limits.max_line_bytes, limits.max_file_bytes - 1)
        self.rows_read = 0
        self.rows_written = 0
        self.rows_rejected = 0
        self.reject_codes: Counter[str] = Counter()
        self.shards: list[Any] = []
        self.key_types: list[str] = []
        self.column_names: list[str] = []
        self._hashes = HashBuckets()
        self.first_cause: BaseException | None = None

    def run(self, rows: Any) -> None:
        op = self.op
        columns = rows.column_names
        self.column_names = columns
        index = {c: i for i, c in enumerate(columns)}
        missing = [k for k in op.key_columns if k not in index]
        if missing:
            raise ConfigurationError(
                f"key column(s) {', '.join(missing)} not in the query result (columns: {', '.join(columns)})"
            )
        key_idx = [index[k] for k in op.key_columns]
        types: list[str | None] = [rows.columns[i].type for i in key_idx]
        builder = op._body_builder(columns, self.endpoint)
        checked = list(range(len(columns))) if builder.checks_all_columns else builder.columns
        checked_names = [(i, columns[i]) for i in checked]
        on_null = op.on_null
        endpoint = self.endpoint
        build_body = builder.build
        check_object = self.validator.check_object
        dumps = orjson.dumps
        max_line = self.max_line
        track = self._hashes.add
        custom_id = _custom_id_function(self.prefix, len(key_idx))
        single_key = key_idx[0] if len(key_idx) == 1 else None
        row_number = 0
        with (
            staging.ShardedJsonlWriter(self.directory, self.limits, endpoint=endpoint) as writer,
            staging.atomic_writer(self.directory / staging.KEYS_NAME) as keys_out,
            staging.atomic_writer(self.directory / staging.REJECTS_NAME) as rejects_out,
        ):

            def reject(row_no: int, key: list[Any] | None, cid: str | None, err: RowRejected) -> None:
                self.rows_rejected += 1
                self.reject_codes[err.code] += 1
                if err.cause is not None and self.first_cause is None:
                    self.first_cause = err.cause
                record = {
                    "row": row_no,
                    "key": key,
                    "custom_id": cid,
                    "code": err.code,
                    "reason": err.reason,
                    "column": err.column,
                }
                rejects_out.write(dumps(record) + b"\n")

            add_line = writer.add
            types_pending = None in types
            prefix = self.prefix
            max_id = keymod.MAX_CUSTOM_ID
            write_key = keys_out.write
            written = 0
            validate_all = not builder.fixed_shape
            for batch in rows.batches():
                first = True
                for row in batch:
                    row_number += 1
                    # ---- key -------------------------------------------------------------
                    if single_key is not None:
                        kv = row[single_key]
                        key_values: list[Any] = [kv]
                        if kv is None:
                            reject(
                                row_number,
                                [None],
                                None,
                                RowRejected(
                                    "null_key", f"key column {op.key_columns[0]!r} is NULL", op.key_columns[0]
                                ),
                            )
                            continue
                    else:
                        key_values = [row[i] for i in key_idx]
                        if None in key_values:
                            col = op.key_columns[key_values.index(None)]
                            reject(
                                row_number,
                                keymod.jsonable_key(key_values),
                                None,
                                RowRejected("null_key", f"key column {col!r} is NULL", col),
                            )
                            continue
                    if types_pending:
                        for pos, value in enumerate(key_values):
                            if types[pos] is None:
                                types[pos] = value_type(value)
                        types_pending = None in types
                    # 64-bit ints and strs go to keys.jsonl as they are; anything else is converted.
                    if single_key is not None:
                        if type(kv) is int:
                            # The common case, inlined (same result as keys.custom_id_for).
                            cid = prefix + str(kv)
                            if len(cid) > max_id:
                                cid = custom_id(key_values)
                            # JSON writers stop at 64 bits; bigger integers are stored as text.
                            plain_key = -(1 << 63) <= kv < (1 << 64)
                        else:
                            cid = custom_id(key_values)
                            plain_key = type(kv) is str
                    else:
                        cid = custom_id(key_values)
                        plain_key = all(type(v) is str for v in key_values)
                    h = hash(cid)
                    track(h)
                    # ---- body --------------------------------------------------------------
                    try:
                        values: Sequence[Any] = row
                        for i, name in checked_names:
                            v = row[i]
                            if v is None:
                                if on_null == "reject":
                                    raise RowRejected("null_value", f"column {name!r} is NULL", name)
                                if on_null == "fail":
                                    raise NullValueError(
                                        f"row {row_number} (key {keymod.jsonable_key(key_values)}): "
                                        f"column {name!r} is NULL and on_null='fail'"
                                    )
                                values = list(values) if values is row else values
                                values[i] = ""  # type: ignore[index]
                            elif isinstance(v, (bytes, bytearray, memoryview)):
                                values = list(values) if values is row else values
                                values[i] = _decode_bytes(v, name)  # type: ignore[index]
                        body = build_body(values)
                        line_obj = {"custom_id": cid, "method": "POST", "url": endpoint, "body": body}
                        # Every line of a variable-shape body is validated. A fixed-shape body
                        # (see BodyBuilder) gets the same verdict on every row, so the validator
                        # sees the first row of each fetched batch; what does vary per row
                        # (custom_id, line size, JSON encoding, NULLs, bytes) is checked here
                        # for every row.
                        problems = check_object(line_obj, row_number) if validate_all or first else None
                        first = False
                        if problems:
                            validate_all = True  # the verdict would repeat: check each row from now on
                            p = problems[0]
                            raise RowRejected(p.code, p.message, p.param)
                        try:
                            line = dumps(line_obj)
                        except orjson.JSONEncodeError as exc:
                            raise RowRejected(
                                "unserializable", f"body cannot be written as JSON: {exc}"
                            ) from None
                        if len(line) > max_line:
                            raise RowRejected(
                                "line_too_large",
                                f"line is {len(line):,} bytes; the limit is {max_line:,}",
                            )
                    except RowRejected as err:
                        reject(row_number, keymod.jsonable_key(key_values), cid, err)
                        continue
                    shard = add_line(line)
                    stored = key_values if plain_key else keymod.jsonable_key(key_values)
                    write_key(dumps({"custom_id": cid, "key": stored, "shard": shard}) + b"\n")
                    written += 1
                if row_number and row_number % _LOG_EVERY < len(batch):
                    op.log.info(
                        "%d rows read, %d written, %d rejected",
                        row_number,
                        written,
                        self.rows_rejected,
                    )
            self.rows_read = row_number
            self.rows_written = written
            self.shards = writer.close()
        self.key_types = [t or "text" for t in types]
        unsafe = self.reject_codes.get("template_unsafe", 0)
        if unsafe and unsafe == self.rows_read and self.first_cause is not None:
            # Every row was blocked: the template itself is unsafe, not one row's data.
            raise self.first_cause
        self._check_duplicates()

    def _check_duplicates(self) -> None:
        candidates = self._hashes.repeated()
        if not candidates:
            return
        counts: Counter[str] = Counter()
        key_of: dict[str, Any] = {}
        for name in (staging.KEYS_NAME, staging.REJECTS_NAME):
            for record in _iter_jsonl(self.directory / name):
                cid = record.get("custom_id")
                if isinstance(cid, str) and hash(cid) in candidates:
                    counts[cid] += 1
                    key_of[cid] = record.get("key")
        dups = [(cid, n) for cid, n in counts.items() if n > 1]
        if not dups:
            return
        dups.sort(key=lambda item: -item[1])
        shown = "; ".join(
            f"{dict(zip(self.op.key_columns, key_of[cid] or [], strict=False))} x{n}"
            for cid, n in dups[:_DUPLICATES_SHOWN]
        )
        more = f" and {len(dups) - _DUPLICATES_SHOWN} more" if len(dups) > _DUPLICATES_SHOWN else ""
        raise DuplicateKeyError(
            f"{len(dups)} key(s) of ({', '.join(self.op.key_columns)}) appear on more than one row: "
            f"{shown}{more}. "
            "Make key_columns unique per row (add a column or deduplicate in the query)."
        )


class HashBuckets:
    """Find repeated 64-bit hashes among millions with bounded memory.

    Duplicate keys are found through the hash of each row's custom_id: 8 bytes per row,
    spread over 256 buckets by the low byte. Past ``spill_at`` hashes in memory every bucket
    is appended to its own temporary file, so memory stays flat however many rows there are;
    at the end each bucket is checked on its own (1/256 of the rows at a time). Repeated
    hashes are only candidates: the caller confirms them against the real custom_ids, so a
    collision never fails a build.

    :param spill_at: hashes held in memory before spilling to disk.
    """

    def __init__(self, spill_at: int = 1 << 20) -> None:
        self._buckets = [array("q") for _ in range(256)]
        self._held = 0
        self._spill_at = spill_at
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.spills = 0

    def add(self, h: int) -> None:
        self._buckets[h & 255].append(h)
        self._held += 1
        if self._held >= self._spill_at:
            self._spill()

    def _spill(self) -> None:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="abp-keys-")
        for i, bucket in enumerate(self._buckets):
            if bucket:
                with open(os.path.join(self._dir.name, f"{i:03d}"), "ab") as fh:
                    bucket.tofile(fh)
                self._buckets[i] = array("q")
        self._held = 0
        self.spills += 1

    def repeated(self) -> set[int]:
        """The hashes seen more than once; frees the buckets and any spill files."""
        candidates: set[int] = set()
        try:
            for i, bucket in enumerate(self._buckets):
                if self._dir is not None:
                    path = os.path.join(self._dir.name, f"{i:03d}")
                    if os.path.exists(path):
                        spilled = array("q")
                        with open(path, "rb") as fh:
                            spilled.frombytes(fh.read())
                        spilled.extend(bucket)
                        bucket = spilled
                seen: set[int] = set()
                for h in bucket:
                    if h in seen:
                        candidates.add(h)
                    else:
                        seen.add(h)
                self._buckets[i] = array("q")
        finally:
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None
        return candidates


def _custom_id_function(prefix: str, key_count: int) -> Callable[[list[Any]], str]:
    custom_id_for = keymod.custom_id_for
    if key_count != 1:
        return lambda values: custom_id_for(values, prefix)
    room = keymod.MAX_CUSTOM_ID - len(prefix)

    def single(values: list[Any]) -> str:
        v = values[0]
        # Integer keys are the common case: skip the general path.
        if type(v) is int:
            text = str(v)
            if len(text) <= room:
                return prefix + text
        return custom_id_for(values, prefix)

    return single


def _iter_jsonl(path: ObjectStoragePath) -> Iterator[dict[str, Any]]:
    with staging.open_read(path) as handle:
        for raw in handle:
            if raw.strip():
                yield orjson.loads(raw)
