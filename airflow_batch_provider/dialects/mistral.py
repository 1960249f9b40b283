"""Mistral: files uploaded with ``purpose=batch``, jobs under ``/v1/batch/jobs``, the model on the job.

Built to Mistral's public API reference and its official Python SDK (``mistralai``): input lines
are ``{custom_id, body}`` (no method, no url, no model: the job names the endpoint and the
model); a job is created with ``{input_files: [id], model, endpoint, metadata, timeout_hours}``;
``GET /v1/batch/jobs`` pages with ``page`` (from 0) and ``page_size``, newest first, answers
``{object: "list", data, total}`` and filters by metadata (each pair a query parameter, as the
SDK sends it), which is how an orphan is found after a crash between create and recording its
id. Statuses QUEUED, RUNNING, SUCCESS, FAILED, TIMEOUT_EXCEEDED, CANCELLATION_REQUESTED and
CANCELLED; counts ``total_requests``, ``succeeded_requests``, ``failed_requests``; results in
``output_file`` and ``error_file`` whose lines have OpenAI's shape
``{id, custom_id, response: {status_code, body}, error}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from airflow_batch_provider.dialects.base import (
    LIST_WHAT,
    Dialect,
    batch_object,
    bind_models,
    page_items,
    page_object,
)
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.limits import MB, Limits

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
    from airflow_batch_provider.models import (  # noqa: TC004
        Batch,
        BatchError,
        BatchState,
        RequestCounts,
        to_utc,
    )

# Mistral's job statuses, in the provider's vocabulary (a job past its timeout is "expired").
STATUSES: dict[str, str] = {
    "QUEUED": "validating",
    "RUNNING": "in_progress",
    "SUCCESS": "completed",
    "FAILED": "failed",
    "TIMEOUT_EXCEEDED": "expired",
    "CANCELLATION_REQUESTED": "cancelling",
    "CANCELLED": "cancelled",
}

# Canonical (OpenAI) body keys with another name at Mistral; the value is carried over.
_RENAMED: dict[str, dict[str, str]] = {
    "/v1/chat/completions": {"max_completion_tokens": "max_tokens", "seed": "random_seed"},
    "/v1/embeddings": {"dimensions": "output_dimension"},
}
# Canonical chat parameters Mistral's chat completion request has no field for: a line using one
# is refused by name rather than sent and ignored.
_UNSUPPORTED_CHAT = ("logit_bias", "logprobs", "top_logprobs", "audio", "modalities", "service_tier", "store")


class MistralDialect(Dialect):
    """Mistral Batch API (``/v1/batch/jobs``)."""

    name = "mistral"
    label = "Mistral"
    default_base_url = "https://api.mistral.ai/v1"
    # Mistral's tokenizer is not bundled here; its batch API costs half the list price.
    token_encoding = None
    token_factor = 1.1
    price_provider = "mistral"
    endpoints = frozenset(
        {
            "/v1/chat/completions",
            "/v1/embeddings",
            "/v1/fim/completions",
            "/v1/moderations",
            "/v1/chat/moderations",
            "/v1/ocr",
            "/v1/classifications",
            "/v1/chat/classifications",
        }
    )
    # A job runs for ``timeout_hours`` (24 by default); windows are given as "<hours>h".
    completion_windows = ("24h", "1h", "6h", "12h", "48h", "72h", "168h")
    # Uploads are capped at 512 MB; no per-line limit is documented, so a line may fill the file.
    limits = Limits(max_lines=1_000_000, max_file_bytes=512 * MB, max_line_bytes=512 * MB)
    # The job carries one model: the lines of one file must agree (the build rejects the others).
    mixed_models = False
    model_placement = "job"
    encodes_lines = True
    list_keys = frozenset({"data", "total"})
    batches_path = "batch/jobs"

    def __init__(self) -> None:
        super().__init__()
        bind_models(globals(), "Batch", "BatchError", "BatchState", "RequestCounts", "to_utc")

    # ---- request lines ----------------------------------------------------------------
    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        body = canonical.get("body")
        if canonical.get("url") == "/v1/chat/completions" and isinstance(body, Mapping):
            used = [key for key in _UNSUPPORTED_CHAT if body.get(key) not in (None, False)]
            if used:
                return f"{', '.join(used)} not supported by Mistral's chat completions"
        return None

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """``{custom_id, body}``: the job names the endpoint and the model, so the line does not."""
        body = dict(canonical["body"])
        body.pop("model", None)
        for old, new in _RENAMED.get(canonical.get("url") or "", {}).items():
            if old in body:
                value = body.pop(old)
                body.setdefault(new, value)
        return {"custom_id": canonical["custom_id"], "body": body}

    # ---- batches --------------------------------------------------------------------
    def create_batch_body(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_files": [input_file_id],
            "endpoint": endpoint,
            "model": model,
            "timeout_hours": int(completion_window.rstrip("h")),
        }
        if metadata:
            body["metadata"] = dict(metadata)
        return body

    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """Mistral's job object as a ``Batch``; anything unreadable is a ``BatchApiResponseError``."""
        raw = batch_object(raw)
        batch_id = raw.get("id")
        if not batch_id:
            raise BatchApiResponseError("batch job object has no id", body=dict(raw))
        if not isinstance(batch_id, str):
            raise BatchApiResponseError(
                f"batch job object has an id that is not a string ({type(batch_id).__name__})", body=dict(raw)
            )
        status = raw.get("status")
        mapped = STATUSES.get(status) if isinstance(status, str) else None
        if mapped is None:
            # An unknown status is an error, never a success (the sensor must not guess).
            raise UnknownBatchStatusError(
                f"batch {batch_id} reported unknown status {status!r}; known: {', '.join(STATUSES)}"
            )
        state = BatchState(mapped)
        input_files = raw.get("input_files")
        first_input = input_files[0] if isinstance(input_files, list) and input_files else None
        errors = raw.get("errors")
        try:
            return Batch(
                id=batch_id,
                state=state,
                endpoint=raw.get("endpoint"),
                input_file_id=first_input,
                output_file_id=raw.get("output_file"),
                error_file_id=raw.get("error_file"),
                request_counts=RequestCounts(
                    total=raw.get("total_requests"),
                    completed=raw.get("succeeded_requests"),
                    failed=raw.get("failed_requests"),
                ),
                created_at=to_utc(raw.get("created_at")),
                in_progress_at=to_utc(raw.get("started_at")),
                completed_at=to_utc(raw.get("completed_at")),
                metadata=raw.get("metadata"),
                errors=[
                    BatchError(code="batch_error", message=e.get("message"))
                    for e in (errors if isinstance(errors, list) else [])
                    if isinstance(e, Mapping)
                ],
                raw=dict(raw),
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"page": 0, "page_size": limit or self.list_page_size}

    def filter_params(self, metadata: Mapping[str, str], *, since: datetime | None = None) -> dict[str, Any]:
        # The SDK sends the metadata filter exploded: one query parameter per pair.
        return {str(k): str(v) for k, v in metadata.items()}

    def list_envelope(self, raw: Any, params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any] | None]:
        """One page's items, and the next page while the pages so far hold fewer than ``total``.

        A first page shorter than asked and short of ``total`` means the server clamps the page
        size: the walk goes on asking for the size it gives. A later short page is the last.
        """
        raw = page_object(raw)
        data = page_items(raw, "data")
        total = raw.get("total")
        if total is not None and (not isinstance(total, int) or isinstance(total, bool)):
            raise BatchApiResponseError(f"{LIST_WHAT}: total is {type(total).__name__}, not an integer")
        page = int(params.get("page") or 0)
        size = int(params.get("page_size") or self.list_page_size)
        next_params: dict[str, Any] | None = None
        if data and total is not None:
            if len(data) < size and page == 0:
                size = len(data)
            if len(data) >= size and (page + 1) * size < total:
                next_params = {**params, "page": page + 1, "page_size": size}
        return data, next_params
