"""HTTP plumbing of the batch hook: streamed multipart bodies, JSONL line splitting, error mapping.

Nothing here knows a vendor; the dialect supplies paths, form fields and parsing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import re
import secrets
import ssl
import time
import weakref
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any, Union

import httpcore
import httpx
import orjson

from airflow_batch_provider.exceptions import (
    BatchApiAuthError,
    BatchApiBadRequestError,
    BatchApiConnectionError,
    BatchApiError,
    BatchApiNotFoundError,
    BatchApiRateLimitError,
    BatchApiRedirectError,
    BatchApiResponseError,
    BatchApiResponseTooLargeError,
    BatchApiServerError,
)
from airflow_batch_provider.hooks.retry import retry_after_seconds
from airflow_batch_provider.jsonl import json_error_text, repeated_key
from airflow_batch_provider.redaction import Secrets, occurs, redact

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

PathSource = Union[str, "os.PathLike[str]", "ObjectStoragePath"]

UPLOAD_CHUNK = 1 << 20
REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-amzn-requestid", "cf-ray")
#: Most characters of a non-JSON error body kept on an exception (after redaction).
ERROR_BODY_LIMIT = 4000


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


def _redact_value(value: Any, secret: Secrets) -> Any:
    if not secret:
        return value
    if isinstance(value, str):
        return redact(value, secret)
    if isinstance(value, dict):
        return {redact(str(k), secret): _redact_value(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, secret) for v in value]
    return value


def redact_json(value: Any, secret: Secrets, raw: bytes | None = None) -> Any:
    """A parsed JSON answer with every secret removed from its keys and strings.

    A vendor may quote the request's key back in a 200 answer (a batch's ``errors``); what the
    hook parses from it reaches exceptions, XCom, trigger events and logs, so it is cleaned once here.

    :param raw: the JSON text ``value`` was parsed from, when known: a text with no escape in it
        (no backslash) holds every parsed string verbatim, so when no secret occurs in it either,
        nothing is walked (a 100-batch listing page: ~2 ms of walking saved, a byte scan instead).
    """
    if raw is not None and b"\\" not in raw and not occurs(raw, secret):
        return value
    return _redact_value(value, secret)


# ---- a deadline per call ---------------------------------------------------------------------
# httpx's timeouts bound each socket operation, so a server that sends one byte a second keeps
# a call alive for as long as it likes. Every exchange gets a total deadline: the async client
# runs it under ``asyncio.timeout``; the sync client's sockets cap each read and write to the
# time left (``arm_total_deadline``). An upload pushes the deadline on after every chunk sent,
# and a streamed download gets a fresh one per chunk read (a progress deadline), so large
# files are bounded by their progress rather than their size.


class CallDeadline:
    """The wall-clock limit of one HTTP exchange (connect, send, every read), renewable on progress.

    :param seconds: how long the exchange may take (and each renewal grants).
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.timer: asyncio.Timeout | None = None

    def left(self) -> float:
        return self.at - time.monotonic()

    def renew(self) -> None:
        """Progress was made: grant ``seconds`` again from now."""
        self.at = time.monotonic() + self.seconds
        if self.timer is not None:
            self.timer.reschedule(asyncio.get_running_loop().time() + self.seconds)


_DEADLINE: contextvars.ContextVar[CallDeadline | None] = contextvars.ContextVar(
    "batch_call_deadline", default=None
)


def renew_call_deadline() -> None:
    """Renew the deadline of the exchange in progress, if any (an upload sent another chunk)."""
    deadline = _DEADLINE.get()
    if deadline is not None:
        deadline.renew()


@contextlib.contextmanager
def deadline_scope(deadline: CallDeadline) -> Iterator[CallDeadline]:
    """Make ``deadline`` the current exchange's deadline (sync sockets read it; uploads renew it)."""
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def _capped(timeout: float | None, error: type[Exception]) -> float | None:
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline.left()
    if left <= 0:
        raise error(f"the call's total deadline of {deadline.seconds:g}s passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose reads and writes never wait past the current exchange's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _capped(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _capped(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        tls = self._inner.start_tls(ssl_context, server_hostname, _capped(timeout, httpcore.ConnectTimeout))
        return _DeadlineStream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(
            host, port, _capped(timeout, httpcore.ConnectTimeout), local_address, socket_options
        )
        return _DeadlineStream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_unix_socket(
            path, _capped(timeout, httpcore.ConnectTimeout), socket_options
        )
        return _DeadlineStream(stream)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def arm_total_deadline(client: httpx.Client) -> None:
    """Make the sockets of ``client``'s own transports honour ``deadline_scope``.

    httpx offers no public way to hand its connection pool a network backend, so the pool's
    backend (one attribute of httpcore's ``ConnectionPool``, proxies included) is wrapped. A
    transport given by the caller (tests, custom proxies) is left as it is.
    """
    for transport in (getattr(client, "_transport", None), *getattr(client, "_mounts", {}).values()):
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is not None and not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]


def iter_with_progress(chunks: Iterator[bytes], seconds: float) -> Iterator[bytes]:
    """Chunks of a streamed download, each of which must arrive within ``seconds`` (sync client)."""
    while True:
        with deadline_scope(CallDeadline(seconds)):
            chunk = next(chunks, None)
        if chunk is None:
            return
        yield chunk


async def aiter_with_progress(chunks: AsyncIterator[bytes], seconds: float) -> AsyncIterator[bytes]:
    """Async twin of ``iter_with_progress``; a late chunk raises ``httpx.ReadTimeout``."""
    while True:
        try:
            async with asyncio.timeout(seconds):
                chunk = await anext(chunks, None)
        except TimeoutError:
            raise httpx.ReadTimeout(f"no data for {seconds:g}s while streaming a file") from None
        if chunk is None:
            return
        yield chunk


# ---- bounded bodies --------------------------------------------------------------------------
# Control-plane answers (batch, file and list objects) are small; a larger one is refused
# while it is read, after decompression, so neither a huge body nor a gzip bomb fills memory.
MAX_CONTROL_BODY = 8 << 20


class BodyDecoder:
    """A response body's content-encoding undone with bounded output, piece by piece.

    zlib inflates into at most ``piece`` bytes per call, so a gzip bomb never expands in memory
    beyond that, and more than ``limit`` decoded bytes in all is refused.

    :param response: the response (its ``content-encoding`` says how to decode).
    :param limit: the most decoded bytes accepted.
    :param action: what is being read, for messages (``reading file file-abc``).
    :param piece: the most bytes of one decoded piece (None: ``limit`` + 1).
    :param cap: how the limit is named in the error (e.g. the connection extra that sets it).
    :param decoded: the body is decoded already (a transport that answered with ready content).
    """

    def __init__(
        self,
        response: httpx.Response,
        limit: int,
        action: str,
        *,
        piece: int | None = None,
        cap: str = "",
        decoded: bool = False,
    ) -> None:
        self.limit = limit
        self.action = action
        self.piece = piece
        self.cap = cap
        self.total = 0
        self.started = False
        encoding = "" if decoded else response.headers.get("content-encoding", "").strip().lower()
        self.encoding = encoding
        if encoding in ("gzip", "x-gzip"):
            self.inflater: Any = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding in ("deflate",):
            self.inflater = zlib.decompressobj(zlib.MAX_WBITS)
        elif encoding in ("", "identity"):
            self.inflater = None
        else:
            raise BatchApiResponseError(
                f"{action}: the server answered with content-encoding {encoding!r}, which was not asked for"
            )

    def _counted(self, data: bytes) -> bytes:
        self.total += len(data)
        if self.total > self.limit:
            how = " decompressed" if self.inflater is not None else ""
            raise BatchApiResponseTooLargeError(
                f"{self.action}: the answer is larger than {self.limit:,} bytes{how}{self.cap}; refused"
            )
        return data

    def _room(self) -> int:
        room = self.limit - self.total + 1
        return room if self.piece is None else min(self.piece, room)

    def feed(self, raw: bytes) -> Iterator[bytes]:
        """The decoded pieces of the raw bytes ``raw``; raises past the limit."""
        if self.inflater is None:
            step = self.piece or len(raw) or 1
            for at in range(0, len(raw), step):
                yield self._counted(raw[at : at + step])
            return
        data = raw
        while True:
            room = self._room()
            try:
                out = self.inflater.decompress(data, room)
            except zlib.error as exc:
                if self.encoding == "deflate" and not self.started:
                    # Some servers send "deflate" without its zlib wrapper (as httpx accepts too).
                    self.inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                    self.started = True
                    continue
                raise BatchApiResponseError(
                    f"{self.action}: the {self.encoding} body is corrupt ({exc})"
                ) from None
            self.started = True
            if out:
                yield self._counted(out)
            data = self.inflater.unconsumed_tail
            # A full piece may leave output inside zlib even with no input left: ask again.
            if not data and len(out) < room:
                return

    def finish(self) -> None:
        """The body ended: a compressed one must have reached its end marker."""
        if self.inflater is not None and not self.inflater.eof:
            raise BatchApiResponseError(
                f"{self.action}: the {self.encoding} body ended before its end marker"
            )


class _BodyReader:
    """Collect a response body up to ``limit`` decoded bytes, inflating gzip with bounded output."""

    def __init__(self, response: httpx.Response, limit: int, action: str) -> None:
        self.decoder = BodyDecoder(response, limit, action)
        self.body = bytearray()

    def feed(self, raw: bytes) -> None:
        for piece in self.decoder.feed(raw):
            self.body += piece

    def finish(self) -> bytes:
        self.decoder.finish()
        return bytes(self.body)


def _already_read(response: httpx.Response, limit: int, action: str) -> bool:
    """Whether the body is in memory already (a transport that answers with ready content)."""
    try:
        size = len(response.content)
    except httpx.ResponseNotRead:
        return False
    if size > limit:
        raise BatchApiResponseTooLargeError(f"{action}: the answer is larger than {limit:,} bytes; refused")
    return True


def read_capped(response: httpx.Response, limit: int, action: str) -> None:
    """Read ``response``'s body (sync) into ``response.content``, refusing more than ``limit`` bytes."""
    if _already_read(response, limit, action):
        return
    try:
        reader = _BodyReader(response, limit, action)
        for raw in response.iter_raw():
            reader.feed(raw)
        # What httpx's own ``read()`` stores; ``content``, ``text`` and ``json()`` read it.
        response._content = reader.finish()
    finally:
        response.close()


async def aread_capped(response: httpx.Response, limit: int, action: str) -> None:
    """Async twin of ``read_capped``."""
    if _already_read(response, limit, action):
        return
    try:
        reader = _BodyReader(response, limit, action)
        async for raw in response.aiter_raw():
            reader.feed(raw)
        response._content = reader.finish()
    finally:
        await response.aclose()


# ---- streamed bodies -------------------------------------------------------------------------
# A result file is read in decoded pieces of at most DOWNLOAD_CHUNK bytes: httpx's own decoder
# inflates a whole network read at once (64 KB of gzip -> 64 MB), so the hook decodes itself.
DOWNLOAD_CHUNK = 1 << 20


def _ready_content(response: httpx.Response) -> bytes | None:
    """The body when the transport answered with it already read and decoded (else None)."""
    try:
        return response.content
    except httpx.ResponseNotRead:
        return None


def iter_decoded(
    response: httpx.Response, *, limit: int, action: str, cap: str, progress: float
) -> Iterator[bytes]:
    """A streamed body, decoded, in pieces of at most ``DOWNLOAD_CHUNK`` bytes, ``limit`` in all.

    Each network read must arrive within ``progress`` seconds (``iter_with_progress``).

    :param response: an open streamed response.
    :param limit: the most decoded bytes; past it a ``BatchApiResponseTooLargeError``.
    :param action: what is read, for messages.
    :param cap: how the limit is named in that error.
    :param progress: seconds each read may take.
    """
    ready = _ready_content(response)
    decoder = BodyDecoder(response, limit, action, piece=DOWNLOAD_CHUNK, cap=cap, decoded=ready is not None)
    raw = (
        iter((ready,))
        if ready is not None
        else iter_with_progress(response.iter_raw(DOWNLOAD_CHUNK), progress)
    )
    for chunk in raw:
        yield from decoder.feed(chunk)
    decoder.finish()


async def aiter_decoded(
    response: httpx.Response, *, limit: int, action: str, cap: str, progress: float
) -> AsyncIterator[bytes]:
    """Async twin of ``iter_decoded``."""
    ready = _ready_content(response)
    decoder = BodyDecoder(response, limit, action, piece=DOWNLOAD_CHUNK, cap=cap, decoded=ready is not None)
    if ready is not None:
        for piece in decoder.feed(ready):
            yield piece
    else:
        async for chunk in aiter_with_progress(response.aiter_raw(DOWNLOAD_CHUNK), progress):
            for piece in decoder.feed(chunk):
                yield piece
    decoder.finish()


# ---- redirects -------------------------------------------------------------------------------
MAX_REDIRECTS = 5


def origin_of(url: httpx.URL) -> str:
    """``scheme://host:port`` of a URL (no path, no query: a signed URL's signature stays out)."""
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    return f"{url.scheme}://{url.host}:{port}"


def next_hop(
    request: httpx.Request, response: httpx.Response, *, hops: int, action: str, foreign: bool
) -> httpx.Request:
    """The request that follows ``response``'s redirect, or a ``BatchApiRedirectError``.

    Within the same origin (scheme, host, port) the request is repeated as httpx would.
    To another origin it is refused, unless ``foreign`` (a result file's content, which a vendor
    may serve from a signed object-store URL): then it goes with no credentials and none of
    the connection's headers.
    """
    here = origin_of(request.url)
    if hops >= MAX_REDIRECTS:
        raise BatchApiRedirectError(
            f"{action}: more than {MAX_REDIRECTS} redirects, last from {here}; not followed"
        )
    try:
        url = request.url.join(response.headers["location"])
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise BatchApiRedirectError(f"{action}: {here} redirected to an invalid location ({exc})") from None
    there = origin_of(url)
    if url.scheme not in ("http", "https"):
        raise BatchApiRedirectError(f"{action}: {here} redirected to a {url.scheme!r} URL; not followed")
    method = request.method
    status = response.status_code
    if (status == 303 and method != "HEAD") or (status in (301, 302) and method == "POST"):
        method, stream = "GET", None
    else:
        stream = request.stream
        if not isinstance(stream, httpx.ByteStream):
            raise BatchApiRedirectError(
                f"{action}: {here} answered {status} to a streamed upload, which cannot be sent again"
            )
    if there == here:
        headers = httpx.Headers(request.headers)
    elif foreign:
        headers = httpx.Headers({"User-Agent": request.headers.get("User-Agent", ""), "Accept": "*/*"})
    else:
        raise BatchApiRedirectError(
            f"{action}: {here} redirected to another origin, {there}; not followed, so the API key "
            "and the connection's headers are never sent there"
        )
    if stream is None:
        for name in ("content-length", "content-type", "transfer-encoding"):
            headers.pop(name, None)
    headers["Host"] = url.netloc.decode("ascii")
    return httpx.Request(method, url, headers=headers, stream=stream, extensions=request.extensions)


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


def open_source(value: PathSource) -> tuple[IO[bytes], int]:
    """Open a file for binary reading and return it with its size."""
    local = local_path_of(value)
    if local is not None:
        handle = open(local, "rb")  # noqa: SIM115 - closed by the caller
        return handle, os.fstat(handle.fileno()).st_size
    from airflow_batch_provider.staging import open_read  # bounded read-ahead on object stores

    size = int(value.size())  # type: ignore[union-attr]
    return open_read(value), size  # type: ignore[arg-type]


def _quote(value: str) -> str:
    # Form field names and file names go inside double quotes; escape what would break them.
    return value.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


class FileBody:
    """A request body read from a file chunk by chunk, with an exact ``Content-Length``.

    httpx would read a file body synchronously, which would block an event loop; this one
    yields the file's bytes (between ``head`` and ``tail``) from a sync iterator or an async one
    whose reads run in a worker thread. Each attempt calls ``iter_sync``/``aiter`` anew and
    reopens the file, so a retried request sends the whole body again.

    :param source: a local path or an ``ObjectStoragePath``.
    :param filename: a name for messages; defaults to the source's name.
    :param size: the file size in bytes.
    :param content_type: the body's media type.
    :param requests: how many batch requests the body holds (an inline create), if known.
    :param offset: the first byte of the file sent (a resumed upload sends the rest from there);
        ``size`` is then the bytes from the offset to the end.
    """

    def __init__(
        self,
        source: PathSource,
        *,
        filename: str | None,
        size: int,
        content_type: str = "application/json",
        requests: int | None = None,
        offset: int = 0,
    ) -> None:
        self.source = source
        self.requests = requests
        self.filename = filename or source_name(source)
        self.size = size
        self.offset = offset
        self.body_type = content_type
        self.head = b""
        self.tail = b""

    @property
    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": self.body_type,
            "Content-Length": str(len(self.head) + self.size + len(self.tail)),
        }

    def _check(self, sent: int) -> None:
        if sent != self.size:
            # The Content-Length already promised self.size bytes; a file that changed under
            # us must fail loudly rather than send something else.
            raise BatchApiError(
                f"{self.filename}: file changed during upload ({sent:,} bytes read, {self.size:,} expected)"
            )

    def _skip(self, handle: IO[bytes]) -> None:
        """Move past the first ``offset`` bytes (a resumed upload): seek, else read them away."""
        if not self.offset:
            return
        try:
            handle.seek(self.offset)
            return
        except (OSError, ValueError, AttributeError):
            pass
        left = self.offset
        while left and (chunk := handle.read(min(left, UPLOAD_CHUNK))):
            left -= len(chunk)

    def iter_sync(self) -> Iterator[bytes]:
        handle, _ = open_source(self.source)
        with handle:
            self._skip(handle)
            yield self.head
            sent = 0
            while chunk := handle.read(UPLOAD_CHUNK):
                sent += len(chunk)
                yield chunk
                renew_call_deadline()
        self._check(sent)
        yield self.tail

    async def aiter(self) -> AsyncIterator[bytes]:
        # File reads (local disk or an object store's SDK) are blocking calls: run them in a
        # thread so the event loop keeps serving other coroutines during a large upload.
        handle, _ = await asyncio.to_thread(open_source, self.source)
        try:
            await asyncio.to_thread(self._skip, handle)
            yield self.head
            sent = 0
            while chunk := await asyncio.to_thread(handle.read, UPLOAD_CHUNK):
                sent += len(chunk)
                yield chunk
                renew_call_deadline()
        finally:
            await asyncio.to_thread(handle.close)
        self._check(sent)
        yield self.tail


class MultipartUpload(FileBody):
    """A ``multipart/form-data`` body whose file part is read from disk chunk by chunk.

    The body has a known length (no chunked transfer encoding), which every vendor accepts.

    :param source: a local path or an ``ObjectStoragePath``.
    :param filename: the name sent in the form; defaults to the source's name.
    :param fields: plain form fields sent before the file (e.g. ``purpose``).
    :param size: the file size in bytes, when the caller already knows it.
    """

    content_type = "application/octet-stream"

    def __init__(
        self, source: PathSource, *, filename: str | None, fields: dict[str, str], size: int
    ) -> None:
        self.boundary = secrets.token_hex(16)
        super().__init__(
            source,
            filename=filename,
            size=size,
            content_type=f"multipart/form-data; boundary={self.boundary}",
        )
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
        handle, size = open_source(source)
        handle.close()
        return cls(source, filename=filename, fields=fields, size=size)


# A run of blank lines (whitespace only): skipped in one regex match, not line by line in Python.
_BLANK_RUN = re.compile(rb"[ \t\r\f\v\n]*\n")
_SPACE = frozenset(b" \t\r\f\v\n")
#: Most blank lines in a row a file may have: a real JSONL file has none, a newline bomb millions.
MAX_BLANK_RUN = 10_000


class LineSplitter:
    """Split a byte stream into numbered non-blank lines, holding at most one line in memory.

    Blank (whitespace-only) lines are counted in the numbering but not given; a run of them is
    skipped at C speed, and more than ``MAX_BLANK_RUN`` in a row is an error.

    :param max_line_bytes: longest line accepted; a longer one raises instead of growing the buffer.
    :param where: what is being read, for error messages (e.g. ``file 'file-abc'``).
    """

    def __init__(self, max_line_bytes: int, where: str) -> None:
        self.max_line_bytes = max_line_bytes
        self.where = where
        self.number = 0
        self._buffer = bytearray()
        # The buffer's first bytes, known to hold no newline: not searched again.
        self._searched = 0
        self._blank_run = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        buffer = self._buffer
        buffer += chunk
        start = 0
        while True:
            end = buffer.find(b"\n", max(start, self._searched))
            if end < 0:
                break
            if buffer[start] in _SPACE:
                run = _BLANK_RUN.match(buffer, start)
                if run is not None:
                    self._blank(buffer.count(b"\n", start, run.end()))
                    start = run.end()
                    continue
            self.number += 1
            self._blank_run = 0
            yield self.number, self._line(bytes(buffer[start:end]))
            start = end + 1
        if start:
            del buffer[:start]
        self._searched = len(buffer)
        if len(buffer) > self.max_line_bytes:
            raise BatchApiResponseError(
                f"{self.where} line {self.number + 1} is longer than {self.max_line_bytes:,} bytes"
            )

    def close(self) -> Iterator[tuple[int, bytes]]:
        if self._buffer:
            self.number += 1
            data = bytes(self._buffer)
            self._buffer.clear()
            self._searched = 0
            if data.strip():
                yield self.number, self._line(data)

    def _blank(self, count: int) -> None:
        """``count`` blank lines in a row: numbered, not given; too many in a row raise."""
        first = self.number - self._blank_run + 1
        self.number += count
        self._blank_run += count
        if self._blank_run > MAX_BLANK_RUN:
            raise BatchApiResponseError(
                f"{self.where} has more than {MAX_BLANK_RUN:,} blank lines in a row (from line {first:,}); "
                "not a JSONL file, stopped reading"
            )

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
    """Parse one JSONL line; bad JSON, or an object repeating a key, raises naming the file and line."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BatchApiResponseError(
            f"{where} line {number} is not valid JSON: {json_error_text(exc)}"
        ) from None
    ambiguous = repeated_key(data, obj)
    if ambiguous is not None:
        raise BatchApiResponseError(f"{where} line {number} {ambiguous}")
    return obj


def parse_json_body(response: httpx.Response, action: str, secret: Secrets) -> Any:
    """The JSON body of a successful response; anything else is a ``BatchApiResponseError``."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise BatchApiResponseError(
            f"{action}: the server answered {response.status_code} with a body that is not JSON ({exc})",
            status_code=response.status_code,
            request_id=request_id_of(response),
            # Redact before cutting: a key straddling the cut would otherwise leave a fragment.
            body=redact(response.text, secret)[:ERROR_BODY_LIMIT],
        ) from None


def request_id_of(response: httpx.Response) -> str | None:
    for name in REQUEST_ID_HEADERS:
        value = response.headers.get(name)
        if value:
            return value
    return None


def body_of(response: httpx.Response, secret: Secrets) -> Any:
    """The error body (parsed JSON if possible, else text), truncated and with the key removed."""
    if not response.content:
        return None
    try:
        return _redact_value(orjson.loads(response.content), secret)
    except orjson.JSONDecodeError:
        # Redact before cutting: a key straddling the cut would otherwise leave a fragment.
        return redact(response.content.decode("utf-8", errors="replace"), secret)[:ERROR_BODY_LIMIT]


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
    response: httpx.Response,
    *,
    action: str,
    what: str | None,
    base_url: str,
    secret: Secrets,
    auth_refused: bool = False,
    not_found: bool = False,
) -> BatchApiError:
    """The typed exception for a non-2xx response (the body must already be read).

    :param auth_refused: the dialect reads this answer as a refused key whatever its status
        (Google answers a wrong key with 400 ``API_KEY_INVALID``).
    :param not_found: the dialect reads this answer as "no such batch" whatever its status
        (Bedrock refuses an id that cannot be a job's with a 400 ValidationException).
    """
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
    if status in (401, 403) or auth_refused:
        reason = "rejected or lacks permission" if status == 403 else "rejected"
        return BatchApiAuthError(
            redact(
                f"{action}: the API key was {reason} by {base_url} (HTTP {status}); "
                f"check the connection's password{detail}",
                secret,
            ),
            **kwargs,
        )
    if status == 404 or not_found:
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


def transport_error(
    exc: Exception, *, action: str, secret: Secrets, base_url: str | None = None
) -> BatchApiConnectionError:
    """The error of a call that got no answer, naming the API root it tried (never the key).

    :param base_url: the connection's API root, so "Connection refused" says where.
    """
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    where = f" to {base_url}" if base_url else ""
    return BatchApiConnectionError(
        redact(f"{action}: the connection{where} {kind}: {type(exc).__name__}: {exc}", secret)
    )
