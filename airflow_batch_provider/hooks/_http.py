"""HTTP plumbing of the batch hook: streamed multipart bodies, JSONL line splitting, error mapping.

Nothing here knows a vendor; the dialect supplies paths, form fields and parsing.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import ssl
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import IO, TYPE_CHECKING, Any, Union

import httpx
import orjson

from airflow_batch_provider.exceptions import (
    BatchApiAuthError,
    BatchApiBadRequestError,
    BatchApiConnectionError,
    BatchApiError,
    BatchApiNotFoundError,
    BatchApiRateLimitError,
    BatchApiResponseError,
    BatchApiServerError,
)
from airflow_batch_provider.hooks.retry import retry_after_seconds

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

PathSource = Union[str, "os.PathLike[str]", "ObjectStoragePath"]

UPLOAD_CHUNK = 1 << 20
REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-amzn-requestid", "cf-ray")
_BODY_LIMIT = 4000
REDACTED = "***"


_SSL_CONTEXT: ssl.SSLContext | None = None


def shared_ssl_context() -> ssl.SSLContext:
    """One TLS context per process for every client the hooks build.

    Building a context (loading the CA bundle) costs ~25 ms of CPU; done per client, a
    triggerer starting 1,000 triggers would hold its event loop for half a minute.
    """
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = httpx.create_ssl_context()
    return _SSL_CONTEXT


# Connections shared by every async client of one event loop (a triggerer runs one loop).
POOL_CONNECTIONS = 100
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncHTTPTransport] = (
    weakref.WeakKeyDictionary()
)


class _SharedTransport(httpx.AsyncBaseTransport):
    """A view of the loop's pooled transport that a closing client cannot close.

    A thousand triggers each with its own client would hold a thousand idle sockets and
    their parser state; a full garbage collection then walks all of it and stalls the loop
    for hundreds of milliseconds. The pool holds no connection settings or secrets: the
    hook's own client still sets the base URL, headers and timeouts of every request.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        # The pool outlives any one trigger; it goes with its event loop.
        return None


def shared_transport() -> httpx.AsyncBaseTransport:
    """The pooled transport of the running event loop, created on first use."""
    loop = asyncio.get_running_loop()
    inner = _POOLS.get(loop)
    if inner is None:
        inner = httpx.AsyncHTTPTransport(
            verify=shared_ssl_context(),
            limits=httpx.Limits(max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS),
        )
        _POOLS[loop] = inner
    return _SharedTransport(inner)


def redact(text: str, secret: str | None) -> str:
    """Remove a secret from text (a server may echo a header back in its error body)."""
    if secret and secret in text:
        return text.replace(secret, REDACTED)
    return text


def _redact_value(value: Any, secret: str | None) -> Any:
    if not secret:
        return value
    if isinstance(value, str):
        return redact(value, secret)
    if isinstance(value, dict):
        return {redact(str(k), secret): _redact_value(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, secret) for v in value]
    return value


def is_object_storage_path(value: Any) -> bool:
    """True for an Airflow ``ObjectStoragePath`` (checked without importing it eagerly)."""
    try:
        from airflow.sdk import ObjectStoragePath
    except ImportError:  # pragma: no cover - Airflow always ships it
        return False
    return isinstance(value, ObjectStoragePath)


def local_path_of(value: PathSource) -> str | None:
    """The local filesystem path of ``value``, or None when it lives in an object store."""
    if is_object_storage_path(value):
        protocol = getattr(value, "protocol", "") or "file"
        return str(value.path) if protocol in ("file", "local") else None  # type: ignore[union-attr]
    return os.fspath(value)  # type: ignore[arg-type]


def source_name(value: PathSource) -> str:
    if is_object_storage_path(value):
        return str(value.name)  # type: ignore[union-attr]
    return os.path.basename(os.fspath(value))  # type: ignore[arg-type]


def _open_source(value: PathSource) -> tuple[IO[bytes], int]:
    """Open a file for binary reading and return it with its size."""
    local = local_path_of(value)
    if local is not None:
        handle = open(local, "rb")  # noqa: SIM115 - closed by the caller
        return handle, os.fstat(handle.fileno()).st_size
    size = int(value.size())  # type: ignore[union-attr]
    return value.open("rb"), size  # type: ignore[union-attr]


def _quote(value: str) -> str:
    # Form field names and file names go inside double quotes; escape what would break them.
    return value.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


class MultipartUpload:
    """A ``multipart/form-data`` body whose file part is read from disk chunk by chunk.

    httpx's own multipart encoder reads the file synchronously, which would block an event
    loop; this one yields the same bytes from a sync iterator or an async one whose reads run
    in a worker thread. Each attempt calls ``iter_sync``/``aiter`` anew and reopens the file, so
    a retried upload sends the whole file again. The body has a known length (no chunked
    transfer encoding), which every vendor accepts.

    :param source: a local path or an ``ObjectStoragePath``.
    :param filename: the name sent in the form; defaults to the source's name.
    :param fields: plain form fields sent before the file (e.g. ``purpose``).
    :param size: the file size in bytes, when the caller already knows it.
    """

    content_type = "application/octet-stream"

    def __init__(
        self, source: PathSource, *, filename: str | None, fields: dict[str, str], size: int
    ) -> None:
        self.source = source
        self.filename = filename or source_name(source)
        self.size = size
        self.boundary = secrets.token_hex(16)
        parts = []
        for name, value in fields.items():
            parts.append(
                f"--{self.boundary}\r\n"
                f'Content-Disposition: form-data; name="{_quote(name)}"\r\n\r\n{value}\r\n'
            )
        parts.append(
            f"--{self.boundary}\r\n"
            f'Content-Disposition: form-data; name="file"; filename="{_quote(self.filename)}"\r\n'
            f"Content-Type: {self.content_type}\r\n\r\n"
        )
        self.head = "".join(parts).encode()
        self.tail = f"\r\n--{self.boundary}--\r\n".encode()

    @classmethod
    def from_source(
        cls, source: PathSource, *, filename: str | None, fields: dict[str, str]
    ) -> MultipartUpload:
        handle, size = _open_source(source)
        handle.close()
        return cls(source, filename=filename, fields=fields, size=size)

    @property
    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": f"multipart/form-data; boundary={self.boundary}",
            "Content-Length": str(len(self.head) + self.size + len(self.tail)),
        }

    def _check(self, sent: int) -> None:
        if sent != self.size:
            # The Content-Length already promised self.size bytes; a file that changed under
            # us must fail loudly rather than upload something else.
            raise BatchApiError(
                f"{self.filename}: file changed during upload ({sent:,} bytes read, {self.size:,} expected)"
            )

    def iter_sync(self) -> Iterator[bytes]:
        handle, _ = _open_source(self.source)
        with handle:
            yield self.head
            sent = 0
            while chunk := handle.read(UPLOAD_CHUNK):
                sent += len(chunk)
                yield chunk
        self._check(sent)
        yield self.tail

    async def aiter(self) -> AsyncIterator[bytes]:
        # File reads (local disk or an object store's SDK) are blocking calls: run them in a
        # thread so the event loop keeps serving other coroutines during a large upload.
        handle, _ = await asyncio.to_thread(_open_source, self.source)
        try:
            yield self.head
            sent = 0
            while chunk := await asyncio.to_thread(handle.read, UPLOAD_CHUNK):
                sent += len(chunk)
                yield chunk
        finally:
            await asyncio.to_thread(handle.close)
        self._check(sent)
        yield self.tail


class LineSplitter:
    """Split a byte stream into numbered physical lines, holding at most one line in memory.

    :param max_line_bytes: longest line accepted; a longer one raises instead of growing the buffer.
    :param where: what is being read, for error messages (e.g. ``file 'file-abc'``).
    """

    def __init__(self, max_line_bytes: int, where: str) -> None:
        self.max_line_bytes = max_line_bytes
        self.where = where
        self.number = 0
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        self._buffer += chunk
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            self.number += 1
            yield self.number, self._line(bytes(self._buffer[start:end]))
            start = end + 1
        if start:
            del self._buffer[:start]
        if len(self._buffer) > self.max_line_bytes:
            raise BatchApiResponseError(
                f"{self.where} line {self.number + 1} is longer than {self.max_line_bytes:,} bytes"
            )

    def close(self) -> Iterator[tuple[int, bytes]]:
        if self._buffer:
            self.number += 1
            data = bytes(self._buffer)
            self._buffer.clear()
            yield self.number, self._line(data)

    def _line(self, data: bytes) -> bytes:
        if data.endswith(b"\r"):
            data = data[:-1]
        if self.number == 1 and data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        if len(data) > self.max_line_bytes:
            raise BatchApiResponseError(
                f"{self.where} line {self.number} is {len(data):,} bytes, "
                f"over the {self.max_line_bytes:,}-byte cap"
            )
        return data


def parse_json_line(data: bytes, number: int, where: str) -> Any:
    """Parse one JSONL line; bad JSON raises naming the file and line."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BatchApiResponseError(f"{where} line {number} is not valid JSON: {exc}") from None


def parse_json_body(response: httpx.Response, action: str, secret: str | None) -> Any:
    """The JSON body of a successful response; anything else is a ``BatchApiResponseError``."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise BatchApiResponseError(
            f"{action}: the server answered {response.status_code} with a body that is not JSON ({exc})",
            status_code=response.status_code,
            request_id=request_id_of(response),
            # Redact before cutting: a key straddling the cut would otherwise leave a fragment.
            body=redact(response.text, secret)[:_BODY_LIMIT],
        ) from None


def request_id_of(response: httpx.Response) -> str | None:
    for name in REQUEST_ID_HEADERS:
        value = response.headers.get(name)
        if value:
            return value
    return None


def body_of(response: httpx.Response, secret: str | None) -> Any:
    """The error body (parsed JSON if possible, else text), truncated and with the key removed."""
    if not response.content:
        return None
    try:
        return _redact_value(orjson.loads(response.content), secret)
    except orjson.JSONDecodeError:
        # Redact before cutting: a key straddling the cut would otherwise leave a fragment.
        return redact(response.content.decode("utf-8", errors="replace"), secret)[:_BODY_LIMIT]


def _vendor_message(body: Any) -> str | None:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return str(body[key])
    return None


def status_error(
    response: httpx.Response, *, action: str, what: str | None, base_url: str, secret: str | None
) -> BatchApiError:
    """The typed exception for a non-2xx response (the body must already be read)."""
    status = response.status_code
    body = body_of(response, secret)
    request_id = request_id_of(response)
    vendor = _vendor_message(body)
    detail = f": {vendor}" if vendor else ""
    kwargs: dict[str, Any] = {
        "status_code": status,
        "request_id": request_id,
        "body": body,
        "retry_after": retry_after_seconds(response.headers),
    }
    if status in (401, 403):
        reason = "rejected" if status == 401 else "rejected or lacks permission"
        return BatchApiAuthError(
            redact(
                f"{action}: the API key was {reason} by {base_url} (HTTP {status}); "
                f"check the connection's password{detail}",
                secret,
            ),
            **kwargs,
        )
    if status == 404:
        target = what or "the resource"
        return BatchApiNotFoundError(
            redact(f"{action}: {target} was not found at {base_url}{detail}", secret), **kwargs
        )
    if status in (400, 422):
        return BatchApiBadRequestError(
            redact(f"{action}: the server refused the request{detail}", secret), **kwargs
        )
    if status == 429:
        return BatchApiRateLimitError(
            redact(f"{action}: still rate limited after every retry{detail}", secret), **kwargs
        )
    if status >= 500:
        return BatchApiServerError(
            redact(f"{action}: server error after every retry{detail}", secret), **kwargs
        )
    return BatchApiError(redact(f"{action}: HTTP {status}{detail}", secret), **kwargs)


def transport_error(exc: Exception, *, action: str, secret: str | None) -> BatchApiConnectionError:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    return BatchApiConnectionError(
        redact(f"{action}: the connection {kind}: {type(exc).__name__}: {exc}", secret)
    )
