"""Doubleword: OpenAI-shaped files and batches, plus a paged results endpoint.

Its output *file* uses the OpenAI line shape; ``GET /v1/batches/{id}/results``
returns lines ``{id, custom_id, model, input_body, response_body, error, status}``
paged with ``skip``/``limit``. Completion windows are ``24h`` and ``1h``; batch ids
are UUIDs; ``custom_id`` may repeat; status never reports ``expired``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from airflow_batch_provider.dialects.base import Dialect, ResultsPage, bind_models, str_or_none
from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.ids import path_segment
from airflow_batch_provider.limits import MB, Limits

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
    from airflow_batch_provider.models import LineError, ResultLine  # noqa: TC004


class DoublewordDialect(Dialect):
    """Doubleword Batch API."""

    name = "doubleword"
    label = "Doubleword"
    default_base_url = "https://api.doubleword.ai/v1"
    endpoints = frozenset({"/v1/chat/completions", "/v1/embeddings", "/v1/responses"})
    completion_windows = ("24h", "1h")
    # Its server takes request bodies up to 10 MB and uploads up to 100 MB (the defaults of its
    # open-source control layer), custom_ids up to 64 characters.
    limits = Limits(max_line_bytes=10 * MB, max_upload_bytes=100 * MB)
    unique_custom_ids = False
    # Each request is routed by its own model.
    mixed_models = True
    # Open-weight models with their own tokenizers: the heuristic, a little above o200k.
    token_encoding = None
    token_factor = 1.1
    price_provider = "doubleword"
    batch_discount = None
    results_modes = ("files", "results_endpoint")

    def __init__(self) -> None:
        super().__init__()
        bind_models(globals(), "LineError", "ResultLine")

    def results_path(self, batch_id: str) -> str:
        return f"batches/{path_segment(batch_id, 'batch_id')}/results"

    def results_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"skip": 0, "limit": limit or self.results_page_size}

    def parse_results_page(
        self, raw: Any, params: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> ResultsPage:
        """Read one page; ``raw`` is the JSONL body (bytes/str) or an already parsed list/dict.

        The server clamps ``limit`` (to 101 today), so a short page says nothing. Its end marker
        is the ``X-Incomplete`` header (``false`` on the last page); without that header only an
        empty page ends the walk.
        """
        items = _results_items(raw)
        lines = [self.parse_results_item(item) for item in items]
        incomplete = _header(headers, INCOMPLETE_HEADER)
        more = bool(items) and (incomplete is None or incomplete.strip().lower() == "true")
        next_params = None
        if more:
            next_params = {**params, "skip": int(params.get("skip") or 0) + len(items)}
        return ResultsPage(lines=lines, next_params=next_params)

    def parse_results_item(self, item: Mapping[str, Any]) -> ResultLine:
        """One ``{id, custom_id, response_body, error, status}`` item from the results endpoint."""
        custom_id = item.get("custom_id")
        if custom_id is not None and not isinstance(custom_id, str):
            raise BatchApiResponseError("result item has an unreadable custom_id", body=dict(item))
        if not custom_id:
            # Doubleword's custom_id is optional: such a result matches no input row. It is kept
            # (with an empty custom_id) so the merge counts it as an orphan instead of failing.
            return ResultLine(
                custom_id="",
                ok=False,
                error=LineError(
                    code="missing_custom_id",
                    message=f"result {item.get('id')!r} has no custom_id; it cannot be matched to a row",
                ),
                line_id=str_or_none(item.get("id")),
                source="inline",
            )
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
            line_id=str_or_none(item.get("id")),
            source="inline",
        )


INCOMPLETE_HEADER = "x-incomplete"


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        # A plain dict may carry another spelling; httpx.Headers is case-insensitive already.
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value


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
