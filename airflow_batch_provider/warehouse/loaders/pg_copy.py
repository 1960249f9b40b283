"""PostgreSQL's bulk-load engine: COPY, and the overlapped COPY that loads in rounds.

The overlapped path (psycopg 3, UTF-8 connections) formats rows with psycopg's C formatter
into a spool of temp files on this thread while a worker thread runs COPYs reading the spool
on the connection, one round (child table) per spool file. psycopg2 connections get COPY text
produced on demand (:class:`_CopyTextReader`). The SQL text comes from the PostgreSQL SQL
dialect; nothing here decides what to write.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import IO, Any

log = logging.getLogger(__name__)


class SpoolAborted(Exception):
    """The other side of a spool gave up; the real error is reported by whoever failed."""


#: Bytes of COPY text per round when rows are loaded in rounds (one spool file each): small
#: enough that the last round, the only one nothing overlaps, is short; large enough that
#: per-round statements stay a small share of the work. A file is deleted once its round is
#: loaded, so the disk holds what is not loaded yet.
ROUND_BYTES = 24 << 20
#: Rounds of each size before the size doubles (each round is a table until commit).
ROUNDS_PER_SIZE = 16


class Spool:
    """Temp files one thread appends to while another reads them in order and then deletes them.

    It lets Python format COPY rows at full speed while the connection is still busy with
    earlier work, without holding the rows in memory: what is not yet sent waits on disk.
    The writer side is a psycopg ``copy.Writer`` (``write``/``finish``).

    :param segment: bytes per spool file before the next one starts.
    :param double_every: files of each size before the size doubles (None: the size stays).
    """

    def __init__(self, segment: int, *, double_every: int | None = None) -> None:
        self._segment = segment
        # With ``double_every``, files get twice as large after that many: a reader that loads
        # each file into a table of its own (rounds) then makes a few hundred tables for 100 GB,
        # not thousands (each holds locks until commit).
        self._double_every = double_every
        self._created = 0
        # Each entry: [file, bytes written]; the last one is being written.
        self._files: list[list[Any]] = []
        self._done = False
        self._failed = False
        #: Which side failed first: "writer" or "reader" (None while both are fine).
        self.first_failure: str | None = None
        self._cond = threading.Condition()

    def write(self, data: Any) -> None:
        if self._failed:
            raise SpoolAborted("the COPY reading this spool failed")
        with self._cond:
            if not self._files or self._files[-1][1] >= self._segment_size():
                self._files.append([tempfile.TemporaryFile(prefix="abp-copy-"), 0])  # noqa: SIM115
                self._created += 1
            current = self._files[-1]
        view = memoryview(data)
        fd = current[0].fileno()
        while view:
            # os.write may write less than asked (a full disk); never count what was not written.
            view = view[os.write(fd, view) :]
        with self._cond:
            current[1] += len(data)
            self._cond.notify()

    def _segment_size(self) -> int:
        """Size at which the current file is complete."""
        if not self._double_every:
            return self._segment
        return self._segment << ((self._created - 1) // self._double_every)

    def finish(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self.fail("writer")
        with self._cond:
            self._done = True
            self._cond.notify()

    def fail(self, side: str) -> None:
        """Stop both sides; ``side`` ("writer" or "reader") is the one that failed."""
        with self._cond:
            self._failed = True
            self.first_failure = self.first_failure or side
            self._cond.notify_all()

    def files(self) -> Iterator[Iterator[bytes]]:
        """The chunks of each spool file in turn, for a reader that loads every file on its own.

        Each file holds whole rows: psycopg's formatter hands over its buffer only after a row.
        """
        while True:
            with self._cond:
                while not self._failed and not self._files and not self._done:
                    self._cond.wait()
                if self._failed:
                    raise SpoolAborted("the rows could not all be produced")
                if not self._files:
                    return
            yield self._file_chunks()

    def _file_chunks(self, size: int = 1 << 20) -> Iterator[bytes]:
        """The next file's bytes as they are written, until it is complete; it is then freed."""
        offset = 0
        while True:
            with self._cond:
                while (
                    not self._failed
                    and (not self._files or offset >= self._files[0][1])
                    and not (self._done or len(self._files) > 1)
                ):
                    self._cond.wait()
                if self._failed:
                    raise SpoolAborted("the rows could not all be produced")
                if not self._files:
                    return  # done, nothing was ever written
                handle, available = self._files[0]
                if offset >= available:
                    # Complete (another file follows, or the writer is done) and read: free it.
                    self._files.pop(0)[0].close()
                    return
            # pread: the writer's file position is never touched from this thread.
            data = os.pread(handle.fileno(), min(size, available - offset), offset)
            if not data:
                raise OSError(f"spool file ended at byte {offset} of {available}")
            offset += len(data)
            yield data

    def close(self) -> None:
        with self._cond:
            for handle, _ in self._files:
                handle.close()
            self._files = []


def _utf8(conn: Any) -> bool:
    return str(getattr(getattr(conn, "info", None), "encoding", "")).replace("_", "-").lower() == "utf-8"


def _copy_from(conn: Any, sql: str, chunks: Iterable[bytes]) -> None:
    cur = conn.cursor()
    try:
        with cur.copy(sql) as copy:
            for chunk in chunks:
                copy.write(chunk)
    finally:
        cur.close()


def _overlapped_copy(
    conn: Any,
    rows: Iterable[Sequence[Any]],
    before: Callable[[], Any],
    load: Callable[[Spool], Any],
    *,
    segment: int,
    double_every: int | None = None,
) -> int:
    """Run ``before`` and then ``load`` (COPYs reading the spool) on ``conn`` in a worker thread
    while this thread formats ``rows`` into a spool the COPYs read as it grows.

    The connection is only ever used by the worker; this thread only formats (psycopg's
    C formatter) and writes local files. ``before`` is typically PostgreSQL parsing the keys
    file, which otherwise leaves Python idle for seconds per million keys. Either side's
    error stops the other (a failure here also cancels the worker's statement), and the
    error of the side that failed first is raised.
    """
    from psycopg import Copy

    spool = Spool(segment, double_every=double_every)
    count = 0
    iterator = iter(rows)
    formatting = conn.cursor()
    try:
        # Built before the worker starts, with the first row's dumpers: those read the
        # connection's client encoding, which nothing changes during the merge; a type first
        # seen later reads it once more, and that read touches no state the worker changes.
        formatter = Copy(formatting, writer=spool, binary=False)  # type: ignore[arg-type]
        first = next(iterator, None)
        if first is not None:
            formatter.write_row(first)
            count = 1

        def work() -> None:
            try:
                started = time.perf_counter()
                before()
                log.debug("%.2fs: staged before the rows", time.perf_counter() - started)
                load(spool)
                log.debug("%.2fs: loaded the rows", time.perf_counter() - started)
            except BaseException:
                spool.fail("reader")
                raise

        formatted = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="abp-pg-load") as pool:
            loading = pool.submit(work)
            try:
                with formatter:
                    for row in iterator:
                        formatter.write_row(row)
                        count += 1
                log.debug("%.2fs: %d rows formatted", time.perf_counter() - formatted, count)
            except BaseException as exc:
                if not isinstance(exc, SpoolAborted):
                    spool.fail("writer")
                if spool.first_failure == "writer":
                    # Do not wait for the worker's statement (keys can take minutes) to finish.
                    cancel = getattr(conn, "cancel_safe", None) or getattr(conn, "cancel", None)
                    if cancel is not None:
                        with contextlib.suppress(Exception):
                            cancel()
                worker_error = None
                try:
                    loading.result()
                except Exception as error:
                    worker_error = error
                if spool.first_failure == "reader" and worker_error is not None:
                    raise worker_error from (None if isinstance(exc, SpoolAborted) else exc)
                raise
            loading.result()
    finally:
        formatting.close()
        spool.close()
    return count


# ---- psycopg2 COPY text format -------------------------------------------------------------
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _without_nul(rows: Iterable[Sequence[Any]]) -> Iterator[Sequence[Any]]:
    """Rows with NUL characters in text replaced by U+FFFD.

    PostgreSQL text cannot hold NUL (valid in JSON as ``\\u0000``, so a model can answer with
    one); left in, one such answer would abort the whole merge transaction.
    """
    for row in rows:
        for value in row:
            if type(value) is str and "\x00" in value:
                row = tuple(v.replace("\x00", "\ufffd") if type(v) is str else v for v in row)
                break
        yield row


def _copy_field(value: Any) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value).translate(_COPY_ESCAPES)


class _CopyTextReader:
    """A file-like view of rows in COPY text format, produced as psycopg2 reads it."""

    def __init__(self, rows: Iterable[Sequence[Any]]) -> None:
        self._rows: Iterator[Sequence[Any]] = iter(rows)
        self._buffer = b""
        self.rows = 0

    def read(self, size: int = -1) -> bytes:
        size = 1 << 16 if size is None or size < 0 else size
        parts = [self._buffer]
        have = len(self._buffer)
        while have < size:
            row = next(self._rows, None)
            if row is None:
                break
            line = ("\t".join(map(_copy_field, row)) + "\n").encode()
            parts.append(line)
            have += len(line)
            self.rows += 1
        data = b"".join(parts)
        self._buffer = data[size:]
        return data[:size]

    readline = read


def copy_rows(conn: Any, sql: str, rows: Iterable[Sequence[Any]]) -> int:
    """Load ``rows`` with one ``COPY ... FROM STDIN`` (psycopg 3 or psycopg2); the rows loaded."""
    cur = conn.cursor()
    count = 0
    try:
        if not hasattr(cur, "copy"):  # psycopg2
            reader = _CopyTextReader(_without_nul(rows))
            cur.copy_expert(sql, reader)
            return reader.rows
        with cur.copy(sql) as copy:
            for row in _without_nul(rows):
                copy.write_row(row)
                count += 1
    finally:
        cur.close()
    return count


def copy_file(conn: Any, handle: IO[bytes], *, before: str, copy_sql: str, after: Sequence[str]) -> bool:
    """Run ``before``, stream ``handle``'s bytes into ``copy_sql`` as they are, then run ``after``
    (psycopg 3); False, doing nothing, on a psycopg2 connection."""
    cur = conn.cursor()
    try:
        if not hasattr(cur, "copy"):
            return False
        cur.execute(before)
        with cur.copy(copy_sql) as copy:
            while chunk := handle.read(1 << 20):
                copy.write(chunk)
        for statement in after:
            cur.execute(statement)
    finally:
        cur.close()
    return True


def copy_records(conn: Any, copy_sql: str, records: Iterable[bytes]) -> int | None:
    """Stream ready COPY records (bytes, one line each, without its end) into ``copy_sql``, a
    few thousand per write; the records loaded, or None, doing nothing, on a psycopg2 connection."""
    cur = conn.cursor()
    count = 0
    try:
        if not can_copy_records(conn):
            return None
        iterator = iter(records)
        with cur.copy(copy_sql) as copy:
            # Joined in C: a Python step per record measured ~0.7 us a line.
            while batch := list(itertools.islice(iterator, 2048)):
                copy.write(b"\n".join(batch) + b"\n")
                count += len(batch)
    finally:
        cur.close()
    return count


def can_copy_records(conn: Any) -> bool:
    """Whether :func:`copy_records` works on ``conn``: psycopg 3 (a streaming COPY writer) and
    UTF-8 (the records are sent as they are)."""
    return type(conn).__module__.split(".")[0] == "psycopg" and _utf8(conn)


def can_load_in_rounds(conn: Any) -> bool:
    """Whether :func:`load_in_rounds` works on ``conn``: psycopg 3 only (psycopg2 has no COPY
    formatter to spool with), and UTF-8 only (the spool is formatted before the connection
    would transcode it)."""
    return type(conn).__module__.split(".")[0] == "psycopg" and _utf8(conn)


def load_in_rounds(
    conn: Any,
    rows: Iterable[Sequence[Any]],
    before: Callable[[], Any],
    round_sql: Callable[[int], tuple[str, str, str]],
    after_round: Callable[[str], Any],
) -> int:
    """Run ``before``, then load ``rows`` in rounds while they are still being produced.

    :param round_sql: for round ``n``, ``(name of its table, CREATE statement of that table,
        COPY statement into it)``; the table is a child of the staging table, so the staging
        table still reads every row.
    :param after_round: called on the loading thread with each round's table once loaded,
        while Python formats the next round.
    """

    def load_rounds(spool: Spool) -> None:
        # One spool file is one round.
        for number, chunks in enumerate(spool.files(), start=1):
            part, create, copy_sql = round_sql(number)
            cur = conn.cursor()
            try:
                cur.execute(create)
            finally:
                cur.close()
            _copy_from(conn, copy_sql, chunks)
            after_round(part)

    return _overlapped_copy(
        conn, _without_nul(rows), before, load_rounds, segment=ROUND_BYTES, double_every=ROUNDS_PER_SIZE
    )


# ---- raw lines parsed by two connections ---------------------------------------------------
#: Bytes of raw lines per round where a second connection parses a share of them (a round
#: streams as its chunks come; one of the second connection's waits on disk until it is parsed).
SHARED_ROUND_BYTES = 4 << 20
#: Of every ``SHARED_CYCLE`` rounds, ``SHARED_MAIN`` (spread evenly) are parsed by the first
#: connection, the others by the second: the first also stages the keys and the second's rows,
#: so it takes less than half (balanced on 1M chat lines, bench_merge.py).
SHARED_MAIN, SHARED_CYCLE = 7, 16


def copy_shared(
    conn: Any,
    helper: Any,
    blocks: Iterable[tuple[bytes, int]],
    first_round: Callable[[Any, int], str],
    second_round: Callable[[int], tuple[Sequence[str], str, Callable[[], Any], str]],
    after_rounds: Callable[[], Any],
) -> tuple[int, list[IO[bytes]]]:
    """Load raw lines, given as blocks of COPY text ``(text, rows)``, in rounds of about
    ``SHARED_ROUND_BYTES``: those of the first connection (``conn``) are sent by this thread as
    they come, those of the second (``helper``) are spooled to a thread that loads and parses
    them there and spools the rows it reads out (COPY TO), one file per round.

    :param first_round: ``(cursor, number of the round's first line)``: readies ``conn`` for the
        round and gives its COPY statement.
    :param second_round: ``number of the round's first line`` -> statements readying the second
        connection, its COPY statement, what parses the round there, the query of its rows.
    :param after_rounds: run on ``conn`` once every round is sent (while the second connection
        may still parse): parses the first connection's lines.
    :return: the lines loaded and the spooled rows of the second connection, in order.
    """
    # Not bounded: the lines wait on disk, and this thread sends its own rounds and goes on to
    # parse them without waiting for the second connection.
    todo: queue.Queue[tuple[int, IO[bytes]] | None] = queue.Queue()
    out: list[IO[bytes]] = []
    failed = threading.Event()

    def parse_rounds() -> None:
        cur = helper.cursor()
        try:
            while (item := todo.get()) is not None and not failed.is_set():
                first, spooled = item
                readying, copy_sql, parse, rows = second_round(first)
                for statement in readying:
                    cur.execute(statement)
                spooled.seek(0)
                with spooled, cur.copy(copy_sql) as copy:
                    while chunk := spooled.read(1 << 20):
                        copy.write(chunk)
                parse()
                target = tempfile.TemporaryFile(prefix="abp-rows-")  # noqa: SIM115
                out.append(target)
                with cur.copy(f"COPY ({rows}) TO STDOUT") as copy:
                    for data in copy:
                        target.write(data)
                target.seek(0)
        except BaseException:
            failed.set()
            raise
        finally:
            cur.close()

    seq = 1
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="abp-pg-parse") as pool:
        parsing = pool.submit(parse_rounds)
        try:
            cur = conn.cursor()
            try:
                iterator = iter(blocks)
                pending = next(iterator, None)
                number = 0
                while pending is not None and not failed.is_set():
                    # Spread evenly: round ``number`` is the first connection's when it brings
                    # the first's count of rounds up to the next whole number.
                    mine = (number + 1) * SHARED_MAIN // SHARED_CYCLE > number * SHARED_MAIN // SHARED_CYCLE
                    first, have = seq, 0
                    spooled = None if mine else tempfile.TemporaryFile(prefix="abp-lines-")  # noqa: SIM115
                    with contextlib.ExitStack() as stack:
                        sink: Any = (
                            stack.enter_context(cur.copy(first_round(cur, first))) if mine else spooled
                        )
                        while pending is not None and have < SHARED_ROUND_BYTES:
                            block, rows = pending
                            sink.write(block)
                            have += len(block)
                            seq += rows
                            pending = next(iterator, None)
                    if spooled is not None:
                        todo.put((first, spooled))
                    number += 1
            finally:
                cur.close()
            if not failed.is_set():
                after_rounds()
        except BaseException:
            failed.set()
            # Do not wait for the second connection's statement to finish.
            cancel = getattr(helper, "cancel_safe", None) or getattr(helper, "cancel", None)
            if cancel is not None:
                with contextlib.suppress(Exception):
                    cancel()
            raise
        finally:
            # The end of the rounds (after a failure, the thread stops at its next round).
            todo.put(None)
        parsing.result()
    return seq - 1, out
