"""The uploaded copy of a staged shard: each canonical line as the connection's vendor takes it.

Staging always holds canonical (OpenAI-shaped) lines, so fingerprints, request hashes and
resubmission never depend on the vendor. At submit, :class:`ShardEncoder` streams a shard through
the dialect's seams (``unsupported``, ``encode_line``, ``model_placement``) one line at a time,
so memory stays flat whatever the shard's size. A dialect that uploads the canonical shape as it
is, with no model override, gets no pass at all (:func:`needs_pass`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any

import orjson

from airflow_batch_provider.exceptions import JsonlValidationError
from airflow_batch_provider.jsonl import dumps_line, iter_raw_lines, json_error_text, missing_model_message

if TYPE_CHECKING:
    from airflow_batch_provider.dialects.base import Dialect

# A staged line was validated against the dialect's own limit when written; this cap only keeps
# a hand-made file's runaway line from filling memory.
_MAX_LINE = 1 << 30


def needs_pass(dialect: Dialect, model: str | None, defaults: Mapping[str, Any] | None = None) -> bool:
    """Whether a shard must be read line by line before upload (else it is uploaded as it is).

    :param dialect: the connection's dialect.
    :param model: a model override for every line (the submit operator's ``model``), or None.
    :param defaults: body fields given to every line that lacks them, or None.
    """
    return (
        bool(model)
        or bool(defaults)
        or dialect.encodes_lines
        or dialect.model_placement == "job"
        or dialect.submission_mode != "file"
    )


class ShardEncoder:
    """Turns a canonical shard into the lines the dialect uploads, and learns the shard's model.

    Every line is checked with ``dialect.unsupported`` (a hand-made file with a feature the vendor
    lacks fails here, before anything is uploaded), gets the ``model`` override when one is given,
    and is encoded with ``dialect.encode_line`` when the dialect ``encodes_lines``. For a dialect
    whose model goes on the job, every line must name the same model; it is kept in ``job_model``.

    :param dialect: the connection's dialect.
    :param where: the shard's path, for messages.
    :param model: replace ``body.model`` on every line (None: keep each line's).
    :param defaults: body fields set on every line that lacks them (``max_tokens`` for a vendor
        that requires it), before the line is checked.
    """

    def __init__(
        self,
        dialect: Dialect,
        *,
        where: str,
        model: str | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.dialect = dialect
        self.where = where
        self.model = model
        self.defaults = dict(defaults or {})
        self.job_model: str | None = None
        # Lines given so far.
        self.count = 0
        self._job_line = 0

    def lines(self, stream: IO[bytes]) -> Iterator[bytes]:
        """Yield each encoded line with its newline; raise ``JsonlValidationError`` naming the line."""
        dialect = self.dialect
        encode = dialect.encodes_lines
        job = dialect.model_placement == "job"
        for raw in iter_raw_lines(stream, _MAX_LINE):
            if not raw.data.strip():
                continue
            number = raw.number
            try:
                obj = orjson.loads(raw.data)
            except orjson.JSONDecodeError as exc:
                raise self._error(number, f"not valid JSON: {json_error_text(exc)}") from None
            body = obj.get("body") if isinstance(obj, dict) else None
            if not isinstance(body, dict):
                raise self._error(number, "no body object")
            for key, value in self.defaults.items():
                body.setdefault(key, value)
            if self.model:
                body["model"] = self.model
            if job:
                self._take_model(body.get("model"), number)
            elif not _named(body.get("model")) and dialect.needs_line_model(str(obj.get("url"))):
                raise self._error(
                    number, missing_model_message(dialect.name, dialect.model_meaning, str(obj.get("url")))
                )
            if encode:
                reason = dialect.unsupported(obj)
                if reason is not None:
                    raise self._error(number, reason)
                encoded = dialect.encode_line(obj)
                self.count += 1
                yield (encoded if isinstance(encoded, bytes) else dumps_line(encoded)) + b"\n"
            else:
                self.count += 1
                yield dumps_line(obj) + b"\n"
        if job and self.job_model is None:
            raise JsonlValidationError(
                f"{self.where}: no line names a model (body.model), and dialect {dialect.name!r} "
                "needs one model for the batch; set it in the build or pass model= to the submit"
            )

    def drain(self, stream: IO[bytes]) -> str | None:
        """Read a shard through, writing nothing; return its job model (a file uploaded before)."""
        for _ in self.lines(stream):
            pass
        return self.job_model

    def _take_model(self, model: object, number: int) -> None:
        if not isinstance(model, str) or not model:
            raise self._error(
                number, f"body.model is missing; dialect {self.dialect.name!r} needs one model per batch"
            )
        if self.job_model is None:
            self.job_model, self._job_line = model, number
        elif model != self.job_model:
            raise self._error(
                number,
                f"body.model {model!r} differs from {self.job_model!r} on line {self._job_line}; "
                f"dialect {self.dialect.name!r} runs one model per batch (build one shard per model)",
            )

    def _error(self, number: int, message: str) -> JsonlValidationError:
        return JsonlValidationError(f"{self.where} line {number}: {message}")


def _named(model: object) -> bool:
    """Whether ``model`` names a model (non-blank text)."""
    return isinstance(model, str) and bool(model.strip())


def write_inline_body(
    encoder: ShardEncoder, source: IO[bytes], out: IO[bytes], fields: Mapping[str, Any]
) -> tuple[int, int]:
    """Write the create body of an "inline" dialect: ``fields`` plus the encoded lines as a JSON
    array under ``dialect.inline_requests_key``, streamed one line at a time (never one object
    of every request in memory). Past the dialect's request or byte limit it fails naming both,
    before anything is sent.

    :param encoder: encodes the shard's lines.
    :param source: the canonical shard.
    :param out: where the body goes (a local temp file, sent with an exact length).
    :return: (body bytes, requests).
    """
    dialect = encoder.dialect
    limits = dialect.limits
    key = orjson.dumps(dialect.inline_requests_key)
    head = orjson.dumps(dict(fields))[:-1] + (b"," if fields else b"") + key + b":["
    out.write(head)
    size = len(head)
    for line in encoder.lines(source):
        piece = (b"," if encoder.count > 1 else b"") + line.rstrip(b"\n")
        out.write(piece)
        size += len(piece)
        if encoder.count > limits.max_lines or size + 2 > limits.max_file_bytes:
            raise JsonlValidationError(
                f"{encoder.where}: more than {limits.max_lines:,} requests or {limits.max_file_bytes:,} "
                f"bytes, dialect {dialect.name!r}'s limit for one batch; build it again (shards are cut "
                "at the dialect's limits) or lower max_lines / max_file_bytes"
            )
    out.write(b"]}")
    return size + 2, encoder.count
