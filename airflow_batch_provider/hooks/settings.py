"""The hook's settings: everything both HTTP clients are built from, read once from the connection.

Pure: :func:`settings_from_connection` takes the connection's fields and the hook's overrides, so
the sync and the async hook (which read the connection differently) build the same settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from airflow_batch_provider import __version__
from airflow_batch_provider.dialects import Dialect, get_dialect
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.hooks.connection_form import DEFAULT_MAX_DOWNLOAD_BYTES, DEFAULT_TIMEOUT
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.hooks.transport import shared_ssl_context

CONNECT_TIMEOUT = 10.0
# Header names whose values are treated as secrets (redacted from vendor text like the key).
SECRET_HEADER_WORDS = ("auth", "key", "token", "secret", "password", "cookie", "signature", "credential")


def normalize_base_url(
    host: str | None,
    *,
    port: int | None = None,
    schema: str | None = None,
    default: str,
    api_path: str = "/v1",
) -> str:
    """The API root URL from a connection: scheme, host, port and a version path (``/v1`` if none).

    :param host: the connection host, a full URL or a bare host name.
    :param port: the connection port, used when the URL names none.
    :param schema: the connection schema, used as the path when the URL has none.
    :param default: the dialect's public URL, used when host is empty.
    :param api_path: the path when neither the URL nor the schema names one (the dialect's).
    """
    text = (host or "").strip() or default
    if "://" not in text:
        text = f"https://{text}"
    refuse_userinfo(text, "connection host")
    parts = urlsplit(text)
    if not parts.hostname:
        raise ConfigurationError(f"connection host {host!r} is not a URL")
    netloc = parts.netloc
    if port and parts.port is None:
        netloc = f"{netloc}:{port}"
    path = parts.path.rstrip("/")
    if not path:
        chosen = schema.strip("/") if schema and schema.strip("/") else api_path.strip("/")
        # An API at the host's root (Bedrock) keeps no path: "/" would double its paths' slash.
        path = f"/{chosen}" if chosen else ""
    return urlunsplit((parts.scheme, netloc, path, parts.query, ""))


def refuse_userinfo(url: str, where: str) -> None:
    """Refuse a URL with credentials before its host (``http://user:password@host/v1``).

    Refused rather than stripped: these APIs authenticate with the dialect's key header, and
    httpx turns userinfo into Basic auth that replaces the Bearer key. Kept, the password would
    also show wherever the URL does (links, connection tests, 404 messages, ``repr``). The
    message shows the URL with everything before its ``@`` masked.

    :param url: the URL.
    :param where: what the URL is, for the message (``connection host``).
    """
    scheme, sep, rest = url.partition("://")
    authority = (rest if sep else scheme).split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" not in authority:
        return
    shown = url.replace(authority, "***@" + authority.rsplit("@", 1)[1], 1)
    raise ConfigurationError(
        f"{where} {shown!r} carries credentials before its host; remove them and put the API key "
        "in the connection's password field (it is sent in the dialect's auth header)"
    )


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
    :param max_download_bytes: the most decoded bytes of one downloaded or streamed file.
    :param allow_private_redirects: a file's redirect may reach private, link-local and
        instance-metadata addresses (see ``hooks.redirects``).
    :param auth: signs each request when the dialect authenticates by a token fetched at run time
        (None: ``auth_headers`` carry the key).
    """

    conn_id: str
    base_url: str
    dialect: Dialect
    api_key: str | None = field(default=None, repr=False)
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    timeout: float = DEFAULT_TIMEOUT
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES
    allow_private_redirects: bool = False
    auth: httpx.Auth | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Settings built by hand too: the base URL shows in links, messages and this repr.
        refuse_userinfo(self.base_url, "base_url")

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
        # A token fetched at run time is a secret too, for as long as it is the current one.
        found.extend(getattr(self.auth, "secret_values", ()))
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
        kwargs: dict[str, Any] = {}
        if self.auth is not None:
            kwargs["auth"] = self.auth
        # Constant query parameters (an API version) go on every call; httpx merges each
        # call's own parameters into them.
        if self.dialect.query_params:
            kwargs["params"] = dict(self.dialect.query_params)
        return kwargs | {
            "base_url": self.base_url + "/",
            "headers": self.client_headers(),
            "timeout": self.httpx_timeout(),
            # Redirects are followed by the hook itself, within one origin (see ``next_hop``).
            "follow_redirects": False,
            "verify": shared_ssl_context(),
        }


def connection_extra(raw_extra: Mapping[str, Any], conn_type: str) -> dict[str, Any]:
    """The connection extra with its empty values left out, under its plain names (older web
    servers saved form fields as ``extra__<conn_type>__<field>``; both spellings are read)."""
    prefix = f"extra__{conn_type}__"
    return {str(k).removeprefix(prefix): v for k, v in raw_extra.items() if v not in (None, "")}


def settings_from_connection(
    conn_id: str,
    conn: Any,
    raw_extra: Mapping[str, Any],
    *,
    conn_type: str,
    dialect: Dialect | None = None,
    timeout: float | None = None,
    max_retries: int | None = None,
    retry_policy: RetryPolicy | None = None,
    inherited: Mapping[str, Any] | None = None,
) -> BatchApiSettings:
    """The settings of a connection (``host``, ``port``, ``schema``, ``password`` and its extra).

    :param conn_id: the connection id, for error messages.
    :param conn: the connection (anything with ``host``, ``port``, ``schema`` and ``password``).
    :param raw_extra: the connection extra, parsed.
    :param conn_type: the connection type, whose ``extra__<type>__`` prefix older forms wrote.
    :param dialect: a dialect overriding the extra's ``dialect``.
    :param timeout: overrides the extra's ``timeout``.
    :param max_retries: overrides the extra's ``max_retries``.
    :param retry_policy: a full policy, winning over ``max_retries`` and the extras.
    :param inherited: extras the platform connection the batch connection signs with supplies
        (``hooks.credentials.platform_extra``: the aws connection's region), used where the
        batch connection's own extra sets none.
    """
    extra = {**(inherited or {}), **connection_extra(raw_extra, conn_type)}
    dialect = (dialect or get_dialect(extra.get("dialect"))).configure(extra, conn_id)
    if dialect.requires_host and not (conn.host or "").strip():
        raise ConfigurationError(
            f"connection {conn_id!r}: dialect {dialect.name!r} has no public URL; set the connection's "
            f"host to the account's endpoint (like {dialect.default_base_url})"
        )
    headers = extra.get("headers") or {}
    if isinstance(headers, str):
        try:
            headers = orjson.loads(headers)
        except orjson.JSONDecodeError:
            raise ConfigurationError(
                f"connection {conn_id!r}: extra 'headers' is not a JSON object"
            ) from None
    if not isinstance(headers, Mapping):
        raise ConfigurationError(f"connection {conn_id!r}: extra 'headers' must be an object")
    timeout = timeout if timeout is not None else extra.get("timeout")
    try:
        timeout_s = float(timeout) if timeout not in (None, "") else DEFAULT_TIMEOUT
        retry = retry_policy or RetryPolicy.from_extra(extra, max_retries)
    except ValueError as exc:
        raise ConfigurationError(f"connection {conn_id!r}: {exc}") from None
    base_url = normalize_base_url(
        conn.host,
        port=conn.port,
        schema=conn.schema,
        default=dialect.default_url,
        api_path=dialect.api_path,
    )
    dialect.check_base_url(base_url, conn_id)
    api_key = conn.password or extra.get("api_key") or None
    return BatchApiSettings(
        conn_id=conn_id,
        base_url=base_url,
        dialect=dialect,
        api_key=api_key,
        extra=dict(extra),
        headers={str(k): str(v) for k, v in headers.items()},
        timeout=timeout_s,
        retry=retry,
        max_download_bytes=_positive_int(extra, "max_download_bytes", DEFAULT_MAX_DOWNLOAD_BYTES, conn_id),
        allow_private_redirects=_flag(extra, "allow_private_redirects", conn_id),
        auth=_auth(dialect, api_key, extra, base_url, conn_id, getattr(conn, "login", None)),
    )


def _auth(
    dialect: Dialect,
    api_key: str | None,
    extra: Mapping[str, Any],
    base_url: str,
    conn_id: str,
    login: str | None,
) -> httpx.Auth | None:
    """What signs each request: platform credentials (``credentials_kind``), read lazily, else
    the dialect's own ``request_auth`` (a token), else nothing (the key's header says it all)."""
    if dialect.credentials_kind is not None:
        from airflow_batch_provider.hooks.credentials import platform_credentials

        credentials = platform_credentials(dialect.credentials_kind, extra, conn_id, login, api_key)
        return dialect.credentials_auth(credentials, base_url, conn_id)
    return dialect.request_auth(api_key, extra, base_url, conn_id)


def request_defaults(value: Any, where: str) -> dict[str, Any]:
    """Body fields for every line that lacks them (``request_defaults``: a mapping or its JSON).

    :param value: the connection extra's or an operator's ``request_defaults`` (None: none).
    :param where: what gave it, for the error (``connection 'x'``).
    """
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise ConfigurationError(f"{where}: request_defaults is not valid JSON") from None
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f'{where}: request_defaults must be an object of body fields, e.g. {{"max_tokens": 1024}}'
        )
    return {str(k): v for k, v in value.items()}


def _positive_int(extra: Mapping[str, Any], name: str, default: int, conn_id: str) -> int:
    """The extra ``name`` as a whole number above zero (``default`` when unset)."""
    value = extra.get(name)
    if value is None:
        return default
    number: int | None = None
    if isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if number is None or number < 1:
        raise ConfigurationError(
            f"connection {conn_id!r}: extra {name!r} must be a whole number above 0, got {value!r}"
        )
    return number


def _flag(extra: Mapping[str, Any], name: str, conn_id: str) -> bool:
    """The extra ``name`` as a boolean (false when unset); the form may save it as text."""
    value = extra.get(name, False)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"connection {conn_id!r}: extra {name!r} must be true or false, got {value!r}"
        )
    return value
