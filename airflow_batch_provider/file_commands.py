"""``airflow-batch validate`` and ``airflow-batch prepare``: check and fix a batch JSONL file from the shell.

Both stream the file line by line (memory stays flat on a 200 MB file) and accept a local
path or, when Airflow's object storage is configured, a URI such as ``s3://bucket/batch.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, TextIO

import orjson

from airflow_batch_provider import staging
from airflow_batch_provider.dialects import DIALECTS, dialect_class
from airflow_batch_provider.exceptions import BatchProviderError
from airflow_batch_provider.jsonl import LineValidator, iter_raw_lines, json_error_text

# prepare rewrites whole lines, so it must hold one; this is far above any vendor's line limit.
_PREPARE_LINE_CAP = 64 * 1024 * 1024


def add_subcommands(subparsers: Any) -> None:
    """Add ``validate`` and ``prepare`` to the ``airflow-batch`` argument parser."""
    add_validate_arguments(subparsers.add_parser("validate", help="check a batch JSONL file"))
    add_prepare_arguments(subparsers.add_parser("prepare", help="set the model on every line"))


def add_validate_arguments(validate: argparse.ArgumentParser) -> None:
    """The options of ``airflow-batch validate``."""
    validate.description = "Check a batch JSONL file; print each problem with its line number; exit 1 if any."
    validate.add_argument("file", help="path or URI of the JSONL file ('-' for stdin)")
    validate.add_argument(
        "--dialect",
        choices=sorted(DIALECTS),
        default="openai",
        help="vendor dialect whose rules apply (default openai)",
    )
    validate.add_argument(
        "--endpoint", default=None, help="url every line must target, e.g. /v1/chat/completions"
    )
    validate.add_argument("--max-lines", type=int, default=None, help="lower the lines-per-file limit")
    validate.add_argument("--max-file-bytes", type=int, default=None, help="lower the file size limit")
    validate.add_argument("--max-line-bytes", type=int, default=None, help="lower the line size limit")
    validate.add_argument(
        "--max-problems",
        type=int,
        default=None,
        help="stop printing after this many problems (all are counted)",
    )
    validate.add_argument("--quiet", "-q", action="store_true", help="print only the summary line")
    validate.set_defaults(func=run_validate)


def add_prepare_arguments(prepare: argparse.ArgumentParser) -> None:
    """The options of ``airflow-batch prepare``."""
    prepare.description = "Set body.model (and optionally url) on every line, streaming; output is atomic."
    prepare.add_argument("file", help="path or URI of the JSONL file ('-' for stdin)")
    prepare.add_argument("--model", required=True, help="model to set on every line")
    prepare.add_argument(
        "--output",
        "-o",
        default=None,
        help="where to write (default: replace FILE in place; '-' or FILE '-' means stdout)",
    )
    prepare.add_argument(
        "--endpoint",
        default=None,
        help="also set the url of every line, e.g. /v1/chat/completions (one the dialect supports)",
    )
    prepare.add_argument(
        "--dialect",
        choices=sorted(DIALECTS),
        default="openai",
        help="vendor dialect whose endpoints --endpoint is checked against (default openai)",
    )
    prepare.set_defaults(func=run_prepare)


# ---- file access: local paths without importing Airflow, URIs through ObjectStoragePath ----------


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


@contextmanager
def _open_input(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdin.buffer
        return
    with staging.open_read(_local(path)) as handle:
        yield handle


# ---- validate ----------------------------------------------------------------------------------


def run_validate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Validate a file; print problems and a summary; return 1 if there is any problem, else 0."""
    out = out or sys.stdout
    # The class, not an instance: its rules are class attributes, and no model is needed.
    dialect = dialect_class(args.dialect)
    if args.endpoint:
        dialect.check_endpoint(args.endpoint)
    limits = dialect.limits.tightened(
        max_lines=args.max_lines, max_file_bytes=args.max_file_bytes, max_line_bytes=args.max_line_bytes
    )
    # Results are matched to rows by custom_id, so a repeated one cannot be merged back even
    # where the vendor accepts it (Doubleword): a hand-made file is held to unique custom_ids.
    rules = dataclasses.replace(dialect.validation_rules(limits), unique_custom_ids=True)
    validator = LineValidator(rules, args.endpoint)
    count = 0
    shown = 0
    limit = args.max_problems
    quiet = getattr(args, "quiet", False)
    name = args.file
    write = out.write
    with _open_input(args.file) as stream:
        for raw in iter_raw_lines(stream, limits.max_line_bytes):
            _, problems = validator.check_raw(raw)
            for problem in problems:
                count += 1
                if not quiet and (limit is None or shown < limit):
                    shown += 1
                    write(f"{name}:{problem}\n")
    for problem in validator.finish():
        count += 1
        if not quiet and (limit is None or shown < limit):
            shown += 1
            write(f"{name}:{problem}\n")
    if count:
        hidden = f" ({count - shown} not shown)" if count > shown and not quiet else ""
        write(
            f"{name}: {count} problem(s){hidden} in {validator.lines:,} line(s), {validator.bytes:,} bytes "
            f"[dialect {dialect.name}]\n"
        )
        return 1
    write(f"{name}: ok, {validator.lines:,} line(s), {validator.bytes:,} bytes [dialect {dialect.name}]\n")
    return 0


# ---- prepare -----------------------------------------------------------------------------------


class PrepareError(BatchProviderError):
    """A line that prepare cannot rewrite; the message names the line."""


def prepare_stream(source: IO[bytes], target: IO[bytes], *, model: str, endpoint: str | None = None) -> int:
    """Copy batch lines from ``source`` to ``target`` with ``body.model`` (and ``url``) set; return the count.

    Blank lines are dropped (they hold no request); a line that is not a JSON object with an
    object ``body`` raises :class:`PrepareError` naming its line number.
    """
    written = 0
    buffer: list[bytes] = []
    buffered = 0
    loads, dumps = orjson.loads, orjson.dumps
    for raw in iter_raw_lines(source, _PREPARE_LINE_CAP):
        if raw.oversize:
            raise PrepareError(f"line {raw.number}: {raw.size:,} bytes is too long to rewrite")
        data = raw.data
        if not data.strip():
            continue
        try:
            obj = loads(data)
        except orjson.JSONDecodeError as exc:
            raise PrepareError(f"line {raw.number}: not valid JSON: {json_error_text(exc)}") from None
        if not isinstance(obj, dict):
            raise PrepareError(f"line {raw.number}: not a JSON object")
        body = obj.get("body")
        if body is None:
            body = obj["body"] = {}
        if not isinstance(body, dict):
            raise PrepareError(f"line {raw.number}: body is a {type(body).__name__}, not an object")
        body["model"] = model
        if endpoint is not None:
            obj["url"] = endpoint
        line = dumps(obj)
        buffer.append(line)
        buffer.append(b"\n")
        buffered += len(line) + 1
        written += 1
        if buffered >= 1 << 20:
            target.write(b"".join(buffer))
            buffer.clear()
            buffered = 0
    if buffer:
        target.write(b"".join(buffer))
    return written


def run_prepare(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Rewrite a file with the model set; return 0.

    :raises ConfigurationError: ``--endpoint`` is not one of the dialect's endpoints (before
        anything is read or written).
    :raises PrepareError: a line cannot be rewritten (nothing is written in place of the output).
    """
    out = out or sys.stdout
    output = args.output or args.file
    if args.endpoint:
        # Before any line is read: a url validate and submit would refuse is never written.
        dialect_class(getattr(args, "dialect", None)).check_endpoint(args.endpoint)
    if output == "-":
        # Streaming to stdout: the lines go there, so the report goes to stderr.
        with _open_input(args.file) as source:
            try:
                lines = prepare_stream(source, sys.stdout.buffer, model=args.model, endpoint=args.endpoint)
            except PrepareError as exc:
                raise PrepareError(f"{args.file}:{exc}; the output is incomplete") from None
            sys.stdout.flush()
        sys.stderr.write(f"<stdout>: set model {args.model!r} on {lines:,} line(s)\n")
        return 0
    existed = _exists(output)
    try:
        with _open_input(args.file) as source, staging.atomic_writer(_local(output)) as target:
            lines = prepare_stream(source, target, model=args.model, endpoint=args.endpoint)
    except PrepareError as exc:
        left = "was not changed" if existed else "was not created"
        raise PrepareError(f"{args.file}:{exc}; {output} {left}") from None
    out.write(f"{output}: set model {args.model!r} on {lines:,} line(s)\n")
    return 0


def _exists(path: str) -> bool:
    local = _local(path)
    if "://" not in local:
        return os.path.exists(local)
    return bool(staging.resolve_path(path).exists())
