"""The resumable upload protocol (a dialect whose ``upload_protocol`` is "resumable"), apart from its I/O.

The protocol, as Google's Files API speaks it: a start call (``X-Goog-Upload-Protocol:
resumable``, ``X-Goog-Upload-Command: start``, the file's length and type in
``X-Goog-Upload-Header-*``, its metadata as the JSON body) answers with the session's URL in
``X-Goog-Upload-URL``; one ``upload, finalize`` command at offset 0 sends the bytes and answers
with the file. When that send drops or fails with a retryable status, a ``query`` command asks
the session what it holds (``X-Goog-Upload-Status`` active with ``X-Goog-Upload-Size-Received``,
or final with the file) and the rest is sent from there, not the whole file again.

:class:`ResumableUpload` holds the calls and the decisions for both hook loops; the session URL
must be on the API's own origin, since the connection's key travels with every call to it.
"""

from __future__ import annotations

from typing import Any

import httpx

from airflow_batch_provider.exceptions import BatchApiResponseError, ConfigurationError, JsonlValidationError
from airflow_batch_provider.hooks.attempts import Retries
from airflow_batch_provider.hooks.calls import Call
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.hooks.transport import FileBody, PathSource, open_source, origin_of, source_name

PROTOCOL = "X-Goog-Upload-Protocol"
COMMAND = "X-Goog-Upload-Command"
OFFSET = "X-Goog-Upload-Offset"
SESSION_URL = "X-Goog-Upload-URL"
STATUS = "X-Goog-Upload-Status"
RECEIVED = "X-Goog-Upload-Size-Received"


class ResumableUpload:
    """One file's resumable upload: its calls, the session and the offset the server holds.

    :param settings: the connection's settings (dialect, base URL, retry policy).
    :param source: a local path or an ``ObjectStoragePath``.
    :param filename: the name the vendor records; defaults to the source's name.
    :param log: where retries and resumes are logged.
    """

    def __init__(
        self, settings: BatchApiSettings, source: PathSource, filename: str | None, log: Any
    ) -> None:
        dialect = settings.dialect
        try:
            handle, size = open_source(source)
        except FileNotFoundError:
            raise ConfigurationError(f"cannot upload {source}: no such file") from None
        handle.close()
        self.filename = filename or source_name(source)
        limit = dialect.limits.max_shard_bytes
        if size > limit:
            # Refused before the start call: the vendor would take the bytes and then refuse them.
            raise JsonlValidationError(
                f"cannot upload {self.filename}: it is {size:,} bytes and dialect {dialect.name!r} "
                f"uploads at most {limit:,} bytes per file; build it again (shards are cut at that size)"
            )
        self.settings = settings
        self.source = source
        self.size = size
        self.log = log
        self.action = f"uploading {self.filename}"
        self.session: str | None = None
        self.offset = 0
        self.resumes = 0
        # Every failed send (dropped, 429, 5xx) spends a retry; progress gives the budget back.
        self.retries = Retries(settings, self.action, None, log)
        self.start = Call(
            "POST",
            dialect.upload_url(settings.base_url),
            self.action,
            json=dialect.upload_start_body(self.filename),
            headers={
                PROTOCOL: "resumable",
                COMMAND: "start",
                "X-Goog-Upload-Header-Content-Length": str(size),
                "X-Goog-Upload-Header-Content-Type": dialect.upload_media_type,
            },
        )

    def started(self, response: httpx.Response) -> None:
        """Take the session URL from the start call's answer; refuse one on another origin."""
        url = response.headers.get(SESSION_URL)
        if not url:
            raise BatchApiResponseError(f"{self.action}: the start call's answer has no {SESSION_URL} header")
        if origin_of(httpx.URL(url)) != origin_of(httpx.URL(self.settings.base_url)):
            # The key is sent with every command: only to the API's own origin.
            raise BatchApiResponseError(
                f"{self.action}: the upload session is on another origin ({origin_of(httpx.URL(url))}); "
                "not sending the file or the key there"
            )
        self.session = url

    def send(self) -> Call:
        """The command sending the file from ``offset`` to its end, and finalizing it."""
        assert self.session is not None
        body = FileBody(
            self.source,
            filename=self.filename,
            size=self.size - self.offset,
            content_type=self.settings.dialect.upload_media_type,
            offset=self.offset,
        )
        return Call(
            "POST",
            self.session,
            self.action,
            upload=body,
            headers={COMMAND: "upload, finalize", OFFSET: str(self.offset)},
        )

    def query(self) -> Call:
        """The command asking the session what it holds."""
        assert self.session is not None
        return Call(
            "POST", self.session, f"{self.action} (asking where to resume)", headers={COMMAND: "query"}
        )

    def queried(self, response: httpx.Response) -> bool:
        """Read the query's answer: True when the upload is already final (its body is the file),
        else the offset to resume from is set."""
        status = response.headers.get(STATUS)
        if status == "final":
            return True
        received = response.headers.get(RECEIVED)
        if status != "active" or received is None or not received.isdigit() or int(received) > self.size:
            raise BatchApiResponseError(
                f"{self.action}: the upload session answered status {status!r} with {received!r} bytes "
                f"received of {self.size:,}; cannot resume"
            )
        if int(received) > self.offset:
            # Progress since the last send: the upload is not stuck, so its retry budget starts
            # again (it bounds failures in a row; each reset needs strictly more bytes held).
            self.retries.retry = 0
            self.retries.drops = 0
        self.offset = int(received)
        self.resumes += 1
        self.log.warning(
            "%s: the server holds %d of %d bytes; resuming from there", self.action, self.offset, self.size
        )
        return False

    def finished(self, response: httpx.Response) -> None:
        """Check that a successful send finalized the upload."""
        status = response.headers.get(STATUS)
        if status is not None and status != "final":
            raise BatchApiResponseError(
                f"{self.action}: all {self.size:,} bytes were sent but the upload status is "
                f"{status!r}, not final"
            )
