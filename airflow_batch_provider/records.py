"""The records of ``keys.jsonl`` and ``rejects.jsonl``: one model each.

The build writes them (one line per input row, so millions of lines: the models are slotted
frozen dataclasses serialised by orjson from a plain dict); the merge reads them back. A line
read back may be malformed (a hand-edited or truncated file): readers take what they find and
report the line, so the read side is lenient (``fields_of`` / ``from_dict``), never silent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One line of keys.jsonl: a request line written to a shard, and the key of its row.

    :param custom_id: the line's custom_id.
    :param key: the row's key values, in key-column order (JSON-able).
    :param shard: index of the shard the line went to (for a row that shares an answer: the
        shard of the line sent for it).
    :param request_hash: the hash of the canonical request (:mod:`airflow_batch_provider.request_hash`);
        None in a keys.jsonl written before it existed.
    :param shared_answer: for a row of a deduplicated build whose request repeats one already
        sent: the custom_id of that line, whose answer the merge gives this row too; else None.
    """

    custom_id: str
    key: list[Any]
    shard: int
    request_hash: str | None = None
    shared_answer: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return KeyRecord.line(self.custom_id, self.key, self.shard, self.request_hash, self.shared_answer)

    @staticmethod
    def line(
        custom_id: str,
        key: list[Any],
        shard: int,
        request_hash: str | None = None,
        shared_answer: str | None = None,
    ) -> dict[str, Any]:
        """The JSON object of a keys.jsonl line, built without a record (for a loop writing
        millions of lines: a record costs about a microsecond more per line). ``request_hash``
        and ``shared_answer`` are written only when set."""
        obj: dict[str, Any] = {"custom_id": custom_id, "key": key, "shard": shard}
        if request_hash is not None:
            obj["request_hash"] = request_hash
        if shared_answer is not None:
            obj["shared_answer"] = shared_answer
        return obj

    @staticmethod
    def request_fields_of(obj: Mapping[str, Any]) -> tuple[str | None, str | None]:
        """``(request_hash, shared_answer)`` of a keys.jsonl object as read, None where missing
        or not text."""
        found = obj.get("request_hash"), obj.get("shared_answer")
        return tuple(v if isinstance(v, str) and v else None for v in found)  # type: ignore[return-value]

    @staticmethod
    def fields_of(obj: Mapping[str, Any]) -> tuple[str | None, list[Any] | None, int | None]:
        """``(custom_id, key, shard)`` of a keys.jsonl object as read, each None where it is
        missing or not of its type (the reader reports that line by number)."""
        custom_id = obj.get("custom_id")
        key = obj.get("key")
        shard = obj.get("shard")
        return (
            custom_id if isinstance(custom_id, str) else None,
            key if isinstance(key, list) else None,
            shard if isinstance(shard, int) else None,
        )


@dataclass(frozen=True, slots=True)
class RejectRecord:
    """One line of rejects.jsonl: an input row that could not become a valid request line.

    :param row: the row's number in the query's result (1-based).
    :param key: its key values (JSON-able), or None / with None values when the key is null.
    :param custom_id: its custom_id, when one was derived before the row was rejected.
    :param code: a stable reason code (``null_key``, ``line_too_large``...).
    :param reason: a sentence saying what is wrong.
    :param column: the column at fault, when there is one.
    """

    row: int | None
    key: list[Any] | None
    custom_id: str | None
    code: str | None
    reason: str
    column: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return RejectRecord.line(self.row, self.key, self.custom_id, self.code, self.reason, self.column)

    @staticmethod
    def line(
        row: int | None,
        key: list[Any] | None,
        custom_id: str | None,
        code: str | None,
        reason: str,
        column: str | None = None,
    ) -> dict[str, Any]:
        """The JSON object of a rejects.jsonl line, built without a record (see ``KeyRecord.line``)."""
        return {
            "row": row,
            "key": key,
            "custom_id": custom_id,
            "code": code,
            "reason": reason,
            "column": column,
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> RejectRecord:
        """A rejects.jsonl object as read (a missing field is None, a missing reason empty)."""
        return cls(
            row=obj.get("row"),
            key=obj.get("key"),
            custom_id=obj.get("custom_id"),
            code=obj.get("code"),
            reason=str(obj.get("reason") or ""),
            column=obj.get("column"),
        )

    @property
    def keyed(self) -> bool:
        """Whether the record has a usable key (no null value), so it can be written by key."""
        return self.key is not None and not any(v is None for v in self.key)

    @property
    def message(self) -> str:
        """The reason, naming the column at fault (once: a reason that quotes it already is kept)."""
        if not self.column or repr(self.column) in self.reason:
            return self.reason
        return f"{self.reason} (column {self.column})"


class RetryKey(NamedTuple):
    """A key the merge found retryable (failed, expired, cancelled, missing), for resubmission.

    :param shard: the shard its line is in (for a shared answer: the line sent for it).
    :param custom_id: the key's own custom_id.
    :param key: its key values (JSON-able).
    :param request_hash: its request_hash, as keys.jsonl gave it (None in an older one).
    :param sent_as: the custom_id of the line that answers it: its own, or the one whose answer
        it shares (a deduplicated build).
    """

    shard: int
    custom_id: str
    key: list[Any]
    request_hash: str | None = None
    sent_as: str | None = None
