"""xAI: its own batch object, colon-style cancel, and a paged results endpoint.

A batch carries no ``status``; it has ``state{num_requests, num_pending, num_success,
num_error, num_cancelled}``, ``cancel_time`` and ``cancel_by_xai_message``, and the
state is derived from those. Results come from ``GET /v1/batches/{id}/results``
(``limit`` + ``pagination_token``) with ``custom_id`` echoed as ``batch_request_id``.
Uploads send no ``purpose``; one file may mix endpoints; a batch is created from
``{name, input_file_id}``, so the run identity travels in ``name``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_batch_provider.dialects.base import (
    LIST_WHAT,
    Dialect,
    ResultsPage,
    batch_object,
    bind_models,
    page_items,
    page_object,
)
from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.ids import path_segment

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
    from airflow_batch_provider.models import (  # noqa: TC004
        Batch,
        BatchError,
        BatchState,
        LineError,
        RequestCounts,
        ResultLine,
        to_utc,
    )


# The metadata key whose value becomes the batch name, so orphans can be found by listing.
NAME_KEY = "airflow_batch_key"


class XAIDialect(Dialect):
    """xAI Batch API."""

    name = "xai"
    label = "xAI"
    default_base_url = "https://api.x.ai/v1"
    list_keys = frozenset({"batches"})
    listed_id_key = "batch_id"
    # Grok's tokenizer is not public.
    token_encoding = None
    token_factor = 1.1
    price_provider = "x-ai"
    batch_discount = None
    endpoints = frozenset(
        {
            "/v1/responses",
            "/v1/chat/completions",
            "/v1/images/generations",
            "/v1/images/edits",
            "/v1/videos/generations",
            "/v1/videos",
            "/v1/videos/edits",
            "/v1/videos/extensions",
        }
    )
    completion_windows = ("24h",)
    mixed_endpoints = True
    # Each request names its own model; no custom_id length is documented.
    mixed_models = True
    max_custom_id_chars = None
    upload_purpose = None
    supports_metadata = False
    results_modes = ("results_endpoint",)
    # Results come from the paged endpoint, in gRPC shape: no result file for a database to read.
    line_shape = None

    def __init__(self) -> None:
        super().__init__()
        bind_models(
            globals(),
            "Batch",
            "BatchError",
            "BatchState",
            "LineError",
            "RequestCounts",
            "ResultLine",
            "to_utc",
        )

    def cancel_path(self, batch_id: str) -> str:
        return f"batches/{path_segment(batch_id, 'batch_id')}:cancel"

    def results_path(self, batch_id: str) -> str:
        return f"batches/{path_segment(batch_id, 'batch_id')}/results"

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
        # xAI takes no endpoint, window or metadata: each line names its url, and the run
        # identity is carried in the batch name.
        batch_name = (metadata or {}).get(NAME_KEY) or name or "airflow-batch"
        return {"name": batch_name, "input_file_id": input_file_id}

    def listed_id(self, item: Any) -> str | None:
        """The ``batch_id`` of a listed item, or its ``id`` (what ``parse_batch`` reads too)."""
        if not isinstance(item, dict):
            return None
        batch_id = item.get("batch_id") or item.get("id")
        return batch_id if isinstance(batch_id, str) and batch_id else None

    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """xAI's batch object as a ``Batch``; anything unreadable is a ``BatchApiResponseError``."""
        raw = batch_object(raw)
        batch_id = raw.get("batch_id") or raw.get("id")
        if not batch_id:
            raise BatchApiResponseError("batch object has no batch_id", body=dict(raw))
        if not isinstance(batch_id, str):
            raise BatchApiResponseError(
                f"batch object has a batch_id that is not a string ({type(batch_id).__name__})",
                body=dict(raw),
            )
        try:
            return self._parse_batch(batch_id, raw)
        except (TypeError, ValueError, OverflowError) as exc:
            # A counter that is text, an object or infinite; a time out of range; a name that is
            # not text: one unreadable field makes the batch unreadable, said with its id.
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None

    def _parse_batch(self, batch_id: str, raw: Mapping[str, Any]) -> Batch:
        state = raw.get("state") or {}
        if not isinstance(state, Mapping):
            raise BatchApiResponseError(f"batch {batch_id} has an unreadable state", body=dict(raw))
        total = _count(state, "num_requests")
        pending = _count(state, "num_pending")
        success = _count(state, "num_success")
        failed = _count(state, "num_error") + _count(state, "num_cancelled")
        errors: list[BatchError] = []
        # expire_time is when xAI will stop the batch, not a state: while it still reports
        # pending requests and no cancel, the batch is running (its own counters decide).
        expire_time = to_utc(raw.get("expire_time"))
        cancel_time = to_utc(raw.get("cancel_time"))
        xai_message = raw.get("cancel_by_xai_message")
        if xai_message:
            # xAI cancels a batch whose file fails validation: that is a failure, not a user cancel.
            status = BatchState.FAILED
            errors.append(BatchError(code="cancelled_by_xai", message=str(xai_message)))
        elif cancel_time is not None:
            status = BatchState.CANCELLED if pending == 0 else BatchState.CANCELLING
        elif pending > 0:
            status = BatchState.IN_PROGRESS
        elif total > 0:
            status = BatchState.COMPLETED
        else:
            # Nothing counted yet: the input file is still being read.
            status = BatchState.VALIDATING
        name = raw.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name is {type(name).__name__}, not text")
        input_file_id = raw.get("input_file_id")
        return Batch(
            id=batch_id,
            state=status,
            input_file_id=str(input_file_id) if input_file_id else None,
            request_counts=RequestCounts(total=total, completed=success, failed=failed),
            created_at=to_utc(raw.get("create_time")),
            expires_at=expire_time,
            cancelled_at=cancel_time,
            metadata={NAME_KEY: name, "name": name} if name else {},
            errors=errors,
            raw=dict(raw),
        )

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"limit": limit or self.list_page_size}

    def list_envelope(self, raw: Any, params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any] | None]:
        raw = page_object(raw)
        items = page_items(raw, "batches", "data")
        # The end marker is an absent or null pagination_token, whatever the page's length.
        token = raw.get("pagination_token")
        if token is not None and not isinstance(token, str):
            raise BatchApiResponseError(
                f"{LIST_WHAT}: pagination_token is {type(token).__name__}, not a string"
            )
        next_params = {**params, "pagination_token": token} if token else None
        return items, next_params

    def results_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"limit": limit or self.results_page_size}

    def parse_results_page(
        self, raw: Any, params: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> ResultsPage:
        if not isinstance(raw, Mapping):
            raise BatchApiResponseError("unreadable results page", body=repr(raw)[:500])
        items = raw.get("results") or []
        token = raw.get("pagination_token")
        lines = [self.parse_results_item(item) for item in items]
        # The end marker is an absent or null pagination_token, whatever the page's length.
        next_params = {**params, "pagination_token": token} if token else None
        return ResultsPage(lines=lines, next_params=next_params)

    def parse_results_item(self, item: Mapping[str, Any]) -> ResultLine:
        custom_id = item.get("batch_request_id") or item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchApiResponseError("result has no batch_request_id", body=dict(item))
        result = item.get("batch_result") or {}
        response = result.get("response") if isinstance(result, Mapping) else None
        raw_error = result.get("error") if isinstance(result, Mapping) else None
        if raw_error is None:
            raw_error = item.get("error_message") or None
        status_code: int | None = None
        body: Any = response
        if isinstance(response, Mapping) and "body" in response:
            status_code = response.get("status_code")
            body = response.get("body")
        elif isinstance(response, Mapping) and len(response) == 1:
            # The gRPC-shaped REST answer wraps the body in its endpoint's name
            # (e.g. {"chat_get_completion": {...}}); unwrap it.
            (inner,) = response.values()
            if isinstance(inner, Mapping):
                body = inner
        error = self.parse_line_error(raw_error, status_code=status_code, body=body)
        ok = error is None and isinstance(body, Mapping) and (status_code is None or 200 <= status_code < 300)
        if not ok and error is None:
            error = LineError(code="unknown_error", message="result has neither a response nor an error")
        return ResultLine(
            custom_id=custom_id,
            ok=ok,
            status_code=status_code if status_code is not None else (200 if ok else None),
            body=dict(body) if ok and isinstance(body, Mapping) else None,
            error=error,
            source="inline",
        )

    def parse_line_error(
        self, raw_error: Any, *, status_code: Any = None, body: Any = None
    ) -> LineError | None:
        """A result's ``error`` is a gRPC status: code 0 (OK) or an empty object is no error;
        code 1 (CANCELLED) is a line the batch's cancel stopped (``batch_cancelled``) and code 4
        (DEADLINE_EXCEEDED) one its expiry stopped (``batch_expired``)."""
        if isinstance(raw_error, Mapping):
            code = raw_error.get("code")
            name = _GRPC_CODES.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
            if name is None and isinstance(code, str):
                name = _GRPC_CODES.get(int(code)) if code.isdigit() else code.strip().lower()
            if name == "ok" or (name in (None, "") and not raw_error.get("message")):
                return None
            if name == "cancelled":
                return LineError(
                    code="batch_cancelled", message=_message(raw_error) or "the request was cancelled"
                )
            if name == "deadline_exceeded":
                # A batch line whose deadline passed was stopped by the batch's expiry.
                return LineError(
                    code="batch_expired", message=_message(raw_error) or "the request's deadline passed"
                )
            if name is not None:
                return LineError(code=name, message=_message(raw_error))
        return super().parse_line_error(raw_error, status_code=status_code, body=body)


# google.rpc.Code, by number, in the spelling of its enum names.
_GRPC_CODES: dict[int, str] = {
    0: "ok",
    1: "cancelled",
    2: "unknown",
    3: "invalid_argument",
    4: "deadline_exceeded",
    5: "not_found",
    6: "already_exists",
    7: "permission_denied",
    8: "resource_exhausted",
    9: "failed_precondition",
    10: "aborted",
    11: "out_of_range",
    12: "unimplemented",
    13: "internal",
    14: "unavailable",
    15: "data_loss",
    16: "unauthenticated",
}


def _count(state: Mapping[str, Any], key: str) -> int:
    """A counter of xAI's ``state`` (null or absent: 0); one that is not a number is a ValueError."""
    value = state.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"state.{key} is {type(value).__name__}, not a count")
    return int(value)


def _message(raw_error: Mapping[str, Any]) -> str | None:
    message = raw_error.get("message")
    return None if message in (None, "") else str(message)
