"""Durable state of the local batch server: SQLite for metadata, a directory for file bytes.

Records are JSON documents keyed by id with an insertion sequence for stable listing
order. Everything written here survives a restart; the engine resumes from it.

The bytes under ``files/`` and ``work/`` are also accounted in memory: every writer reserves
its bytes before writing them (an upload as it streams, a batch per result line) and gives
back what it removes, so concurrent writers cannot pass ``max_bytes`` between them.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

# Ids this server hands out (``file-<hex>``, ``batch_<hex>``, UUIDs); anything else, such as
# ".." or a NUL, names no record and never becomes a path.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    active INTEGER NOT NULL DEFAULT 1,
    data TEXT NOT NULL
);
"""


class Store:
    """SQLite metadata plus a files directory under ``data_dir``.

    :param data_dir: where ``server.db``, ``files/`` and ``work/`` live (created if missing).
    :param max_bytes: cap on the bytes under ``files/`` and ``work/`` (None: no cap); writers
        must ``reserve`` before they write.
    """

    def __init__(self, data_dir: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.root = Path(data_dir)
        self.max_bytes = max_bytes
        self.files_dir = self.root / "files"
        self.work_dir = self.root / "work"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # One connection shared by the event loop and worker threads, serialised by a lock:
        # every statement is tiny, so contention is negligible.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "server.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        # Reservations are taken from the event loop and from echo worker threads alike.
        self._quota = threading.Lock()
        self._used = 0
        self.peak_used = 0
        self.recount()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- ids and paths ------------------------------------------------------------
    @staticmethod
    def new_id(prefix: str, style: str = "openai") -> str:
        """A new id: ``prefix`` + 24 hex characters, or a UUID for vendors that use them."""
        if style == "uuid":
            return str(uuid.uuid4())
        return f"{prefix}{uuid.uuid4().hex[:24]}"

    @staticmethod
    def valid_id(ident: str) -> bool:
        """Whether ``ident`` has the shape of an id this server issues (letters, digits, ``-``, ``_``)."""
        return _ID.fullmatch(ident) is not None

    def file_path(self, file_id: str) -> Path:
        if not self.valid_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.files_dir / file_id

    def temp_path(self, name: str) -> Path:
        return self.work_dir / f"{name}.{uuid.uuid4().hex}.part"

    def work_path(self, batch_id: str, kind: str) -> Path:
        return self.work_dir / f"{batch_id}.{kind}.jsonl"

    # ---- files ------------------------------------------------------------------------
    def add_file(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO files (id, data) VALUES (?, ?)", (record["id"], orjson.dumps(record))
            )

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        if not self.valid_id(file_id):
            return None
        with self._lock:
            row = self._db.execute("SELECT data FROM files WHERE id = ?", (file_id,)).fetchone()
        return orjson.loads(row[0]) if row else None

    def list_files(
        self, *, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; ``after`` is the id of the last file of the previous page."""
        return self._page("files", after=after, limit=limit, purpose=purpose)

    def delete_file(self, file_id: str) -> bool:
        if not self.valid_id(file_id):
            return False
        with self._lock:
            cur = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.remove(self.file_path(file_id))
        return cur.rowcount > 0

    def usage(self) -> int:
        """Bytes held under ``files/`` and ``work/`` (what ``max_storage_bytes`` caps)."""
        total = 0
        for folder in (self.files_dir, self.work_dir):
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # removed meanwhile
                        continue
        return total

    # ---- storage accounting ---------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes held or reserved under ``files/`` and ``work/``."""
        return self._used

    def recount(self) -> int:
        """Set the accounted bytes to what is on disk (at start-up and after a sweep)."""
        total = self.usage()
        with self._quota:
            self._used = total
            self.peak_used = max(self.peak_used, total)
        return total

    def room(self) -> int | None:
        """Bytes that can still be reserved (None without a cap)."""
        if self.max_bytes is None:
            return None
        return max(self.max_bytes - self._used, 0)

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the cap before writing them; False (nothing taken) if they do not fit.

        :param size: bytes about to be written.
        """
        with self._quota:
            if self.max_bytes is not None and self._used + size > self.max_bytes:
                return False
            self._used += size
            self.peak_used = max(self.peak_used, self._used)
            return True

    def release(self, size: int) -> None:
        """Give back ``size`` bytes that were reserved or are removed from disk."""
        if size > 0:
            with self._quota:
                self._used = max(self._used - size, 0)

    def remove(self, path: Path) -> None:
        """Delete a file under the data dir and give its bytes back."""
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        self.release(size)

    def discard_work(self, batch_id: str) -> None:
        """Remove the work files of a batch that will not publish them (it failed)."""
        for kind in ("output", "error"):
            self.remove(self.work_path(batch_id, kind))

    def sweep(self, live_batches: set[str], pending_files: set[str]) -> int:
        """Remove what a crash left behind; returns how many files went.

        Partial uploads (``*.part``), work files of batches not in ``live_batches``, and
        files under ``files/`` without a record unless listed in ``pending_files``.
        """
        removed = 0
        with os.scandir(self.work_dir) as entries:
            for entry in entries:
                if entry.name.endswith(".part") or entry.name.split(".", 1)[0] not in live_batches:
                    Path(entry.path).unlink(missing_ok=True)
                    removed += 1
        with self._lock:
            known = {row[0] for row in self._db.execute("SELECT id FROM files")}
        with os.scandir(self.files_dir) as entries:
            for entry in entries:
                if entry.name not in known and entry.name not in pending_files:
                    Path(entry.path).unlink(missing_ok=True)
                    removed += 1
        self.recount()
        return removed

    # ---- batches --------------------------------------------------------------------
    def add_batch(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, active, data) VALUES (?, ?, ?)",
                (record["id"], int(not _terminal(record)), orjson.dumps(record)),
            )

    def save_batch(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE batches SET data = ?, active = ? WHERE id = ?",
                (orjson.dumps(record), int(not _terminal(record)), record["id"]),
            )

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return orjson.loads(row[0]) if row else None

    def list_batches(self, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        return self._page("batches", after=after, limit=limit)

    def active_batches(self) -> Iterator[dict[str, Any]]:
        """Batches not yet terminal, oldest first (the ones to resume after a restart)."""
        with self._lock:
            rows = self._db.execute("SELECT data FROM batches WHERE active = 1 ORDER BY seq").fetchall()
        for (data,) in rows:
            yield orjson.loads(data)

    def _page(
        self, table: str, *, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        sql = f"SELECT data FROM {table}"
        where: list[str] = []
        params: list[Any] = []
        if after:
            where.append(f"seq < (SELECT seq FROM {table} WHERE id = ?)")
            params.append(after)
        if purpose:
            where.append("json_extract(data, '$.purpose') = ?")
            params.append(purpose)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        params.append(limit + 1)
        with self._lock:
            rows = self._db.execute(sql, params).fetchall()
        items = [orjson.loads(r[0]) for r in rows[:limit]]
        return items, len(rows) > limit


def _terminal(record: dict[str, Any]) -> bool:
    return record.get("status") in ("completed", "failed", "expired", "cancelled")


def now() -> float:
    return time.time()
