"""From a normalised ``ResultLine`` to one flat results-table row, whatever the endpoint.

The body shapes handled here are the OpenAI-compatible ones every dialect normalises to:
chat completions, legacy completions, the Responses API and embeddings. Nothing here
knows a vendor or a database; the writer decides how the row reaches the table.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import ResultLine

#: Every status a results row can have.
STATUSES: tuple[str, ...] = (
    "succeeded",
    "failed",
    "expired",
    "cancelled",
    "missing",
    "rejected",
    "invalid_output",
)
#: The statuses worth sending again.
RETRYABLE_STATUSES: frozenset[str] = frozenset({"failed", "expired", "cancelled", "missing"})

# Error codes a vendor writes for lines a batch never ran because the batch itself ended.
_ERROR_CODE_STATUS = {"batch_expired": "expired", "batch_cancelled": "cancelled"}
#: Error code of a result line that could not be read (``on_bad_result_line="record"``).
INVALID_RESULT_LINE = "invalid_result_line"
_ERROR_CODE_STATUS[INVALID_RESULT_LINE] = "invalid_output"
#: A token count above this is not believed (recorded as NULL with a warning).
MAX_TOKEN_COUNT = 10**9
_SAMPLES = 5


@dataclass(frozen=True)
class Column:
    """A results-table column with its portable type.

    :param name: column name (quoted by the warehouse dialect, never pasted raw).
    :param type: integer, float, text, boolean, date, timestamp or json.
    """

    name: str
    type: str


#: The columns every results row carries after the key columns, in row order.
#: ``custom_id`` and ``seq`` lead the staged row; ``seq`` only orders duplicates and never
#: reaches the target table.
RESULT_COLUMNS: tuple[Column, ...] = (
    Column("status", "text"),
    Column("content", "text"),
    Column("embedding", "json"),
    Column("finish_reason", "text"),
    Column("model", "text"),
    Column("prompt_tokens", "integer"),
    Column("completion_tokens", "integer"),
    Column("total_tokens", "integer"),
    # Input tokens read from the vendor's prompt cache (``usage.prompt_tokens_details.cached_tokens``,
    # where every dialect puts them); priced apart in ``cost``. Added after the first release.
    Column("cached_tokens", "integer"),
    Column("error_code", "text"),
    Column("error_message", "text"),
    Column("batch_id", "text"),
)
#: Who answered each row: the vendor (the batch connection's dialect name) and the batch
#: connection of the merge that wrote the row. They are the same for every row of one merge,
#: so the writer fills them in SQL rather than staging them. Added after the first release:
#: an existing results table without them gets them (``ALTER TABLE ... ADD COLUMN``).
ANSWERED_BY_COLUMNS: tuple[Column, ...] = (
    Column("vendor", "text"),
    Column("batch_conn_id", "text"),
)
#: What the row cost (USD) at the merge's prices: uncached input, cached input and output tokens
#: each at its price, the batch discount taken; 0 for a row that used no tokens (rejected, or an
#: error the vendor does not bill); NULL when the price is not known (never $0). Filled in SQL by
#: the writer for the rows of its merge.
COST_COLUMN = Column("cost", "float")
#: What each row asked, from the build's keys.jsonl (not from a result line, so both parse paths
#: agree): ``request_hash``, the hash of the canonical request (``skip_unchanged`` compares it),
#: and ``shared_answer``, the custom_id whose answer a row of a deduplicated build shares (NULL
#: for a row sent itself). NULL for a rejected row and without a manifest.
REQUEST_COLUMNS: tuple[Column, ...] = (Column("request_hash", "text"), Column("shared_answer", "text"))
#: Columns a merge adds to an existing results table that lacks them (all nullable).
ADDABLE_COLUMNS: tuple[Column, ...] = (
    *ANSWERED_BY_COLUMNS,
    Column("cached_tokens", "integer"),
    COST_COLUMN,
    *REQUEST_COLUMNS,
)
RESERVED_COLUMNS: frozenset[str] = frozenset(
    {
        "custom_id",
        "merged_at",
        COST_COLUMN.name,
        *(c.name for c in RESULT_COLUMNS),
        *(c.name for c in ANSWERED_BY_COLUMNS),
        *(c.name for c in REQUEST_COLUMNS),
    }
)

# Columns the writer fills itself (or only stages), which no mapped column may reuse.
_WRITER_COLUMNS = frozenset(
    {
        "custom_id",
        "merged_at",
        "seq",
        COST_COLUMN.name,
        *(c.name for c in ANSWERED_BY_COLUMNS),
        *(c.name for c in REQUEST_COLUMNS),
    }
)

_PATH_TOKEN = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")


def compile_json_path(path: str) -> tuple[str | int, ...]:
    """Split ``$.choices[0].message.content`` (the ``$.`` is optional) into keys and indexes."""
    text = path.strip()
    if text.startswith("$"):
        text = text[1:]
    steps: list[str | int] = []
    pos = 0
    while pos < len(text):
        match = _PATH_TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise ConfigurationError(f"JSON path {path!r}: cannot read it at character {pos}")
        steps.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        pos = match.end()
    if not steps:
        raise ConfigurationError(f"JSON path {path!r} is empty")
    return tuple(steps)


def follow(obj: Any, steps: Sequence[str | int]) -> Any:
    """The value at ``steps`` inside ``obj``, or None when any step is absent."""
    for step in steps:
        if isinstance(step, int):
            if not isinstance(obj, list) or step >= len(obj):
                return None
            obj = obj[step]
        else:
            if not isinstance(obj, Mapping):
                return None
            obj = obj.get(step)
        if obj is None:
            return None
    return obj


def _scalar_or_json(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value if not isinstance(value, bool) else str(value).lower()
    return orjson.dumps(value).decode()


# ---- structured output ---------------------------------------------------------------------
_JSON_TYPES = {"integer": "integer", "number": "float", "boolean": "boolean", "string": "text"}


class OutputSchema:
    """Parses and validates an answer's content against a pydantic model or a JSON schema.

    :param schema: a pydantic model class, its dotted import path, or a JSON schema dict
        whose top level is an object with ``properties``.
    :param prefix: prepended to every field's column name.
    """

    def __init__(self, schema: type[BaseModel] | str | Mapping[str, Any], prefix: str = "") -> None:
        if isinstance(schema, str):
            schema = _import_object(schema)
        self.model: type[BaseModel] | None = None
        self._validator: Any = None
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            self.model = schema
            json_schema = schema.model_json_schema()
        elif isinstance(schema, Mapping):
            import jsonschema

            json_schema = dict(schema)
            try:
                cls = jsonschema.validators.validator_for(json_schema)
                cls.check_schema(json_schema)
            except jsonschema.SchemaError as exc:
                raise ConfigurationError(f"output_schema is not a valid JSON schema: {exc.message}") from exc
            self._validator = cls(json_schema)
        else:
            raise ConfigurationError(
                f"output_schema must be a pydantic model class, its dotted path or a JSON schema dict, "
                f"not {type(schema).__name__}"
            )
        properties = json_schema.get("properties")
        if not isinstance(properties, Mapping) or not properties:
            raise ConfigurationError("output_schema must describe an object with properties")
        self.fields: list[str] = list(properties)
        self.columns: tuple[Column, ...] = tuple(
            Column(f"{prefix}{name}", _portable_type(spec)) for name, spec in properties.items()
        )

    def parse(self, content: str | None) -> tuple[tuple[Any, ...] | None, str | None]:
        """``(values in column order, None)`` for a valid answer, ``(None, reason)`` otherwise."""
        if content is None or not content.strip():
            return None, "the answer has no content to parse"
        if self.model is not None:
            try:
                data = self.model.model_validate_json(content).model_dump(mode="json")
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                    for err in exc.errors()[:5]
                )
                return None, f"output does not match {self.model.__name__}: {problems}"
        else:
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError as exc:
                return None, f"output is not valid JSON: {exc}"
            error = next(iter(self._validator.iter_errors(data)), None)
            if error is not None:
                where = ".".join(str(p) for p in error.absolute_path) or "<root>"
                return None, f"output does not match the schema at {where}: {error.message}"
            if not isinstance(data, Mapping):
                return None, "output is not a JSON object"
        return tuple(
            _field_value(data.get(name), col.type)
            for name, col in zip(self.fields, self.columns, strict=True)
        ), None


def _import_object(path: str) -> Any:
    module_name, _, attribute = path.rpartition(".")
    try:
        if not module_name:
            raise ImportError("not a dotted path")
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"output_schema {path!r} cannot be imported: {exc}") from exc


def _portable_type(spec: Any) -> str:
    if not isinstance(spec, Mapping):
        return "json"
    options = spec.get("anyOf") or spec.get("oneOf")
    if options:
        # Optional[X] shows up as anyOf [X, null]: the column takes X's type.
        non_null = [o for o in options if not (isinstance(o, Mapping) and o.get("type") == "null")]
        return _portable_type(non_null[0]) if len(non_null) == 1 else "json"
    kind = spec.get("type")
    if isinstance(kind, list):
        non_null_kinds = [k for k in kind if k != "null"]
        kind = non_null_kinds[0] if len(non_null_kinds) == 1 else None
    return _JSON_TYPES.get(kind, "json") if isinstance(kind, str) else "json"


def _field_value(value: Any, portable: str) -> Any:
    if value is None:
        return None
    if portable == "json":
        return orjson.dumps(value).decode()
    if portable == "text" and not isinstance(value, str):
        return orjson.dumps(value).decode()
    return value


# ---- the mapper ----------------------------------------------------------------------------
class ResultMapper:
    """Turns result lines into staged rows and keeps the run's token sums.

    Row layout: ``custom_id, seq, *RESULT_COLUMNS, *extra columns, *schema columns``.

    :param extra_columns: ``{column: JSON path into the response body}``.
    :param output_schema: optional structured-output schema (see :class:`OutputSchema`).
    """

    def __init__(
        self,
        *,
        extra_columns: Mapping[str, str] | None = None,
        output_schema: OutputSchema | None = None,
    ) -> None:
        self.extra_paths = [(name, compile_json_path(path)) for name, path in (extra_columns or {}).items()]
        self.output_schema = output_schema
        self.extra_columns = tuple(Column(name, "text") for name, _ in self.extra_paths)
        self.columns: tuple[Column, ...] = (
            *RESULT_COLUMNS,
            *self.extra_columns,
            *(output_schema.columns if output_schema else ()),
        )
        seen: set[str] = set()
        for col in self.columns:
            if col.name in seen or col.name in _WRITER_COLUMNS:
                raise ConfigurationError(
                    f"column {col.name!r} is defined twice (extra_columns / output_schema fields must not "
                    f"reuse a results column: {', '.join(sorted(RESERVED_COLUMNS))})"
                )
            seen.add(col.name)
        self._empty_schema = (None,) * len(output_schema.columns) if output_schema else ()
        self.reset()

    def reset(self) -> None:
        """Start counting lines and tokens afresh (one mapper may serve several merges)."""
        self.lines = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.total_tokens = 0
        #: Result lines that could not be read, recorded as ``invalid_output``; a few reasons.
        self.bad_lines = 0
        self.bad_line_samples: list[str] = []
        #: Lines whose token counts were negative, absurd or not integers (stored as NULL).
        self.bad_token_lines = 0
        self.bad_token_samples: list[str] = []

    def row(self, line: ResultLine, batch_id: str | None) -> tuple[Any, ...]:
        """The staged row of one result line."""
        self.lines += 1
        body = line.body
        content = embedding = finish_reason = model = None
        prompt = completion = total = cached = None
        if type(body) is dict:
            content, embedding, finish_reason = extract_answer(body)
            model = body.get("model")
            if type(model) is not str:
                model = None
            prompt, completion, total = extract_usage(body)
            cached = extract_cached(body)
            if prompt is None or completion is None or total is None:
                dropped = unusable_token_counts(body)
                if dropped:
                    self.bad_token_lines += 1
                    if len(self.bad_token_samples) < _SAMPLES:
                        self.bad_token_samples.append(f"{line.custom_id}: {dropped}")
            if prompt:
                self.prompt_tokens += prompt
            if completion:
                self.completion_tokens += completion
            if total:
                self.total_tokens += total
        else:
            body = None
        error_code = error_message = None
        schema_values = self._empty_schema
        if line.ok and body is None:
            # Never a success with nothing in it.
            status, error_code = "invalid_output", "empty_response"
            error_message = "the response has no JSON object body to read an answer from"
        elif line.ok:
            status = "succeeded"
            if content is None and embedding is None:
                # No answer this mapper knows (moderations, images, a vendor's own endpoint...):
                # the whole response body is the answer, as JSON text.
                content = orjson.dumps(body).decode()
            if self.output_schema is not None:
                values, reason = self.output_schema.parse(content)
                if values is None:
                    status, error_code, error_message = "invalid_output", "invalid_output", reason
                else:
                    schema_values = values
        else:
            code = line.error.code if line.error else None
            status = _ERROR_CODE_STATUS.get(code or "", "failed")
            if code == INVALID_RESULT_LINE:
                self.bad_lines += 1
                if len(self.bad_line_samples) < _SAMPLES and line.error is not None:
                    self.bad_line_samples.append(str(line.error.message))
            error_code = code
            error_message = line.error.message if line.error else None
        if not self.extra_paths:
            extras: tuple[Any, ...] = ()
        elif body is None:
            extras = (None,) * len(self.extra_paths)
        else:
            extras = tuple(_scalar_or_json(follow(body, steps)) for _, steps in self.extra_paths)
        return (
            line.custom_id,
            self.lines,
            status,
            content,
            None if embedding is None else orjson.dumps(embedding).decode(),
            finish_reason,
            model,
            prompt,
            completion,
            total,
            cached,
            error_code,
            error_message,
            batch_id,
            *extras,
            *schema_values,
        )


# The functions below run once per result line: they check ``dict``/``list`` exactly (bodies
# come from JSON) instead of the much slower ``Mapping`` ABC, and read each field once.


def extract_answer(body: dict[str, Any]) -> tuple[str | None, Any, str | None]:
    """``(content, embedding, finish_reason)`` from a chat, completions, responses or embeddings body."""
    choices = body.get("choices")
    if type(choices) is list and choices and type(choices[0]) is dict:
        first = choices[0]
        message = first.get("message")
        content: Any = None
        if type(message) is dict:
            content = message.get("content")
            if content is None:
                if message.get("tool_calls"):
                    # A tool-calling answer has no text; its calls are the answer.
                    content = orjson.dumps(message["tool_calls"]).decode()
                elif message.get("refusal"):
                    content = message["refusal"]
            elif type(content) is list:
                content = "".join(p.get("text", "") for p in content if type(p) is dict)
        else:
            content = first.get("text")
        reason = first.get("finish_reason")
        return (
            content if type(content) is str else None,
            None,
            reason if type(reason) is str else None,
        )
    data = body.get("data")
    if type(data) is list and body.get("object") == "list":
        vectors = [d.get("embedding") for d in data if type(d) is dict]
        return None, vectors[0] if len(vectors) == 1 else vectors, None
    output = body.get("output")
    if type(output) is list or "output_text" in body:
        text = body.get("output_text")
        if type(text) is not str:
            parts = [
                part.get("text", "")
                for item in output or []
                if type(item) is dict and item.get("type") == "message"
                for part in item.get("content") or []
                if type(part) is dict and part.get("type") == "output_text"
            ]
            text = "".join(parts) if parts else None
        details = body.get("incomplete_details")
        status = (details.get("reason") if type(details) is dict else None) or body.get("status")
        return text, None, status if type(status) is str else None
    return None, None, None


def extract_usage(body: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """``(prompt, completion, total)`` tokens; the Responses API names them input/output."""
    usage = body.get("usage")
    if type(usage) is not dict:
        return None, None, None
    prompt = usage.get("prompt_tokens")
    if prompt is None:
        prompt = usage.get("input_tokens")
    completion = usage.get("completion_tokens")
    if completion is None:
        completion = usage.get("output_tokens")
    total = usage.get("total_tokens")
    # ``type(...) is int`` also keeps booleans (an int subclass) out of the token counts; a
    # negative or absurd count is not believed either (see unusable_token_counts).
    prompt = prompt if type(prompt) is int and 0 <= prompt <= MAX_TOKEN_COUNT else None
    completion = completion if type(completion) is int and 0 <= completion <= MAX_TOKEN_COUNT else None
    given_total = total is not None
    total = total if type(total) is int and 0 <= total <= MAX_TOKEN_COUNT else None
    if not given_total and (prompt is not None or completion is not None):
        total = (prompt or 0) + (completion or 0)
    return prompt, completion, total


def extract_cached(body: dict[str, Any]) -> int | None:
    """Input tokens read from the prompt cache (``usage.prompt_tokens_details.cached_tokens``),
    when given as a believable count; else None."""
    usage = body.get("usage")
    details = usage.get("prompt_tokens_details") if type(usage) is dict else None
    cached = details.get("cached_tokens") if type(details) is dict else None
    return cached if type(cached) is int and 0 <= cached <= MAX_TOKEN_COUNT else None


def unusable_token_counts(body: dict[str, Any]) -> dict[str, Any]:
    """The token counts of ``usage`` that are given but not believed: not an integer, below 0
    or over ``MAX_TOKEN_COUNT`` (``extract_usage`` returns None for them)."""
    usage = body.get("usage")
    if type(usage) is not dict:
        return {}
    return {
        name: value
        for name in ("prompt_tokens", "input_tokens", "completion_tokens", "output_tokens", "total_tokens")
        if (value := usage.get(name)) is not None
        and not (type(value) is int and 0 <= value <= MAX_TOKEN_COUNT)
    }
