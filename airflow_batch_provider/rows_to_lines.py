"""The row loop of a build: warehouse rows into validated shards, ``keys.jsonl`` and ``rejects.jsonl``.

:func:`build_lines` reads a :class:`~airflow_batch_provider.warehouse.read.RowStream` once and
does, per row: key (NULL check, custom_id, duplicate tracking), body (NULL and bytes columns,
the compiled :class:`~airflow_batch_provider.rendering.BodyBuilder`), validation and size, then
writes the line to its shard and the key record to ``keys.jsonl``; a row that cannot become a
line goes to ``rejects.jsonl`` with its key and reason. Everything it needs comes in a frozen
:class:`BuildSpec`; what it counted comes back as a :class:`BuildResult`. This is the hot path
of the build: the per-row code stays in one flat loop with its lookups bound to locals.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from airflow_batch_provider import keys as keymod
from airflow_batch_provider import staging
from airflow_batch_provider.exceptions import BatchProviderError, ConfigurationError
from airflow_batch_provider.jsonl import LineValidator
from airflow_batch_provider.records import KeyRecord, RejectRecord
from airflow_batch_provider.rendering import (
    BodySource,
    RowRejected,
    body_builder,
    decode_bytes,
    text_rejection,
)
from airflow_batch_provider.request_hash import request_hash
from airflow_batch_provider.warehouse.read import value_type

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from airflow_batch_provider.estimate import EstimateTally
    from airflow_batch_provider.limits import Limits, ValidationRules
    from airflow_batch_provider.models import Shard
    from airflow_batch_provider.warehouse.read import RowStream
    from airflow_batch_provider.warehouse.unchanged import UnchangedRows

ON_NULL_CHOICES = ("reject", "empty", "fail")
_LOG_EVERY = 100_000
_BYTES = (bytes, bytearray, memoryview)
# Rejections a value's text that UTF-8 cannot encode may cause on the way to a line (a template
# failing on it, JSON text that cannot be parsed, a line that cannot be written): such a row is
# rejected as ``invalid_text`` naming the column instead (rendering.text_rejection).
_TEXT_SUSPECTS = frozenset({"template_error", "invalid_json", "unserializable", "key_unencodable"})


class NullValueError(BatchProviderError):
    """A column the request body uses is NULL and ``on_null='fail'``."""


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """Everything one build's row loop needs, resolved before the first row.

    :param directory: the staging directory the shards, keys and rejects go to.
    :param endpoint: the url of every line.
    :param limits: the (tightened) limits every shard and line must meet.
    :param rules: the dialect's validation rules for a line.
    :param key_columns: the columns that make the custom_id.
    :param body: how the body is made from a row.
    :param on_null: a NULL in a column the body uses: ``reject``, ``empty`` or ``fail``.
    :param prefix: text put in front of every custom_id (already checked).
    :param unsupported: the dialect's check of what its vendor cannot express in a line (a
        reason, or None), run on every row; None when the dialect has nothing to refuse.
    :param tally: counts every written line's tokens (and cost) into its shard; None: no estimate.
    :param skip_unchanged: each row carries, one place past the stream's columns, the
        ``request_hash`` of the succeeded answer the target already holds for its key (or
        None); a row whose request hashes the same is left out (counted, not written).
    :param deduplicate: a row whose request repeats one already written in this build is not
        written again: its keys.jsonl record names the custom_id sent (``shared_answer``).
    """

    directory: ObjectStoragePath
    endpoint: str
    limits: Limits
    rules: ValidationRules
    key_columns: tuple[str, ...]
    body: BodySource
    on_null: str = "reject"
    prefix: str = ""
    unsupported: Callable[[Mapping[str, Any]], str | None] | None = None
    tally: EstimateTally | None = None
    skip_unchanged: bool = False
    deduplicate: bool = False


@dataclasses.dataclass
class BuildResult:
    """What a build wrote and rejected: the manifest's counts, shards and key types."""

    rows_read: int = 0
    rows_written: int = 0
    rows_rejected: int = 0
    #: Rows left out because the target already answered the same request (skip_unchanged).
    rows_unchanged: int = 0
    #: Rows that share the line of an identical request written before them (deduplicate).
    rows_shared: int = 0
    reject_codes: Counter[str] = dataclasses.field(default_factory=Counter)
    #: The reason of the first row rejected with each code (a build that rejects every row
    #: says why, and how to fix it, in its error).
    first_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    shards: list[Shard] = dataclasses.field(default_factory=list)
    key_types: list[str] = dataclasses.field(default_factory=list)
    column_names: list[str] = dataclasses.field(default_factory=list)


def build_lines(spec: BuildSpec, rows: RowStream | UnchangedRows, log: Any = None) -> BuildResult:
    """Turn every row of ``rows`` into a line or a reject record; return the counts.

    :param spec: what to build.
    :param rows: the open row stream of the query.
    :param log: a logger for progress every 100,000 rows (the operator's), or None.

    :raises ConfigurationError: a key column (or a column a template names) is not in the result.
    :raises NullValueError: ``on_null='fail'`` and a column the body uses is NULL.
    :raises DuplicateKeyError: two rows have the same key.
    :raises SecurityError: the template is blocked by the sandbox on every row.
    """
    columns = rows.column_names
    index = {c: i for i, c in enumerate(columns)}
    key_columns = spec.key_columns
    missing = [k for k in key_columns if k not in index]
    if missing:
        raise ConfigurationError(
            f"key column(s) {', '.join(missing)} not in the query result (columns: {', '.join(columns)})"
        )
    key_idx = [index[k] for k in key_columns]
    single = key_idx[0] if len(key_idx) == 1 else -1
    types: list[str | None] = [rows.columns[i].type for i in key_idx]
    builder = body_builder(spec.body, columns, spec.endpoint)
    checked = list(range(len(columns))) if builder.checks_all_columns else builder.columns
    checked_names = [(i, columns[i]) for i in checked]
    result = BuildResult(column_names=columns)
    reject_codes = result.reject_codes
    first_cause: BaseException | None = None
    hashes = keymod.HashBuckets()
    track = hashes.add
    on_null = spec.on_null
    endpoint = spec.endpoint
    prefix = spec.prefix
    build_body = builder.build
    # A vendor that runs one model per batch gets one set of shards per model (ModelShardWriter)
    # instead of rejecting the rows whose model differs from the first line's.
    per_model = not spec.rules.mixed_models
    rules = dataclasses.replace(spec.rules, mixed_models=True) if per_model else spec.rules
    check_object = LineValidator(rules, endpoint).check_object
    unsupported = spec.unsupported
    # A fixed-shape body may be counted from the line as written (HeuristicCounter.from_line).
    tally = spec.tally.fixed_adder() if spec.tally is not None and builder.fixed_shape else None
    tally_body = spec.tally.add if spec.tally is not None and tally is None else None
    dumps = orjson.dumps
    newline = orjson.OPT_APPEND_NEWLINE
    custom_id_for = keymod.custom_id_for
    stored_key = keymod.stored_key
    jsonable_key = keymod.jsonable_key
    # A line must also fit an otherwise empty shard.
    max_line = min(spec.limits.max_line_bytes, spec.limits.max_file_bytes - 1)
    validate_all = not builder.fixed_shape
    types_pending = None in types
    row_number = written = rejected = unchanged = shared = 0
    hash_request = request_hash
    # The target's hash of each row's last answer sits one place past the query's columns.
    previous = len(columns) if spec.skip_unchanged else -1
    # Deduplication: request_hash -> (custom_id, shard) of the line sent for it. The one map a
    # build keeps per distinct request (~200 bytes each with its strings); off by default.
    sent: dict[str, tuple[str, int]] | None = {} if spec.deduplicate else None
    writer: staging.ShardedJsonlWriter | staging.ModelShardWriter = (
        staging.ModelShardWriter(spec.directory, spec.limits, endpoint=endpoint)
        if per_model
        else staging.ShardedJsonlWriter(spec.directory, spec.limits, endpoint=endpoint)
    )
    with (
        writer,
        staging.atomic_writer(spec.directory / staging.KEYS_NAME) as keys_out,
        staging.atomic_writer(spec.directory / staging.REJECTS_NAME) as rejects_out,
    ):
        add_line = writer.add if isinstance(writer, staging.ShardedJsonlWriter) else None
        add_model_line = writer.add if isinstance(writer, staging.ModelShardWriter) else None
        write_key = keys_out.write
        for batch in rows.batches():
            first = True
            for row in batch:
                row_number += 1
                key_values = [row[single]] if single >= 0 else [row[i] for i in key_idx]
                cid: str | None = None
                try:
                    if None in key_values:
                        col = key_columns[key_values.index(None)]
                        raise RowRejected("null_key", f"key column {col!r} is NULL", col)
                    if types_pending:
                        types = [
                            t if t is not None else value_type(v)
                            for t, v in zip(types, key_values, strict=True)
                        ]
                        types_pending = None in types
                    try:
                        cid = custom_id_for(key_values, prefix)
                    except orjson.JSONEncodeError as exc:
                        raise RowRejected("key_unencodable", f"key cannot be encoded: {exc}") from None
                    track(hash(cid))
                    values: Sequence[Any] = row
                    for i, _ in checked_names:
                        v = row[i]
                        if v is None or isinstance(v, _BYTES):
                            values = _usable_values(row, checked_names, on_null, row_number, key_values)
                            break
                    try:
                        line_obj: dict[str, Any] = {
                            "custom_id": cid,
                            "method": "POST",
                            "url": endpoint,
                            "body": build_body(values),
                        }
                    except orjson.JSONEncodeError as exc:
                        # Only a plain-substitution JSON template escapes a value this way.
                        raise RowRejected(
                            "unserializable", f"body cannot be written as JSON: {exc}"
                        ) from None
                    # Every line of a variable-shape body is validated. A fixed-shape body (see
                    # BodyBuilder) gets the same verdict on every row, so the validator sees the
                    # first row of each fetched batch; what does vary per row (custom_id, line
                    # size, JSON encoding, NULLs, bytes) is checked here for every row.
                    problems = check_object(line_obj, row_number) if validate_all or first else None
                    first = False
                    if problems:
                        validate_all = True  # the verdict would repeat: check each row from now on
                        raise RowRejected(problems[0].code, problems[0].message, problems[0].param)
                    if unsupported is not None:
                        # Per row: a fixed-shape body still varies in values (n, a format...).
                        reason = unsupported(line_obj)
                        if reason is not None:
                            raise RowRejected("unsupported", reason)
                    try:
                        line = dumps(line_obj)
                    except orjson.JSONEncodeError as exc:
                        raise RowRejected(
                            "unserializable", f"body cannot be written as JSON: {exc}"
                        ) from None
                    if len(line) > max_line:
                        raise RowRejected(
                            "line_too_large", f"line is {len(line):,} bytes; the limit is {max_line:,}"
                        )
                    rhash = hash_request(endpoint, line_obj["body"])
                    if previous >= 0 and row[previous] == rhash:
                        unchanged += 1
                        continue
                    if sent is not None:
                        first_sent = sent.get(rhash)
                        if first_sent is not None:
                            key_record = KeyRecord.line(
                                cid, stored_key(key_values), first_sent[1], rhash, first_sent[0]
                            )
                            write_key(dumps(key_record, option=newline))
                            shared += 1
                            continue
                    if add_model_line is not None:
                        body = line_obj["body"]
                        model = body.get("model") if isinstance(body, dict) else None
                        try:
                            shard = add_model_line(line, model if isinstance(model, str) else None)
                        except staging.TooManyModelsError as exc:
                            raise RowRejected("too_many_models", str(exc), "model") from None
                    else:
                        assert add_line is not None
                        shard = add_line(line)
                    if sent is not None:
                        sent[rhash] = (cid, shard)
                except RowRejected as err:
                    if err.code in _TEXT_SUSPECTS:
                        err = text_rejection(row, columns) or err
                    rejected += 1
                    if err.code not in reject_codes:
                        result.first_reasons[err.code] = err.reason
                    reject_codes[err.code] += 1
                    if err.cause is not None and first_cause is None:
                        first_cause = err.cause
                    record = RejectRecord.line(
                        row_number, jsonable_key(key_values), cid, err.code, err.reason, err.column
                    )
                    try:
                        reject_line = dumps(record, option=newline)
                    except orjson.JSONEncodeError:
                        # The key itself holds such text: written with it escaped, readable.
                        record["key"] = [_printable(v) for v in record["key"]]
                        reject_line = dumps(record, option=newline)
                    rejects_out.write(reject_line)
                    continue
                if tally is not None:
                    tally(line, cid, line_obj["body"], shard)
                elif tally_body is not None:
                    tally_body(line_obj["body"], shard)
                write_key(dumps(KeyRecord.line(cid, stored_key(key_values), shard, rhash), option=newline))
                written += 1
            if log is not None and row_number and row_number % _LOG_EVERY < len(batch):
                log.info("%d rows read, %d written, %d rejected", row_number, written, rejected)
        result.shards = writer.close()
    if spec.tally is not None:
        spec.tally.finish()
        shard_fields = spec.tally.shard_fields
        result.shards = [s.model_copy(update=shard_fields(s.index)) for s in result.shards]
    result.rows_read, result.rows_written, result.rows_rejected = row_number, written, rejected
    result.rows_unchanged, result.rows_shared = unchanged, shared
    result.key_types = [t or "text" for t in types]
    unsafe = reject_codes.get("template_unsafe", 0)
    if unsafe and unsafe == row_number and first_cause is not None:
        # Every row was blocked: the template itself is unsafe, not one row's data.
        raise first_cause
    records = itertools.chain(
        _iter_jsonl(spec.directory / staging.KEYS_NAME), _iter_jsonl(spec.directory / staging.REJECTS_NAME)
    )
    keymod.check_unique(hashes, records, key_columns)
    return result


def _usable_values(
    row: Sequence[Any],
    checked_names: list[tuple[int, str]],
    on_null: str,
    row_number: int,
    key_values: list[Any],
) -> list[Any]:
    """The row with NULLs the body uses made empty text and bytes decoded, or why it cannot be."""
    values = list(row)
    for i, name in checked_names:
        v = values[i]
        if v is None:
            if on_null == "reject":
                raise RowRejected("null_value", f"column {name!r} is NULL", name)
            if on_null == "fail":
                raise NullValueError(
                    f"row {row_number} (key {keymod.jsonable_key(key_values)}): "
                    f"column {name!r} is NULL and on_null='fail'"
                )
            values[i] = ""
        elif isinstance(v, _BYTES):
            values[i] = decode_bytes(v, name)
    return values


def _printable(value: Any) -> Any:
    """Text with what UTF-8 cannot encode (a lone surrogate) written as a ``\\udXXX`` escape."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _iter_jsonl(path: ObjectStoragePath) -> Iterator[dict[str, Any]]:
    with staging.open_read(path) as handle:
        for raw in handle:
            if raw.strip():
                yield orjson.loads(raw)
