"""Pydantic v2 models: the wire lines and the normalised domain objects.

Request-side models (``RequestLine``) are strict and forbid unknown fields: what we
send must be exactly the documented shape. Response-side models ignore unknown
fields, because vendors add fields over time and a new field must never break a run.
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, field_validator

from airflow_batch_provider.exceptions import UnknownBatchStatusError
from airflow_batch_provider.ids import check_id


class _Response(BaseModel):
    """Base for models parsed from vendor responses: unknown fields are tolerated."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, defer_build=True)


class BatchState(str, Enum):
    """Normalised lifecycle state of a batch (OpenAI's vocabulary is the baseline)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_success(self) -> bool:
        return self is BatchState.COMPLETED

    @classmethod
    def parse(cls, value: str | None, *, batch_id: str | None = None) -> BatchState:
        """Map a vendor status string to a state; an unknown one is an error, never success."""
        if value is None:
            raise UnknownBatchStatusError(f"batch {batch_id or '?'} has no status")
        normalised = str(value).strip().lower().replace("-", "_")
        # Vendors spell the cancel states both ways (cancelled / canceled).
        normalised = {"canceled": "cancelled", "canceling": "cancelling"}.get(normalised, normalised)
        try:
            return cls(normalised)
        except ValueError:
            raise UnknownBatchStatusError(
                f"batch {batch_id or '?'} reported unknown status {value!r}; "
                f"known: {', '.join(s.value for s in cls)}"
            ) from None


_TERMINAL = frozenset({BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED})


class RequestLine(BaseModel):
    """One line of a batch input file: ``{custom_id, method, url, body}``."""

    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)

    custom_id: str = Field(min_length=1)
    method: str = "POST"
    url: str
    body: dict[str, Any]


class RequestCounts(_Response):
    """How many lines of a batch are done; ``completed`` counts successes only.

    A count the vendor sent as null (or did not send) reads as 0.
    """

    total: int = 0
    completed: int = 0
    failed: int = 0

    @field_validator("total", "completed", "failed", mode="before")
    @classmethod
    def _null_is_zero(cls, value: Any) -> Any:
        return 0 if value is None else value

    @property
    def pending(self) -> int:
        return max(self.total - self.completed - self.failed, 0)


class BatchError(_Response):
    """A batch-level error (for example one validation problem with its line number)."""

    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None
    # Set by the dialect when the code says a quota refused the batch (``batch_quota_error_codes``).
    quota: bool = False


class Batch(_Response):
    """A batch as the provider sees it, whatever the vendor's wire shape."""

    id: str
    state: BatchState
    endpoint: str | None = None
    completion_window: str | None = None
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    created_at: datetime | None = None
    in_progress_at: datetime | None = None
    finalizing_at: datetime | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    expired_at: datetime | None = None
    expires_at: datetime | None = None
    cancelling_at: datetime | None = None
    cancelled_at: datetime | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    errors: list[BatchError] = Field(default_factory=list)
    raw: dict[str, Any] = Field(default_factory=dict, repr=False)

    @field_validator(
        "created_at",
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "expires_at",
        "cancelling_at",
        "cancelled_at",
        mode="before",
    )
    @classmethod
    def _aware_utc(cls, value: Any) -> Any:
        return to_utc(value)

    @field_validator("id", "input_file_id", "output_file_id", "error_file_id")
    @classmethod
    def _vendor_id(cls, value: str | None, info: Any) -> str | None:
        # These ids come from the vendor's answer and are later placed in URLs that carry the key:
        # an answer naming ``../../admin`` is refused here, as an unreadable batch.
        return None if value is None else check_id(value, info.field_name)

    @field_validator("request_counts", mode="before")
    @classmethod
    def _counts(cls, value: Any) -> Any:
        # OpenAI-compatible servers send "request_counts": null while validating: counts unknown.
        return RequestCounts() if value is None else value

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            # A ValueError (not the TypeError ``dict(5)`` raises) is what pydantic reports as invalid.
            raise ValueError(f"metadata must be an object, not {type(value).__name__}")
        return {str(k): str(v) for k, v in value.items()}

    @field_validator("errors", mode="before")
    @classmethod
    def _errors(cls, value: Any) -> Any:
        # OpenAI wraps errors as {"object": "list", "data": [...]}.
        if value is None:
            return []
        if isinstance(value, dict):
            return value.get("data") or []
        return value

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    def summary(self) -> dict[str, Any]:
        """A small JSON-able view for XCom, events and logs (no raw vendor object)."""
        return self.model_dump(mode="json", exclude={"raw"})


class LineError(_Response):
    """A per-line error, normalised from whatever the vendor sent."""

    code: str | None = None
    message: str | None = None
    param: str | None = None
    type: str | None = None


ResultSource = Literal["output", "error", "inline"]


class ResultLine(_Response):
    """One result of a batch line, normalised: an answer (``ok``) or an error."""

    custom_id: str
    ok: bool
    status_code: int | None = None
    # Checked to be a dict by the dialect that parsed it; validating it again would walk and copy
    # every response body (the hot path of a merge), so pydantic passes it through as is.
    body: SkipValidation[dict[str, Any] | None] = None
    error: LineError | None = None
    request_id: str | None = None
    line_id: str | None = None
    source: ResultSource = "output"


class Shard(BaseModel):
    """One batch input file in staging."""

    model_config = ConfigDict(extra="ignore", defer_build=True)

    index: int
    path: str = Field(description="path of the shard, relative to the manifest's directory")
    lines: int
    bytes: int
    fingerprint: str = Field(description="sha256 of the shard's bytes")
    endpoint: str | None = None
    input_tokens: int | None = Field(default=None, description="estimated input tokens of the shard's lines")
    max_output_tokens: int | None = Field(
        default=None, description="worst-case output tokens (None: a line sets no cap, and no default)"
    )
    estimated_cost: float | None = Field(default=None, description="USD, worst case; None: price unknown")
    table: str | None = Field(
        default=None,
        description="the shard's requests table (bq://project.dataset.table) when the build wrote "
        "the requests in BigQuery (requests_table); ``path`` then names no file",
    )


class Manifest(BaseModel):
    """What a build produced: the shards, the key mapping and the row accounting."""

    model_config = ConfigDict(extra="ignore", defer_build=True)

    version: int = 1
    source: str = ""
    dialect: str = "openai"
    endpoint: str
    model: str | None = None
    key_columns: list[str] = Field(default_factory=list)
    key_types: list[str] = Field(
        default_factory=list,
        description="portable type of each key column: integer, float, text, boolean, date, timestamp, json",
    )
    custom_id_prefix: str = ""
    shards: list[Shard] = Field(default_factory=list)
    rows_read: int = 0
    rows_written: int = 0
    rows_rejected: int = 0
    rows_unchanged: int = Field(
        default=0,
        description="rows left out by skip_unchanged: the target already holds their succeeded answer "
        "to the same request (request_hash)",
    )
    rows_shared: int = Field(
        default=0,
        description="rows of a deduplicated build whose request repeats one sent for another row: "
        "in keys.jsonl, not in a shard; the merge gives them that row's answer",
    )
    rejects_path: str | None = None
    keys_path: str | None = Field(
        default=None, description="JSONL of {custom_id, key} for every written row, relative to the manifest"
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    estimate: dict[str, Any] | None = Field(
        default=None,
        description="the run's token and cost estimate (see airflow_batch_provider.estimate)",
    )
    extra: dict[str, Any] = Field(default_factory=dict)


def to_utc(value: Any) -> datetime | None:
    """Turn epoch seconds, ISO strings or datetimes into aware UTC datetimes; None stays None.

    Anything else (a bool, an object, a number out of range, text that is not a timestamp)
    raises ``ValueError``, which the models report as an invalid field.
    """
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # Some vendors send milliseconds; no batch was created before 2001 or after 2286.
        seconds = value / 1000 if value > 10_000_000_000 else value
        try:
            return datetime.fromtimestamp(seconds, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            # Past year 9999 (1e20), NaN, or beyond the platform's time_t: a vendor's bad
            # number is a ValueError like any unreadable field, never an OverflowError.
            raise ValueError(f"cannot read {value!r} as a timestamp") from None
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"cannot read {value[:64]!r} as a timestamp") from None
        return (
            parsed.replace(tzinfo=timezone.utc) if parsed.tzinfo is None else parsed.astimezone(timezone.utc)
        )
    raise ValueError(f"cannot read {type(value).__name__} {str(value)[:64]!r} as a timestamp")
