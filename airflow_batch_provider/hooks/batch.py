"""BatchApiHook: the Files + Batches API of any OpenAI-compatible vendor, sync and async.

The connection (type ``batch_api``) gives the API root URL (``host``), the key
(``password``) and, in extra, the ``dialect`` plus optional ``headers``,
``organization``, ``project``, ``timeout``, ``max_retries``, ``backoff_initial``,
``backoff_max``, ``retry_after_max``, ``max_download_bytes`` and ``allow_private_redirects``.
Every vendor difference comes from the dialect.

A file's content is read in decoded pieces and refused past ``max_download_bytes`` (default
8 GiB, after decompression). Its redirect may lead to another origin (an object store), sent
without credentials, and only over https or to loopback http, never to a private, link-local
or instance-metadata address (each hop, each resolved address) unless the connection sets
``allow_private_redirects: true``.

Creating a batch is not idempotent (each create is billed), so ``create_batch`` retries
only when the request provably did not reach the server (a connection that never opened,
408 or 429). After an ambiguous failure (read timeout, dropped connection, 5xx, 409) it
looks for the batch it may have created by the ``metadata`` it was given, returns that
batch if found and retries otherwise; without metadata it raises rather than risk paying
twice.

The hook does the I/O and little else; each concern lives in its own module, shared by
the sync methods and their ``a``-prefixed async twins: ``settings`` (the connection),
``calls`` (what each operation sends), ``attempts`` (retry decisions), ``lines`` (a file's
lines, resumed after a drop), ``results`` (result modes, pages and lines) and ``create``
(the create request and the lookup of the batch a lost create made).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Container, Iterable, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from datetime import datetime
from typing import Any, ClassVar, TypeVar

import httpx
from airflow.sdk import BaseHook

from airflow_batch_provider.constants import CONN_TYPE, DEFAULT_CONN_ID
from airflow_batch_provider.dialects import Dialect, ListPage, get_dialect
from airflow_batch_provider.exceptions import (
    BatchApiError,
    BatchApiResponseError,
    ConfigurationError,
)
from airflow_batch_provider.hooks import calls, checks
from airflow_batch_provider.hooks.attempts import AmbiguousCreate, BodyDropped, Restarts, Retries, SendOnce
from airflow_batch_provider.hooks.calls import Call
from airflow_batch_provider.hooks.connection_form import (
    CONN_FIELDS,
    UI_FIELD_BEHAVIOUR,
    legacy_form_widgets,
    legacy_ui_field_behaviour,
)
from airflow_batch_provider.hooks.create import (
    AMBIGUOUS_LOOKUPS,
    INLINE_SCAN,
    BatchCreate,
    InlineMatch,
    newest_created,
)
from airflow_batch_provider.hooks.lines import DOWNLOAD_CAP, LINES_PER_TURN, ResumableLines
from airflow_batch_provider.hooks.objects import ObjectLines, list_result_objects, read_summary
from airflow_batch_provider.hooks.redirects import acheck_hop, check_hop
from airflow_batch_provider.hooks.results import (
    MAX_BARREN_PAGES,
    Pages,
    result_files,
    result_line,
    result_line_or_bad,
    results_body,
    results_mode,
    results_pages,
    results_stream_url,
)
from airflow_batch_provider.hooks.resumable import ResumableUpload
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.hooks.settings import BatchApiSettings, settings_from_connection
from airflow_batch_provider.hooks.transport import (
    CallDeadline,
    FileBody,
    PathSource,
    aiter_decoded,
    aread_capped,
    arm_total_deadline,
    deadline_scope,
    iter_decoded,
    next_hop,
    origin_of,
    parse_json_body,
    read_capped,
    redact,
    redact_json,
)
from airflow_batch_provider.models import Batch, ResultLine
from airflow_batch_provider.staging import atomic_writer, resolve_path

T = TypeVar("T")

# Listing items read per turn of the event loop, so a page of 190,000 items (8 MB) never holds
# the loop for its whole parse.
PARSE_SLICE = 500
# A body larger than this is decoded in a thread (orjson + secret scan of a multi-MB page).
DECODE_IN_THREAD_BYTES = 256 << 10


class BatchApiHook(BaseHook):
    """Talk to an OpenAI-compatible Files + Batches API (OpenAI, Doubleword, ZeroGPU, xAI, ...).

    The sync methods use an ``httpx.Client`` and the ``a``-prefixed twins an
    ``httpx.AsyncClient``; both are built from the same settings. Async methods read the
    connection without blocking the event loop (``aget_settings``), so triggers can use them.

    :param batch_conn_id: the ``batch_api`` connection id.
    :param dialect: dialect name overriding the connection's ``dialect`` extra.
    :param timeout: read/write timeout in seconds overriding the connection's ``timeout``.
    :param max_retries: retries per call overriding the connection's ``max_retries``.
    :param retry_policy: a full retry policy (wins over ``max_retries`` and the extras).
    :param transport: an httpx transport for the sync client (tests, custom proxies).
    :param async_transport: an httpx transport for the async client.
    """

    conn_name_attr = "batch_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = CONN_TYPE
    hook_name = "LLM Batch API"

    conn_fields: ClassVar[dict[str, dict[str, Any]]] = CONN_FIELDS
    ui_field_behaviour: ClassVar[dict[str, Any]] = UI_FIELD_BEHAVIOUR

    def __init__(
        self,
        batch_conn_id: str = default_conn_name,
        *,
        dialect: str | Dialect | None = None,
        timeout: float | None = None,
        max_retries: int | None = None,
        retry_policy: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__()
        self._transport = transport
        self._async_transport = async_transport
        self.batch_conn_id = batch_conn_id
        self._dialect_override = get_dialect(dialect) if dialect is not None else None
        self._timeout = timeout
        self._max_retries = max_retries
        self._retry_policy = retry_policy
        self._settings: BatchApiSettings | None = None
        self._client: httpx.Client | None = None
        self._aclient: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"<BatchApiHook conn_id={self.batch_conn_id!r}>"

    # ---- connection form -----------------------------------------------------------------
    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Relabel and hide the standard fields (the pre-3.2 spelling of ``UI_FIELD_BEHAVIOUR``)."""
        return legacy_ui_field_behaviour()

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """Extra form fields for Airflow < 3.2 web servers that still build forms with wtforms.

        Airflow >= 3.2 reads ``CONN_FIELDS`` from the provider info instead and never calls this.
        """
        return legacy_form_widgets()

    # ---- settings --------------------------------------------------------------------------
    def _build_settings(
        self, conn: Any, raw_extra: Mapping[str, Any], inherited: Mapping[str, Any] | None = None
    ) -> BatchApiSettings:
        return settings_from_connection(
            self.batch_conn_id,
            conn,
            raw_extra,
            conn_type=self.conn_type,
            dialect=self._dialect_override,
            timeout=self._timeout,
            max_retries=self._max_retries,
            retry_policy=self._retry_policy,
            inherited=inherited,
        )

    def _inherited(self, conn: Any, raw_extra: Mapping[str, Any]) -> dict[str, Any]:
        """What the connection takes from the platform connection it signs with (blocking)."""
        from airflow_batch_provider.hooks.credentials import platform_extra
        from airflow_batch_provider.hooks.settings import connection_extra

        extra = connection_extra(raw_extra, self.conn_type)
        try:
            dialect = self._dialect_override or get_dialect(extra.get("dialect"))
        except ConfigurationError:
            return {}  # settings_from_connection says what is wrong with the dialect
        if dialect.credentials_kind is None:
            return {}
        return platform_extra(
            dialect.credentials_kind,
            extra,
            self.batch_conn_id,
            getattr(conn, "login", None),
            conn.password or extra.get("api_key"),
        )

    def get_settings(self) -> BatchApiSettings:
        """Resolve the connection once (blocking; use ``aget_settings`` in async code)."""
        if self._settings is None:
            conn = self.get_connection(self.batch_conn_id)
            raw_extra = conn.extra_dejson
            settings = self._build_settings(conn, raw_extra, self._inherited(conn, raw_extra))
            if settings.api_key:
                from airflow.sdk.log import mask_secret

                mask_secret(settings.api_key)
            self._settings = settings
        return self._settings

    async def aget_settings(self) -> BatchApiSettings:
        """Resolve the connection without blocking the event loop (safe in the triggerer)."""
        if self._settings is None:
            from airflow.providers.common.compat.connection import (
                get_async_connection,
                get_async_extra_dejson,
            )

            conn = await get_async_connection(self.batch_conn_id, self)
            raw_extra = await get_async_extra_dejson(conn)
            # Reading the platform connection (the aws one's region) blocks: a thread, once.
            inherited = await asyncio.to_thread(self._inherited, conn, raw_extra)
            settings = self._build_settings(conn, raw_extra, inherited)
            if settings.api_key:
                await _amask_secret(settings.api_key)
            # Concurrent first calls (a trigger polls its batches together) all await above;
            # the first to finish wins, so every caller shares one settings object.
            if self._settings is None:
                self._settings = settings
        return self._settings

    @property
    def dialect(self) -> Dialect:
        """The dialect: the constructor's, else the connection's ``dialect`` extra, else openai.

        Once the connection is read, the dialect as configured by it (``Dialect.configure``).
        """
        if self._dialect_override is not None and self._settings is None:
            return self._dialect_override
        return self.get_settings().dialect

    # ---- clients ---------------------------------------------------------------------------
    def get_conn(self) -> httpx.Client:
        """The sync ``httpx.Client`` (created on first use)."""
        if self._client is None:
            self._client = httpx.Client(transport=self._transport, **self.get_settings().client_kwargs())
            if self._transport is None:
                arm_total_deadline(self._client)
        return self._client

    async def aget_conn(self) -> httpx.AsyncClient:
        """The async ``httpx.AsyncClient`` (created on first use)."""
        if self._aclient is None:
            settings = await self.aget_settings()
            # Checked again after the await: a concurrent first call may have built it meanwhile,
            # and a second client would be overwritten without ever being closed.
            if self._aclient is None:
                self._aclient = httpx.AsyncClient(transport=self._async_transport, **settings.client_kwargs())
        return self._aclient

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        # A token auth's credential holds its own session (see ``Dialect.request_auth``).
        closer = getattr(self._settings.auth, "close", None) if self._settings else None
        if closer is not None:
            closer()

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None
        closer = getattr(self._settings.auth, "aclose", None) if self._settings else None
        if closer is not None:
            await closer()

    def __enter__(self) -> BatchApiHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> BatchApiHook:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- the request core ------------------------------------------------------------------
    # Two entry points per client: ``_request`` for idempotent calls (retried per the policy)
    # and ``_send_once`` for a create (repeated only when provably unsent or refused, else
    # ``AmbiguousCreate``). What is sent comes from ``calls``, the decisions from ``attempts``;
    # the loops below only do I/O. Each attempt has a total deadline of the connection's timeout.
    def _request(self, call: Call) -> httpx.Response:
        """Send an idempotent call with retries; a 2xx response (open if streamed) or a typed error."""
        return self._call(call, Retries(self.get_settings(), call.action, call.what, self.log))

    async def _arequest(self, call: Call) -> httpx.Response:
        """The async twin of ``_request``."""
        settings = await self.aget_settings()
        return await self._acall(call, Retries(settings, call.action, call.what, self.log))

    def _send_once(self, call: Call) -> httpx.Response:
        """Send a non-idempotent call; raises ``AmbiguousCreate`` when it may have been acted on."""
        return self._call(call, SendOnce(self.get_settings(), call.action, call.what, self.log))

    async def _asend_once(self, call: Call) -> httpx.Response:
        """The async twin of ``_send_once``."""
        settings = await self.aget_settings()
        return await self._acall(call, SendOnce(settings, call.action, call.what, self.log))

    def _call(self, call: Call, retries: Retries) -> httpx.Response:
        client = self.get_conn()
        while True:
            request = call.build(client, call.upload.iter_sync() if call.upload else None)
            try:
                response = self._exchange(client, request, call)
            except BodyDropped as dropped:
                time.sleep(retries.body_dropped(dropped.error))
                continue
            except httpx.TransportError as exc:
                time.sleep(retries.transport_failed(exc))
                continue
            if response.is_success:
                return response
            response.read()
            response.close()
            if response.status_code in call.accept:
                return response
            time.sleep(retries.status_failed(response))

    async def _acall(self, call: Call, retries: Retries) -> httpx.Response:
        client = await self.aget_conn()
        while True:
            request = call.build(client, call.upload.aiter() if call.upload else None)
            try:
                response = await self._aexchange(client, request, call)
            except BodyDropped as dropped:
                await asyncio.sleep(retries.body_dropped(dropped.error))
                continue
            except httpx.TransportError as exc:
                await asyncio.sleep(retries.transport_failed(exc))
                continue
            if response.is_success:
                return response
            await response.aread()
            await response.aclose()
            if response.status_code in call.accept:
                return response
            await asyncio.sleep(retries.status_failed(response))

    def _exchange(self, client: httpx.Client, request: httpx.Request, call: Call) -> httpx.Response:
        """One attempt: redirects within the origin, a total deadline, a bounded body unless streamed."""
        settings = self._settings
        assert settings is not None
        with deadline_scope(CallDeadline(settings.timeout)):
            hops = 0
            while True:
                response = client.send(request, stream=True)
                if not response.has_redirect_location:
                    break
                response.close()
                # next_hop raises past MAX_REDIRECTS hops or for another origin.
                request = next_hop(
                    request, response, hops=hops, action=call.action, foreign=call.foreign_redirects
                )
                hops += 1
                # Every hop away from the connection's own origin: its host and addresses.
                if origin_of(request.url) != origin_of(client.base_url):
                    check_hop(request.url, action=call.action, allow_private=settings.allow_private_redirects)
            if not (call.stream and response.is_success):
                try:
                    read_capped(response, call.max_body, call.action)
                except httpx.TransportError as exc:
                    if response.is_success:
                        raise BodyDropped(exc) from exc
                    raise
        return response

    async def _aexchange(
        self, client: httpx.AsyncClient, request: httpx.Request, call: Call
    ) -> httpx.Response:
        """Async twin of ``_exchange``; the deadline is an ``asyncio.timeout`` around the attempt."""
        settings = self._settings
        assert settings is not None
        deadline = CallDeadline(settings.timeout)
        response: httpx.Response | None = None
        try:
            with deadline_scope(deadline):
                async with asyncio.timeout(settings.timeout) as deadline.timer:
                    hops = 0
                    while True:
                        response = await client.send(request, stream=True)
                        if not response.has_redirect_location:
                            break
                        await response.aclose()
                        request = next_hop(
                            request, response, hops=hops, action=call.action, foreign=call.foreign_redirects
                        )
                        hops += 1
                        # Every hop away from the connection's own origin: its host and addresses.
                        if origin_of(request.url) != origin_of(client.base_url):
                            await acheck_hop(
                                request.url,
                                action=call.action,
                                allow_private=settings.allow_private_redirects,
                            )
                    if not (call.stream and response.is_success):
                        try:
                            await aread_capped(response, call.max_body, call.action)
                        except httpx.TransportError as exc:
                            if response.is_success:
                                raise BodyDropped(exc) from exc
                            raise
        except TimeoutError:
            if response is not None:
                await response.aclose()
            raise httpx.ReadTimeout(
                f"no complete answer within the call's total deadline of {settings.timeout:g}s",
                request=request,
            ) from None
        return response

    def _json(self, response: httpx.Response, action: str) -> Any:
        # Every batch, file and list object is parsed here: a key the vendor echoed is removed once.
        secrets = self._settings.secrets if self._settings else ()
        return redact_json(parse_json_body(response, action, secrets), secrets, response.content)

    async def _ajson(self, response: httpx.Response, action: str) -> Any:
        """``_json`` for the event loop: a large body is decoded (and cleaned) in a thread.

        CPU work on bytes already read, not a sync client: the loop keeps serving triggers while
        a multi-MB listing page is decoded.
        """
        if len(response.content) > DECODE_IN_THREAD_BYTES:
            return await asyncio.to_thread(self._json, response, action)
        return self._json(response, action)

    def _json_object(self, response: httpx.Response, action: str) -> dict[str, Any]:
        data = self._json(response, action)
        if not isinstance(data, dict):
            raise BatchApiResponseError(f"{action}: expected a JSON object, got {type(data).__name__}")
        return data

    def _batch_of(self, response: httpx.Response, action: str) -> Batch:
        assert self._settings is not None
        return self._settings.dialect.parse_batch(self._json_object(response, action))

    # ---- files -----------------------------------------------------------------------------
    def _uploaded(self, response: httpx.Response, call: Call) -> str:
        assert self._settings is not None and call.upload is not None
        file_id = self._settings.dialect.parse_file_id(self._json_object(response, call.action))
        self.log.info("Uploaded %s (%d bytes) as file %s", call.upload.filename, call.upload.size, file_id)
        return file_id

    def upload_file(self, source: PathSource, *, filename: str | None = None) -> str:
        """Upload a batch input file, streamed from disk or object storage; return its file id.

        :param source: a local path or an ``ObjectStoragePath``.
        :param filename: the name the vendor records; defaults to the source's name.
        """
        dialect = self.get_settings().dialect
        if dialect.upload_protocol == "resumable":
            return self._upload_resumable(source, filename)
        call = calls.upload(dialect, calls.upload_body(source, filename, dialect))
        return self._uploaded(self._request(call), call)

    def _upload_resumable(self, source: PathSource, filename: str | None) -> str:
        """Upload through the resumable protocol: start a session, send the bytes, and after a
        drop or a retryable failure send the rest from the offset the session reports."""
        settings = self.get_settings()
        upload = ResumableUpload(settings, source, filename, self.log)
        # An unused session costs nothing, so the start is retried like any idempotent call.
        upload.started(self._request(upload.start))
        client = self.get_conn()
        while True:
            call = upload.send()
            assert call.upload is not None
            try:
                response = self._exchange(client, call.build(client, call.upload.iter_sync()), call)
            except BodyDropped as dropped:
                # The answer broke off after its status: the session says what it holds.
                time.sleep(upload.retries.body_dropped(dropped.error))
            except httpx.TransportError as exc:
                time.sleep(upload.retries.transport_failed(exc))
            else:
                if response.is_success:
                    upload.finished(response)
                    return self._uploaded_file(response, upload)
                time.sleep(upload.retries.status_failed(response))
            query = self._request(upload.query())
            if upload.queried(query):
                return self._uploaded_file(query, upload)

    def _uploaded_file(self, response: httpx.Response, upload: ResumableUpload) -> str:
        assert self._settings is not None
        file_id = self._settings.dialect.parse_file_id(self._json_object(response, upload.action))
        self.log.info(
            "Uploaded %s (%d bytes, %d resume(s)) as file %s",
            upload.filename,
            upload.size,
            upload.resumes,
            file_id,
        )
        return file_id

    async def aupload_file(self, source: PathSource, *, filename: str | None = None) -> str:
        """Async twin of ``upload_file`` (file reads run in a worker thread)."""
        settings = await self.aget_settings()
        dialect = settings.dialect
        if dialect.upload_protocol == "resumable":
            return await self._aupload_resumable(source, filename)
        call = calls.upload(dialect, await asyncio.to_thread(calls.upload_body, source, filename, dialect))
        return self._uploaded(await self._arequest(call), call)

    async def _aupload_resumable(self, source: PathSource, filename: str | None) -> str:
        """Async twin of ``_upload_resumable``."""
        settings = await self.aget_settings()
        upload = await asyncio.to_thread(ResumableUpload, settings, source, filename, self.log)
        upload.started(await self._arequest(upload.start))
        client = await self.aget_conn()
        while True:
            call = upload.send()
            assert call.upload is not None
            try:
                response = await self._aexchange(client, call.build(client, call.upload.aiter()), call)
            except BodyDropped as dropped:
                await asyncio.sleep(upload.retries.body_dropped(dropped.error))
            except httpx.TransportError as exc:
                await asyncio.sleep(upload.retries.transport_failed(exc))
            else:
                if response.is_success:
                    upload.finished(response)
                    return self._uploaded_file(response, upload)
                await asyncio.sleep(upload.retries.status_failed(response))
            query = await self._arequest(upload.query())
            if upload.queried(query):
                return self._uploaded_file(query, upload)

    def get_file(self, file_id: str) -> dict[str, Any]:
        """The vendor's file object."""
        call = calls.get_file(self.dialect, file_id)
        return self._json_object(self._request(call), call.action)

    async def aget_file(self, file_id: str) -> dict[str, Any]:
        call = calls.get_file((await self.aget_settings()).dialect, file_id)
        return self._json_object(await self._arequest(call), call.action)

    def delete_file(self, file_id: str) -> None:
        """Delete a file at the vendor."""
        self._request(calls.delete_file(self.dialect, file_id))

    async def adelete_file(self, file_id: str) -> None:
        await self._arequest(calls.delete_file((await self.aget_settings()).dialect, file_id))

    def download_file(self, file_id: str, dest: PathSource) -> int:
        """Stream a file's content to ``dest``; the file appears complete or not at all.

        A dropped connection restarts the download (bounded by the retry policy).

        :param file_id: the vendor file id.
        :param dest: a local path or an ``ObjectStoragePath``.
        :return: the number of bytes written.
        """
        settings = self.get_settings()
        call = calls.file_content(settings.dialect, file_id, f"downloading file {file_id}")
        restarts = Restarts(settings, call.action, self.log)
        while True:
            try:
                with atomic_writer(resolve_path(dest)) as handle:
                    response = self._request(call)
                    written = 0
                    try:
                        for chunk in iter_decoded(
                            response,
                            limit=settings.max_download_bytes,
                            action=call.action,
                            cap=DOWNLOAD_CAP,
                            progress=settings.timeout,
                        ):
                            handle.write(chunk)
                            written += len(chunk)
                    finally:
                        response.close()
                self.log.info("Downloaded file %s (%d bytes) to %s", file_id, written, dest)
                return written
            except httpx.TransportError as exc:
                time.sleep(restarts.dropped(exc))

    async def adownload_file(self, file_id: str, dest: PathSource) -> int:
        """Async twin of ``download_file`` (file writes run in a worker thread)."""
        settings = await self.aget_settings()
        call = calls.file_content(settings.dialect, file_id, f"downloading file {file_id}")
        restarts = Restarts(settings, call.action, self.log)
        while True:
            try:
                async with _aatomic_writer(dest) as handle:
                    response = await self._arequest(call)
                    written = 0
                    try:
                        async for chunk in aiter_decoded(
                            response,
                            limit=settings.max_download_bytes,
                            action=call.action,
                            cap=DOWNLOAD_CAP,
                            progress=settings.timeout,
                        ):
                            await asyncio.to_thread(handle.write, chunk)
                            written += len(chunk)
                    finally:
                        await response.aclose()
                self.log.info("Downloaded file %s (%d bytes) to %s", file_id, written, dest)
                return written
            except httpx.TransportError as exc:
                await asyncio.sleep(restarts.dropped(exc))

    def iter_file_lines(self, file_id: str) -> Iterator[dict[str, Any]]:
        """Stream a JSONL file's objects, one line in memory at a time.

        A dropped connection re-requests the file and skips the lines already yielded.
        """
        for _, obj in self._iter_jsonl(file_id):
            yield obj

    def iter_raw_lines(self, file_id: str) -> Iterator[tuple[int, bytes]]:
        """``(line number, bytes)`` of a JSONL file's non-blank lines, unparsed (keys redacted),
        for a warehouse that parses them itself; resumes like ``iter_file_lines``."""
        return self._iter_jsonl(file_id, raw=True)

    def _iter_jsonl(
        self, file_id: str, *, lenient: bool = False, raw: bool = False, call: Call | None = None
    ) -> Iterator[tuple[int, Any]]:
        """``(line number, object)``; with ``lenient`` a bad line gives its error instead of raising.

        :param call: the request reading the stream, when it is not the file's content.
        """
        lines = ResumableLines(self.get_settings(), file_id, self.log, lenient=lenient, raw=raw, call=call)
        while True:
            try:
                lines.attempt()
                response = self._request(lines.call)
                try:
                    for piece in iter_decoded(
                        response,
                        limit=lines.limit,
                        action=lines.action,
                        cap=DOWNLOAD_CAP,
                        progress=lines.timeout,
                    ):
                        yield from lines.feed(piece)
                finally:
                    response.close()
                yield from lines.end()
                return
            except httpx.TransportError as exc:
                time.sleep(lines.dropped(exc))

    async def aiter_file_lines(self, file_id: str) -> AsyncIterator[dict[str, Any]]:
        """Async twin of ``iter_file_lines``."""
        async for _, obj in self._aiter_jsonl(file_id):
            yield obj

    async def aiter_raw_lines(self, file_id: str) -> AsyncIterator[tuple[int, bytes]]:
        """Async twin of ``iter_raw_lines``."""
        async for item in self._aiter_jsonl(file_id, raw=True):
            yield item

    async def _aiter_jsonl(
        self, file_id: str, *, lenient: bool = False, raw: bool = False, call: Call | None = None
    ) -> AsyncIterator[tuple[int, Any]]:
        """Async twin of ``_iter_jsonl``."""
        lines = ResumableLines(
            await self.aget_settings(), file_id, self.log, lenient=lenient, raw=raw, call=call
        )
        # Lines given, for the loop's turns: the consumer may not await between them.
        given = 0
        while True:
            try:
                lines.attempt()
                response = await self._arequest(lines.call)
                try:
                    async for piece in aiter_decoded(
                        response,
                        limit=lines.limit,
                        action=lines.action,
                        cap=DOWNLOAD_CAP,
                        progress=lines.timeout,
                    ):
                        for item in lines.feed(piece):
                            yield item
                            given += 1
                            if given % LINES_PER_TURN == 0:
                                await asyncio.sleep(0)
                        # A decoded MiB of blank or skipped lines gives nothing: a turn for the loop anyway.
                        await asyncio.sleep(0)
                finally:
                    await response.aclose()
                for item in lines.end():
                    yield item
                return
            except httpx.TransportError as exc:
                await asyncio.sleep(lines.dropped(exc))

    # ---- batches ---------------------------------------------------------------------------
    def create_batch(
        self,
        *,
        input_file_id: str | None = None,
        endpoint: str,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        model: str | None = None,
        inline: FileBody | None = None,
        output_uri: str | None = None,
        not_these: Iterable[str] = (),
    ) -> Batch:
        """Create a batch from an uploaded file, never paying twice for one call.

        Retries only attempts that provably did not reach the server (connect errors, 408,
        429). After an ambiguous failure (timeout, dropped connection, 5xx, 409) it lists
        batches for one carrying ``metadata`` (or ``name`` for dialects without metadata)
        and returns it if found, else retries; with nothing to look for it raises.

        :param input_file_id: the uploaded input file.
        :param endpoint: the url every line targets, e.g. ``/v1/chat/completions``.
        :param completion_window: the vendor's window, ``24h`` by default.
        :param metadata: tags identifying the run; also how a lost create is found again.
        :param name: a batch name, for dialects that name batches.
        :param model: the one model of the file, for dialects that put the model on the job.
        :param inline: for a dialect whose ``submission_mode`` is "inline", the create body (the
            encoded requests) streamed from a local file, instead of ``input_file_id``. Such a
            vendor's batches carry no tags: after an ambiguous failure the batch is looked for
            by its creation time and request count (``inline.requests``; one match is adopted,
            several raise, none retries); without a count the failure is raised.
        :param output_uri: for a dialect whose ``submission_mode`` is "object_store", the prefix the
            job writes its results under; ``input_file_id`` is then the encoded input's URI.
        :param not_these: ids of batches known not to be this create's (the caller's other
            shards), left out of that lookup.
        """
        settings = self.get_settings()
        create = BatchCreate(
            settings,
            self.log,
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            name,
            model=model,
            inline=inline,
            output_uri=output_uri,
            not_these=not_these,
        )
        while True:
            try:
                response = self._send_once(create.call)
                return create.created(self._batch_of(response, create.action))
            except AmbiguousCreate as exc:
                tags = create.failed(exc)
                for _ in range(AMBIGUOUS_LOOKUPS):
                    time.sleep(create.settle(exc))
                    match = create.inline_match()
                    try:
                        if match is None:
                            found = self.find_created_batch(
                                tags, input_file_id=input_file_id, since=create.since
                            )
                        else:
                            found = create.one_inline(exc, self.find_inline_batches(match))
                    except BatchApiError as lookup:
                        raise create.lookup_failed(exc, lookup) from lookup
                    if found is not None:
                        return create.adopt(found)

    async def acreate_batch(
        self,
        *,
        input_file_id: str | None = None,
        endpoint: str,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        model: str | None = None,
        inline: FileBody | None = None,
        output_uri: str | None = None,
        not_these: Iterable[str] = (),
    ) -> Batch:
        """Async twin of ``create_batch`` (same duplicate protection)."""
        settings = await self.aget_settings()
        create = BatchCreate(
            settings,
            self.log,
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            name,
            model=model,
            inline=inline,
            output_uri=output_uri,
            not_these=not_these,
        )
        while True:
            try:
                response = await self._asend_once(create.call)
                return create.created(self._batch_of(response, create.action))
            except AmbiguousCreate as exc:
                tags = create.failed(exc)
                for _ in range(AMBIGUOUS_LOOKUPS):
                    await asyncio.sleep(create.settle(exc))
                    match = create.inline_match()
                    try:
                        if match is None:
                            found = await self.afind_created_batch(
                                tags, input_file_id=input_file_id, since=create.since
                            )
                        else:
                            found = create.one_inline(exc, await self.afind_inline_batches(match))
                    except BatchApiError as lookup:
                        raise create.lookup_failed(exc, lookup) from lookup
                    if found is not None:
                        return create.adopt(found)

    def get_batch(self, batch_id: str) -> Batch:
        """The batch, normalised by the dialect."""
        call = calls.get_batch(self.dialect, batch_id)
        return self._batch_of(self._request(call), call.action)

    async def aget_batch(self, batch_id: str) -> Batch:
        call = calls.get_batch((await self.aget_settings()).dialect, batch_id)
        return self._batch_of(await self._arequest(call), call.action)

    def _cancelled(self, response: httpx.Response, batch_id: str, action: str) -> Batch | None:
        """The batch a cancel answered, or None when it must be read (final already, or no body)."""
        if not response.is_success:
            self.log.info("Batch %s is already final (HTTP %d to cancel)", batch_id, response.status_code)
            return None
        self.log.info("Cancel requested for batch %s", batch_id)
        if response.content.strip() in (b"", b"{}"):
            # Some servers answer a cancel with an empty body (Google: an empty object); read
            # the batch instead.
            return None
        return self._batch_of(response, action)

    def cancel_batch(self, batch_id: str) -> Batch:
        """Ask the vendor to cancel a batch (repeatable: cancelling twice is harmless)."""
        call = calls.cancel_batch(self.dialect, batch_id)
        return self._cancelled(self._request(call), batch_id, call.action) or self.get_batch(batch_id)

    async def acancel_batch(self, batch_id: str) -> Batch:
        call = calls.cancel_batch((await self.aget_settings()).dialect, batch_id)
        response = await self._arequest(call)
        return self._cancelled(response, batch_id, call.action) or await self.aget_batch(batch_id)

    def list_batches(
        self,
        *,
        page_size: int | None = None,
        limit: int | None = None,
        known: Mapping[str, Batch] | None = None,
        where: Mapping[str, str] | None = None,
        since: datetime | None = None,
    ) -> Iterator[Batch]:
        """Every batch visible to the key, newest first, following pagination.

        A listed item that does not parse is left out (logged), not an error of the listing.

        :param page_size: batches per request (the dialect's default if None).
        :param limit: stop after this many batches (all if None).
        :param known: batches read before, by id: one the vendor shows unchanged is given back
            as it is, not parsed again (what a poller listing the same batches each cycle wants).
        :param where: metadata pairs the vendor's listing may filter by (``dialect.filter_params``);
            a listing without a filter ignores it, so callers still check each batch's tags.
        :param since: with ``where``, no batch looked for was created before this moment (a
            listing that filters by creation time may use it; see ``dialect.filter_params``).
        """
        pages = self.list_batch_pages(page_size=page_size, limit=limit, known=known, where=where, since=since)
        for page in pages:
            yield from page.batches

    def list_batch_pages(
        self,
        *,
        page_size: int | None = None,
        limit: int | None = None,
        known: Mapping[str, Batch] | None = None,
        wanted: Container[str] | None = None,
        where: Mapping[str, str] | None = None,
        since: datetime | None = None,
    ) -> Iterator[ListPage]:
        """The listing page by page, with the items of each that do not parse (see ``list_batches``).

        :param wanted: parse only the items of these batch ids (a poller reading its triggers'
            batches); the others are counted in ``ListPage.skipped``, not parsed (None: all).
        :param where: metadata pairs the vendor's listing may filter by (see ``list_batches``).
        :param since: when the batches looked for were first intended (see ``list_batches``).
        """
        dialect = self.dialect
        params = {**dialect.list_params(page_size), **_filter(dialect, where, since)}
        pages = Pages(calls.LIST_ACTION, params, limit=limit, barren=MAX_BARREN_PAGES)
        while pages.params is not None:
            response = self._request(calls.list_batches(dialect, pages.params))
            items, next_params = dialect.list_envelope(self._json(response, pages.action), pages.params)
            page = ListPage([], next_params)
            page = _read_items(dialect, items, known, wanted, page)
            yield self._listed(pages, page)
            pages.turn()

    async def alist_batches(
        self,
        *,
        page_size: int | None = None,
        limit: int | None = None,
        known: Mapping[str, Batch] | None = None,
        where: Mapping[str, str] | None = None,
        since: datetime | None = None,
    ) -> AsyncIterator[Batch]:
        """Async twin of ``list_batches``."""
        pages = self.alist_batch_pages(
            page_size=page_size, limit=limit, known=known, where=where, since=since
        )
        async with aclosing(pages):  # type: ignore[type-var]
            async for page in pages:
                for batch in page.batches:
                    yield batch

    async def alist_batch_pages(
        self,
        *,
        page_size: int | None = None,
        limit: int | None = None,
        known: Mapping[str, Batch] | None = None,
        wanted: Container[str] | None = None,
        where: Mapping[str, str] | None = None,
        since: datetime | None = None,
    ) -> AsyncIterator[ListPage]:
        """Async twin of ``list_batch_pages``: a large page is decoded in a thread and read in
        slices, so the event loop is never held for the whole page.

        :param wanted: parse only the items of these batch ids (a poller reading its triggers'
            batches); the others are counted in ``ListPage.skipped``, not parsed (None: all).
        :param where: metadata pairs the vendor's listing may filter by (see ``list_batches``).
        :param since: when the batches looked for were first intended (see ``list_batches``).
        """
        dialect = (await self.aget_settings()).dialect
        params = {**dialect.list_params(page_size), **_filter(dialect, where, since)}
        pages = Pages(calls.LIST_ACTION, params, limit=limit, barren=MAX_BARREN_PAGES)
        while pages.params is not None:
            response = await self._arequest(calls.list_batches(dialect, pages.params))
            raw = await self._ajson(response, pages.action)
            items, next_params = dialect.list_envelope(raw, pages.params)
            page = ListPage([], next_params)
            for start in range(0, len(items), PARSE_SLICE):
                if start:
                    # The triggers (and everything else on the loop) run between slices.
                    await asyncio.sleep(0)
                page = _read_items(dialect, items[start : start + PARSE_SLICE], known, wanted, page)
            yield self._listed(pages, page)
            pages.turn()

    def _listed(self, pages: Pages, page: ListPage) -> ListPage:
        """The page as given (cut at the listing's limit); its unreadable items are logged."""
        if page.unreadable:
            first = page.unreadable[0]
            self.log.warning(
                "%s: %d listed item(s) could not be read and were left out (first: %s)",
                pages.action,
                len(page.unreadable),
                first.error,
            )
        read = len(page.batches) + len(page.unreadable) + page.skipped
        batches = list(pages.take(page.batches, page.next_params, read=read))
        return ListPage(batches, pages.next_params, page.unreadable, page.skipped)

    def find_batches(
        self, metadata: Mapping[str, str], *, limit: int | None = 1000, since: datetime | None = None
    ) -> list[Batch]:
        """Batches whose tags (``dialect.metadata_of``) contain every pair of ``metadata``.

        :param metadata: the pairs to match; empty matches nothing.
        :param limit: how many batches to scan at most (newest first).
        :param since: none of them was created before this moment by this machine's clock (a
            listing that filters by creation time asks for those after it, less clock skew).
        """
        if not metadata:
            return []
        return _tagged(self.dialect, metadata, self.list_batches(limit=limit, where=metadata, since=since))

    async def afind_batches(
        self, metadata: Mapping[str, str], *, limit: int | None = 1000, since: datetime | None = None
    ) -> list[Batch]:
        """Async twin of ``find_batches``."""
        if not metadata:
            return []
        dialect = (await self.aget_settings()).dialect
        listed = self.alist_batches(limit=limit, where=metadata, since=since)
        return _tagged(dialect, metadata, [b async for b in listed])

    def find_created_batch(
        self,
        tags: Mapping[str, str],
        *,
        input_file_id: str | None = None,
        accept: Callable[[Batch], bool] | None = None,
        since: datetime | None = None,
    ) -> Batch | None:
        """The batch a create tagged ``tags`` made, when a lost answer or a crash hid it; else None.

        The newest batch carrying every pair of ``tags``, made from ``input_file_id`` (when
        given) and taken by ``accept`` (when given).

        :param tags: the metadata (or, without metadata, ``name``) the create carried.
        :param input_file_id: the create's input file; a batch made from another is not it.
        :param accept: a further test a batch must pass (the submit operator skips dead ones).
        :param since: when the create was first intended (a listing filtered by time uses it).
        """
        found = self.find_batches(tags, since=since)
        return newest_created(found, input_file_id=input_file_id, accept=accept)

    async def afind_created_batch(
        self,
        tags: Mapping[str, str],
        *,
        input_file_id: str | None = None,
        accept: Callable[[Batch], bool] | None = None,
        since: datetime | None = None,
    ) -> Batch | None:
        """Async twin of ``find_created_batch``."""
        found = await self.afind_batches(tags, since=since)
        return newest_created(found, input_file_id=input_file_id, accept=accept)

    def find_inline_batches(self, match: InlineMatch) -> InlineMatch:
        """Read the listing (newest first) into ``match`` until it is past ``match.since``: the
        batches that may be a lost inline create (no tags: by creation time and request count)."""
        for batch in self.list_batches(limit=INLINE_SCAN):
            if not match.see(batch):
                break
        return match

    async def afind_inline_batches(self, match: InlineMatch) -> InlineMatch:
        """Async twin of ``find_inline_batches``."""
        async for batch in self.alist_batches(limit=INLINE_SCAN):
            if not match.see(batch):
                break
        return match

    # ---- results ---------------------------------------------------------------------------
    def _results_page(self, dialect: Dialect, pages: Pages, response: httpx.Response) -> list[ResultLine]:
        """The lines of the page just read; a page past the batch's size raises."""
        assert pages.params is not None
        page = dialect.parse_results_page(
            results_body(response, pages.action, self._settings), pages.params, response.headers
        )
        return list(pages.take(page.lines, page.next_params))

    def iter_results(
        self, batch: Batch | str, *, mode: str | None = None, on_bad_line: str = "fail"
    ) -> Iterator[ResultLine]:
        """Every result line of a batch, normalised and streamed.

        Reads the output file then the error file when the batch has them (and the dialect
        offers files), else pages the batch's results endpoint.

        :param batch: the batch or its id.
        :param mode: force ``files``, ``results_endpoint`` or ``results_url`` (the one JSONL
            stream an ended batch names; resumed after a drop like a file).
        :param on_bad_line: a result file line that is not JSON, not an object or unreadable by
            the dialect: ``fail`` (raise naming it) or ``record`` (yield it as a failed line with
            code ``invalid_result_line``, the reason, file and line, and the custom_id it has, or "").
        """
        dialect = self.dialect
        if isinstance(batch, str):
            batch = self.get_batch(batch)
        chosen = results_mode(dialect, batch, mode)
        read = result_line_or_bad if on_bad_line == "record" else result_line
        if chosen == "files":
            for file_id, source in result_files(batch):
                for number, obj in self._iter_jsonl(file_id, lenient=on_bad_line == "record"):
                    yield read(dialect, obj, source, file_id, number)
            return
        if chosen == "object_store":
            yield from self._iter_objects(batch, read, lenient=on_bad_line == "record")
            return
        if chosen == "results_url":
            url = results_stream_url(self.get_settings(), batch)
            if url is None:
                return
            call = calls.results_stream(url, batch.id, f"reading results of batch {batch.id}")
            for number, obj in self._iter_jsonl(batch.id, lenient=on_bad_line == "record", call=call):
                yield read(dialect, obj, "output", f"results of batch {batch.id}", number)
            return
        pages = results_pages(dialect, batch)
        while pages.params is not None:
            call = calls.results_page(dialect, batch.id, pages.params, pages.action)
            yield from self._results_page(dialect, pages, self._request(call))
            pages.turn()

    async def aiter_results(
        self, batch: Batch | str, *, mode: str | None = None, on_bad_line: str = "fail"
    ) -> AsyncIterator[ResultLine]:
        """Async twin of ``iter_results``."""
        dialect = (await self.aget_settings()).dialect
        if isinstance(batch, str):
            batch = await self.aget_batch(batch)
        chosen = results_mode(dialect, batch, mode)
        read = result_line_or_bad if on_bad_line == "record" else result_line
        if chosen == "files":
            for file_id, source in result_files(batch):
                async for number, obj in self._aiter_jsonl(file_id, lenient=on_bad_line == "record"):
                    yield read(dialect, obj, source, file_id, number)
            return
        if chosen == "object_store":
            # Read by the merge (a worker), not a trigger: the object store's client is blocking,
            # so lines are read in a thread a slice at a time and the event loop stays free.
            lines = self._iter_objects(batch, read, lenient=on_bad_line == "record")
            while True:
                chunk = await asyncio.to_thread(_take, lines, LINES_PER_TURN)
                for line in chunk:
                    yield line
                if len(chunk) < LINES_PER_TURN:
                    return
        if chosen == "results_url":
            url = results_stream_url(await self.aget_settings(), batch)
            if url is None:
                return
            call = calls.results_stream(url, batch.id, f"reading results of batch {batch.id}")
            async for number, obj in self._aiter_jsonl(batch.id, lenient=on_bad_line == "record", call=call):
                yield read(dialect, obj, "output", f"results of batch {batch.id}", number)
            return
        pages = results_pages(dialect, batch)
        while pages.params is not None:
            call = calls.results_page(dialect, batch.id, pages.params, pages.action)
            for line in self._results_page(dialect, pages, await self._arequest(call)):
                yield line
            pages.turn()

    def _iter_objects(
        self, batch: Batch, read: Callable[..., ResultLine], *, lenient: bool
    ) -> Iterator[ResultLine]:
        """The result lines of an "object_store" batch: every result object under its output
        prefix (found by listing), then its summary's totals checked against the lines read."""
        settings = self.get_settings()
        dialect = settings.dialect
        counts = {"output": 0, "error": 0}
        summaries = []
        for obj in list_result_objects(dialect, batch, dialect.storage_conn_id):
            if obj.kind == "summary":
                summaries.append(obj)
                continue
            for number, item in ObjectLines(settings, obj, self.log, lenient=lenient):
                yield read(dialect, item, obj.kind, obj.relative, number)
                counts[obj.kind] += 1
        for summary in summaries:
            problem = dialect.check_summary(batch, read_summary(summary), counts)
            if problem is not None:
                raise BatchApiResponseError(f"batch {batch.id}: {summary.relative}: {problem}")

    # ---- connection test -------------------------------------------------------------------
    def test_connection(self) -> tuple[bool, str]:
        """List one batch and report each check: reachable (the API answered), authenticated (no
        401/403) and dialect (the answer is in the configured vendor's shape, else which one it
        looks like). One message, secrets redacted; never raises."""
        try:
            settings = self.get_settings()
        except Exception as exc:
            secret = self._settings.secrets if self._settings else None
            return False, redact(f"The connection is not usable: {type(exc).__name__}: {exc}", secret)
        dialect = settings.dialect
        target = f"{settings.base_url} as {dialect.label}"
        try:
            params = dialect.list_params(1)
            call = calls.list_batches(dialect, params)
            try:
                answer = self._json_object(self._request(call), call.action)
            except BatchApiError as exc:
                ok, message = checks.report(
                    target, checks.checks_for_error(exc, dialect.api_path, settings.base_url), exc
                )
                return ok, redact(message, settings.secrets)
            parse_error: Exception | None = None
            try:
                dialect.parse_list_page(answer, params)
            except Exception as exc:
                parse_error = exc
            if settings.auth is not None:
                keyed = "the token was accepted"
            elif settings.api_key:
                keyed = "the key was accepted"
            else:
                keyed = "no key is set and none was asked for"
            found = [
                checks.Check("reachable", True, "HTTP 200"),
                checks.Check("authenticated", True, keyed),
                checks.dialect_check(dialect, answer, parse_error),
            ]
            ok, message = checks.report(target, found)
        except Exception as exc:
            ok, message = False, f"Connection test of {target} failed: {type(exc).__name__}: {exc}"
        return ok, redact(message, settings.secrets)


def _read_items(
    dialect: Dialect,
    items: list[Any],
    known: Mapping[str, Batch] | None,
    wanted: Container[str] | None,
    page: ListPage,
) -> ListPage:
    """``page`` with ``items`` read onto it: the wanted ones parsed (all if ``wanted`` is None),
    the rest counted as skipped. Returns the same page (its lists grow in place)."""
    skipped = 0
    if wanted is not None:
        kept = [item for item in items if dialect.listed_id(item) in wanted]
        skipped, items = len(items) - len(kept), kept
    parsed, bad = dialect.parse_list_items(items, known)
    page.batches.extend(parsed)
    page.unreadable.extend(bad)
    return replace(page, skipped=page.skipped + skipped) if skipped else page


def _take(items: Iterator[T], count: int) -> list[T]:
    """Up to ``count`` next items of ``items`` (fewer: it is exhausted)."""
    return list(itertools.islice(items, count))


def _filter(dialect: Dialect, where: Mapping[str, str] | None, since: datetime | None) -> dict[str, Any]:
    """The listing's filter parameters for ``where`` (and ``since``); {} without ``where``."""
    return dialect.filter_params(where, since=since) if where else {}


def _tagged(dialect: Dialect, metadata: Mapping[str, str], batches: Iterable[Batch]) -> list[Batch]:
    """The batches whose tags contain every pair of ``metadata``."""
    wanted = {str(k): str(v) for k, v in metadata.items()}
    return [b for b in batches if wanted.items() <= dialect.metadata_of(b).items()]


@asynccontextmanager
async def _aatomic_writer(dest: PathSource) -> AsyncIterator[Any]:
    """Async ``atomic_writer``: opening, moving and removing run in a worker thread."""
    manager = atomic_writer(resolve_path(dest))
    handle = await asyncio.to_thread(manager.__enter__)
    try:
        yield handle
    except BaseException as exc:
        suppressed = await asyncio.to_thread(manager.__exit__, type(exc), exc, exc.__traceback__)
        if not suppressed:
            raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)


async def _amask_secret(secret: str) -> None:
    try:
        from airflow.sdk.log import amask_secret
    except ImportError:  # Airflow < 3.3.2 has only the sync masker
        from airflow.sdk.log import mask_secret

        mask_secret(secret)
        return
    await amask_secret(secret)
