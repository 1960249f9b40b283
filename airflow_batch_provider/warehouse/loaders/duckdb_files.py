"""DuckDB's bulk-load engine: rows as JSONL chunk files, double-buffered, read by ``read_json``.

Rows are written as JSON arrays (the cheapest thing to produce in Python) to one of two
chunk files; DuckDB loads one chunk in a worker thread (it releases the GIL) while Python
writes the next, so parsing and loading overlap on two cores. The ``INSERT ... read_json``
statement comes from the DuckDB SQL dialect.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import IO, Any

import orjson


def load_chunks(conn: Any, sql: str, rows: Iterable[Sequence[Any]], chunk_rows: int) -> int:
    """Load ``rows`` through ``sql`` (parameters: a chunk file's path, then its
    ``maximum_object_size``), ``chunk_rows`` rows per file; the rows loaded."""
    dumps = orjson.dumps
    return load_lines(conn, sql, (dumps(row) for row in rows), chunk_rows)


def load_lines(
    conn: Any, sql: str | Callable[[], Sequence[str]], lines: Iterable[bytes], chunk_rows: int
) -> int:
    """Load ready ``lines`` (bytes without their line end) through ``sql`` as :func:`load_chunks`
    loads rows; ``sql`` may be a callable giving, once a chunk is written, the statements to run
    over it (each with the same two parameters)."""
    paths = []
    for _ in range(2):
        fd, path = tempfile.mkstemp(prefix="abp-merge-", suffix=".jsonl")
        os.close(fd)
        paths.append(path)
    count = 0
    iterator = iter(lines)
    pending: Future[Any] | None = None
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="abp-duckdb-load") as loader:
            for turn in itertools.count():
                path = paths[turn % 2]
                written = longest = 0
                with open(path, "wb", buffering=1 << 20) as fh:
                    write = fh.write
                    for line in islice(iterator, chunk_rows):
                        if len(line) > longest:
                            longest = len(line)
                        write(line)
                        write(b"\n")
                        written += 1
                if pending is not None:
                    pending.result()  # the other file is free again (and errors surface here)
                    pending = None
                if not written:
                    break
                statements = [sql] if isinstance(sql, str) else list(sql())
                pending = loader.submit(_run, conn, statements, [path, json_buffer(longest)])
                count += written
            if pending is not None:
                pending.result()
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return count


def _run(conn: Any, statements: Sequence[str], params: Sequence[Any]) -> None:
    for statement in statements:
        conn.execute(statement, params)


def json_buffer(longest: int) -> int:
    """``maximum_object_size`` for read_json over lines no longer than ``longest`` bytes.

    DuckDB sizes each reading thread's buffer from it (16 MB by default, two per thread),
    memory the buffer manager's limit does not cover; the longest line is known here.
    """
    return max(1 << 20, 2 * longest)


@contextlib.contextmanager
def numbered_lines(handle: IO[bytes]) -> Iterator[tuple[str, int]]:
    """The non-blank lines of ``handle`` in a local temp file, each as ``[line number, line]``
    (no parsing in Python), with the longest line's length; the file is deleted afterwards.

    For ``read_json`` over a file that may live on an object store: read_json has no line
    numbers, and numbering in SQL (``ROW_NUMBER() OVER ()``) would hold every line in memory.
    """
    fd, path = tempfile.mkstemp(prefix="abp-keys-", suffix=".jsonl")
    try:
        longest = 0
        with os.fdopen(fd, "wb", buffering=1 << 20) as out:
            write = out.write
            for number, line in enumerate(handle, start=1):
                line = line.strip()
                if line:
                    longest = max(longest, len(line))
                    write(b"[%d,%s]\n" % (number, line))
        yield path, longest
    finally:
        os.unlink(path)
