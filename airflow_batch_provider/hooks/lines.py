"""Reading a JSONL file over HTTP one line at a time, resuming after a dropped connection.

:class:`ResumableLines` holds every decision of such a read and does no I/O: it is fed the
bytes of each attempt and the error that ended one. The hook's ``_iter_jsonl`` (sync) and
``_aiter_jsonl`` (async) drive it, the way ``waiting.PollLoop`` serves both watch loops.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.hooks import calls
from airflow_batch_provider.hooks.attempts import Restarts
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.hooks.transport import LineSplitter, parse_json_line
from airflow_batch_provider.limits import MAX_RESULT_LINE_BYTES
from airflow_batch_provider.redaction import redact_bytes, secret_bytes

# How the download cap is named in its error, so the user knows what to raise.
DOWNLOAD_CAP = " (the connection extra 'max_download_bytes')"
# An async reader gives the event loop a turn after this many lines (and after every decoded
# MiB), so one large or hostile file never holds the triggerer's other coroutines.
LINES_PER_TURN = 256
# The custom_id of a line too damaged to parse (truncated, say) when it is still legible.
CUSTOM_ID_TEXT = re.compile(rb'"custom_id"\s*:\s*"([^"\\]{1,64})"')


@dataclass(frozen=True)
class BadLine:
    """A result file line that cannot be read (``on_bad_line="record"``)."""

    error: BatchApiResponseError
    custom_id: str | None


def line_object(
    data: bytes, number: int, where: str, hidden: tuple[bytes, ...] = (), lenient: bool = False
) -> Any:
    """The JSON object of line ``number`` (None for a blank line); with ``lenient`` a ``BadLine``."""
    if not data.strip():
        return None
    # A vendor may quote the key back in an error line; it must not reach the results table.
    data = redact_bytes(data, hidden)
    try:
        obj = parse_json_line(data, number, where)
        if not isinstance(obj, dict):
            raise BatchApiResponseError(f"{where} line {number} is not a JSON object")
    except BatchApiResponseError as exc:
        if lenient:
            found = CUSTOM_ID_TEXT.search(data)
            return BadLine(exc, found.group(1).decode("utf-8", "replace") if found else None)
        raise
    return obj


def raw_line(data: bytes, hidden: tuple[bytes, ...] = ()) -> bytes | None:
    """A line's bytes with any key redacted (None for a blank line), left for a warehouse to parse."""
    if not data.strip():
        return None
    return redact_bytes(data, hidden)


class ResumableLines:
    """The state of reading one JSONL file: the last line given, and the restarts left.

    A dropped connection re-requests the whole file and skips the lines already given, so
    every line is given once, in order, holding one line in memory at a time.

    :param settings: the connection's settings (policy, dialect, secrets, timeout).
    :param file_id: the vendor file id.
    :param log: where restarts are logged.
    :param lenient: give a ``BadLine`` for a line that is not a JSON object instead of raising.
    :param call: the request that reads the stream (default: the file's content).
    """

    def __init__(
        self,
        settings: BatchApiSettings,
        file_id: str,
        log: Any,
        *,
        lenient: bool = False,
        raw: bool = False,
        call: calls.Call | None = None,
    ) -> None:
        if call is None:
            self.where = f"file {file_id!r}"
            self.action = f"reading file {file_id}"
            self.call = calls.file_content(settings.dialect, file_id, self.action)
        else:
            # Another JSONL stream than a file's content (a batch's results_url).
            self.where = call.what or file_id
            self.action = call.action
            self.call = call
        self.timeout = settings.timeout
        self.limit = settings.max_download_bytes
        self._restarts = Restarts(settings, self.action, log)
        self._hidden = secret_bytes(settings.secrets)
        self._lenient = lenient
        # Give each non-blank line's bytes (keys redacted) unparsed, for a warehouse to parse.
        self._raw = raw
        self._done = 0
        self._splitter = LineSplitter(MAX_RESULT_LINE_BYTES, self.where)

    def attempt(self) -> None:
        """Start an attempt: its stream begins again at line 1."""
        self._splitter = LineSplitter(MAX_RESULT_LINE_BYTES, self.where)

    def feed(self, chunk: bytes) -> Iterator[tuple[int, Any]]:
        """``(line number, object)`` of each new line the chunk completes."""
        return self._new(self._splitter.feed(chunk))

    def end(self) -> Iterator[tuple[int, Any]]:
        """The last line, when the stream did not end with a newline."""
        return self._new(self._splitter.close())

    def dropped(self, exc: httpx.TransportError) -> float:
        """Seconds to wait before the next attempt; raises once the restarts are spent."""
        return self._restarts.dropped(exc)

    def _new(self, lines: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, Any]]:
        for number, data in lines:
            if number > self._done:
                item = (
                    raw_line(data, self._hidden)
                    if self._raw
                    else line_object(data, number, self.where, self._hidden, self._lenient)
                )
                self._done = number
                if item is not None:
                    yield number, item
