"""Request bodies from warehouse rows: sandboxed Jinja row templates and the body builders.

A :class:`BodySource` says how a body is made (chat messages, a JSON body template, a Python
callable, or an embeddings input column) plus the defaults merged into every body;
:func:`body_builder` compiles it once against a query's columns into a :class:`BodyBuilder`,
a plain ``row tuple -> body dict`` function the row loop calls. A row that cannot become a
body raises :class:`RowRejected` with the code and reason that go into ``rejects.jsonl``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from airflow_batch_provider.exceptions import ConfigurationError

DEFAULT_ENDPOINT = "/v1/chat/completions"
EMBEDDINGS_ENDPOINT = "/v1/embeddings"
RESPONSES_ENDPOINT = "/v1/responses"
# Names a row template may use besides the result columns.
_TEMPLATE_GLOBALS = frozenset({"row"})


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
                    # rows_to_lines.build_lines).
                    raise RowRejected(
                        "template_unsafe", f"template blocked by the sandbox: SecurityError: {exc}", cause=exc
                    ) from None
                except orjson.JSONEncodeError:
                    # A value's text UTF-8 cannot encode (JSON escaping in ``finalize``): the row
                    # loop rejects the row naming the column (rendering.text_rejection).
                    raise
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


def decode_bytes(value: Any, column: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RowRejected(
            "invalid_utf8",
            f"column {column!r} holds bytes that are not valid UTF-8 (byte {exc.start}); "
            "cast or convert it in the query",
            column,
        ) from None


def text_rejection(values: Sequence[Any], columns: Sequence[str]) -> RowRejected | None:
    """The rejection of a row holding text that no UTF-8 line can carry, naming its column.

    A lone surrogate (U+D800-U+DFFF) is a valid Python ``str`` character that UTF-8 cannot
    encode: a PostgreSQL ``json`` value keeps ``"\\ud800"`` verbatim and the driver decodes it
    to one. Called once a row failed (this walks the values; the row loop does not).

    :param values: the row's values (text, or lists and dicts of them, as JSON columns arrive).
    :param columns: their column names.
    """
    for name, value in zip(columns, values, strict=False):
        char = _lone_surrogate(value)
        if char is not None:
            return RowRejected(
                "invalid_text",
                f"column {name!r} holds text with a lone surrogate (U+{ord(char):04X}), which UTF-8 "
                "cannot encode; clean or cast it in the query",
                name,
            )
    return None


def _lone_surrogate(value: Any) -> str | None:
    """The first character of ``value`` (text, or in a list or dict) UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return value[exc.start]
        return None
    if isinstance(value, Mapping):
        value = [item for pair in value.items() for item in pair]
    if isinstance(value, (list, tuple)):
        for item in value:
            char = _lone_surrogate(item)
            if char is not None:
                return char
    return None


@dataclasses.dataclass(frozen=True)
class BodySource:
    """How the body of every line is made: exactly one source plus the defaults merged in.

    :param messages: chat messages whose strings are Jinja row templates, or one template
        string rendering a JSON list of messages.
    :param body_template: a Jinja row template rendering the whole body as a JSON object.
    :param body_callable: ``row dict -> body dict``.
    :param input_column: for embeddings: the column holding the text to embed.
    :param defaults: body keys merged into every body (the body's own keys win).
    :param model: the model put first in every body; a ``body_template`` setting another
        model rejects the row.
    """

    messages: Sequence[Mapping[str, Any]] | str | None = None
    body_template: str | None = None
    body_callable: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    input_column: str | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model: str | None = None

    def default_endpoint(self) -> str:
        """The url lines target when none is given: embeddings for ``input_column``, else chat."""
        return EMBEDDINGS_ENDPOINT if self.input_column is not None else DEFAULT_ENDPOINT


def body_builder(source: BodySource, columns: list[str], endpoint: str) -> BodyBuilder:
    """Compile ``source`` against the query's ``columns`` into the function the row loop calls.

    :raises ConfigurationError: a template or ``input_column`` names a column the query does not return.
    """
    defaults = dict(source.defaults)
    if source.model:
        defaults = {"model": source.model, **{k: v for k, v in defaults.items() if k != "model"}}
    index = {c: i for i, c in enumerate(columns)}
    if source.input_column is not None:
        if source.input_column not in index:
            raise ConfigurationError(
                f"input_column {source.input_column!r} is not in the query result "
                f"(columns: {', '.join(columns)})"
            )
        i = index[source.input_column]

        def build_embedding(row: Sequence[Any]) -> dict[str, Any]:
            value = row[i]
            if not isinstance(value, (str, list)):
                value = str(value)
            return {**defaults, "input": value}

        return BodyBuilder(build_embedding, [i], fixed_shape=True)
    if source.body_callable is not None:
        func = source.body_callable

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
    templates: list[RowTemplate] = []
    if source.body_template is not None:
        builder = _template_body(source.body_template, columns, defaults, source.model, templates)
    elif isinstance(source.messages, str):
        field = "input" if endpoint == RESPONSES_ENDPOINT else "messages"
        builder = _text_messages_body(source.messages, columns, defaults, field, templates)
    else:
        field = "input" if endpoint == RESPONSES_ENDPOINT else "messages"
        const, compiled = _compile_structure(list(source.messages or []), columns, _jinja_env(), templates)
        render = (lambda row: compiled) if const else compiled

        def build_messages(row: Sequence[Any]) -> dict[str, Any]:
            return {**defaults, field: render(row)}

        builder = build_messages
    used = sorted({i for t in templates for i in t.column_indexes})
    return BodyBuilder(
        builder,
        used,
        checks_all_columns=any(t.uses_row for t in templates),
        fixed_shape=source.body_template is None and not isinstance(source.messages, str),
    )


def _json_template(
    source: str, columns: list[str], templates: list[RowTemplate], what: str
) -> Callable[[Sequence[Any]], Any]:
    """A template rendering JSON text (values JSON-escaped), as ``row -> parsed JSON value``."""
    tpl = RowTemplate(source, columns, _jinja_env(json_text=True), json_text=True)
    templates.append(tpl)
    render = tpl.render

    def parse(row: Sequence[Any]) -> Any:
        try:
            return orjson.loads(render(row))
        except orjson.JSONDecodeError as exc:
            raise RowRejected("invalid_json", f"{what} rendered invalid JSON: {exc}") from None

    return parse


def _template_body(
    source: str, columns: list[str], defaults: dict[str, Any], model: str | None, templates: list[RowTemplate]
) -> Callable[[Sequence[Any]], dict[str, Any]]:
    parse = _json_template(source, columns, templates, "body_template")

    def build_from_template(row: Sequence[Any]) -> dict[str, Any]:
        parsed = parse(row)
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

    return build_from_template


def _text_messages_body(
    source: str, columns: list[str], defaults: dict[str, Any], field: str, templates: list[RowTemplate]
) -> Callable[[Sequence[Any]], dict[str, Any]]:
    parse = _json_template(source, columns, templates, "messages template")

    def build_from_text(row: Sequence[Any]) -> dict[str, Any]:
        parsed = parse(row)
        if not isinstance(parsed, list) or not parsed:
            raise RowRejected("invalid_body", "messages template must render a non-empty JSON list")
        return {**defaults, field: parsed}

    return build_from_text
