"""ZeroGPU: OpenAI-shaped batches, ``x-api-key`` auth, chat completions only.

Validation happens synchronously at ``POST /v1/batches`` and answers 400 with
``error.line``; a batch with failed lines still ends ``completed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_batch_provider.dialects.base import Dialect


class ZeroGPUDialect(Dialect):
    """ZeroGPU Batch API."""

    name = "zerogpu"
    label = "ZeroGPU"
    default_base_url = "https://api.zerogpu.ai/v1"
    endpoints = frozenset({"/v1/chat/completions"})
    completion_windows = ("24h",)

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
