"""custom_id from a row's key columns, and the way back from staged key values to typed Python.

A custom_id must be stable across runs (the same key always gives the same id, in any
process), at most 64 characters of ``[a-zA-Z0-9_-]`` (the strictest rule of any vendor)
and distinct for distinct keys.
A single integer key, or a single short string key made of safe characters, is used as is so
ids stay readable in vendor consoles; everything else is hashed. Hashed ids start with
``HASH_PREFIX`` and a readable id never does, so the two forms cannot collide. The way back
from a hashed id is ``keys.jsonl`` in staging, which records the key values of every line.
Two rows with the same key are found with bounded memory by :class:`HashBuckets` (hashes of
every custom_id, spilled to disk past a threshold) and confirmed by :func:`check_unique`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
import uuid
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import orjson

from airflow_batch_provider.exceptions import DuplicateKeyError

MAX_CUSTOM_ID = 64
HASH_PREFIX = "k-"
# 26 base32 characters = 130 bits of sha256; ample for any batch and short enough for a prefix.
_HASH_CHARS = 26
MAX_PREFIX = MAX_CUSTOM_ID - len(HASH_PREFIX) - _HASH_CHARS

# Characters every vendor takes in a custom_id: the strictest rule is ^[a-zA-Z0-9_-]{1,64}$, so a
# readable id (and a prefix) uses nothing else; hashed ids are base32 after "k-".
_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_INTEGER_TEXT = re.compile(r"-?[0-9]+")

KEY_TYPES = ("integer", "float", "text", "boolean", "date", "timestamp", "json")
_DUPLICATES_SHOWN = 10


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can start a custom_id, else raise ``ValueError`` saying why."""
    if prefix and not _SAFE.fullmatch(prefix):
        raise ValueError(
            f"custom_id prefix {prefix!r} may only use letters, digits, _ and - "
            "(the characters every vendor accepts in a custom_id)"
        )
    if len(prefix) > MAX_PREFIX:
        raise ValueError(f"custom_id prefix {prefix!r} is longer than {MAX_PREFIX} characters")
    return prefix


def _canonical(value: Any) -> Any:
    """A JSON-able, type-tagged form of one key value, identical in every process and run.

    The tag keeps ``1`` and ``"1"`` (and ``1`` and ``True``) apart: SQLite lets one column hold both.
    """
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, int):
        return ["i", str(value)]
    if isinstance(value, float):
        return ["f", repr(value)]
    if isinstance(value, Decimal):
        # 1.0 and 1.00 are the same key; integral decimals equal the integer they hold.
        if value.is_finite() and value == value.to_integral_value():
            return ["i", str(int(value))]
        return ["f", format(value.normalize(), "f")]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ["x", bytes(value).hex()]
    if isinstance(value, datetime):
        return ["t", value.isoformat()]
    if isinstance(value, date):
        return ["d", value.isoformat()]
    if isinstance(value, (time, timedelta, uuid.UUID)):
        return ["s", str(value)]
    if isinstance(value, (list, tuple)):
        return ["a", [_canonical(v) for v in value]]
    if isinstance(value, dict):
        return ["o", sorted((str(k), _canonical(v)) for k, v in value.items())]
    return ["s", str(value)]


def readable_id(value: Any) -> str | None:
    """The key as it would appear in a readable custom_id, or None if it must be hashed."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Decimal) and value.is_finite() and value == value.to_integral_value():
        return str(int(value))
    # Digits-only text is hashed so the string "1" never shares an id with the integer 1.
    if isinstance(value, str) and (
        _SAFE.fullmatch(value) and not _INTEGER_TEXT.fullmatch(value) and not value.startswith(HASH_PREFIX)
    ):
        return value
    return None


def hashed_id(values: Sequence[Any]) -> str:
    """The hash part of a custom_id for ``values`` (``HASH_PREFIX`` + 26 base32 characters)."""
    digest = hashlib.sha256(orjson.dumps([_canonical(v) for v in values])).digest()
    return HASH_PREFIX + base64.b32encode(digest).decode("ascii")[:_HASH_CHARS].lower()


def custom_id_for(values: Sequence[Any], prefix: str = "") -> str:
    """The custom_id of a row with key ``values``: stable, at most 64 characters, distinct per key.

    :param values: the row's key column values, in key column order.
    :param prefix: optional text put in front (letters, digits, ``_-``; at most ``MAX_PREFIX``).
    """
    if len(values) == 1:
        value = values[0]
        if type(value) is int:
            # The common case first: an integer key is its own id when it fits.
            text = prefix + str(value)
            return text if len(text) <= MAX_CUSTOM_ID else prefix + hashed_id(values)
        readable = readable_id(value)
        if readable is not None and len(prefix) + len(readable) <= MAX_CUSTOM_ID:
            return prefix + readable
    return prefix + hashed_id(values)


def jsonable_key(values: Sequence[Any]) -> list[Any]:
    """Key values as written to ``keys.jsonl`` and ``rejects.jsonl`` (dates as ISO text, decimals as text)."""
    return [_jsonable(v) for v in values]


def stored_key(values: list[Any]) -> list[Any]:
    """``jsonable_key(values)``, returning ``values`` itself when JSON already holds them as they are.

    The build calls this for every row: a 64-bit integer or text key (the usual kinds) skips
    the conversion.
    """
    if len(values) == 1:
        value = values[0]
        kind = type(value)
        if (kind is int and -(1 << 63) <= value < (1 << 64)) or kind is str:
            return values
    elif all(type(v) is str for v in values):
        return values
    return jsonable_key(values)


def _jsonable(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
        return str(value)  # JSON writers (orjson) stop at 64 bits; decode_key turns it back
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(raw).decode("ascii")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def decode_key(values: Sequence[Any], key_types: Sequence[str]) -> tuple[Any, ...]:
    """Turn a ``keys.jsonl`` key back into typed Python values using the manifest's ``key_types``.

    An unknown or missing type leaves the value as stored.
    """
    out: list[Any] = []
    for i, value in enumerate(values):
        kind = key_types[i] if i < len(key_types) else "text"
        out.append(_decode(value, kind))
    return tuple(out)


def _decode(value: Any, kind: str) -> Any:
    if value is None:
        return None
    if kind == "integer":
        return int(value)
    if kind == "float":
        return Decimal(value) if isinstance(value, str) else float(value)
    if kind == "boolean":
        return bool(value)
    if kind == "date" and isinstance(value, str):
        return date.fromisoformat(value)
    if kind == "timestamp" and isinstance(value, str):
        return datetime.fromisoformat(value)
    return value


# ---------------------------------------------------------------------------------------------
# Duplicate keys: two rows with the same custom_id
# ---------------------------------------------------------------------------------------------


class HashBuckets:
    """Find repeated 64-bit hashes among millions with bounded memory.

    Duplicate keys are found through the hash of each row's custom_id: 8 bytes per row,
    spread over 256 buckets by the low byte. Past ``spill_at`` hashes in memory every bucket
    is appended to its own temporary file, so memory stays flat however many rows there are;
    at the end each bucket is checked on its own (1/256 of the rows at a time). Repeated
    hashes are only candidates: the caller confirms them against the real custom_ids, so a
    collision never fails a build.

    :param spill_at: hashes held in memory before spilling to disk.
    """

    def __init__(self, spill_at: int = 1 << 20) -> None:
        self._buckets = [array("q") for _ in range(256)]
        self._held = 0
        self._spill_at = spill_at
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.spills = 0

    def add(self, h: int) -> None:
        self._buckets[h & 255].append(h)
        self._held += 1
        if self._held >= self._spill_at:
            self._spill()

    def _spill(self) -> None:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="abp-keys-")
        for i, bucket in enumerate(self._buckets):
            if bucket:
                with open(os.path.join(self._dir.name, f"{i:03d}"), "ab") as fh:
                    bucket.tofile(fh)
                self._buckets[i] = array("q")
        self._held = 0
        self.spills += 1

    def repeated(self) -> set[int]:
        """The hashes seen more than once; frees the buckets and any spill files."""
        candidates: set[int] = set()
        try:
            for i, bucket in enumerate(self._buckets):
                if self._dir is not None:
                    path = os.path.join(self._dir.name, f"{i:03d}")
                    if os.path.exists(path):
                        spilled = array("q")
                        with open(path, "rb") as fh:
                            spilled.frombytes(fh.read())
                        spilled.extend(bucket)
                        bucket = spilled
                seen: set[int] = set()
                for h in bucket:
                    if h in seen:
                        candidates.add(h)
                    else:
                        seen.add(h)
                self._buckets[i] = array("q")
        finally:
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None
        return candidates


def check_unique(
    hashes: HashBuckets, records: Iterable[Mapping[str, Any]], key_columns: Sequence[str]
) -> None:
    """Raise ``DuplicateKeyError`` naming the keys given to more than one row, if any.

    :param hashes: ``hash(custom_id)`` of every row (written or rejected).
    :param records: the ``{"custom_id", "key"}`` records of every row, read only when a hash
        repeats; a repeated hash counts only when the custom_ids themselves repeat.
    :param key_columns: the key column names, for the message.
    """
    candidates = hashes.repeated()
    if not candidates:
        return
    counts: Counter[str] = Counter()
    key_of: dict[str, Any] = {}
    for record in records:
        cid = record.get("custom_id")
        if isinstance(cid, str) and hash(cid) in candidates:
            counts[cid] += 1
            key_of[cid] = record.get("key")
    dups = [(cid, n) for cid, n in counts.items() if n > 1]
    if not dups:
        return
    dups.sort(key=lambda item: -item[1])
    shown = "; ".join(
        f"{dict(zip(key_columns, key_of[cid] or [], strict=False))} x{n}"
        for cid, n in dups[:_DUPLICATES_SHOWN]
    )
    more = f" and {len(dups) - _DUPLICATES_SHOWN} more" if len(dups) > _DUPLICATES_SHOWN else ""
    raise DuplicateKeyError(
        f"{len(dups)} key(s) of ({', '.join(key_columns)}) appear on more than one row: "
        f"{shown}{more}. "
        "Make key_columns unique per row (add a column or deduplicate in the query)."
    )
