"""BatchApiHook: the Files + Batches API of any OpenAI-compatible vendor, sync and async.

The connection (type ``batch_api``) gives the API root URL (``host``), the key
(``password``) and, in extra, the ``dialect`` plus optional ``headers``,
``organization``, ``project``, ``timeout``, ``max_retries``, ``backoff_initial``,
``backoff_max`` and ``retry_after_max``. Every vendor difference comes from the dialect.

Creating a batch is not idempotent (each create is billed), so ``create_batch`` retries
only when the request provably did not reach the server (a connection that never opened,
408 or 429). After an ambiguous failure (read timeout, dropped connection, 5xx, 409) it
looks for the batch it may have created by the ``metadata`` it was given, returns that
batch if found and retries otherwise; without metadata it raises rather than risk paying
twice.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson
from airflow.sdk import BaseHook

from airflow_batch_provider import __version__
from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.dialects import DIALECTS, Dialect, get_dialect
from airflow_batch_provider.exceptions import (
    BatchApiError,
    BatchApiQuotaError,
    BatchApiResponseError,
    ConfigurationError,
    JsonlValidationError,
)
from airflow_batch_provider.hooks.connection_form import CONN_FIELDS, DEFAULT_TIMEOUT, UI_FIELD_BEHAVIOUR
from airflow_batch_provider.hooks.retry import (
    NOT_SENT_ERRORS,
    REFUSED_STATUS,
    RetryPolicy,
    is_retryable_status,
)
from airflow_batch_provider.hooks.transport import (
    MAX_CONTROL_BODY,
    REDACTED,
    CallDeadline,
    LineSplitter,
    MultipartUpload,
    PathSource,
    aiter_with_progress,
    aread_capped,
    arm_total_deadline,
    deadline_scope,
    iter_with_progress,
    next_hop,
    parse_json_body,
    parse_json_line,
    read_capped,
    redact,
    redact_json,
    shared_ssl_context,
    status_error,
    transport_error,
)
from airflow_batch_provider.models import Batch, ResultLine
from airflow_batch_provider.staging import atomic_writer, resolve_path

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
DOWNLOAD_CHUNK = 1 << 20
# After an ambiguous create, how many times to look for the batch (each after a settle delay)
# before sending the create again: a vendor still working on a timed-out request, or a
# listing that lags behind creates, gets a second chance to show the batch.
AMBIGUOUS_LOOKUPS = 2
# Result lines are far smaller than this; the cap only stops a broken server from filling memory.
MAX_RESULT_LINE_BYTES = 256 * 1024 * 1024
# Header names whose values are treated as secrets (redacted from vendor text like the key).
SECRET_HEADER_WORDS = ("auth", "key", "token", "secret", "password", "cookie", "signature", "credential")


def normalize_base_url(
    host: str | None, *, port: int | None = None, schema: str | None = None, default: str
) -> str:
    """The API root URL from a connection: scheme, host, port and a version path (``/v1`` if none).

    :param host: the connection host, a full URL or a bare host name.
    :param port: the connection port, used when the URL names none.
    :param schema: the connection schema, used as the path when the URL has none.
    :param default: the dialect's public URL, used when host is empty.
    """
    text = (host or "").strip() or default
    if "://" not in text:
        text = f"https://{text}"
    parts = urlsplit(text)
    if not parts.hostname:
        raise ConfigurationError(f"connection host {host!r} is not a URL")
    netloc = parts.netloc
    if port and parts.port is None:
        netloc = f"{netloc}:{port}"
    path = parts.path.rstrip("/")
    if not path:
        path = "/" + (schema.strip("/") if schema and schema.strip("/") else "v1")
    return urlunsplit((parts.scheme, netloc, path, parts.query, ""))


@dataclass(frozen=True)
class BatchApiSettings:
    """Everything both HTTP clients are built from, resolved once from the connection.

    :param conn_id: the Airflow connection id.
    :param base_url: the API root, e.g. ``https://api.openai.com/v1``.
    :param dialect: the vendor dialect.
    :param api_key: the secret key; never shown by ``repr``/``str``.
    :param extra: the connection extra (organisation, project, ...).
    :param headers: extra headers from the connection.
    :param timeout: seconds for reads and writes (connects use at most 10s).
    :param retry: the retry policy.
    """

    conn_id: str
    base_url: str
    dialect: Dialect
    api_key: str | None = field(default=None, repr=False)
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    timeout: float = DEFAULT_TIMEOUT
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __repr__(self) -> str:
        key = "***" if self.api_key else None
        return (
            f"BatchApiSettings(conn_id={self.conn_id!r}, base_url={self.base_url!r}, "
            f"dialect={self.dialect.name!r}, api_key={key}, timeout={self.timeout}, retry={self.retry})"
        )

    __str__ = __repr__

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every value to keep out of logs, exceptions and XCom: the key and secret-named headers."""
        found = [self.api_key] if self.api_key else []
        for name, value in self.headers.items():
            if value and any(word in name.lower() for word in SECRET_HEADER_WORDS):
                found.append(value)
        return tuple(found)

    def client_headers(self) -> dict[str, str]:
        # Only the encodings the bounded reader can inflate without letting a bomb fill memory.
        headers = {
            "User-Agent": f"airflow-batch-provider/{__version__}",
            "Accept": "application/json",
            "Accept-Encoding": "gzip, deflate",
        }
        headers.update({str(k): str(v) for k, v in self.headers.items()})
        # Authentication last, so a stray extra header can never replace the key's header.
        headers.update(self.dialect.auth_headers(self.api_key, self.extra))
        return headers

    def httpx_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT))

    def client_kwargs(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url + "/",
            "headers": self.client_headers(),
            "timeout": self.httpx_timeout(),
            # Redirects are followed by the hook itself, within one origin (see ``next_hop``).
            "follow_redirects": False,
            "verify": shared_ssl_context(),
        }


class _AmbiguousCreate(Exception):
    """A create request failed in a way that does not tell whether the batch exists."""

    def __init__(self, error: BatchApiError, response: httpx.Response | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.response = response


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
    conn_type = "batch_api"
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
        return {
            "hidden_fields": list(UI_FIELD_BEHAVIOUR["hidden-fields"]),
            "relabeling": dict(UI_FIELD_BEHAVIOUR["relabeling"]),
            "placeholders": dict(UI_FIELD_BEHAVIOUR["placeholders"]),
        }

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """Extra form fields for Airflow < 3.2 web servers that still build forms with wtforms.

        Airflow >= 3.2 reads ``CONN_FIELDS`` from the provider info instead and never calls this.
        """
        from flask_appbuilder.fieldwidgets import BS3TextFieldWidget
        from wtforms import IntegerField, StringField

        return {
            "dialect": StringField(
                "Dialect (" + " | ".join(sorted(DIALECTS)) + ")", widget=BS3TextFieldWidget()
            ),
            "organization": StringField("Organization", widget=BS3TextFieldWidget()),
            "project": StringField("Project", widget=BS3TextFieldWidget()),
            "timeout": IntegerField("Timeout (seconds)", widget=BS3TextFieldWidget()),
            "max_retries": IntegerField("Max retries", widget=BS3TextFieldWidget()),
        }

    # ---- settings --------------------------------------------------------------------------
    def _build_settings(self, conn: Any, raw_extra: Mapping[str, Any]) -> BatchApiSettings:
        # Older web servers saved form fields as "extra__<conn_type>__<field>"; accept both spellings.
        prefix = f"extra__{self.conn_type}__"
        extra = {str(k).removeprefix(prefix): v for k, v in raw_extra.items() if v not in (None, "")}
        dialect = self._dialect_override or get_dialect(extra.get("dialect"))
        dialect.check_connection(extra, self.batch_conn_id)
        headers = extra.get("headers") or {}
        if isinstance(headers, str):
            try:
                headers = orjson.loads(headers)
            except orjson.JSONDecodeError:
                raise ConfigurationError(
                    f"connection {self.batch_conn_id!r}: extra 'headers' is not a JSON object"
                ) from None
        if not isinstance(headers, Mapping):
            raise ConfigurationError(f"connection {self.batch_conn_id!r}: extra 'headers' must be an object")
        timeout = self._timeout if self._timeout is not None else extra.get("timeout")
        try:
            timeout_s = float(timeout) if timeout not in (None, "") else DEFAULT_TIMEOUT
            retry = self._retry_policy or RetryPolicy.from_extra(extra, self._max_retries)
        except ValueError as exc:
            raise ConfigurationError(f"connection {self.batch_conn_id!r}: {exc}") from None
        return BatchApiSettings(
            conn_id=self.batch_conn_id,
            base_url=normalize_base_url(
                conn.host, port=conn.port, schema=conn.schema, default=dialect.default_base_url
            ),
            dialect=dialect,
            api_key=conn.password or extra.get("api_key") or None,
            extra=dict(extra),
            headers={str(k): str(v) for k, v in headers.items()},
            timeout=timeout_s,
            retry=retry,
        )

    def get_settings(self) -> BatchApiSettings:
        """Resolve the connection once (blocking; use ``aget_settings`` in async code)."""
        if self._settings is None:
            conn = self.get_connection(self.batch_conn_id)
            settings = self._build_settings(conn, conn.extra_dejson)
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
            settings = self._build_settings(conn, await get_async_extra_dejson(conn))
            if settings.api_key:
                await _amask_secret(settings.api_key)
            # Concurrent first calls (a trigger polls its batches together) all await above;
            # the first to finish wins, so every caller shares one settings object.
            if self._settings is None:
                self._settings = settings
        return self._settings

    @property
    def dialect(self) -> Dialect:
        """The dialect: the constructor's, else the connection's ``dialect`` extra, else openai."""
        if self._dialect_override is not None:
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

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None

    def __enter__(self) -> BatchApiHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> BatchApiHook:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- the request core (sync) -----------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        action: str,
        what: str | None = None,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        upload: MultipartUpload | None = None,
        stream: bool = False,
        create: bool = False,
        foreign_redirects: bool = False,
        max_body: int = MAX_CONTROL_BODY,
        accept: frozenset[int] = frozenset(),
    ) -> httpx.Response:
        """Send with retries; return a 2xx response (open if ``stream``) or raise a typed error.

        ``create`` marks a non-idempotent request: only provably unsent or refused attempts
        are repeated here; other failures raise ``_AmbiguousCreate``. Each attempt has a total
        deadline of the connection's timeout; a body read whole may be ``max_body`` bytes at
        most; ``foreign_redirects`` lets a redirect reach another origin, without credentials.
        A status in ``accept`` is returned (read and closed) instead of raised or retried. An
        answer the dialect reads as out of quota raises ``BatchApiQuotaError`` at once: waiting
        does not refill a quota.
        """
        settings = self.get_settings()
        client = self.get_conn()
        policy = settings.retry
        retry = 0
        while True:
            request = client.build_request(
                method,
                path,
                params=dict(params) if params else None,
                json=json,
                content=upload.iter_sync() if upload else None,
                headers=upload.headers if upload else None,
            )
            try:
                response = self._exchange(
                    client,
                    request,
                    stream=stream,
                    action=action,
                    foreign=foreign_redirects,
                    max_body=max_body,
                )
            except httpx.TransportError as exc:
                error = transport_error(exc, action=action, secret=settings.secrets)
                if create and not isinstance(exc, NOT_SENT_ERRORS):
                    raise _AmbiguousCreate(error) from exc
                if retry >= policy.max_retries:
                    raise error from exc
                delay = policy.delay(retry)
                self._log_retry(action, retry, policy, delay, type(exc).__name__)
                time.sleep(delay)
                retry += 1
                continue
            if response.is_success:
                return response
            response.read()
            response.close()
            if response.status_code in accept:
                return response
            self._raise_if_quota(response, action, what)
            retryable = is_retryable_status(response.status_code)
            if create and retryable and response.status_code not in REFUSED_STATUS:
                raise _AmbiguousCreate(self._status_error(response, action, what), response)
            if not retryable or retry >= policy.max_retries:
                raise self._status_error(response, action, what)
            delay = policy.delay(retry, response)
            self._log_retry(action, retry, policy, delay, f"HTTP {response.status_code}")
            time.sleep(delay)
            retry += 1

    # ---- the request core (async) ----------------------------------------------------------
    async def _arequest(
        self,
        method: str,
        path: str,
        *,
        action: str,
        what: str | None = None,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        upload: MultipartUpload | None = None,
        stream: bool = False,
        create: bool = False,
        foreign_redirects: bool = False,
        max_body: int = MAX_CONTROL_BODY,
        accept: frozenset[int] = frozenset(),
    ) -> httpx.Response:
        """The async twin of ``_request`` (same decisions, non-blocking sleeps)."""
        settings = await self.aget_settings()
        client = await self.aget_conn()
        policy = settings.retry
        retry = 0
        while True:
            request = client.build_request(
                method,
                path,
                params=dict(params) if params else None,
                json=json,
                content=upload.aiter() if upload else None,
                headers=upload.headers if upload else None,
            )
            try:
                response = await self._aexchange(
                    client,
                    request,
                    stream=stream,
                    action=action,
                    foreign=foreign_redirects,
                    max_body=max_body,
                )
            except httpx.TransportError as exc:
                error = transport_error(exc, action=action, secret=settings.secrets)
                if create and not isinstance(exc, NOT_SENT_ERRORS):
                    raise _AmbiguousCreate(error) from exc
                if retry >= policy.max_retries:
                    raise error from exc
                delay = policy.delay(retry)
                self._log_retry(action, retry, policy, delay, type(exc).__name__)
                await asyncio.sleep(delay)
                retry += 1
                continue
            if response.is_success:
                return response
            await response.aread()
            await response.aclose()
            if response.status_code in accept:
                return response
            self._raise_if_quota(response, action, what)
            retryable = is_retryable_status(response.status_code)
            if create and retryable and response.status_code not in REFUSED_STATUS:
                raise _AmbiguousCreate(self._status_error(response, action, what), response)
            if not retryable or retry >= policy.max_retries:
                raise self._status_error(response, action, what)
            delay = policy.delay(retry, response)
            self._log_retry(action, retry, policy, delay, f"HTTP {response.status_code}")
            await asyncio.sleep(delay)
            retry += 1

    def _exchange(
        self,
        client: httpx.Client,
        request: httpx.Request,
        *,
        stream: bool,
        action: str,
        foreign: bool,
        max_body: int,
    ) -> httpx.Response:
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
                request = next_hop(request, response, hops=hops, action=action, foreign=foreign)
                hops += 1
            if not (stream and response.is_success):
                read_capped(response, max_body, action)
        return response

    async def _aexchange(
        self,
        client: httpx.AsyncClient,
        request: httpx.Request,
        *,
        stream: bool,
        action: str,
        foreign: bool,
        max_body: int,
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
                        request = next_hop(request, response, hops=hops, action=action, foreign=foreign)
                        hops += 1
                    if not (stream and response.is_success):
                        await aread_capped(response, max_body, action)
        except TimeoutError:
            if response is not None:
                await response.aclose()
            raise httpx.ReadTimeout(
                f"no complete answer within the call's total deadline of {settings.timeout:g}s",
                request=request,
            ) from None
        return response

    def _raise_if_quota(self, response: httpx.Response, action: str, what: str | None) -> None:
        settings = self._settings
        assert settings is not None
        if not settings.dialect.is_quota_error(response.status_code, _error_body(response)):
            return
        error = self._status_error(response, action, what)
        raise BatchApiQuotaError(
            f"{action}: the account is out of quota or credit at {settings.base_url} "
            f"(HTTP {response.status_code}); not retried: add credit or raise the quota, then run again",
            status_code=error.status_code,
            request_id=error.request_id,
            body=error.body,
        )

    def _status_error(self, response: httpx.Response, action: str, what: str | None) -> BatchApiError:
        settings = self._settings
        assert settings is not None
        return status_error(
            response, action=action, what=what, base_url=settings.base_url, secret=settings.secrets
        )

    def _log_retry(self, action: str, retry: int, policy: RetryPolicy, delay: float, reason: str) -> None:
        # Only the action, the reason and the timing: never a header or a body.
        self.log.warning("%s: %s; retry %d/%d in %.2fs", action, reason, retry + 1, policy.max_retries, delay)

    def _json(self, response: httpx.Response, action: str) -> Any:
        # Every batch, file and list object is parsed here: a key the vendor echoed is removed once.
        secrets = self._settings.secrets if self._settings else ()
        return redact_json(parse_json_body(response, action, secrets), secrets)

    def _json_object(self, response: httpx.Response, action: str) -> dict[str, Any]:
        data = self._json(response, action)
        if not isinstance(data, dict):
            raise BatchApiResponseError(f"{action}: expected a JSON object, got {type(data).__name__}")
        return data

    # ---- files -----------------------------------------------------------------------------
    def _upload_body(self, source: PathSource, filename: str | None, dialect: Dialect) -> MultipartUpload:
        try:
            upload = MultipartUpload.from_source(source, filename=filename, fields=dialect.upload_form())
        except FileNotFoundError:
            raise ConfigurationError(f"cannot upload {source}: no such file") from None
        limit = dialect.limits.max_shard_bytes
        if upload.size > limit:
            # Refused here, before sending: the vendor would read the whole body and then answer 413.
            raise JsonlValidationError(
                f"cannot upload {upload.filename}: it is {upload.size:,} bytes and dialect "
                f"{dialect.name!r} uploads at most {limit:,} bytes per file; build it again "
                f"(shards are cut at that size) or split it"
            )
        return upload

    def upload_file(self, source: PathSource, *, filename: str | None = None) -> str:
        """Upload a batch input file, streamed from disk or object storage; return its file id.

        :param source: a local path or an ``ObjectStoragePath``.
        :param filename: the name the vendor records; defaults to the source's name.
        """
        dialect = self.dialect
        upload = self._upload_body(source, filename, dialect)
        action = f"uploading {upload.filename}"
        response = self._request("POST", dialect.files_path, action=action, upload=upload)
        file_id = dialect.parse_file_id(self._json_object(response, action))
        self.log.info("Uploaded %s (%d bytes) as file %s", upload.filename, upload.size, file_id)
        return file_id

    async def aupload_file(self, source: PathSource, *, filename: str | None = None) -> str:
        """Async twin of ``upload_file`` (file reads run in a worker thread)."""
        dialect = (await self.aget_settings()).dialect
        upload = await asyncio.to_thread(self._upload_body, source, filename, dialect)
        action = f"uploading {upload.filename}"
        response = await self._arequest("POST", dialect.files_path, action=action, upload=upload)
        file_id = dialect.parse_file_id(self._json_object(response, action))
        self.log.info("Uploaded %s (%d bytes) as file %s", upload.filename, upload.size, file_id)
        return file_id

    def get_file(self, file_id: str) -> dict[str, Any]:
        """The vendor's file object."""
        action = f"getting file {file_id}"
        response = self._request(
            "GET", self.dialect.file_path(file_id), action=action, what=f"file {file_id!r}"
        )
        return self._json_object(response, action)

    async def aget_file(self, file_id: str) -> dict[str, Any]:
        dialect = (await self.aget_settings()).dialect
        action = f"getting file {file_id}"
        response = await self._arequest(
            "GET", dialect.file_path(file_id), action=action, what=f"file {file_id!r}"
        )
        return self._json_object(response, action)

    def delete_file(self, file_id: str) -> None:
        """Delete a file at the vendor."""
        self._request(
            "DELETE",
            self.dialect.file_path(file_id),
            action=f"deleting file {file_id}",
            what=f"file {file_id!r}",
        )

    async def adelete_file(self, file_id: str) -> None:
        dialect = (await self.aget_settings()).dialect
        await self._arequest(
            "DELETE", dialect.file_path(file_id), action=f"deleting file {file_id}", what=f"file {file_id!r}"
        )

    def download_file(self, file_id: str, dest: PathSource) -> int:
        """Stream a file's content to ``dest``; the file appears complete or not at all.

        A dropped connection restarts the download (bounded by the retry policy).

        :param file_id: the vendor file id.
        :param dest: a local path or an ``ObjectStoragePath``.
        :return: the number of bytes written.
        """
        settings = self.get_settings()
        action = f"downloading file {file_id}"
        retry = 0
        while True:
            try:
                with atomic_writer(resolve_path(dest)) as handle:
                    response = self._request(
                        "GET",
                        settings.dialect.file_content_path(file_id),
                        action=action,
                        what=f"file {file_id!r}",
                        stream=True,
                        foreign_redirects=True,
                    )
                    written = 0
                    try:
                        for chunk in iter_with_progress(
                            response.iter_bytes(DOWNLOAD_CHUNK), settings.timeout
                        ):
                            handle.write(chunk)
                            written += len(chunk)
                    finally:
                        response.close()
                self.log.info("Downloaded file %s (%d bytes) to %s", file_id, written, dest)
                return written
            except httpx.TransportError as exc:
                retry = self._mid_stream_retry(exc, action, retry)
                time.sleep(settings.retry.backoff(retry - 1))

    async def adownload_file(self, file_id: str, dest: PathSource) -> int:
        """Async twin of ``download_file`` (file writes run in a worker thread)."""
        settings = await self.aget_settings()
        action = f"downloading file {file_id}"
        retry = 0
        while True:
            try:
                async with _aatomic_writer(dest) as handle:
                    response = await self._arequest(
                        "GET",
                        settings.dialect.file_content_path(file_id),
                        action=action,
                        what=f"file {file_id!r}",
                        stream=True,
                        foreign_redirects=True,
                    )
                    written = 0
                    try:
                        async for chunk in aiter_with_progress(
                            response.aiter_bytes(DOWNLOAD_CHUNK), settings.timeout
                        ):
                            await asyncio.to_thread(handle.write, chunk)
                            written += len(chunk)
                    finally:
                        await response.aclose()
                self.log.info("Downloaded file %s (%d bytes) to %s", file_id, written, dest)
                return written
            except httpx.TransportError as exc:
                retry = self._mid_stream_retry(exc, action, retry)
                await asyncio.sleep(settings.retry.backoff(retry - 1))

    def _mid_stream_retry(self, exc: httpx.TransportError, action: str, retry: int) -> int:
        """Count a failure during a streamed body; raise once the budget is spent."""
        settings = self._settings
        assert settings is not None
        if retry >= settings.retry.max_retries:
            raise transport_error(exc, action=action, secret=settings.secrets) from exc
        self.log.warning(
            "%s: %s mid-stream; restarting (retry %d/%d)",
            action,
            type(exc).__name__,
            retry + 1,
            settings.retry.max_retries,
        )
        return retry + 1

    def iter_file_lines(self, file_id: str) -> Iterator[dict[str, Any]]:
        """Stream a JSONL file's objects, one line in memory at a time.

        A dropped connection re-requests the file and skips the lines already yielded.
        """
        for _, obj in self._iter_jsonl(file_id):
            yield obj

    def _iter_jsonl(self, file_id: str, *, lenient: bool = False) -> Iterator[tuple[int, Any]]:
        """``(line number, object)``; with ``lenient`` a bad line gives its error instead of raising."""
        settings = self.get_settings()
        where = f"file {file_id!r}"
        action = f"reading file {file_id}"
        hidden = tuple(secret.encode() for secret in settings.secrets)
        done = 0
        retry = 0
        while True:
            splitter = LineSplitter(MAX_RESULT_LINE_BYTES, where)
            try:
                response = self._request(
                    "GET",
                    settings.dialect.file_content_path(file_id),
                    action=action,
                    what=where,
                    stream=True,
                    foreign_redirects=True,
                )
                try:
                    for chunk in iter_with_progress(response.iter_bytes(DOWNLOAD_CHUNK), settings.timeout):
                        for number, data in splitter.feed(chunk):
                            if number > done:
                                item = _line_object(data, number, where, hidden, lenient)
                                done = number
                                if item is not None:
                                    yield number, item
                finally:
                    response.close()
                for number, data in splitter.close():
                    if number > done:
                        item = _line_object(data, number, where, hidden, lenient)
                        done = number
                        if item is not None:
                            yield number, item
                return
            except httpx.TransportError as exc:
                retry = self._mid_stream_retry(exc, action, retry)
                time.sleep(settings.retry.backoff(retry - 1))

    async def aiter_file_lines(self, file_id: str) -> AsyncIterator[dict[str, Any]]:
        """Async twin of ``iter_file_lines``."""
        async for _, obj in self._aiter_jsonl(file_id):
            yield obj

    async def _aiter_jsonl(self, file_id: str) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        settings = await self.aget_settings()
        where = f"file {file_id!r}"
        action = f"reading file {file_id}"
        hidden = tuple(secret.encode() for secret in settings.secrets)
        done = 0
        retry = 0
        while True:
            splitter = LineSplitter(MAX_RESULT_LINE_BYTES, where)
            try:
                response = await self._arequest(
                    "GET",
                    settings.dialect.file_content_path(file_id),
                    action=action,
                    what=where,
                    stream=True,
                    foreign_redirects=True,
                )
                try:
                    async for chunk in aiter_with_progress(
                        response.aiter_bytes(DOWNLOAD_CHUNK), settings.timeout
                    ):
                        for number, data in splitter.feed(chunk):
                            if number > done:
                                item = _line_object(data, number, where, hidden)
                                done = number
                                if item is not None:
                                    yield number, item
                finally:
                    await response.aclose()
                for number, data in splitter.close():
                    if number > done:
                        item = _line_object(data, number, where, hidden)
                        done = number
                        if item is not None:
                            yield number, item
                return
            except httpx.TransportError as exc:
                retry = self._mid_stream_retry(exc, action, retry)
                await asyncio.sleep(settings.retry.backoff(retry - 1))

    # ---- batches ---------------------------------------------------------------------------
    def _create_body(
        self,
        dialect: Dialect,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None,
        name: str | None,
    ) -> dict[str, Any]:
        dialect.check_completion_window(completion_window)
        if endpoint:
            dialect.check_endpoint(endpoint)
        if metadata and dialect.supports_metadata and len(metadata) > dialect.max_metadata_pairs:
            raise ConfigurationError(
                f"{len(metadata)} metadata pairs given; "
                f"dialect {dialect.name!r} allows {dialect.max_metadata_pairs}"
            )
        return dialect.create_batch_body(
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            name=name,
        )

    @staticmethod
    def _identity(
        dialect: Dialect, body: Mapping[str, Any], metadata: Mapping[str, str] | None, name: str | None
    ) -> dict[str, str] | None:
        """The tags by which a batch created from ``body`` can be found again, or None if it cannot."""
        if not metadata and not name:
            return None
        if dialect.supports_metadata:
            return dict(metadata) if metadata else None
        # A dialect without metadata carries the identity in the batch name, when the caller chose one.
        body_name = body.get("name")
        chosen = {name, *(metadata or {}).values()} - {None}
        if isinstance(body_name, str) and body_name in chosen:
            return {"name": body_name}
        return None

    @staticmethod
    def _matches(batch: Batch, input_file_id: str) -> bool:
        return batch.input_file_id in (None, input_file_id)

    def create_batch(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
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
        """
        settings = self.get_settings()
        dialect = settings.dialect
        body = self._create_body(
            dialect,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            name=name,
        )
        identity = self._identity(dialect, body, metadata, name)
        action = f"creating a batch from file {input_file_id}"
        retry = 0
        while True:
            try:
                response = self._request("POST", dialect.batches_path, action=action, json=body, create=True)
            except _AmbiguousCreate as exc:
                retry = self._ambiguous_create(exc, identity, retry)
                for _ in range(AMBIGUOUS_LOOKUPS):
                    time.sleep(settings.retry.settle_delay(retry - 1, exc.response))
                    try:
                        found = [
                            b for b in self.find_batches(identity or {}) if self._matches(b, input_file_id)
                        ]
                    except BatchApiError as lookup:
                        raise self._lookup_failed(exc, lookup) from lookup
                    if found:
                        return self._adopt(found, action)
                continue
            batch = dialect.parse_batch(self._json_object(response, action))
            self.log.info("Created batch %s from file %s", batch.id, input_file_id)
            return batch

    async def acreate_batch(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Batch:
        """Async twin of ``create_batch`` (same duplicate protection)."""
        settings = await self.aget_settings()
        dialect = settings.dialect
        body = self._create_body(
            dialect,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            name=name,
        )
        identity = self._identity(dialect, body, metadata, name)
        action = f"creating a batch from file {input_file_id}"
        retry = 0
        while True:
            try:
                response = await self._arequest(
                    "POST", dialect.batches_path, action=action, json=body, create=True
                )
            except _AmbiguousCreate as exc:
                retry = self._ambiguous_create(exc, identity, retry)
                for _ in range(AMBIGUOUS_LOOKUPS):
                    await asyncio.sleep(settings.retry.settle_delay(retry - 1, exc.response))
                    try:
                        found = [
                            b
                            for b in await self.afind_batches(identity or {})
                            if self._matches(b, input_file_id)
                        ]
                    except BatchApiError as lookup:
                        raise self._lookup_failed(exc, lookup) from lookup
                    if found:
                        return self._adopt(found, action)
                continue
            batch = dialect.parse_batch(self._json_object(response, action))
            self.log.info("Created batch %s from file %s", batch.id, input_file_id)
            return batch

    def _ambiguous_create(self, exc: _AmbiguousCreate, identity: Mapping[str, str] | None, retry: int) -> int:
        settings = self._settings
        assert settings is not None
        error = exc.error
        if identity is None:
            raise _with_note(
                error,
                "the batch may have been created, so the request was not repeated "
                "(pass metadata so a lost create can be found and retried safely)",
            ) from exc
        if retry >= settings.retry.max_retries:
            raise error from exc
        self.log.warning(
            "Batch create failed ambiguously (%s); looking for a batch tagged %s before retrying",
            type(error).__name__,
            sorted(identity),
        )
        return retry + 1

    @staticmethod
    def _lookup_failed(exc: _AmbiguousCreate, lookup: BatchApiError) -> BatchApiError:
        # Whether the batch exists is unknown, so neither retry nor pretend: say both failures.
        return _with_note(
            exc.error,
            f"the batch may have been created and looking for it failed too ({_message_of(lookup)}); "
            "not retried to avoid a duplicate",
        )

    def _adopt(self, found: list[Batch], action: str) -> Batch:
        # Newest first: if an earlier try also created one, the latest matches this call.
        found.sort(key=lambda b: b.created_at.timestamp() if b.created_at else 0.0, reverse=True)
        batch = found[0]
        self.log.warning("%s: the lost create had succeeded; using batch %s", action, batch.id)
        return batch

    def get_batch(self, batch_id: str) -> Batch:
        """The batch, normalised by the dialect."""
        dialect = self.dialect
        action = f"getting batch {batch_id}"
        response = self._request(
            "GET", dialect.batch_path(batch_id), action=action, what=f"batch {batch_id!r}"
        )
        return dialect.parse_batch(self._json_object(response, action))

    async def aget_batch(self, batch_id: str) -> Batch:
        dialect = (await self.aget_settings()).dialect
        action = f"getting batch {batch_id}"
        response = await self._arequest(
            "GET", dialect.batch_path(batch_id), action=action, what=f"batch {batch_id!r}"
        )
        return dialect.parse_batch(self._json_object(response, action))

    def cancel_batch(self, batch_id: str) -> Batch:
        """Ask the vendor to cancel a batch (repeatable: cancelling twice is harmless)."""
        dialect = self.dialect
        action = f"cancelling batch {batch_id}"
        response = self._request(
            "POST",
            dialect.cancel_path(batch_id),
            action=action,
            what=f"batch {batch_id!r}",
            accept=dialect.cancel_final_statuses,
        )
        if not response.is_success:
            self.log.info("Batch %s is already final (HTTP %d to cancel)", batch_id, response.status_code)
            return self.get_batch(batch_id)
        self.log.info("Cancel requested for batch %s", batch_id)
        return self._batch_or_get(response, batch_id, action)

    async def acancel_batch(self, batch_id: str) -> Batch:
        dialect = (await self.aget_settings()).dialect
        action = f"cancelling batch {batch_id}"
        response = await self._arequest(
            "POST",
            dialect.cancel_path(batch_id),
            action=action,
            what=f"batch {batch_id!r}",
            accept=dialect.cancel_final_statuses,
        )
        if not response.is_success:
            self.log.info("Batch %s is already final (HTTP %d to cancel)", batch_id, response.status_code)
            return await self.aget_batch(batch_id)
        self.log.info("Cancel requested for batch %s", batch_id)
        if not response.content.strip():
            return await self.aget_batch(batch_id)
        return self._batch_or_get(response, batch_id, action)

    def _batch_or_get(self, response: httpx.Response, batch_id: str, action: str) -> Batch:
        if not response.content.strip():
            # Some servers answer a cancel with an empty body; read the batch instead.
            return self.get_batch(batch_id)
        return self._settings_dialect().parse_batch(self._json_object(response, action))

    def _settings_dialect(self) -> Dialect:
        assert self._settings is not None
        return self._settings.dialect

    def list_batches(self, *, page_size: int | None = None, limit: int | None = None) -> Iterator[Batch]:
        """Every batch visible to the key, newest first, following pagination.

        :param page_size: batches per request (the dialect's default if None).
        :param limit: stop after this many batches (all if None).
        """
        dialect = self.dialect
        params: dict[str, Any] | None = dialect.list_params(page_size)
        pages: set[bytes] = set()
        seen = 0
        while params is not None:
            action = "listing batches"
            response = self._request("GET", dialect.batches_path, action=action, params=params)
            page = dialect.parse_list_page(self._json_object(response, action), params)
            for batch in page.batches:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield batch
            params = _next_params(page.next_params, params, pages, action)

    async def alist_batches(
        self, *, page_size: int | None = None, limit: int | None = None
    ) -> AsyncIterator[Batch]:
        """Async twin of ``list_batches``."""
        dialect = (await self.aget_settings()).dialect
        params: dict[str, Any] | None = dialect.list_params(page_size)
        pages: set[bytes] = set()
        seen = 0
        while params is not None:
            action = "listing batches"
            response = await self._arequest("GET", dialect.batches_path, action=action, params=params)
            page = dialect.parse_list_page(self._json_object(response, action), params)
            for batch in page.batches:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield batch
            params = _next_params(page.next_params, params, pages, action)

    def find_batches(self, metadata: Mapping[str, str], *, limit: int | None = 1000) -> list[Batch]:
        """Batches whose tags (``dialect.metadata_of``) contain every pair of ``metadata``.

        :param metadata: the pairs to match; empty matches nothing.
        :param limit: how many batches to scan at most (newest first).
        """
        if not metadata:
            return []
        dialect = self.dialect
        wanted = {str(k): str(v) for k, v in metadata.items()}
        return [b for b in self.list_batches(limit=limit) if wanted.items() <= dialect.metadata_of(b).items()]

    async def afind_batches(self, metadata: Mapping[str, str], *, limit: int | None = 1000) -> list[Batch]:
        """Async twin of ``find_batches``."""
        if not metadata:
            return []
        dialect = (await self.aget_settings()).dialect
        wanted = {str(k): str(v) for k, v in metadata.items()}
        return [
            b
            async for b in self.alist_batches(limit=limit)
            if wanted.items() <= dialect.metadata_of(b).items()
        ]

    # ---- results ---------------------------------------------------------------------------
    @staticmethod
    def _results_mode(dialect: Dialect, batch: Batch, mode: str | None) -> str:
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
        return "files"

    def iter_results(
        self, batch: Batch | str, *, mode: str | None = None, on_bad_line: str = "fail"
    ) -> Iterator[ResultLine]:
        """Every result line of a batch, normalised and streamed.

        Reads the output file then the error file when the batch has them (and the dialect
        offers files), else pages the batch's results endpoint.

        :param batch: the batch or its id.
        :param mode: force ``files`` or ``results_endpoint``.
        :param on_bad_line: a result file line that is not JSON, not an object or unreadable by
            the dialect: ``fail`` (raise naming it) or ``record`` (yield it as a failed line with
            code ``invalid_result_line``, the reason, file and line, and the custom_id it has, or "").
        """
        dialect = self.dialect
        if isinstance(batch, str):
            batch = self.get_batch(batch)
        if self._results_mode(dialect, batch, mode) == "files":
            for file_id, source in ((batch.output_file_id, "output"), (batch.error_file_id, "error")):
                if not file_id:
                    continue
                for number, obj in self._iter_jsonl(file_id, lenient=on_bad_line == "record"):
                    if on_bad_line == "record":
                        yield _result_line_or_bad(dialect, obj, source, file_id, number)
                    else:
                        yield _result_line(dialect, obj, source, file_id, number)
            return
        params: dict[str, Any] | None = dialect.results_params()
        pages: set[bytes] = set()
        action = f"reading results of batch {batch.id}"
        yielded, most = 0, _most_results(dialect, batch)
        while params is not None:
            response = self._request(
                "GET",
                dialect.results_path(batch.id),
                action=action,
                what=f"batch {batch.id!r}",
                params=params,
                max_body=MAX_RESULT_LINE_BYTES,
            )
            page = dialect.parse_results_page(
                _results_body(response, action, self._settings), params, response.headers
            )
            yielded += len(page.lines)
            _check_page_total(yielded, most, action)
            yield from page.lines
            params = _next_params(page.next_params, params, pages, action)

    async def aiter_results(
        self, batch: Batch | str, *, mode: str | None = None
    ) -> AsyncIterator[ResultLine]:
        """Async twin of ``iter_results``."""
        dialect = (await self.aget_settings()).dialect
        if isinstance(batch, str):
            batch = await self.aget_batch(batch)
        if self._results_mode(dialect, batch, mode) == "files":
            for file_id, source in ((batch.output_file_id, "output"), (batch.error_file_id, "error")):
                if not file_id:
                    continue
                async for number, obj in self._aiter_jsonl(file_id):
                    yield _result_line(dialect, obj, source, file_id, number)
            return
        params: dict[str, Any] | None = dialect.results_params()
        pages: set[bytes] = set()
        action = f"reading results of batch {batch.id}"
        yielded, most = 0, _most_results(dialect, batch)
        while params is not None:
            response = await self._arequest(
                "GET",
                dialect.results_path(batch.id),
                action=action,
                what=f"batch {batch.id!r}",
                params=params,
                max_body=MAX_RESULT_LINE_BYTES,
            )
            page = dialect.parse_results_page(
                _results_body(response, action, self._settings), params, response.headers
            )
            yielded += len(page.lines)
            _check_page_total(yielded, most, action)
            for line in page.lines:
                yield line
            params = _next_params(page.next_params, params, pages, action)

    # ---- connection test -------------------------------------------------------------------
    def test_connection(self) -> tuple[bool, str]:
        """List one batch to prove the URL, the key and the dialect work; never raises."""
        try:
            settings = self.get_settings()
            dialect = settings.dialect
            action = "listing batches"
            params = dialect.list_params(1)
            response = self._request("GET", dialect.batches_path, action=action, params=params)
            dialect.parse_list_page(self._json_object(response, action), params)
        except Exception as exc:
            secret = self._settings.secrets if self._settings else None
            return False, redact(f"{type(exc).__name__}: {exc}", secret)
        return True, f"Connected to {settings.base_url} as {dialect.label}: listing batches works"


def _message_of(error: BatchApiError) -> str:
    # BatchApiError appends " | status=... | body=..." to its message; keep the message alone.
    return str(error).split(" | ", 1)[0]


def _with_note(error: BatchApiError, note: str) -> BatchApiError:
    """The same typed error with a note appended to its message."""
    return type(error)(
        f"{_message_of(error)}; {note}",
        status_code=error.status_code,
        request_id=error.request_id,
        body=error.body,
    )


def _line_object(
    data: bytes, number: int, where: str, hidden: tuple[bytes, ...] = (), lenient: bool = False
) -> Any:
    if not data.strip():
        return None
    for secret in hidden:
        # A vendor may quote the key back in an error line; it must not reach the results table.
        if secret in data:
            data = data.replace(secret, REDACTED.encode())
    try:
        obj = parse_json_line(data, number, where)
        if not isinstance(obj, dict):
            raise BatchApiResponseError(f"{where} line {number} is not a JSON object")
    except BatchApiResponseError as exc:
        if lenient:
            found = _CUSTOM_ID_TEXT.search(data)
            return _BadLine(exc, found.group(1).decode("utf-8", "replace") if found else None)
        raise
    return obj


# The custom_id of a line too damaged to parse (truncated, say) when it is still legible.
_CUSTOM_ID_TEXT = re.compile(rb'"custom_id"\s*:\s*"([^"\\]{1,64})"')


@dataclass(frozen=True)
class _BadLine:
    """A result file line that cannot be read (``on_bad_line="record"``)."""

    error: BatchApiResponseError
    custom_id: str | None


def _result_line_or_bad(dialect: Dialect, obj: Any, source: Any, file_id: str, number: int) -> ResultLine:
    """``_result_line``, or for a line that cannot be read a failed line saying why."""
    from airflow_batch_provider.models import LineError

    if isinstance(obj, _BadLine):
        error, custom_id = obj.error, obj.custom_id
    else:
        try:
            return _result_line(dialect, obj, source, file_id, number)
        except BatchApiResponseError as exc:
            error, custom_id = exc, obj.get("custom_id")
    return ResultLine(
        custom_id=custom_id if isinstance(custom_id, str) else "",
        ok=False,
        error=LineError(code="invalid_result_line", message=_message_of(error)),
        source=source,
    )


def _result_line(
    dialect: Dialect, obj: Mapping[str, Any], source: Any, file_id: str, number: int
) -> ResultLine:
    try:
        return dialect.parse_result_line(obj, source)
    except BatchApiResponseError as exc:
        raise BatchApiResponseError(f"file {file_id!r} line {number}: {exc.args[0]}", body=exc.body) from None


def _error_body(response: httpx.Response) -> Any:
    """The parsed JSON of an error answer (already read), or None."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None


def _results_body(response: httpx.Response, action: str, settings: BatchApiSettings | None) -> Any:
    """A results page as the dialect takes it: parsed JSON, or raw bytes for a JSONL body.

    A key the vendor quoted back (an error item) is removed before anything reads the page.
    """
    content = response.content
    for secret in settings.secrets if settings else ():
        content = content.replace(secret.encode(), REDACTED.encode())
    content_type = response.headers.get("content-type", "")
    if "ndjson" in content_type or "jsonl" in content_type:
        return content
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        if b"\n" in content.strip():
            return content
        return parse_json_body(response, action, settings.secrets if settings else None)


def _most_results(dialect: Dialect, batch: Batch) -> int:
    """How many result lines a batch can have: no more than its requests, nor than one file's lines.

    The larger of the two: a count the vendor reports late or not at all must not cut real results.
    """
    return max(batch.request_counts.total, dialect.limits.max_lines)


def _check_page_total(yielded: int, most: int, action: str) -> None:
    """A results endpoint that pages past every request of the batch would page forever."""
    if yielded > most:
        raise BatchApiResponseError(
            f"{action}: the server returned more result lines ({yielded:,}) than the batch can have "
            f"({most:,}); stopped reading instead of paging without end"
        )


def _next_params(
    next_params: dict[str, Any] | None, params: Mapping[str, Any], seen: set[bytes], action: str
) -> dict[str, Any] | None:
    """The next page's parameters; a cursor already visited (A -> B -> A) is an error, not a loop."""
    seen.add(orjson.dumps(dict(params), option=orjson.OPT_SORT_KEYS, default=str))
    if next_params is not None and (
        orjson.dumps(dict(next_params), option=orjson.OPT_SORT_KEYS, default=str) in seen
    ):
        # Following it would read the same pages forever (and yield their lines again).
        raise BatchApiResponseError(
            f"{action}: the server returned a page cursor it had already returned ({dict(next_params)})"
        )
    return next_params


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
