"""Azure OpenAI batch (Global Batch and Data Zone Batch deployments).

Built to Azure OpenAI's public REST reference and the official ``openai`` SDK's ``AzureOpenAI``
client. The wire shapes are OpenAI's (Files + Batches, the same statuses, output and error
files); what differs is where the API lives, how a request authenticates, and the limits:

- **Paths.** The connection's host is the resource endpoint (``https://<resource>.openai.azure.com``).
  Without extra ``api_version`` the v1 API is used: ``{endpoint}/openai/v1/files``,
  ``/openai/v1/batches``, no version parameter. With it, the classic API:
  ``{endpoint}/openai/files?api-version=<version>`` and ``/openai/batches?api-version=...``,
  the version sent on every call.
- **Auth.** The key in the ``api-key`` header (the connection's password), or with extra
  ``auth: entra`` a Microsoft Entra ID bearer token for ``https://cognitiveservices.azure.com/.default``
  through ``azure-identity`` (the ``[azure]`` extra): a service principal (extras ``tenant_id``,
  ``client_id`` and the password as its client secret) or ``DefaultAzureCredential`` (managed
  identity, workload identity, environment; extra ``client_id`` picks a user-assigned identity).
  The token is refreshed before it expires; the async client gets it from ``azure.identity.aio``.
- **Endpoints.** Staging keeps the canonical ``/v1/chat/completions``; on the classic API each
  uploaded line's ``url`` and the create's ``endpoint`` read ``/chat/completions`` (the form of
  Microsoft's classic samples), on the v1 API ``/v1/chat/completions`` (its REST reference).
- **The model** of each line (``body.model``) is the deployment's name and must be the same on
  every line of a file. At most 100,000 requests and 200 MB per file.
- **File expiry.** Uploads carry ``expires_after`` and creates ``output_expires_after`` (anchor
  ``created_at``, extra ``file_expiry_seconds``, 14 days by default, 14 to 30 days allowed), so
  finished runs do not fill the resource's file cap (500 files without expiry, 10,000 with).
- **Enqueued token quota.** ``token_limit_exceeded`` refuses a create (in some regions) or fails
  the batch (in others); both are reported as the quota error they are.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from airflow_batch_provider.dialects.base import Dialect
from airflow_batch_provider.exceptions import BatchApiAuthError, ConfigurationError
from airflow_batch_provider.limits import MB, Limits
from airflow_batch_provider.redaction import redact

if TYPE_CHECKING:
    import httpx

    from airflow_batch_provider.dialects.tokens import Token

#: The Entra ID scope of Azure OpenAI (Cognitive Services) data-plane calls.
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"
#: ``expires_after.seconds`` Azure accepts on a batch file: 14 to 30 days.
MIN_FILE_EXPIRY = 14 * 24 * 3600
MAX_FILE_EXPIRY = 30 * 24 * 3600
DEFAULT_FILE_EXPIRY = MIN_FILE_EXPIRY
AUTH_MODES = ("api_key", "entra")
EXTRA_NAME = "airflow-batch-provider[azure]"


def make_credential(extra: Mapping[str, Any], secret: str | None, *, asynchronous: bool) -> Any:
    """An ``azure-identity`` credential for the connection (sync, or from ``azure.identity.aio``).

    A service principal when extras ``tenant_id`` and ``client_id`` and a client secret (the
    password, or extra ``client_secret``) are set; else ``DefaultAzureCredential``, whose
    user-assigned managed identity is extra ``client_id`` when given.

    :param extra: the connection extra.
    :param secret: the client secret, if any.
    :param asynchronous: build the ``azure.identity.aio`` credential (for the event loop).
    """
    if asynchronous:
        from azure.identity.aio import ClientSecretCredential, DefaultAzureCredential
    else:
        from azure.identity import (  # type: ignore[assignment]
            ClientSecretCredential,
            DefaultAzureCredential,
        )
    tenant_id, client_id = extra.get("tenant_id"), extra.get("client_id")
    if tenant_id and client_id and secret:
        return ClientSecretCredential(str(tenant_id), str(client_id), secret)
    if client_id:
        return DefaultAzureCredential(managed_identity_client_id=str(client_id))
    return DefaultAzureCredential()


class AzureOpenAIDialect(Dialect):
    """Azure OpenAI Batch API (Global Batch and Data Zone Batch deployments).

    :param api_version: the classic API's version (None: the v1 API).
    :param auth: ``api_key`` or ``entra``.
    :param file_expiry_seconds: ``expires_after.seconds`` of uploaded batch files.
    """

    name = "azure"
    label = "Azure OpenAI"
    default_base_url = "https://YOUR-RESOURCE.openai.azure.com"
    requires_host = True
    default_api_path = "/openai/v1"
    endpoints = frozenset({"/v1/chat/completions", "/v1/embeddings", "/v1/responses"})
    # 100,000 requests and 200 MB per file; no per-line limit is documented.
    limits = Limits(max_lines=100_000, max_file_bytes=200 * MB, max_line_bytes=200 * MB)
    # Every line's body.model names the one deployment the batch runs on.
    mixed_models = False
    model_meaning = "the batch deployment's name"
    quota_error_codes = frozenset({"insufficient_quota", "token_limit_exceeded"})
    batch_quota_error_codes = frozenset({"token_limit_exceeded"})
    connection_fields = {
        "api_version": {
            "label": "API version (azure)",
            "description": (
                "Azure OpenAI: empty for the v1 API ({endpoint}/openai/v1); a version such as "
                "2024-10-21 for the classic API ({endpoint}/openai, ?api-version= on every call). "
                "The host is the resource endpoint, https://<resource>.openai.azure.com."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "auth": {
            "label": "Auth (azure)",
            "description": (
                "Azure OpenAI: 'api_key' (default; the password is the resource key, sent as api-key) "
                "or 'entra' (a Microsoft Entra ID token; needs the [azure] extra): with tenant_id and "
                "client_id the password is the service principal's client secret, else "
                "DefaultAzureCredential (client_id picks a user-assigned managed identity)."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "tenant_id": {
            "label": "Entra ID tenant id (azure)",
            "description": "Directory (tenant) id of the service principal, for auth 'entra'.",
            "schema": {"type": ["string", "null"]},
        },
        "client_id": {
            "label": "Entra ID client id (azure)",
            "description": "Application (client) id, or a user-assigned managed identity's (auth 'entra').",
            "schema": {"type": ["string", "null"]},
        },
        "file_expiry_seconds": {
            "label": "Batch file expiry in seconds (azure)",
            "description": (
                "expires_after of uploaded batch files, anchored at creation: 1209600 (14 days, the "
                "default) to 2592000 (30 days), so finished runs do not fill the resource's 500 files."
            ),
            "schema": {"type": ["integer", "null"], "minimum": MIN_FILE_EXPIRY, "maximum": MAX_FILE_EXPIRY},
        },
    }

    def __init__(
        self,
        *,
        api_version: str | None = None,
        auth: str = "api_key",
        file_expiry_seconds: int = DEFAULT_FILE_EXPIRY,
    ) -> None:
        super().__init__()
        self.api_version = api_version
        self.auth = auth
        self.file_expiry_seconds = file_expiry_seconds
        # The classic API names endpoints without the version segment (``/chat/completions``, in
        # each line's ``url`` and the create's ``endpoint``); the v1 API's reference with it.
        self.encodes_lines = api_version is not None

    def __repr__(self) -> str:
        path = f"classic api-version={self.api_version}" if self.api_version else "v1"
        return f"<Dialect azure {path} auth={self.auth}>"

    # ---- connection ---------------------------------------------------------------------
    def configure(self, extra: Mapping[str, Any], conn_id: str) -> AzureOpenAIDialect:
        """The dialect with the connection's API version, auth mode and file expiry, checked."""
        self.check_connection(extra, conn_id)
        where = f"connection {conn_id!r} (dialect azure)"
        version = extra.get("api_version")
        if version is not None and (not isinstance(version, str) or not version.strip()):
            raise ConfigurationError(f"{where}: extra 'api_version' must be a version string like 2024-10-21")
        auth = str(extra.get("auth") or "api_key").strip().lower().replace("-", "_")
        if auth not in AUTH_MODES:
            raise ConfigurationError(
                f"{where}: extra 'auth' is {extra.get('auth')!r}; use one of {', '.join(AUTH_MODES)}"
            )
        if auth == "entra" and importlib.util.find_spec("azure.identity") is None:
            raise ConfigurationError(
                f"{where}: auth 'entra' needs the azure-identity package; install the "
                f"'azure' extra: pip install '{EXTRA_NAME}'"
            )
        raw_expiry = extra.get("file_expiry_seconds", DEFAULT_FILE_EXPIRY)
        # A whole number, or its digits (a form saves numbers as text); never a bool or a float.
        if isinstance(raw_expiry, str) and raw_expiry.strip().isdigit():
            raw_expiry = int(raw_expiry.strip())
        if not isinstance(raw_expiry, int) or isinstance(raw_expiry, bool):
            raise ConfigurationError(
                f"{where}: extra 'file_expiry_seconds' must be a whole number of seconds, got {raw_expiry!r}"
            )
        expiry = raw_expiry
        if not MIN_FILE_EXPIRY <= expiry <= MAX_FILE_EXPIRY:
            raise ConfigurationError(
                f"{where}: extra 'file_expiry_seconds' is {expiry}; Azure accepts "
                f"{MIN_FILE_EXPIRY} (14 days) to {MAX_FILE_EXPIRY} (30 days)"
            )
        return AzureOpenAIDialect(
            api_version=version.strip() if isinstance(version, str) else None,
            auth=auth,
            file_expiry_seconds=expiry,
        )

    @property
    def api_path(self) -> str:
        return "/openai" if self.api_version else "/openai/v1"

    def check_base_url(self, base_url: str, conn_id: str) -> None:
        """A host naming the path must name the one the API version picks (v1 takes no version)."""
        path = urlsplit(base_url).path.rstrip("/")
        where = f"connection {conn_id!r} (dialect azure)"
        if self.api_version and path.endswith("/openai/v1"):
            raise ConfigurationError(
                f"{where}: the host names the v1 path ({path}), which takes no api-version, but extra "
                f"'api_version' is {self.api_version!r}; remove it, or set the host to the resource endpoint"
            )
        if not self.api_version and path.endswith("/openai"):
            raise ConfigurationError(
                f"{where}: the host names the classic path ({path}), which needs extra 'api_version'; "
                "set it, or end the host with /openai/v1 (or give only the resource endpoint)"
            )

    @property
    def query_params(self) -> dict[str, str]:
        return {"api-version": self.api_version} if self.api_version else {}

    # ---- authentication -------------------------------------------------------------
    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        """The key in ``api-key``; nothing under Entra ID (its bearer comes from ``request_auth``)."""
        if self.auth == "entra" or not api_key:
            return {}
        return {"api-key": api_key}

    def request_auth(
        self, secret: str | None, extra: Mapping[str, Any], base_url: str, conn_id: str
    ) -> httpx.Auth | None:
        if self.auth != "entra":
            if not secret:
                raise ConfigurationError(
                    f"connection {conn_id!r} (dialect azure): no API key; set the password to the "
                    "resource's key, or extra auth 'entra' for a Microsoft Entra ID token"
                )
            return None
        from airflow_batch_provider.dialects.tokens import RefreshingBearerAuth

        client_secret = secret or (str(extra["client_secret"]) if extra.get("client_secret") else None)
        credentials: dict[bool, Any] = {}

        def credential(asynchronous: bool) -> Any:
            # Built on first use, each kind once: a sync client never builds the aio one.
            if asynchronous not in credentials:
                credentials[asynchronous] = make_credential(extra, client_secret, asynchronous=asynchronous)
            return credentials[asynchronous]

        def fetch() -> Token:
            try:
                access = credential(False).get_token(ENTRA_SCOPE)
            except Exception as exc:
                raise _token_error(exc, client_secret) from None
            return _token(access)

        async def afetch() -> Token:
            try:
                # Built off the loop: the first build imports azure.identity.aio and reads the
                # environment, which must not hold up the triggerer's other triggers.
                built: Any = credentials.get(True)
                if built is None:
                    built = await asyncio.to_thread(credential, True)
                access = await built.get_token(ENTRA_SCOPE)
            except Exception as exc:
                raise _token_error(exc, client_secret) from None
            return _token(access)

        def close() -> None:
            closing = credentials.pop(False, None)
            if closing is not None and hasattr(closing, "close"):
                closing.close()

        async def aclose() -> None:
            # The aio credential holds an HTTP session: closed with the hook's async client.
            closing = credentials.pop(True, None)
            if closing is not None and hasattr(closing, "close"):
                await closing.close()

        return RefreshingBearerAuth(
            base_url, fetch, afetch, what="Microsoft Entra ID", close=close, aclose=aclose
        )

    def is_quota_error(self, status_code: int, body: Any) -> bool:
        """Also ``token_limit_exceeded`` on a refused create (400/403/429): the enqueued token
        quota of the deployment is full, and only finished batches or a higher quota free it."""
        if super().is_quota_error(status_code, body):
            return True
        if status_code not in (400, 403, 429) or not isinstance(body, Mapping):
            return False
        error = body.get("error")
        code = error.get("code") if isinstance(error, Mapping) else body.get("code")
        return isinstance(code, str) and code.lower() in self.batch_quota_error_codes

    # ---- request lines ----------------------------------------------------------------
    def wire_endpoint(self, endpoint: str) -> str:
        """The endpoint as this connection's API names it: ``/v1/chat/completions`` on the v1
        API, ``/chat/completions`` on the classic one (Microsoft's classic samples and files).

        :param endpoint: a canonical endpoint (``/v1/...``).
        """
        if self.api_version and endpoint.startswith("/v1/"):
            return endpoint[len("/v1") :]
        return endpoint

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """The canonical line with its ``url`` as the classic API names it (classic only)."""
        url = canonical.get("url")
        if isinstance(url, str):
            canonical["url"] = self.wire_endpoint(url)
        return canonical

    # ---- batches --------------------------------------------------------------------
    def create_batch_body(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """OpenAI's body, and ``output_expires_after``: the batch's output and error files count
        against the resource's file cap too, so they expire like the input."""
        body = super().create_batch_body(
            input_file_id=input_file_id,
            endpoint=self.wire_endpoint(endpoint),
            completion_window=completion_window,
            metadata=metadata,
            name=name,
            model=model,
        )
        body["output_expires_after"] = {"anchor": "created_at", "seconds": self.file_expiry_seconds}
        return body

    # ---- files ----------------------------------------------------------------------
    def upload_form(self) -> dict[str, str]:
        """``purpose=batch`` and the file's expiry, as the SDK sends ``expires_after``."""
        return {
            "purpose": "batch",
            "expires_after[anchor]": "created_at",
            "expires_after[seconds]": str(self.file_expiry_seconds),
        }


def _token(access: Any) -> Token:
    """A ``Token`` from an ``azure.core.credentials.AccessToken`` (``token``, ``expires_on``)."""
    from airflow_batch_provider.dialects.tokens import Token

    value = getattr(access, "token", None)
    expires_on = getattr(access, "expires_on", None)
    if not isinstance(value, str) or not value or not isinstance(expires_on, (int, float)):
        raise BatchApiAuthError("Microsoft Entra ID gave no access token (no token or expires_on)")
    return Token(value, float(expires_on))


def _token_error(exc: Exception, secret: str | None) -> BatchApiAuthError:
    """The error of a failed token request: its kind and first line, never the client secret."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    text = redact(text, secret)
    return BatchApiAuthError(
        f"Microsoft Entra ID refused a token for {ENTRA_SCOPE}: {type(exc).__name__}: {text}"
    )
