"""Snowflake's bulk-load engine: JSONL chunk files PUT on a temporary internal stage, one COPY INTO.

Rows are written as JSON objects ``{"r": [values...]}`` to local chunk files of at most
``chunk_bytes`` each; every file is uploaded (``PUT``, gzip-compressed by the client) to a
temporary stage of the session as soon as it is complete and deleted locally, so the disk holds
one chunk and memory one row.
Once every chunk is on the stage, one ``COPY INTO`` loads them all into a one-``VARIANT``-column
table (Snowflake's documented JSON load: a JSON value per row) and one ``INSERT ... SELECT``
casts each element of ``r`` into the staging table's typed columns. (An object, not a bare
array: a reader that guesses the layout, like the emulator's DuckDB, takes a one-line file of
an array for an array of rows.) The SQL text comes from the
Snowflake SQL dialect; nothing here decides what to write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from itertools import count
from typing import Any

import orjson

#: Uncompressed bytes per chunk file: large enough that a PUT's round trips are a small share
#: of its time, small enough that the local disk holds little.
CHUNK_BYTES = 64 << 20


def _default(value: Any) -> Any:
    """JSON for what orjson does not encode itself (Decimal keys read from NUMBER columns)."""
    return str(value)


def write_chunks(rows: Iterable[Sequence[Any]], chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, int]]:
    """``(path, rows in it)`` of each complete chunk file; each file is deleted once the next is asked for."""
    dumps = orjson.dumps
    iterator = iter(rows)
    first = next(iterator, None)
    if first is None:
        return
    pending: Sequence[Any] | None = first
    for number in count(1):
        if pending is None:
            return
        fd, path = tempfile.mkstemp(prefix=f"abp-snowflake-{number:05d}-", suffix=".jsonl")
        written = size = 0
        try:
            with os.fdopen(fd, "wb", buffering=1 << 20) as fh:
                row: Sequence[Any] | None = pending
                while row is not None:
                    line = b'{"r":' + dumps(row, default=_default) + b"}\n"
                    fh.write(line)
                    written += 1
                    size += len(line)
                    row = next(iterator, None)
                    if size >= chunk_bytes:
                        break
                pending = row
            yield path, written
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)


def load(
    conn: Any,
    rows: Iterable[Sequence[Any]],
    *,
    stage: str,
    statements_before: Sequence[str],
    copy_sql: str,
    statements_after: Sequence[str],
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Stage ``rows`` as JSONL chunks on ``stage`` and load them; the rows loaded.

    :param stage: the stage reference (``@name``) the chunks are PUT on.
    :param statements_before: run first (create the stage and the raw table).
    :param copy_sql: the ``COPY INTO`` loading every chunk on the stage.
    :param statements_after: run last (cast the raw rows into the staging table, clean up).
    """
    cur = conn.cursor()
    loaded = 0
    try:
        for statement in statements_before:
            cur.execute(statement)
        for path, written in write_chunks(rows, chunk_bytes):
            # The client compresses and uploads the file; quotes in a temp path are impossible,
            # but a backslash (Windows) must not escape the closing quote.
            uri = "file://" + path.replace("\\", "/")
            cur.execute(f"PUT '{uri}' {stage} AUTO_COMPRESS=TRUE OVERWRITE=TRUE")
            loaded += written
        if loaded:
            cur.execute(copy_sql)
        for statement in statements_after:
            cur.execute(statement)
    finally:
        cur.close()
    return loaded
