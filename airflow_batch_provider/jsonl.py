"""Streaming batch JSONL: read lines with bounded memory and validate them against a dialect's rules.

The rules follow seed 001 (ZeroGPU's canonical schema) as the baseline; a dialect may
loosen or tighten them (see ``ValidationRules``). The same validator serves the build
operator, ``airflow-batch validate``, the submit path and the local batch server, so a
file is judged the same way everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import orjson

from airflow_batch_provider.limits import ValidationRules

UTF8_BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Problem:
    """One reason a file or line is not a valid batch input.

    :param line: 1-based physical line number, or None for a file-level problem.
    :param code: a stable machine-readable code (e.g. ``duplicate_custom_id``).
    :param message: what is wrong, for a person.
    :param param: the offending field, when there is one.
    :param custom_id: the line's custom_id, when it could be read.
    """

    line: int | None
    code: str
    message: str
    param: str | None = None
    custom_id: str | None = None

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line is not None else "file"
        return f"{where}: {self.message} [{self.code}]"

    def as_error(self) -> dict[str, Any]:
        """The OpenAI ``errors.data[]`` shape: ``{code, line, message, param}``."""
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


@dataclass(frozen=True)
class RawLine:
    """A physical line of a JSONL stream.

    ``data`` holds the line without its ``\\n``; when the line was longer than the reader's
    cap, ``data`` is empty, ``oversize`` is True and ``size`` is the true length.
    """

    number: int
    data: bytes
    size: int
    oversize: bool = False


def iter_raw_lines(stream: IO[bytes], max_line_bytes: int) -> Iterator[RawLine]:
    """Yield the physical lines of a binary stream, never holding more than ``max_line_bytes`` of one.

    A line over the cap is skipped to its end and reported as ``oversize`` so the caller can
    say where it was, instead of loading a gigabyte line into memory.
    """
    number = 0
    cap = max_line_bytes + 2  # room for "\r\n" on a line exactly at the limit
    while True:
        chunk = stream.readline(cap)
        if not chunk:
            return
        number += 1
        if chunk.endswith(b"\n") or len(chunk) < cap:
            data = chunk[:-1] if chunk.endswith(b"\n") else chunk
            yield RawLine(number, data, len(data))
            continue
        # The line is longer than the cap: measure the rest without keeping it.
        size = len(chunk)
        while True:
            more = stream.readline(_READ_CHUNK)
            if not more:
                break
            if more.endswith(b"\n"):
                size += len(more) - 1
                break
            size += len(more)
        yield RawLine(number, b"", size, oversize=True)


def json_error_text(exc: ValueError) -> str:
    """What the JSON parser said of one line, placed by its column only (the caller names the
    line, so the parser's own "line 1" would be a second, wrong line number)."""
    msg = getattr(exc, "msg", None)
    column = getattr(exc, "colno", None)
    if isinstance(msg, str) and isinstance(column, int):
        return f"{msg} at column {column}"
    return str(exc)


def missing_model_message(dialect: str, meaning: str, url: str) -> str:
    """Why a line without ``body.model`` is refused, and the ways to give it one.

    :param dialect: the dialect's name.
    :param meaning: what the model names for the vendor (``Dialect.model_meaning``).
    :param url: the line's url.
    """
    return (
        f"body.model ({meaning}) is missing; dialect {dialect!r} needs it on every line to {url}: "
        "set model= on the build or the submit (or a model key in the build's body or template, "
        "from a column), or run airflow-batch prepare --model NAME"
    )


def dumps_line(obj: Any) -> bytes:
    """Serialise one JSONL line (no newline) the way every writer of this package does."""
    return orjson.dumps(obj)


def repeated_key(data: bytes, obj: Any) -> str | None:
    """Why the JSON line ``data`` (``obj`` as orjson parsed it) is ambiguous, or None.

    An object that repeats a key reads differently in different parsers (orjson and
    PostgreSQL's jsonb keep the last value, DuckDB the first), so such a line is unreadable
    wherever it is read. Fast for the usual line: parsing keeps every string token but a
    repeated key's (and what its dropped value held), so the same count of ``"`` in ``data`` and
    in orjson's writing of ``obj`` (which writes a ``"`` in text as ``\\"``) proves there is none,
    unless ``data`` spelled a ``"`` as ``\\u0022``, which only the slow check can count.

    :param data: the line's bytes.
    :param obj: the line parsed by ``orjson.loads``.
    :returns: ``repeats the key 'k'``, or None.
    """
    try:
        written = orjson.dumps(obj)
    except orjson.JSONEncodeError:  # orjson writes 255 levels, and reads 1024
        written = b""
    # A line orjson itself wrote (compact, as this package's server and many writers do) is
    # proved by one comparison; another by two counts and a scan (~1.3 us for 400 bytes).
    if written == data or (data.count(b'"') == written.count(b'"') and b"\\u0022" not in data):
        return None
    key = _first_repeat(data)
    return None if key is None else f"repeats the key {key!r}"


# The bytes the slow check stops at: a string's start and where objects and arrays open and close.
_STRUCTURE = re.compile(rb'["{}\[\]]')
_BLANKS = b" \t\r\n"


def _first_repeat(data: bytes) -> str | None:
    """The first key (in reading order) an object of ``data`` repeats; ``data`` is valid JSON.

    A scan with a stack of the keys of each open object rather than ``json.loads`` with an
    ``object_pairs_hook``: that recurses, and its limit depends on the caller's stack, while
    orjson reads 1024 levels wherever it is called.
    """
    stack: list[set[str] | None] = []
    i = 0
    while (found := _STRUCTURE.search(data, i)) is not None:
        i = found.start()
        c = data[i]
        if c == 0x22:  # '"'
            end = i + 1
            while True:  # the closing quote: one not escaped by an odd run of backslashes
                end = data.index(b'"', end)
                k = end - 1
                while data[k] == 0x5C:
                    k -= 1
                if (end - 1 - k) % 2 == 0:
                    break
                end += 1
            after = end + 1
            while after < len(data) and data[after] in _BLANKS:
                after += 1
            keys = stack[-1] if stack else None
            if keys is not None and data[after : after + 1] == b":":
                key = orjson.loads(data[i : end + 1])
                if key in keys:
                    return str(key)
                keys.add(key)
            i = end + 1
        elif c == 0x7B:  # '{'
            stack.append(set())
            i += 1
        elif c == 0x5B:  # '['
            stack.append(None)
            i += 1
        else:
            stack.pop()
            i += 1
    return None


class LineValidator:
    """Validates lines one at a time and remembers what file-level rules need.

    :param rules: the dialect's rules and limits.
    :param expected_url: the batch's ``endpoint``; every line's url must equal it (unless
        the dialect allows mixed endpoints).
    """

    def __init__(self, rules: ValidationRules, expected_url: str | None = None) -> None:
        self.rules = rules
        self.expected_url = expected_url
        self.first_url: str | None = None
        self.first_model: tuple[int, str] | None = None
        self.lines = 0
        self.bytes = 0
        self._seen: set[str] = set()
        self._oversize_files = False

    def check_raw(self, raw: RawLine) -> tuple[dict[str, Any] | None, list[Problem]]:
        """Parse and check one physical line; blank lines return ``(None, [])`` and do not count."""
        self.bytes += raw.size + 1
        if raw.oversize or raw.size > self.rules.limits.max_line_bytes:
            self.lines += 1
            return None, [
                Problem(
                    raw.number,
                    "line_too_large",
                    f"line is {raw.size:,} bytes; the limit is {self.rules.limits.max_line_bytes:,}",
                )
            ]
        data = raw.data
        if raw.number == 1 and data.startswith(UTF8_BOM):
            self.lines += 1
            return None, [
                Problem(
                    1, "byte_order_mark", "file starts with a UTF-8 byte order mark; save it as plain UTF-8"
                )
            ]
        if not data.strip():
            return None, []
        self.lines += 1
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as uexc:
                return None, [
                    Problem(raw.number, "invalid_utf8", f"line is not valid UTF-8 (byte {uexc.start})")
                ]
            return None, [Problem(raw.number, "invalid_json", f"not valid JSON: {json_error_text(exc)}")]
        return obj if isinstance(obj, dict) else None, self.check_object(obj, raw.number)

    def check_object(self, obj: Any, number: int) -> list[Problem]:
        """Check one parsed line against every per-line rule."""
        if not isinstance(obj, dict):
            kind = "an array" if isinstance(obj, list) else f"a {type(obj).__name__}"
            return [Problem(number, "invalid_line", f"line must be a JSON object, found {kind}")]
        problems: list[Problem] = []
        custom_id = obj.get("custom_id")
        cid = custom_id if isinstance(custom_id, str) and custom_id else None
        longest = self.rules.max_custom_id_chars
        if cid is None:
            problems.append(
                Problem(number, "invalid_custom_id", "custom_id must be a non-empty string", "custom_id")
            )
        elif longest is not None and len(cid) > longest:
            problems.append(
                Problem(
                    number,
                    "custom_id_too_long",
                    f"custom_id is {len(cid)} characters; the limit is {longest}",
                    "custom_id",
                    cid,
                )
            )
        if cid is not None and self.rules.unique_custom_ids:
            if cid in self._seen:
                problems.append(
                    Problem(number, "duplicate_custom_id", f"custom_id {cid!r} is repeated", "custom_id", cid)
                )
            else:
                self._seen.add(cid)
        method = obj.get("method")
        if not isinstance(method, str) or method.upper() not in self.rules.methods:
            problems.append(
                Problem(number, "invalid_method", f"method must be POST, found {method!r}", "method", cid)
            )
        problems.extend(self._check_url(obj.get("url"), number, cid))
        body = obj.get("body")
        if not isinstance(body, dict) or not body:
            problems.append(
                Problem(number, "invalid_body", "body must be a non-empty JSON object", "body", cid)
            )
        elif body.get("stream") is True:
            problems.append(
                Problem(
                    number,
                    "stream_not_supported",
                    "body.stream=true is not allowed in a batch",
                    "body.stream",
                    cid,
                )
            )
        else:
            url = obj.get("url")
            if isinstance(url, str) and url in self.rules.endpoints:
                problems.extend(self._check_fields(body, url, number, cid))
            problems.extend(self._check_model(body.get("model"), number, cid))
        return problems

    def _check_fields(self, body: dict[str, Any], url: str, number: int, cid: str | None) -> list[Problem]:
        """The body fields the url needs (``messages`` for chat, ``input`` for embeddings), and
        ``body.model`` where the vendor runs each line on its own model."""
        rules = self.rules
        problems: list[Problem] = []
        for name in rules.required_fields.get(url, ()):
            if body.get(name) is None:
                problems.append(
                    Problem(
                        number,
                        "missing_body_field",
                        f"body has no {name!r}, which {url} needs{self._shaped_for(body, url)}",
                        f"body.{name}",
                        cid,
                    )
                )
        model = body.get("model")
        if url in rules.model_endpoints and not (isinstance(model, str) and model.strip()):
            problems.append(
                Problem(
                    number,
                    "missing_model",
                    missing_model_message(rules.dialect, rules.model_meaning, url),
                    "body.model",
                    cid,
                )
            )
        return problems

    def _shaped_for(self, body: dict[str, Any], url: str) -> str:
        """A hint naming the endpoint the body is shaped for, when it is another one."""
        for other, names in self.rules.required_fields.items():
            if other != url and names and all(body.get(n) is not None for n in names):
                return f" (the body has {', '.join(repr(n) for n in names)}: is it meant for {other}?)"
        return ""

    def _check_model(self, model: Any, number: int, cid: str | None) -> list[Problem]:
        """One model per file, for vendors that fail a whole batch mixing models."""
        if self.rules.mixed_models or not isinstance(model, str):
            return []
        if self.first_model is None:
            self.first_model = (number, model)
            return []
        first_line, first = self.first_model
        if model == first:
            return []
        return [
            Problem(
                number,
                "mismatched_model",
                f"body.model {model!r} differs from {first!r} on line {first_line}; "
                "this vendor runs one model per batch file",
                "body.model",
                cid,
            )
        ]

    def _check_url(self, url: Any, number: int, cid: str | None) -> list[Problem]:
        if not isinstance(url, str) or url not in self.rules.endpoints:
            allowed = ", ".join(sorted(self.rules.endpoints))
            return [
                Problem(
                    number, "invalid_url", f"url {url!r} is not a batchable endpoint ({allowed})", "url", cid
                )
            ]
        if self.rules.mixed_endpoints:
            return []
        if self.expected_url is not None and url != self.expected_url:
            return [
                Problem(
                    number,
                    "mismatched_url",
                    f"url {url!r} differs from the batch endpoint {self.expected_url!r}",
                    "url",
                    cid,
                )
            ]
        if self.first_url is None:
            self.first_url = url
        elif url != self.first_url:
            return [
                Problem(
                    number,
                    "mismatched_url",
                    f"url {url!r} differs from {self.first_url!r} on an earlier line; a batch takes one url",
                    "url",
                    cid,
                )
            ]
        return []

    def finish(self) -> list[Problem]:
        """File-level rules, once every line has been seen."""
        limits = self.rules.limits
        problems: list[Problem] = []
        if self.lines == 0:
            problems.append(Problem(None, "empty_file", "file has no lines"))
        if self.lines > limits.max_lines:
            problems.append(
                Problem(
                    None,
                    "too_many_lines",
                    f"file has {self.lines:,} lines; the limit is {limits.max_lines:,}",
                )
            )
        if self.bytes > limits.max_file_bytes:
            problems.append(
                Problem(
                    None,
                    "file_too_large",
                    f"file is {self.bytes:,} bytes; the limit is {limits.max_file_bytes:,}",
                )
            )
        return problems


def validate_stream(
    stream: IO[bytes], rules: ValidationRules, expected_url: str | None = None
) -> Iterator[Problem]:
    """Yield every problem of a JSONL stream, line problems first, file problems last."""
    validator = LineValidator(rules, expected_url)
    for raw in iter_raw_lines(stream, rules.limits.max_line_bytes):
        _, problems = validator.check_raw(raw)
        yield from problems
    yield from validator.finish()


def iter_objects(stream: IO[bytes], max_line_bytes: int = 1 << 30) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, parsed_object)`` for every non-blank line; bad JSON raises naming the line."""
    for raw in iter_raw_lines(stream, max_line_bytes):
        if raw.oversize:
            raise ValueError(f"line {raw.number}: {raw.size:,} bytes is over the {max_line_bytes:,}-byte cap")
        if not raw.data.strip():
            continue
        try:
            yield raw.number, orjson.loads(raw.data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"line {raw.number}: not valid JSON: {json_error_text(exc)}") from None
