"""Doubleword: OpenAI-shaped files and batches, plus a paged results endpoint.

Its output *file* uses the OpenAI line shape; ``GET /v1/batches/{id}/results``
returns lines ``{id, custom_id, model, input_body, response_body, error, status}``
paged with ``skip``/``limit``. Completion windows are ``24h`` and ``1h``; batch ids
are UUIDs; ``custom_id`` may repeat; status never reports ``expired``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from airflow_batch_provider.dialects.base import Dialect, ResultsPage
from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.models import LineError, ResultLine


class DoublewordDialect(Dialect):
    """Doubleword Batch API."""

    name = "doubleword"
    label = "Doubleword"
    default_base_url = "https://api.doubleword.ai/v1"
    endpoints = frozenset({"/v1/chat/completions", "/v1/embeddings", "/v1/responses"})
    completion_windows = ("24h", "1h")
    unique_custom_ids = False
    results_modes = ("files", "results_endpoint")

    def results_path(self, batch_id: str) -> str:
        return f"batches/{batch_id}/results"

    def results_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"skip": 0, "limit": limit or self.results_page_size}

    def parse_results_page(self, raw: Any, params: Mapping[str, Any]) -> ResultsPage:
        """Read one page; ``raw`` is the JSONL body (bytes/str) or an already parsed list/dict."""
        items = _results_items(raw)
        lines = [self.parse_results_item(item) for item in items]
        limit = int(params.get("limit") or self.results_page_size)
        next_params = None
        if len(items) >= limit:
            next_params = {**params, "skip": int(params.get("skip") or 0) + len(items)}
        return ResultsPage(lines=lines, next_params=next_params)

    def parse_results_item(self, item: Mapping[str, Any]) -> ResultLine:
        """One ``{id, custom_id, response_body, error, status}`` item from the results endpoint."""
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchApiResponseError("result item has no custom_id", body=dict(item))
        body = item.get("response_body")
        error = self.parse_line_error(item.get("error"))
        status = str(item.get("status") or "").lower()
        ok = error is None and isinstance(body, dict) and status in ("", "completed", "succeeded", "success")
        if not ok and error is None:
            error = LineError(
                code=status or "unknown_error", message=f"request ended {status or 'without a body'}"
            )
        return ResultLine(
            custom_id=custom_id,
            ok=ok,
            status_code=200 if ok else None,
            body=body if isinstance(body, dict) else None,
            error=error,
            line_id=item.get("id"),
            source="inline",
        )


def _results_items(raw: Any) -> list[Mapping[str, Any]]:
    if isinstance(raw, (bytes, str)):
        data = raw.encode() if isinstance(raw, str) else raw
        return [orjson.loads(line) for line in data.splitlines() if line.strip()]
    if isinstance(raw, list):
        return raw
    if isinstance(raw, Mapping):
        if "custom_id" in raw:
            # A one-line JSONL page parses as a single item, not as an envelope.
            return [raw]
        return list(raw.get("data") or raw.get("results") or [])
    raise BatchApiResponseError("unreadable results page", body=repr(raw)[:500])
