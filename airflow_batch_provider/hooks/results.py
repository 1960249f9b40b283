"""Results of a batch, apart from the I/O: which source to read, pages and their lines.

The hook's sync and async readers share everything here: the results mode, the turning of
pages (a cursor that loops is an error), the bound on how many lines a batch can have and
the reading of a line or a page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import orjson

from airflow_batch_provider.dialects import Dialect
from airflow_batch_provider.exceptions import (
    BatchApiRedirectError,
    BatchApiResponseError,
    ConfigurationError,
)
from airflow_batch_provider.hooks.attempts import message_of
from airflow_batch_provider.hooks.lines import BadLine
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.hooks.transport import origin_of, parse_json_body
from airflow_batch_provider.models import Batch, LineError, ResultLine
from airflow_batch_provider.redaction import redact_bytes, secret_bytes

T = TypeVar("T")


def results_mode(dialect: Dialect, batch: Batch, mode: str | None) -> str:
    """The results mode (see ``ResultsMode``): the one asked for, else what the batch and dialect offer."""
    if mode is not None:
        if mode not in dialect.results_modes:
            raise ConfigurationError(
                f"results mode {mode!r} is not offered by dialect {dialect.name!r}; "
                f"offered: {', '.join(dialect.results_modes)}"
            )
        return mode
    if "files" in dialect.results_modes and (batch.output_file_id or batch.error_file_id):
        return "files"
    if "results_endpoint" in dialect.results_modes:
        return "results_endpoint"
    if "results_url" in dialect.results_modes:
        return "results_url"
    if "object_store" in dialect.results_modes:
        return "object_store"
    return "files"


def results_stream_url(settings: BatchApiSettings, batch: Batch) -> str | None:
    """The absolute URL of the batch's results stream (None while it has none), refused when it
    is on another origin than the API: the connection's key is sent with it, and must never go
    to a host the connection does not name."""
    url = settings.dialect.results_url_of(batch)
    if url is None:
        return None
    base = httpx.URL(settings.base_url)
    try:
        full = base.join(url)
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise BatchApiResponseError(f"batch {batch.id} has an unreadable results_url ({exc})") from None
    if full.scheme not in ("http", "https") or origin_of(full) != origin_of(base):
        raise BatchApiRedirectError(
            f"batch {batch.id}: its results_url is on {origin_of(full)}, not the API's origin "
            f"{origin_of(base)}; not read, so the API key is never sent there"
        )
    return str(full)


def result_files(batch: Batch) -> list[tuple[str, str]]:
    """``(file id, source)`` of the batch's output then error file, those it has."""
    return [
        (file_id, source)
        for file_id, source in ((batch.output_file_id, "output"), (batch.error_file_id, "error"))
        if file_id
    ]


def result_line(
    dialect: Dialect, obj: Mapping[str, Any], source: Any, file_id: str, number: int
) -> ResultLine:
    """Line ``number`` of a result file, normalised by the dialect."""
    try:
        return dialect.parse_result_line(obj, source)
    except BatchApiResponseError as exc:
        raise BatchApiResponseError(f"file {file_id!r} line {number}: {exc.args[0]}", body=exc.body) from None


def result_line_or_bad(dialect: Dialect, obj: Any, source: Any, file_id: str, number: int) -> ResultLine:
    """``result_line``, or for a line that cannot be read a failed line saying why."""
    if isinstance(obj, BadLine):
        error, custom_id = obj.error, obj.custom_id
    else:
        try:
            return result_line(dialect, obj, source, file_id, number)
        except BatchApiResponseError as exc:
            error, custom_id = exc, obj.get("custom_id")
    return ResultLine(
        custom_id=custom_id if isinstance(custom_id, str) else "",
        ok=False,
        error=LineError(code="invalid_result_line", message=message_of(error)),
        source=source,
    )


def results_body(response: httpx.Response, action: str, settings: BatchApiSettings | None) -> Any:
    """A results page as the dialect takes it: parsed JSON, or raw bytes for a JSONL body.

    A key the vendor quoted back (an error item) is removed before anything reads the page.
    """
    content = redact_bytes(response.content, secret_bytes(settings.secrets if settings else None))
    content_type = response.headers.get("content-type", "")
    if "ndjson" in content_type or "jsonl" in content_type:
        return content
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        if b"\n" in content.strip():
            return content
        return parse_json_body(response, action, settings.secrets if settings else None)


def most_results(dialect: Dialect, batch: Batch) -> int:
    """How many result lines a batch can have: no more than its requests, nor than one file's lines.

    The larger of the two: a count the vendor reports late or not at all must not cut real results.
    """
    return max(batch.request_counts.total, dialect.limits.max_lines)


def results_pages(dialect: Dialect, batch: Batch) -> Pages:
    """The pages of a batch's results endpoint, bounded by how many lines the batch can have."""
    return Pages(
        f"reading results of batch {batch.id}", dialect.results_params(), most=most_results(dialect, batch)
    )


# Pages in a row that give nothing yet name a next page, before a listing is an endless one.
MAX_BARREN_PAGES = 3


def _cursor(params: Mapping[str, Any]) -> bytes:
    return orjson.dumps(dict(params), option=orjson.OPT_SORT_KEYS, default=str)


@dataclass
class Pages:
    """The cursor of a paged listing: the next page's parameters and the items given so far.

    :param action: what is listed, for messages.
    :param params: the first page's parameters (None: nothing to list).
    :param limit: give at most this many items, then stop (all if None).
    :param most: more items than this is a server paging without end, an error (no bound if None).
    :param barren: more pages than this in a row that give nothing but name a next page is a
        server paging without end, an error (no bound if None). A listing sets it: its cursor
        changes every page, so only the lack of progress shows the loop.
    """

    action: str
    params: dict[str, Any] | None
    limit: int | None = None
    most: int | None = None
    barren: int | None = None
    given: int = 0
    _barren_in_row: int = 0
    _seen: set[bytes] = field(default_factory=set)
    _next: dict[str, Any] | None = None

    def take(
        self, items: Sequence[T], next_params: dict[str, Any] | None, *, read: int | None = None
    ) -> Sequence[T]:
        """The page's items to give (cut at ``limit``), remembering where the next page starts.

        :param read: the items the page held, those left out too (default: ``len(items)``); a
            page that held none is barren.
        """
        held = len(items) if read is None else read
        self._next = next_params
        if self.limit is not None and len(items) > self.limit - self.given:
            items, self._next = items[: self.limit - self.given], None
        self.given += len(items)
        self._barren_in_row = self._barren_in_row + 1 if not held and self._next is not None else 0
        if self.barren is not None and self._barren_in_row > self.barren:
            raise BatchApiResponseError(
                f"{self.action}: the server returned {self._barren_in_row} pages in a row with nothing "
                f"on them, each naming a next page; stopped instead of paging without end"
            )
        if self.most is not None and self.given > self.most:
            raise BatchApiResponseError(
                f"{self.action}: the server returned more result lines ({self.given:,}) than the batch "
                f"can have ({self.most:,}); stopped reading instead of paging without end"
            )
        return items

    @property
    def next_params(self) -> dict[str, Any] | None:
        """The next page's parameters, as the last ``take`` left them (None: that was the last)."""
        return self._next

    def turn(self) -> None:
        """Move to the next page; a cursor already visited (A -> B -> A) is an error, not a loop."""
        assert self.params is not None
        self._seen.add(_cursor(self.params))
        if self._next is not None and _cursor(self._next) in self._seen:
            # Following it would read the same pages forever (and yield their lines again).
            raise BatchApiResponseError(
                f"{self.action}: the server returned a page cursor it had already returned "
                f"({dict(self._next)})"
            )
        self.params = self._next
