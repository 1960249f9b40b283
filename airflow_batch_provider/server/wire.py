"""Server-side wire shapes per vendor: auth, create body, batch objects, listings, result lines.

This is an independent implementation of what each vendor sends, written from the
vendors' documentation (see shared/seeds/README.md), so the provider's client-side
dialects are tested against shapes they did not produce themselves.
"""

from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, ClassVar

import orjson

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.dialects.base import Dialect

# OpenAI's metadata limits.
_MAX_METADATA_PAIRS = 16
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512

# Messages of the lines the server writes itself when a batch stops early.
SYSTEM_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
}


class ApiError(Exception):
    """An error answer: HTTP status, vendor-shaped body and optional headers."""

    def __init__(self, status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


def _ts(value: float | None) -> int | None:
    return int(value) if value is not None else None


def _iso(value: float | None) -> str | None:
    if value is None:
        return None
    return datetime.fromtimestamp(value, timezone.utc).isoformat().replace("+00:00", "Z")


class Wire:
    """OpenAI's shapes; the baseline the other vendors' classes adjust.

    :param dialect: the client-side dialect of the same vendor, used only for its declared
        facts (endpoints, windows, validation rules), never for its parsing code.
    """

    name = "openai"
    id_style = "openai"
    upload_requires_purpose = True
    sync_validation = False
    # Whether lines the upstream answered non-2xx keep their response (OpenAI) or become
    # ``response: null`` error lines (ZeroGPU's documented error schema).
    error_lines_keep_response = True
    results_endpoint = False
    # What a cancel of a finished batch answers.
    cancel_final_status = 400
    # The path of the batch collection under /v1 (the other one answers 404).
    batches_route = "batches"
    # Whether input lines are the vendor's own shape, read through ``canonical_line``.
    vendor_lines = False
    # Where the API is mounted; each prefix serves the same files and batches.
    path_prefixes: tuple[str, ...] = ("/v1",)
    # Whether failed requests go to the output file beside the answers (one responses file).
    one_results_file = False
    # Where the resumable upload protocol is served (Google's ``/upload/v1beta``); None: not served.
    upload_prefix: str | None = None
    # Whether a file's content is ``GET files/{id}:download?alt=media`` (Google) beside ``/content``.
    colon_download = False
    # Whether a batch is created at ``POST models/{model}:batchGenerateContent`` (Google).
    model_batches = False
    # Those custom methods, each with the endpoint its batches' lines target.
    model_methods: ClassVar[Mapping[str, str]] = {}
    # Whether every request carries a signature over its method, URL, headers and body (AWS
    # SigV4), checked by ``check_signature`` instead of a key header (``check_auth``).
    signed_requests = False

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        # A bearer token accepted beside the key, for vendors that take an identity provider's
        # token (``ServerConfig.bearer_token``); None: only the key.
        self.bearer_token: str | None = None

    def check_request(self, path: str, query: Mapping[str, str]) -> None:
        """What the vendor requires of a request's path and query (an API version); nothing here."""

    def upload_fields(self, fields: Mapping[str, str]) -> dict[str, Any]:
        """What an upload's form fields beside ``file`` and ``purpose`` add to the file record."""
        return {}

    def token_limit_exceeded(self) -> ApiError:
        """A create refused because the deployment's enqueued token quota is full."""
        return self.error(
            400,
            "This mode's vendor has no enqueued token limit; the token_limit fault needs --dialect azure.",
            code="unsupported_fault",
        )

    def enqueued_limit_refused(self, message: str) -> ApiError:
        """A create refused because the model's enqueued-token limit is full (``max_enqueued_tokens``)."""
        return self.error(400, message, code="token_limit_exceeded")

    # ---- errors and auth ----------------------------------------------------------
    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        return ApiError(
            status,
            {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}},
            headers,
        )

    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        auth = headers.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def check_auth(self, headers: Mapping[str, str], api_key: str | None) -> None:
        """What the vendor requires on every API request (the key, and a vendor's own extras)."""
        self.check_key(headers, api_key)

    def check_signature(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, api_key: str | None
    ) -> None:
        """A signed request's signature, for a mode whose ``signed_requests`` is set."""
        raise NotImplementedError(f"{self.name} authenticates by key, not by signature")

    def check_key(self, headers: Mapping[str, str], api_key: str | None) -> None:
        """The API key alone (also what guards the server's own /admin endpoints)."""
        if api_key is None:
            return
        presented = self.presented_key(headers)
        if presented is None:
            raise self.error(401, "No API key provided.", code="missing_api_key")
        # Constant-time: the comparison must not tell an attacker how much of a guess was right.
        if not hmac.compare_digest(presented.encode(), api_key.encode()):
            # Never echo the key back: only say that it did not match.
            raise self.error(401, "Incorrect API key provided.", code="invalid_api_key")

    def not_found(self, what: str, ident: str) -> ApiError:
        return self.error(404, f"No {what} found with id '{ident}'.", code="not_found")

    def rate_limited(self, retry_after: float) -> ApiError:
        return self.error(
            429,
            "Rate limit reached (injected by the local batch server).",
            type_="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": f"{retry_after:g}", "retry-after-ms": str(int(retry_after * 1000))},
        )

    def quota_exceeded(self) -> ApiError:
        """A 429 that no wait cures: the account is out of quota (OpenAI's ``insufficient_quota``)."""
        return self.error(
            429,
            "You exceeded your current quota (injected by the local batch server).",
            type_="insufficient_quota",
            code="insufficient_quota",
        )

    def upload_too_large(self, limit: int) -> ApiError:
        size = f"{limit // (1 << 20)} MB" if limit % (1 << 20) == 0 else f"{limit:,} bytes"
        return self.error(413, f"Uploaded file is larger than {size}", param="file", code="file_too_large")

    def results_limit(self, value: str | None) -> int:
        """The page size of a results endpoint, from its ``limit`` parameter."""
        limit = _int_param(value, 1000, "limit", self)
        if not 1 <= limit <= 10000:
            raise self.error(400, "limit must be 1..10000.", param="limit")
        return limit

    def results_headers(self, rec: Mapping[str, Any], skip: int, lines: int) -> dict[str, str]:
        """Headers of a results page (where a vendor says whether more pages follow)."""
        return {}

    def server_error(self, status: int, retry_after: float) -> ApiError:
        headers = {"Retry-After": f"{retry_after:g}"} if status == 503 else {}
        return self.error(
            status,
            f"Injected {status} from the local batch server.",
            type_="server_error",
            code=None,
            headers=headers,
        )

    # ---- files ----------------------------------------------------------------------
    def render_file(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": rec["id"],
            "object": "file",
            "bytes": rec["bytes"],
            "created_at": _ts(rec["created_at"]),
            "expires_at": None,
            "filename": rec["filename"],
            "purpose": rec.get("purpose"),
            "status": "processed",
            "status_details": None,
        }

    def render_deleted(self, file_id: str) -> dict[str, Any]:
        """The answer to a file's delete."""
        return {"id": file_id, "object": "file", "deleted": True}

    def render_file_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        data = [self.render_file(r) for r in items]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    # ---- batch creation -------------------------------------------------------------
    def parse_create(self, body: Any) -> dict[str, Any]:
        """Read and check a create body; answer what the engine needs."""
        if not isinstance(body, Mapping):
            raise self.error(400, "Request body must be a JSON object.")
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise self.error(400, "Missing required parameter: 'input_file_id'.", param="input_file_id")
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise self.error(400, "Missing required parameter: 'endpoint'.", param="endpoint")
        if endpoint not in self.dialect.endpoints:
            raise self.error(
                400,
                f"Invalid value for 'endpoint': {endpoint!r}. "
                f"Supported: {', '.join(sorted(self.dialect.endpoints))}.",
                param="endpoint",
                code="invalid_value",
            )
        window = body.get("completion_window")
        if window not in self.dialect.completion_windows:
            raise self.error(
                400,
                f"Invalid value for 'completion_window': {window!r}. "
                f"Supported: {', '.join(self.dialect.completion_windows)}.",
                param="completion_window",
                code="invalid_value",
            )
        metadata = body.get("metadata")
        if metadata is not None:
            self._check_metadata(metadata)
        return {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "metadata": dict(metadata) if metadata else None,
            "name": None,
        }

    def _check_metadata(self, metadata: Any) -> None:
        if not isinstance(metadata, Mapping):
            raise self.error(400, "metadata must be an object of string pairs.", param="metadata")
        if len(metadata) > _MAX_METADATA_PAIRS:
            raise self.error(
                400,
                f"metadata has {len(metadata)} pairs; the limit is {_MAX_METADATA_PAIRS}.",
                param="metadata",
            )
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise self.error(400, f"metadata value of {key!r} must be a string.", param=f"metadata.{key}")
            if len(key) > _MAX_METADATA_KEY:
                raise self.error(
                    400, f"metadata key {key[:20]!r}... is longer than {_MAX_METADATA_KEY}.", param="metadata"
                )
            if len(value) > _MAX_METADATA_VALUE:
                raise self.error(
                    400,
                    f"metadata value of {key!r} is longer than {_MAX_METADATA_VALUE}.",
                    param=f"metadata.{key}",
                )

    def canonical_line(self, obj: Any, rec: Mapping[str, Any]) -> Any:
        """The canonical ``{custom_id, method, url, body}`` of one input line (``vendor_lines`` only).

        :raises ValueError: the line is not in the vendor's shape (the message says why).
        """
        return obj

    def window_seconds(self, window: str | None) -> float:
        text = (window or "24h").strip()
        unit = text[-1]
        return float(text[:-1]) * {"h": 3600, "m": 60, "s": 1, "d": 86400}.get(unit, 3600)

    def validation_error(self, problem: Mapping[str, Any]) -> ApiError:
        """400 answer of a vendor that validates at create time (ZeroGPU)."""
        raise NotImplementedError

    # ---- batch objects --------------------------------------------------------------
    def status_of(self, rec: Mapping[str, Any]) -> str:
        return str(rec["status"])

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        counts = rec["request_counts"]
        errors = rec.get("errors")
        return {
            "id": rec["id"],
            "object": "batch",
            "endpoint": rec["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": rec["input_file_id"],
            "completion_window": rec["completion_window"],
            "status": self.status_of(rec),
            "output_file_id": rec.get("output_file_id"),
            "error_file_id": rec.get("error_file_id"),
            "created_at": _ts(rec["created_at"]),
            "in_progress_at": _ts(rec.get("in_progress_at")),
            "expires_at": _ts(rec.get("expires_at")),
            "finalizing_at": _ts(rec.get("finalizing_at")),
            "completed_at": _ts(rec.get("completed_at")),
            "failed_at": _ts(rec.get("failed_at")),
            "expired_at": _ts(rec.get("expired_at")),
            "cancelling_at": _ts(rec.get("cancelling_at")),
            "cancelled_at": _ts(rec.get("cancelled_at")),
            "request_counts": {
                "total": counts["total"],
                "completed": counts["completed"],
                "failed": counts["failed"],
            },
            "metadata": rec.get("metadata"),
        }

    def list_page_args(self, params: Mapping[str, str]) -> tuple[str | None, int]:
        """(after id, limit) from the listing query."""
        limit = _int_param(params.get("limit"), 20, "limit", self)
        if not 1 <= limit <= 100:
            raise self.error(400, "limit must be between 1 and 100.", param="limit")
        return params.get("after") or None, limit

    def render_batch_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        data = [self.render_batch(r) for r in items]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    def is_cancel_path(self, tail: str) -> bool:
        return tail == "cancel"

    def render_cancelled(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        """The answer to a cancel: the batch, by default."""
        return self.render_batch(rec)

    def list_query(self, params: Mapping[str, str], multi: list[tuple[str, str]]) -> dict[str, Any]:
        """A listing paged by number (``page``, ``page_size``) with filters: what the page wants.

        Only for a wire whose ``batches_route`` lists that way (the OpenAI shape pages by cursor).
        """
        raise NotImplementedError(f"{self.name} lists batches by cursor (list_page_args)")

    def render_job_list(self, items: list[dict[str, Any]], total: int) -> dict[str, Any]:
        """One page of a listing paged by number, with the count of every match."""
        raise NotImplementedError(f"{self.name} lists batches by cursor (render_batch_list)")

    # ---- result lines -----------------------------------------------------------------
    def result_line(
        self, rec: Mapping[str, Any], line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        """``response_line`` for a request of batch ``rec`` (a vendor whose answer's shape depends
        on the batch, Bedrock's InvokeModel jobs, overrides this)."""
        return self.response_line(line_id, custom_id, status, body, request_id)

    def response_line(
        self, line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        """The result line of an answered request and whether it belongs to the output file."""
        ok = 200 <= status < 300
        if ok or self.error_lines_keep_response:
            return ok, {
                "id": line_id,
                "custom_id": custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": None,
            }
        inner = body.get("error") if isinstance(body, Mapping) else None
        inner = inner if isinstance(inner, Mapping) else {}
        return False, self.system_line(
            line_id,
            custom_id,
            self.line_error_code(status, inner.get("code")),
            f"[legacy:http_{status}] {inner.get('message') or 'request failed'}",
            param=inner.get("param"),
        )

    def line_error_code(self, status: int, code: Any) -> str:
        return str(code or f"http_{status}")

    def system_line(
        self, line_id: str, custom_id: str, code: str, message: str | None = None, param: Any = None
    ) -> dict[str, Any]:
        """An error line the server writes itself (expired, cancelled...)."""
        return {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message or SYSTEM_MESSAGES.get(code, code), "param": param},
        }


def _int_param(value: str | None, default: int, name: str, wire: Wire) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise wire.error(400, f"{name} must be an integer, got {value!r}.", param=name) from None


class DoublewordWire(Wire):
    """Doubleword: OpenAI shapes with UUID ids, a ``1h`` window and a paged results endpoint."""

    name = "doubleword"
    id_style = "uuid"
    results_endpoint = True

    # Its results endpoint clamps ``limit`` to 1..101 (10 when absent) instead of refusing it, and
    # says whether more results exist in ``X-Incomplete`` (true while the batch still runs).
    RESULTS_DEFAULT_LIMIT = 10
    RESULTS_MAX_LIMIT = 101

    def results_limit(self, value: str | None) -> int:
        limit = _int_param(value, self.RESULTS_DEFAULT_LIMIT, "limit", self)
        return max(1, min(limit, self.RESULTS_MAX_LIMIT))

    def results_headers(self, rec: Mapping[str, Any], skip: int, lines: int) -> dict[str, str]:
        counts = rec["request_counts"]
        running = rec["status"] in ("validating", "in_progress", "finalizing", "cancelling")
        last = skip + lines
        more = running or last < counts["completed"] + counts["failed"]
        return {"X-Incomplete": "true" if more else "false", "X-Last-Line": str(last)}

    def status_of(self, rec: Mapping[str, Any]) -> str:
        # Doubleword derives status from its request counts and never says "expired":
        # a batch whose window ran out is complete, its unfinished lines failed.
        status = str(rec["status"])
        return "completed" if status == "expired" else status

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        out = super().render_batch(rec)
        out["expired_at"] = None
        return out


class ZeroGPUWire(Wire):
    """ZeroGPU: ``x-api-key`` auth, validation answered synchronously at create, null-response error lines."""

    name = "zerogpu"
    sync_validation = True
    error_lines_keep_response = False
    cancel_final_status = 409

    _CODES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        402: "insufficient_quota",
        429: "rate_limit_exceeded",
    }

    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        zcode = self._CODES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
        body = {"error": {"type": zcode, "code": code or zcode, "message": message, "param": param, **extra}}
        return ApiError(status, body, headers)

    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        return (headers.get("x-api-key") or "").strip() or None

    def check_auth(self, headers: Mapping[str, str], api_key: str | None) -> None:
        super().check_auth(headers, api_key)
        if api_key is not None and not (headers.get("x-project-id") or "").strip():
            # ZeroGPU needs the project on every request, beside the key.
            raise self.error(401, "Missing x-project-id header.", code="missing_project")

    _SIZE_RULES = frozenset({"line_too_large", "file_too_large", "too_many_lines"})

    def validation_error(self, problem: Mapping[str, Any]) -> ApiError:
        # ZeroGPU answers with its OpenAI-semantic code; the precise rule travels in the
        # message's "[legacy:...]" prefix, the way its error lines keep internal codes.
        rule = str(problem["code"])
        where = f"line {problem['line']}: " if problem.get("line") else ""
        return self.error(
            400,
            f"[legacy:{rule}] {where}{problem['message']}",
            code="request_too_large" if rule in self._SIZE_RULES else "invalid_request_error",
            param=problem.get("param"),
            line=problem.get("line"),
        )

    def line_error_code(self, status: int, code: Any) -> str:
        if status >= 500:
            return "internal_error"
        return self._CODES.get(status, "invalid_request_error")


class XAIWire(Wire):
    """xAI: ``batch_id`` + ``state`` counters, ``{name, input_file_id}`` create, ``:cancel``, results."""

    name = "xai"
    id_style = "uuid"
    upload_requires_purpose = False
    results_endpoint = True

    def render_file(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        out = super().render_file(rec)
        out["file_id"] = rec["id"]
        return out

    def parse_create(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise self.error(400, "Request body must be a JSON object.")
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise self.error(
                400, "input_file_id is required to create a batch from a file.", param="input_file_id"
            )
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise self.error(400, "name must be a string.", param="name")
        return {
            "input_file_id": input_file_id,
            "endpoint": None,
            "completion_window": "24h",
            "metadata": None,
            "name": name or "batch",
        }

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        counts = rec["request_counts"]
        progress = rec.get("progress") or {}
        cancelled = int(progress.get("cancelled", 0))
        # Lines the expiry stopped end as errors (gRPC DEADLINE_EXCEEDED in the results), so the
        # counters, the only state xAI reports, reach zero pending.
        errored = counts["failed"] - cancelled
        total = counts["total"]
        status = rec["status"]
        pending = total - counts["completed"] - errored - cancelled
        if status in ("validating", "failed"):
            total = pending = 0
        return {
            "batch_id": rec["id"],
            "name": rec.get("name"),
            "input_file_id": rec.get("input_file_id"),
            "create_time": _iso(rec["created_at"]),
            "expire_time": _iso(rec.get("expires_at")),
            "cancel_time": _iso(rec.get("cancelled_at") or rec.get("cancelling_at") or rec.get("failed_at")),
            "cancel_by_xai_message": rec.get("cancel_message"),
            "state": {
                "num_requests": total,
                "num_pending": pending,
                "num_success": counts["completed"],
                "num_error": errored,
                "num_cancelled": cancelled,
            },
        }

    def list_page_args(self, params: Mapping[str, str]) -> tuple[str | None, int]:
        limit = _int_param(params.get("limit"), 100, "limit", self)
        if not 1 <= limit <= 1000:
            raise self.error(400, "limit must be between 1 and 1000.", param="limit")
        return params.get("pagination_token") or None, limit

    def render_batch_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        return {
            "batches": [self.render_batch(r) for r in items],
            "pagination_token": items[-1]["id"] if has_more and items else None,
        }

    def is_cancel_path(self, tail: str) -> bool:
        return False


class MistralWire(Wire):
    """Mistral: ``/v1/batch/jobs`` with the model on the job, ``{custom_id, body}`` lines, UUID ids,
    upper-case statuses, a ``page``/``page_size`` listing with ``total`` and metadata/status filters."""

    name = "mistral"
    id_style = "uuid"
    batches_route = "batch/jobs"
    vendor_lines = True

    STATUSES = {
        "validating": "QUEUED",
        "in_progress": "RUNNING",
        "finalizing": "RUNNING",
        "completed": "SUCCESS",
        "failed": "FAILED",
        "expired": "TIMEOUT_EXCEEDED",
        "cancelling": "CANCELLATION_REQUESTED",
        "cancelled": "CANCELLED",
    }
    MAX_TIMEOUT_HOURS = 168
    # Query parameters of GET /v1/batch/jobs; any other one is a metadata pair (the SDK sends the
    # ``metadata`` filter exploded, one parameter per pair).
    LIST_PARAMS = frozenset(
        {
            "page",
            "page_size",
            "model",
            "agent_id",
            "metadata",
            "created_after",
            "created_by_me",
            "status",
            "order_by",
        }
    )

    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        if status == 401:
            # Mistral's gateway refuses a missing or wrong key with a bare message.
            return ApiError(status, {"message": "Unauthorized", "request_id": uuid.uuid4().hex}, headers)
        body = {"object": "error", "message": message, "type": type_, "param": param, "code": code, **extra}
        return ApiError(status, body, headers)

    def render_file(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        output = rec.get("purpose") == "batch_output"
        kind = "batch_request"
        if output:
            kind = "batch_error" if str(rec["filename"]).endswith("_error.jsonl") else "batch_result"
        return {
            "id": rec["id"],
            "object": "file",
            "bytes": rec["bytes"],
            "created_at": _ts(rec["created_at"]),
            "filename": rec["filename"],
            "purpose": "batch" if output else rec.get("purpose"),
            "sample_type": kind,
            "source": "mistral" if output else "upload",
            "num_lines": None,
            "mimetype": "application/jsonl",
        }

    def render_file_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        return {"object": "list", "data": [self.render_file(r) for r in items], "total": len(items)}

    def parse_create(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise self.error(422, "Request body must be a JSON object.")
        files = body.get("input_files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
            raise self.error(422, "input_files must be a non-empty list of file ids.", param="input_files")
        if len(files) > 1:
            raise self.error(422, "The local batch server takes one input file per job.", param="input_files")
        endpoint = body.get("endpoint")
        if endpoint not in self.dialect.endpoints:
            raise self.error(
                422,
                f"Invalid endpoint {endpoint!r}; supported: {', '.join(sorted(self.dialect.endpoints))}.",
                param="endpoint",
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise self.error(422, "model is required (the job runs one model).", param="model")
        hours = body.get("timeout_hours", 24)
        if not isinstance(hours, int) or isinstance(hours, bool) or not 1 <= hours <= self.MAX_TIMEOUT_HOURS:
            raise self.error(
                422, f"timeout_hours must be an integer 1..{self.MAX_TIMEOUT_HOURS}.", param="timeout_hours"
            )
        metadata = body.get("metadata")
        if metadata is not None:
            self._check_metadata(metadata)
        return {
            "input_file_id": files[0],
            "endpoint": endpoint,
            "completion_window": f"{hours}h",
            "metadata": dict(metadata) if metadata else None,
            "name": None,
            "model": model,
        }

    def canonical_line(self, obj: Any, rec: Mapping[str, Any]) -> Any:
        if not isinstance(obj, dict):
            return obj
        extra = sorted(set(obj) - {"custom_id", "body"})
        if extra:
            raise ValueError(
                f"unexpected field(s) {', '.join(extra)}: a Mistral batch line is {{custom_id, body}}"
            )
        body = obj.get("body")
        if isinstance(body, dict):
            # The job names the model; the line's own model (if any) is not used.
            body = {**body, "model": rec.get("model")}
        return {"custom_id": obj.get("custom_id"), "method": "POST", "url": rec["endpoint"], "body": body}

    def status_of(self, rec: Mapping[str, Any]) -> str:
        return self.STATUSES[str(rec["status"])]

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        counts = rec["request_counts"]
        errors = rec.get("errors") or []
        terminal = rec["status"] in ("completed", "failed", "expired", "cancelled")
        ended = (
            rec.get("completed_at")
            or rec.get("failed_at")
            or rec.get("expired_at")
            or rec.get("cancelled_at")
        )
        return {
            "id": rec["id"],
            "object": "batch",
            "input_files": [rec["input_file_id"]],
            "metadata": rec.get("metadata"),
            "endpoint": rec["endpoint"],
            "model": rec.get("model"),
            "agent_id": None,
            "output_file": rec.get("output_file_id"),
            "error_file": rec.get("error_file_id"),
            "errors": [{"message": str(e.get("message") or e.get("code")), "count": 1} for e in errors],
            "status": self.status_of(rec),
            "created_at": _ts(rec["created_at"]),
            "total_requests": counts["total"],
            "completed_requests": counts["completed"] + counts["failed"],
            "succeeded_requests": counts["completed"],
            "failed_requests": counts["failed"],
            "started_at": _ts(rec.get("in_progress_at")),
            "completed_at": _ts(ended) if terminal else None,
        }

    def list_query(self, params: Mapping[str, str], multi: list[tuple[str, str]]) -> dict[str, Any]:
        """The listing's page, size, order and filters (metadata pairs, statuses, model)."""
        page = _int_param(params.get("page"), 0, "page", self)
        size = _int_param(params.get("page_size"), 100, "page_size", self)
        if page < 0 or not 1 <= size <= 1000:
            raise self.error(422, "page must be >= 0 and page_size 1..1000.", param="page_size")
        metadata: dict[str, str] = {}
        raw_metadata = params.get("metadata")
        if raw_metadata:
            try:
                parsed = orjson.loads(raw_metadata)
            except orjson.JSONDecodeError:
                raise self.error(422, "metadata must be a JSON object.", param="metadata") from None
            if not isinstance(parsed, dict):
                raise self.error(422, "metadata must be a JSON object.", param="metadata")
            metadata.update({str(k): str(v) for k, v in parsed.items()})
        metadata.update({k: v for k, v in multi if k not in self.LIST_PARAMS})
        statuses = {v for k, v in multi if k == "status"}
        unknown = statuses - set(self.STATUSES.values())
        if unknown:
            raise self.error(422, f"Unknown status filter {sorted(unknown)}.", param="status")
        order = params.get("order_by") or "-created"
        if order not in ("created", "-created"):
            raise self.error(422, "order_by must be 'created' or '-created'.", param="order_by")
        return {
            "page": page,
            "page_size": size,
            "metadata": metadata,
            "statuses": statuses,
            "model": params.get("model") or None,
            "oldest_first": order == "created",
        }

    def render_job_list(self, items: list[dict[str, Any]], total: int) -> dict[str, Any]:
        return {"object": "list", "data": [self.render_batch(r) for r in items], "total": total}

    def is_cancel_path(self, tail: str) -> bool:
        return tail == "cancel"


class AzureWire(Wire):
    """Azure OpenAI: OpenAI's shapes under ``/openai/v1`` (no version) and ``/openai`` (with
    ``api-version`` on every call), the key in ``api-key`` or an Entra ID bearer token, Azure's
    401 body, file expiry (``expires_after``, 14 to 30 days) and ``token_limit_exceeded``."""

    name = "azure"
    path_prefixes = ("/openai/v1", "/openai")
    # Lines name their endpoint as the classic samples do (``/chat/completions``) or as the v1
    # reference does (``/v1/chat/completions``); both are read as the canonical form.
    vendor_lines = True
    MIN_EXPIRY = 14 * 24 * 3600
    MAX_EXPIRY = 30 * 24 * 3600

    def canonical_endpoint(self, endpoint: Any) -> Any:
        """``/chat/completions`` read as ``/v1/chat/completions`` (a supported endpoint only)."""
        if isinstance(endpoint, str) and not endpoint.startswith("/v1/"):
            versioned = "/v1" + endpoint
            if versioned in self.dialect.endpoints:
                return versioned
        return endpoint

    def canonical_line(self, obj: Any, rec: Mapping[str, Any]) -> Any:
        if isinstance(obj, dict) and "url" in obj:
            obj["url"] = self.canonical_endpoint(obj["url"])
        return obj

    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        return (headers.get("api-key") or "").strip() or None

    def check_auth(self, headers: Mapping[str, str], api_key: str | None) -> None:
        if api_key is None and self.bearer_token is None:
            return
        key = self.presented_key(headers)
        bearer = super().presented_key(headers)
        # The key in api-key (the AzureOpenAI client), or as a bearer (the OpenAI client on the
        # v1 path); else a bearer equal to the stand-in Entra ID token.
        accepted = (
            (key is not None and api_key is not None and hmac.compare_digest(key.encode(), api_key.encode()))
            or (
                bearer is not None
                and api_key is not None
                and hmac.compare_digest(bearer.encode(), api_key.encode())
            )
            or (
                bearer is not None
                and self.bearer_token is not None
                and hmac.compare_digest(bearer.encode(), self.bearer_token.encode())
            )
        )
        if not accepted:
            # Azure answers a missing, wrong or expired credential alike, never echoing it.
            raise self.error(401, "")

    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        if status == 401:
            body = {
                "error": {
                    "code": "401",
                    "message": "Access denied due to invalid subscription key or wrong API endpoint. "
                    "Make sure to provide a valid key for an active subscription and use a correct "
                    "regional API endpoint for your resource.",
                }
            }
            return ApiError(status, body, headers)
        return super().error(status, message, type_=type_, code=code, param=param, headers=headers, **extra)

    def check_request(self, path: str, query: Mapping[str, str]) -> None:
        # The classic API names its version on every call; the v1 API takes none.
        if not path.startswith("/openai/v1/") and not (query.get("api-version") or "").strip():
            raise self.error(
                400, "Missing required query parameter 'api-version'.", code="BadRequest", type_="BadRequest"
            )

    def upload_fields(self, fields: Mapping[str, str]) -> dict[str, Any]:
        anchor = fields.get("expires_after[anchor]")
        seconds = fields.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return {}
        return {"expires_after_seconds": self._expiry("expires_after", anchor, seconds)}

    def _expiry(self, name: str, anchor: Any, seconds: Any) -> int:
        """The seconds of an ``expires_after``-shaped value, checked as Azure does (14 to 30 days)."""
        if anchor != "created_at":
            raise self.error(400, f"{name}.anchor must be 'created_at'.", param=f"{name}.anchor")
        if isinstance(seconds, str) and seconds.strip().isdigit():
            seconds = int(seconds)
        if not isinstance(seconds, int) or isinstance(seconds, bool):
            raise self.error(400, f"{name}.seconds must be an integer.", param=f"{name}.seconds")
        if not self.MIN_EXPIRY <= seconds <= self.MAX_EXPIRY:
            raise self.error(
                400,
                f"{name}.seconds must be between {self.MIN_EXPIRY} and {self.MAX_EXPIRY}.",
                param=f"{name}.seconds",
            )
        return seconds

    def parse_create(self, body: Any) -> dict[str, Any]:
        if isinstance(body, Mapping) and "endpoint" in body:
            body = {**body, "endpoint": self.canonical_endpoint(body["endpoint"])}
        created = super().parse_create(body)
        output = body.get("output_expires_after")
        if output is not None:
            if not isinstance(output, Mapping):
                raise self.error(400, "output_expires_after must be an object.", param="output_expires_after")
            self._expiry("output_expires_after", output.get("anchor"), output.get("seconds"))
        return created

    def render_file(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        out = super().render_file(rec)
        seconds = rec.get("expires_after_seconds")
        if isinstance(seconds, int):
            out["expires_at"] = _ts(rec["created_at"] + seconds)
        return out

    def token_limit_exceeded(self) -> ApiError:
        return self.error(
            400,
            "The number of enqueued tokens has surpassed the configured limit for this deployment. "
            "Please either increase the limit or try again once the current jobs have finished.",
            code="token_limit_exceeded",
        )


class AnthropicWire(Wire):
    """Anthropic Message Batches: ``/v1/messages/batches`` with the requests inline in the create,
    ``x-api-key`` + ``anthropic-version``, ``processing_status`` and five request counts, a
    ``limit``/``after_id``/``before_id`` listing and one results stream per ended batch."""

    name = "anthropic"
    batches_route = "messages/batches"
    vendor_lines = True
    upload_requires_purpose = False
    cancel_final_status = 400
    MAX_LIST = 1000
    _TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        402: "billing_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        504: "timeout_error",
        529: "overloaded_error",
    }
    _VERSION = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    _CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
    _STOP = {
        "stop": "end_turn",
        "length": "max_tokens",
        "tool_calls": "tool_use",
        "content_filter": "refusal",
    }

    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        kind = self._TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        request_id = f"req_{uuid.uuid4().hex[:24]}"
        body = {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id}
        return ApiError(status, body, {**(headers or {}), "request-id": request_id})

    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        # The API documents ``x-api-key``; the official SDK (2.x) sends the key as a bearer token.
        return (headers.get("x-api-key") or "").strip() or super().presented_key(headers)

    def check_key(self, headers: Mapping[str, str], api_key: str | None) -> None:
        if api_key is None:
            return
        presented = self.presented_key(headers)
        if presented is None:
            raise self.error(401, "x-api-key header is required")
        if not hmac.compare_digest(presented.encode(), api_key.encode()):
            raise self.error(401, "invalid x-api-key")

    def check_auth(self, headers: Mapping[str, str], api_key: str | None) -> None:
        self.check_key(headers, api_key)
        version = (headers.get("anthropic-version") or "").strip()
        if not version:
            raise self.error(400, "anthropic-version: header is required")
        if not self._VERSION.fullmatch(version):
            raise self.error(400, f"anthropic-version: {version!r} is not a valid version")

    def quota_exceeded(self) -> ApiError:
        return self.error(402, "Your credit balance is too low (injected by the local batch server).")

    def rate_limited(self, retry_after: float) -> ApiError:
        return self.error(
            429,
            "Rate limit reached (injected by the local batch server).",
            headers={"retry-after": f"{retry_after:g}"},
        )

    def server_error(self, status: int, retry_after: float) -> ApiError:
        headers = {"retry-after": f"{retry_after:g}"} if status == 503 else {}
        return self.error(status, f"Injected {status} from the local batch server.", headers=headers)

    # ---- create -----------------------------------------------------------------------
    def parse_requests(self, body: Any, max_requests: int) -> list[dict[str, Any]]:
        """The ``requests`` of a create body, checked as the API checks them (400 naming the item)."""
        if not isinstance(body, Mapping):
            raise self.error(400, "Request body must be a JSON object.")
        unknown = sorted(set(body) - {"requests"})
        if unknown:
            raise self.error(400, f"{unknown[0]}: Extra inputs are not permitted")
        requests = body.get("requests")
        if not isinstance(requests, list) or not requests:
            raise self.error(400, "requests: Field required (a non-empty list)")
        if len(requests) > max_requests:
            raise self.error(
                413, f"requests: at most {max_requests:,} requests per batch, got {len(requests):,}"
            )
        seen: set[str] = set()
        for index, item in enumerate(requests):
            where = f"requests.{index}"
            if not isinstance(item, Mapping):
                raise self.error(400, f"{where}: Input should be an object")
            extra = sorted(set(item) - {"custom_id", "params"})
            if extra:
                raise self.error(400, f"{where}.{extra[0]}: Extra inputs are not permitted")
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not self._CUSTOM_ID.fullmatch(custom_id):
                raise self.error(
                    400, f"{where}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
                )
            if custom_id in seen:
                raise self.error(400, f"{where}.custom_id: duplicate custom_id {custom_id!r}")
            seen.add(custom_id)
            params = item.get("params")
            if not isinstance(params, Mapping):
                raise self.error(400, f"{where}.params: Field required")
            if not isinstance(params.get("model"), str) or not params.get("model"):
                raise self.error(400, f"{where}.params.model: Field required")
            tokens = params.get("max_tokens")
            if type(tokens) is not int or tokens < 1:
                raise self.error(400, f"{where}.params.max_tokens: Field required (an integer >= 1)")
            messages = params.get("messages")
            if not isinstance(messages, list) or not messages:
                raise self.error(400, f"{where}.params.messages: Field required (a non-empty list)")
            if params.get("stream") is True:
                raise self.error(400, f"{where}.params.stream: streaming is not supported in batches")
        return requests

    def canonical_line(self, obj: Any, rec: Mapping[str, Any]) -> Any:
        """``{custom_id, params}`` as the chat-completions line the backend answers."""
        if not isinstance(obj, dict) or not isinstance(obj.get("params"), dict):
            raise ValueError("an Anthropic batch request is {custom_id, params}")
        params = obj["params"]
        messages: list[dict[str, Any]] = []
        system = params.get("system")
        if system:
            messages.append({"role": "system", "content": _blocks_text(system)})
        for message in params.get("messages") or []:
            if isinstance(message, dict):
                messages.append(
                    {"role": message.get("role"), "content": _blocks_text(message.get("content"))}
                )
        body: dict[str, Any] = {"model": params.get("model"), "messages": messages}
        for key in ("max_tokens", "temperature", "top_p"):
            if params.get(key) is not None:
                body[key] = params[key]
        if params.get("stop_sequences"):
            body["stop"] = list(params["stop_sequences"])
        return {"custom_id": obj.get("custom_id"), "method": "POST", "url": rec["endpoint"], "body": body}

    # ---- batch objects ----------------------------------------------------------------
    def status_of(self, rec: Mapping[str, Any]) -> str:
        status = str(rec["status"])
        if status in ("completed", "failed", "expired", "cancelled"):
            return "ended"
        return "canceling" if status == "cancelling" else "in_progress"

    def request_counts(self, rec: Mapping[str, Any]) -> dict[str, int]:
        """The five counts: every request "processing" until the batch ends."""
        counts = rec["request_counts"]
        total = int(counts["total"])
        if self.status_of(rec) != "ended":
            return {"processing": total, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        progress = rec.get("progress") or {}
        canceled = int(progress.get("cancelled") or 0)
        expired = int(progress.get("expired") or 0)
        succeeded = int(counts["completed"])
        return {
            "processing": 0,
            "succeeded": succeeded,
            "errored": max(total - succeeded - canceled - expired, 0),
            "canceled": canceled,
            "expired": expired,
        }

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        ended = self.status_of(rec) == "ended"
        ended_at = (
            rec.get("completed_at")
            or rec.get("failed_at")
            or rec.get("expired_at")
            or rec.get("cancelled_at")
        )
        return {
            "id": rec["id"],
            "type": "message_batch",
            "processing_status": self.status_of(rec),
            "request_counts": self.request_counts(rec),
            "ended_at": _iso(ended_at) if ended else None,
            "created_at": _iso(rec["created_at"]),
            "expires_at": _iso(rec.get("expires_at")),
            "archived_at": None,
            "cancel_initiated_at": _iso(rec.get("cancelling_at")),
            # A path: the route makes it absolute on the host the client called.
            "results_url": f"/v1/messages/batches/{rec['id']}/results" if ended else None,
        }

    def list_window(self, params: Mapping[str, str]) -> tuple[int, str | None, str | None]:
        """(limit, after_id, before_id) of a listing."""
        limit = _int_param(params.get("limit"), 20, "limit", self)
        if not 1 <= limit <= self.MAX_LIST:
            raise self.error(400, f"limit: Input should be between 1 and {self.MAX_LIST}")
        after, before = params.get("after_id") or None, params.get("before_id") or None
        if after and before:
            raise self.error(400, "Only one of after_id and before_id may be given")
        return limit, after, before

    def render_batch_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        data = [self.render_batch(r) for r in items]
        return {
            "data": data,
            "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    # ---- result lines -------------------------------------------------------------------
    def response_line(
        self, line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        if 200 <= status < 300 and isinstance(body, Mapping):
            return True, {
                "custom_id": custom_id,
                "result": {"type": "succeeded", "message": self._message(body)},
            }
        inner = body.get("error") if isinstance(body, Mapping) else None
        message = inner.get("message") if isinstance(inner, Mapping) else None
        return False, self._errored(custom_id, status, str(message or f"request failed with HTTP {status}"))

    def system_line(
        self, line_id: str, custom_id: str, code: str, message: str | None = None, param: Any = None
    ) -> dict[str, Any]:
        if code == "batch_expired":
            return {"custom_id": custom_id, "result": {"type": "expired"}}
        if code == "batch_cancelled":
            return {"custom_id": custom_id, "result": {"type": "canceled"}}
        return self._errored(custom_id, 500, message or SYSTEM_MESSAGES.get(code, code))

    def _errored(self, custom_id: str, status: int, message: str) -> dict[str, Any]:
        kind = self._TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {
            "custom_id": custom_id,
            "result": {
                "type": "errored",
                "error": {"type": "error", "error": {"type": kind, "message": message}, "request_id": None},
            },
        }

    def _message(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A chat-completion answer as a Messages answer."""
        choice = (body.get("choices") or [{}])[0]
        reply = choice.get("message") or {}
        usage = body.get("usage") or {}
        finish = choice.get("finish_reason")
        return {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": str(reply.get("content") or "")}],
            "stop_reason": self._STOP.get(finish, "end_turn"),
            "stop_sequence": None,
            "usage": {
                "input_tokens": int(usage.get("prompt_tokens") or 0),
                "output_tokens": int(usage.get("completion_tokens") or 0),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }


def _blocks_text(content: Any) -> str:
    """The text of a Messages content (a string, or blocks of which the text ones count)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


class GeminiWire(Wire):
    """Google's Gemini API Batch Mode: ``/v1beta`` with ``x-goog-api-key``, files through the
    resumable upload protocol (``/upload/v1beta/files``), ``models/{model}:batchGenerateContent``
    creating a batch that is a long-running operation (``BATCH_STATE_*``, string int64
    ``batchStats``), a ``pageSize``/``pageToken`` listing of ``operations``, ``:cancel`` answering
    ``{}``, and one responses file of ``{key, response | error}`` lines, downloaded with
    ``files/{id}:download?alt=media``. Errors are ``{"error": {"code", "message", "status"}}``."""

    name = "gemini"
    vendor_lines = True
    upload_requires_purpose = False
    # Failed requests are lines of the one responses file, beside the answers.
    one_results_file = True
    upload_prefix: str | None = "/upload/v1beta"
    colon_download = True
    model_batches = True
    model_methods: ClassVar[Mapping[str, str]] = {
        "batchGenerateContent": "/v1/chat/completions",
        "asyncBatchEmbedContent": "/v1/embeddings",
    }
    cancel_final_status = 400
    path_prefixes = ("/v1beta",)
    # A batch still pending or running after 48 hours expires.
    WINDOW = "48h"
    MAX_PAGE = 1000
    STATES = {
        "validating": "BATCH_STATE_PENDING",
        "in_progress": "BATCH_STATE_RUNNING",
        "finalizing": "BATCH_STATE_RUNNING",
        # No cancelling state: the batch runs until the cancel takes effect.
        "cancelling": "BATCH_STATE_RUNNING",
        "completed": "BATCH_STATE_SUCCEEDED",
        "failed": "BATCH_STATE_FAILED",
        "expired": "BATCH_STATE_EXPIRED",
        "cancelled": "BATCH_STATE_CANCELLED",
    }
    _STATUS = {
        400: "INVALID_ARGUMENT",
        401: "UNAUTHENTICATED",
        403: "PERMISSION_DENIED",
        404: "NOT_FOUND",
        405: "UNIMPLEMENTED",
        409: "ABORTED",
        413: "INVALID_ARGUMENT",
        415: "INVALID_ARGUMENT",
        429: "RESOURCE_EXHAUSTED",
        499: "CANCELLED",
        500: "INTERNAL",
        501: "UNIMPLEMENTED",
        503: "UNAVAILABLE",
        504: "DEADLINE_EXCEEDED",
    }
    _TYPES = "type.googleapis.com/google.ai.generativelanguage.v1main."
    # The batch's metadata type (and its output's) by the endpoint its lines target.
    _KIND = {"/v1/embeddings": "EmbedContentBatch"}
    _FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}

    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        name = "FAILED_PRECONDITION" if code == "invalid_state" else self._STATUS.get(status)
        if name is None:
            name = "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"
        return ApiError(status, {"error": {"code": status, "message": message, "status": name}}, headers)

    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        return (headers.get("x-goog-api-key") or "").strip() or None

    def check_key(self, headers: Mapping[str, str], api_key: str | None) -> None:
        if api_key is None:
            return
        presented = self.presented_key(headers)
        if presented is None:
            raise self.error(
                403,
                "Method doesn't allow unregistered callers (callers without established identity). "
                "Please use API Key or other form of API consumer identity to call this API.",
            )
        if not hmac.compare_digest(presented.encode(), api_key.encode()):
            # Google answers a wrong key as an invalid argument; the key is never echoed.
            error = self.error(400, "API key not valid. Please pass a valid API key.")
            error.body["error"]["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID",
                    "domain": "googleapis.com",
                }
            ]
            raise error

    def rate_limited(self, retry_after: float) -> ApiError:
        error = self.error(
            429,
            "Resource has been exhausted (injected by the local batch server).",
            headers={"Retry-After": f"{retry_after:g}"},
        )
        error.body["error"]["details"] = [
            self._quota_failure("GenerateRequestsPerMinutePerProjectPerModel"),
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{retry_after:g}s"},
        ]
        return error

    def quota_exceeded(self) -> ApiError:
        error = self.error(429, "You exceeded your current quota (injected by the local batch server).")
        error.body["error"]["details"] = [self._quota_failure("GenerateRequestsPerDayPerProjectPerModel")]
        return error

    @staticmethod
    def _quota_failure(quota_id: str) -> dict[str, Any]:
        return {
            "@type": "type.googleapis.com/google.rpc.QuotaFailure",
            "violations": [
                {"quotaMetric": "generativelanguage.googleapis.com/generate_requests", "quotaId": quota_id}
            ],
        }

    def server_error(self, status: int, retry_after: float) -> ApiError:
        headers = {"Retry-After": f"{retry_after:g}"} if status == 503 else {}
        return self.error(status, f"Injected {status} from the local batch server.", headers=headers)

    def not_found(self, what: str, ident: str) -> ApiError:
        return self.error(404, f"Requested entity was not found ({what} {ident}).")

    # ---- files ------------------------------------------------------------------------
    def render_file(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        created = _iso(rec["created_at"])
        generated = rec.get("purpose") == "batch_output"
        return {
            "name": f"files/{rec['id']}",
            "displayName": rec["filename"],
            "mimeType": rec.get("mime_type") or "application/jsonl",
            "sizeBytes": str(rec["bytes"]),
            "createTime": created,
            "updateTime": created,
            "expirationTime": _iso(float(rec["created_at"]) + 48 * 3600),
            "state": "ACTIVE",
            "source": "GENERATED" if generated else "UPLOADED",
        }

    def render_deleted(self, file_id: str) -> dict[str, Any]:
        return {}

    def render_file_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        files = [self.render_file(r) for r in items]
        page: dict[str, Any] = {"files": files}
        if has_more and items:
            page["nextPageToken"] = items[-1]["id"]
        return page

    # ---- create -----------------------------------------------------------------------
    def parse_create(self, body: Any) -> dict[str, Any]:
        """``{"batch": {displayName, inputConfig: {fileName}}}`` (snake_case accepted, as the API does)."""
        if not isinstance(body, Mapping):
            raise self.error(400, "Invalid JSON payload: the body must be an object.")
        batch = body.get("batch")
        if not isinstance(batch, Mapping):
            raise self.error(400, "batch is required.")
        display = _either(batch, "displayName", "display_name")
        if not isinstance(display, str) or not display:
            raise self.error(400, "batch.display_name is required.")
        source = _either(batch, "inputConfig", "input_config")
        if not isinstance(source, Mapping):
            raise self.error(400, "batch.input_config is required.")
        if _either(source, "requests") is not None:
            raise self.error(400, "The local batch server takes batch input from a file only (file_name).")
        file_name = _either(source, "fileName", "file_name")
        if not isinstance(file_name, str) or not file_name.startswith("files/"):
            raise self.error(400, "batch.input_config.file_name must name a file: files/{id}.")
        return {
            "input_file_id": file_name.removeprefix("files/"),
            "endpoint": "/v1/chat/completions",
            "completion_window": self.WINDOW,
            "metadata": None,
            "name": display,
        }

    def canonical_line(self, obj: Any, rec: Mapping[str, Any]) -> Any:
        """``{key, request: GenerateContentRequest | EmbedContentRequest}`` as the canonical line
        the backend answers."""
        if not isinstance(obj, dict):
            return obj
        extra = sorted(set(obj) - {"key", "request", "metadata"})
        if extra:
            raise ValueError(f"unexpected field(s) {', '.join(extra)}: a batch line is {{key, request}}")
        request = obj.get("request")
        if rec["endpoint"] == "/v1/embeddings":
            return self._embedding_line(obj.get("key"), request, rec)
        if not isinstance(request, dict):
            raise ValueError("a batch line needs a request object (GenerateContentRequest)")
        messages: list[dict[str, Any]] = []
        system = request.get("systemInstruction") or request.get("system_instruction")
        if isinstance(system, dict):
            messages.append({"role": "system", "content": _parts_text(system.get("parts"))})
        contents = request.get("contents")
        if not isinstance(contents, list) or not contents:
            raise ValueError("request.contents must be a non-empty list")
        for content in contents:
            if not isinstance(content, dict):
                raise ValueError("request.contents holds an item that is not an object")
            role = content.get("role") or "user"
            if role not in ("user", "model"):
                raise ValueError(f"request.contents role {role!r} is not user or model")
            messages.append(
                {
                    "role": "assistant" if role == "model" else "user",
                    "content": _parts_text(content.get("parts")),
                }
            )
        body: dict[str, Any] = {
            "model": str(rec.get("model") or "").removeprefix("models/"),
            "messages": messages,
        }
        config = request.get("generationConfig") or request.get("generation_config") or {}
        if not isinstance(config, dict):
            raise ValueError("request.generationConfig must be an object")
        for source, target in (
            ("temperature", "temperature"),
            ("topP", "top_p"),
            ("maxOutputTokens", "max_tokens"),
            ("seed", "seed"),
        ):
            if config.get(source) is not None:
                body[target] = config[source]
        if config.get("stopSequences"):
            body["stop"] = list(config["stopSequences"])
        schema = config.get("responseSchema")
        if isinstance(schema, dict):
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": _json_schema(schema)},
            }
        elif config.get("responseMimeType") == "application/json":
            body["response_format"] = {"type": "json_object"}
        return {"custom_id": obj.get("key"), "method": "POST", "url": rec["endpoint"], "body": body}

    def _embedding_line(self, key: Any, request: Any, rec: Mapping[str, Any]) -> dict[str, Any]:
        """``{key, request: EmbedContentRequest}`` as an embeddings line: one content's text."""
        if not isinstance(request, dict):
            raise ValueError("a batch line needs a request object (EmbedContentRequest)")
        content = request.get("content")
        if not isinstance(content, dict):
            raise ValueError("request.content must be an object (EmbedContentRequest)")
        text = _parts_text(content.get("parts"))
        if not isinstance(text, str) or not text:
            raise ValueError("request.content needs text parts")
        body: dict[str, Any] = {"model": str(rec.get("model") or "").removeprefix("models/"), "input": text}
        dimensions = _either(request, "outputDimensionality", "output_dimensionality")
        if dimensions is not None:
            body["dimensions"] = dimensions
        return {"custom_id": key, "method": "POST", "url": rec["endpoint"], "body": body}

    # ---- batch objects ----------------------------------------------------------------
    def status_of(self, rec: Mapping[str, Any]) -> str:
        return self.STATES[str(rec["status"])]

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        name = f"batches/{rec['id']}"
        status = str(rec["status"])
        done, total, succeeded, failed, unrun, ended = tallies(rec)
        kind = self._KIND.get(str(rec.get("endpoint")), "GenerateContentBatch")
        meta: dict[str, Any] = {
            "@type": self._TYPES + kind,
            "name": name,
            "model": rec.get("model"),
            "displayName": rec.get("name"),
            "inputConfig": {"fileName": f"files/{rec['input_file_id']}"},
            "createTime": _iso(rec["created_at"]),
            "updateTime": _iso(ended or rec.get("in_progress_at") or rec["created_at"]),
            "batchStats": {
                "requestCount": str(total),
                "successfulRequestCount": str(succeeded),
                "failedRequestCount": str(failed),
                "pendingRequestCount": str(max(total - succeeded - failed - unrun, 0) if not done else 0),
            },
            "state": self.status_of(rec),
        }
        if done:
            meta["endTime"] = _iso(ended)
        operation: dict[str, Any] = {"name": name, "metadata": meta, "done": done}
        output = rec.get("output_file_id")
        if done and output:
            meta["output"] = {"responsesFile": f"files/{output}"}
            operation["response"] = {
                "@type": f"{self._TYPES}{kind}Output",
                "responsesFile": f"files/{output}",
            }
        if status == "failed":
            errors = rec.get("errors") or [{}]
            message = str(errors[0].get("message") or errors[0].get("code") or "the batch failed")
            operation["error"] = {"code": 3, "message": message, "status": "INVALID_ARGUMENT"}
        return operation

    def render_cancelled(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def list_page_args(self, params: Mapping[str, str]) -> tuple[str | None, int]:
        size = _int_param(params.get("pageSize") or params.get("page_size"), 50, "pageSize", self)
        if not 1 <= size <= self.MAX_PAGE:
            raise self.error(400, f"pageSize must be 1..{self.MAX_PAGE}.")
        return (params.get("pageToken") or params.get("page_token") or None), size

    def render_batch_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        page: dict[str, Any] = {"operations": [self.render_batch(r) for r in items]}
        if has_more and items:
            page["nextPageToken"] = items[-1]["id"]
        return page

    def is_cancel_path(self, tail: str) -> bool:
        # Cancel is a custom method: POST batches/{id}:cancel.
        return False

    # ---- result lines -------------------------------------------------------------------
    def response_line(
        self, line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        if 200 <= status < 300 and isinstance(body, Mapping) and body.get("object") == "list":
            return True, {"key": custom_id, "response": self._embedding(body)}
        if 200 <= status < 300 and isinstance(body, Mapping):
            return True, {"key": custom_id, "response": self._response(body, request_id)}
        inner = body.get("error") if isinstance(body, Mapping) else None
        message = inner.get("message") if isinstance(inner, Mapping) else None
        return False, {
            "key": custom_id,
            "error": {
                "code": status,
                "message": str(message or f"request failed with HTTP {status}"),
                "status": self._STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"),
            },
        }

    def system_line(
        self, line_id: str, custom_id: str, code: str, message: str | None = None, param: Any = None
    ) -> dict[str, Any]:
        status = {"batch_expired": "DEADLINE_EXCEEDED", "batch_cancelled": "CANCELLED"}.get(code, "INTERNAL")
        return {
            "key": custom_id,
            "error": {
                "code": 499 if status == "CANCELLED" else 504 if status == "DEADLINE_EXCEEDED" else 500,
                "message": message or SYSTEM_MESSAGES.get(code, code),
                "status": status,
            },
        }

    def _embedding(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """An embeddings answer (one input) as an ``EmbedContentResponse``."""
        data = body.get("data") or [{}]
        usage = body.get("usage") or {}
        return {
            "embedding": {"values": list(data[0].get("embedding") or [])},
            "tokenCount": int(usage.get("prompt_tokens") or 0),
        }

    def _response(self, body: Mapping[str, Any], request_id: str) -> dict[str, Any]:
        """A chat-completion answer as a ``GenerateContentResponse``."""
        choice = (body.get("choices") or [{}])[0]
        reply = choice.get("message") or {}
        usage = body.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        answer = int(usage.get("completion_tokens") or 0)
        return {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": str(reply.get("content") or "")}]},
                    "finishReason": self._FINISH.get(choice.get("finish_reason"), "STOP"),
                    "index": 0,
                }
            ],
            "usageMetadata": {
                "promptTokenCount": prompt,
                "candidatesTokenCount": answer,
                "totalTokenCount": prompt + answer,
            },
            "modelVersion": body.get("model"),
            "responseId": request_id,
        }


def tallies(rec: Mapping[str, Any]) -> tuple[bool, int, int, int, int, float | None]:
    """A batch record as Google reports it: whether it has ended, its requests, those that
    succeeded, those that failed (a request a cancel or expiry left unrun did not fail), those
    left unrun, and when it ended."""
    done = str(rec["status"]) in ("completed", "failed", "expired", "cancelled")
    counts = rec["request_counts"]
    progress = rec.get("progress") or {}
    unrun = int(progress.get("cancelled") or 0) + int(progress.get("expired") or 0)
    failed = max(int(counts["failed"]) - unrun, 0)
    ended = (
        rec.get("completed_at") or rec.get("failed_at") or rec.get("expired_at") or rec.get("cancelled_at")
    )
    return done, int(counts["total"]), int(counts["completed"]), failed, unrun, ended


def _either(obj: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` present (proto JSON takes camelCase and snake_case alike)."""
    for name in names:
        if name in obj:
            return obj[name]
    return None


def _parts_text(parts: Any) -> Any:
    """Gemini parts as chat content: text alone as a string, with inline data as content parts."""
    if not isinstance(parts, list):
        raise ValueError("parts must be a list")
    out: list[dict[str, Any]] = []
    for part in parts:
        if not isinstance(part, dict):
            raise ValueError("a part is not an object")
        if isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif isinstance(part.get("inlineData"), dict):
            data = part["inlineData"]
            url = f"data:{data.get('mimeType')};base64,{data.get('data')}"
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(part.get("functionCall"), dict) or isinstance(part.get("functionResponse"), dict):
            # Function turns reach the backend as text (the echo model calls no function).
            out.append({"type": "text", "text": orjson.dumps(part).decode()})
        else:
            raise ValueError(f"part with fields {sorted(part)} is not supported by the local batch server")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A ``responseSchema`` (OpenAPI subset, upper-case types) as the JSON schema the backend reads."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out["type"] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: _json_schema(v) for k, v in value.items() if isinstance(v, dict)}
        elif key == "items" and isinstance(value, dict):
            out[key] = _json_schema(value)
        elif key in ("nullable", "propertyOrdering"):
            continue
        else:
            out[key] = value
    return out


WIRES: dict[str, type[Wire]] = {
    cls.name: cls
    for cls in (Wire, DoublewordWire, ZeroGPUWire, XAIWire, MistralWire, AzureWire, AnthropicWire, GeminiWire)
}


def wire_class(dialect_name: str) -> type[Wire]:
    """The server mode of a dialect. Modes in modules of their own (they import this one) are
    registered on first use."""
    from airflow_batch_provider.server.bedrock import BedrockWire
    from airflow_batch_provider.server.vertex import VertexWire

    WIRES.setdefault(BedrockWire.name, BedrockWire)
    WIRES.setdefault(VertexWire.name, VertexWire)
    return WIRES[get_dialect(dialect_name).name]


def get_wire(dialect_name: str) -> Wire:
    return wire_class(dialect_name)(get_dialect(dialect_name))
