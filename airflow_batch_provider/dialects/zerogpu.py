"""ZeroGPU: OpenAI-shaped batches, ``x-api-key`` + ``x-project-id`` auth, chat completions only.

Validation happens synchronously at ``POST /v1/batches`` and answers 400 with
``error.line``; a batch with failed lines still ends ``completed``. A batch may be
200 MB but one upload at most 100 MB (413 "Uploaded file is larger than 100 MB"),
so shards are cut at 100 MB. Every request needs both the key and the project
(401 otherwise); cancelling a finished batch answers 409.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_batch_provider.dialects.base import Dialect
from airflow_batch_provider.limits import MB, Limits


class ZeroGPUDialect(Dialect):
    """ZeroGPU Batch API."""

    name = "zerogpu"
    label = "ZeroGPU"
    default_base_url = "https://api.zerogpu.ai/v1"
    endpoints = frozenset({"/v1/chat/completions"})
    completion_windows = ("24h",)
    # The only vendor documenting a per-line limit (1 MB); uploads stop at 100 MB.
    limits = Limits(max_line_bytes=1 * MB, max_upload_bytes=100 * MB)
    max_custom_id_chars = None
    required_extras = ("project",)
    cancel_final_statuses = frozenset({409})
    # Open-weight models with their own tokenizers: the heuristic, a little above o200k.
    token_encoding = None
    token_factor = 1.1
    price_provider = None
    batch_discount = None

    # Codes ZeroGPU documents on error lines; anything else is passed through unchanged.
    error_codes = frozenset(
        {
            "invalid_request_error",
            "authentication_error",
            "not_found_error",
            "request_too_large",
            "insufficient_quota",
            "rate_limit_exceeded",
            "internal_error",
            "batch_cancelled",
            "batch_expired",
        }
    )

    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if api_key:
            headers["x-api-key"] = api_key
        project = (extra or {}).get("project")
        if project:
            headers["x-project-id"] = str(project)
        return headers
