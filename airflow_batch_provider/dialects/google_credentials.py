"""Google Cloud credentials as a bearer token refreshed before it expires (Vertex AI).

The credentials come from the connection, in this order: a service-account key as JSON (the
password, or extra ``keyfile_dict``, the google provider's name), a key file (extra
``key_path``), else Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's
user credentials, the GCE/GKE metadata server). ``google-auth`` (the ``vertex`` extra) reads
them; the google provider is not needed.

The sync client refreshes through ``google-auth`` itself. The async client (the triggerer) never
waits on a blocking call: the three kinds a deployment uses are refreshed over ``httpx``'s async
client with the grant ``google-auth`` would send, to the endpoint it would send it to (a service
account's JWT assertion signed here, to its key's ``token_uri``; an authorized user's refresh
token, to the endpoint ``google-auth`` gave the credentials, Google's whatever the file says; the
metadata server's token, at ``GCE_METADATA_HOST``); any other kind (workload identity
federation, impersonation) is refreshed by ``google-auth`` in a worker thread, as it has no async
refresh for them. Which kind ADC is (``google.auth.default``: a file to read, maybe a metadata
server to probe) is found in a worker thread too, once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections.abc import Mapping
from datetime import timezone
from pathlib import Path
from typing import Any

import httpx
import orjson

from airflow_batch_provider.dialects.tokens import RefreshingBearerAuth, Token
from airflow_batch_provider.exceptions import BatchApiAuthError, ConfigurationError
from airflow_batch_provider.hooks.transport import aread_capped
from airflow_batch_provider.redaction import redact

#: The OAuth scope of Google Cloud APIs (Vertex AI included).
CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
DEFAULT_TOKEN_URI = "https://oauth2.googleapis.com/token"  # noqa: S105 (a URL, no secret)
METADATA_TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"  # noqa: S105
JWT_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
EXTRA_NAME = "airflow-batch-provider[vertex]"
WHAT = "Google credentials"
# A token request is small: it either answers quickly or the next poll tries again.
TOKEN_TIMEOUT = 30.0
#: The largest token answer read (an access token and its expiry: a few KB).
MAX_TOKEN_ANSWER = 64 * 1024


def key_info(secret: str | None, extra: Mapping[str, Any], conn_id: str) -> dict[str, Any] | None:
    """The connection's credentials file content (a service-account key, an authorized user's
    credentials), or None for Application Default Credentials.

    :param secret: the connection's password (a key as JSON, or empty).
    :param extra: the connection extra (``keyfile_dict``: the key as JSON or an object;
        ``key_path``: a key file).
    :param conn_id: the connection id, for error messages.
    """
    where = f"connection {conn_id!r}"
    raw: Any = secret or extra.get("keyfile_dict")
    source = "the password" if secret else "extra 'keyfile_dict'"
    if not raw and extra.get("key_path"):
        path = Path(str(extra["key_path"])).expanduser()
        source = f"key file {str(path)!r} (extra 'key_path')"
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigurationError(f"{where}: cannot read {source}: {exc.strerror}") from None
    if not raw:
        return None
    if isinstance(raw, (str, bytes)):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            # The message never quotes the text: it is a private key.
            raise ConfigurationError(
                f"{where}: {source} is not JSON (a service-account key file's content)"
            ) from None
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"{where}: {source} must be a JSON object (a service-account key)")
    kind = raw.get("type")
    if kind == "service_account":
        missing = [k for k in ("client_email", "private_key") if not raw.get(k)]
        if missing:
            raise ConfigurationError(
                f"{where}: the service-account key in {source} has no {', '.join(missing)}"
            )
    elif not isinstance(kind, str):
        raise ConfigurationError(f"{where}: {source} has no 'type' (a key file says 'service_account')")
    return dict(raw)


def check_installed(conn_id: str) -> None:
    """Refuse, by name, a Google connection without ``google-auth`` installed."""
    if importlib.util.find_spec("google.auth") is None:
        raise ConfigurationError(
            f"connection {conn_id!r}: Google credentials need the google-auth package; install the "
            f"'vertex' extra: pip install '{EXTRA_NAME}'"
        )


def load_credentials(info: Mapping[str, Any] | None, scopes: list[str]) -> Any:
    """``google-auth`` credentials of a key (or of Application Default Credentials), scoped.

    Blocking: ADC may probe the metadata server. The async path calls it in a worker thread.
    """
    import google.auth

    if info is None:
        credentials, _ = google.auth.default(scopes=scopes)
        return credentials
    credentials, _ = google.auth.load_credentials_from_dict(dict(info), scopes=scopes)
    return credentials


def _token_of(credentials: Any) -> Token:
    value = getattr(credentials, "token", None)
    expiry = getattr(credentials, "expiry", None)
    if not isinstance(value, str) or not value:
        raise BatchApiAuthError(f"{WHAT} gave no access token")
    # google-auth's expiry is a naive UTC datetime (None: it did not say; an hour is Google's).
    expires_on = expiry.replace(tzinfo=timezone.utc).timestamp() if expiry else time.time() + 3600
    return Token(value, expires_on)


def _answer_token(response: httpx.Response, where: str) -> Token:
    """The token of an OAuth token answer (``access_token``, ``expires_in``), else an auth error
    naming the answer's ``error`` (never its body: it may echo what was sent)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200 or not isinstance(body, dict):
        code = body.get("error") if isinstance(body, dict) else None
        described = body.get("error_description") if isinstance(body, dict) else None
        detail = ": ".join(str(p)[:200] for p in (code, described) if p)
        raise BatchApiAuthError(
            f"{where} refused a token (HTTP {response.status_code}){': ' + detail if detail else ''}"
        )
    value, expires_in = body.get("access_token"), body.get("expires_in")
    if not isinstance(value, str) or not value:
        raise BatchApiAuthError(f"{where} answered without an access_token")
    seconds = (
        float(expires_in)
        if isinstance(expires_in, (int, float)) and not isinstance(expires_in, bool)
        else 3600.0
    )
    return Token(value, time.time() + seconds)


def service_account_assertion(info: Mapping[str, Any], scopes: list[str], now: float | None = None) -> str:
    """The signed JWT a service account trades for a token (RFC 7523), as ``google-auth`` signs it."""
    from google.auth import crypt, jwt

    issued = int(now if now is not None else time.time())
    payload = {
        "iss": info["client_email"],
        "scope": " ".join(scopes),
        # Google's token audience, whatever token_uri the key names (as google-auth signs it).
        "aud": DEFAULT_TOKEN_URI,
        "iat": issued,
        "exp": issued + 3600,
    }
    signer = crypt.RSASigner.from_service_account_info(dict(info))
    return jwt.encode(signer, payload).decode()


async def _afetch_by_grant(info: Mapping[str, Any], scopes: list[str]) -> Token | None:
    """A token for a service account (a key) or an authorized user (``_grant_info``), over the
    async client; None for another kind (the caller refreshes it through google-auth off the loop)."""
    kind = info.get("type")
    if kind == "service_account":
        form = {"grant_type": JWT_GRANT, "assertion": service_account_assertion(info, scopes)}
    elif kind == "authorized_user" and info.get("refresh_token"):
        form = {
            "grant_type": "refresh_token",
            "refresh_token": str(info["refresh_token"]),
            "client_id": str(info.get("client_id") or ""),
            "client_secret": str(info.get("client_secret") or ""),
        }
        # The scopes the credentials hold, as google-auth sends them (the token is cut to them).
        if info.get("scopes"):
            form["scope"] = " ".join(info["scopes"])
    else:
        return None
    # A service account's key names its token endpoint. An authorized user's info comes from the
    # credentials google-auth loaded (``_grant_info``), whose endpoint is Google's whatever the file
    # says: a planted file cannot send a refresh token elsewhere.
    token_uri = str(info.get("token_uri") or DEFAULT_TOKEN_URI)
    return await _token_call("POST", token_uri, f"the token endpoint {token_uri}", data=form)


async def _afetch_metadata(scopes: list[str]) -> Token:
    """A token from the GCE/GKE metadata server, asked as google-auth asks it (``GCE_METADATA_HOST``,
    else ``GCE_METADATA_ROOT``, else ``metadata.google.internal``; the scopes as a query parameter,
    which Cloud Run honours and Compute Engine ignores)."""
    host = (
        os.environ.get("GCE_METADATA_HOST")
        or os.environ.get("GCE_METADATA_ROOT")
        or "metadata.google.internal"
    )
    url = f"http://{host}{METADATA_TOKEN_PATH}"
    return await _token_call(
        "GET",
        url,
        "the metadata server",
        headers={"Metadata-Flavor": "Google"},
        params={"scopes": ",".join(scopes)},
    )


async def _token_call(method: str, url: str, where: str, **kwargs: Any) -> Token:
    """One token request within ``TOKEN_TIMEOUT`` in all, its answer read up to
    ``MAX_TOKEN_ANSWER`` bytes (a token answer is small; anything bigger is refused)."""
    async with asyncio.timeout(TOKEN_TIMEOUT), httpx.AsyncClient(timeout=TOKEN_TIMEOUT) as client:
        response = await client.send(client.build_request(method, url, **kwargs), stream=True)
        await aread_capped(response, MAX_TOKEN_ANSWER, where)
    return _answer_token(response, where)


def _grant_info(credentials: Any) -> dict[str, Any] | None:
    """The grant fields of loaded user credentials (an ``authorized_user`` file: the connection's,
    ``GOOGLE_APPLICATION_CREDENTIALS``' or gcloud's), refreshed over the async client, with the
    token endpoint google-auth chose; None for another kind (a service-account key is read by
    ``key_info`` or ``adc_key_info`` instead)."""
    from google.oauth2 import credentials as user

    if isinstance(credentials, user.Credentials) and credentials.refresh_token:
        return {
            "type": "authorized_user",
            "refresh_token": credentials.refresh_token,
            "client_id": credentials.client_id,
            "client_secret": credentials.client_secret,
            "token_uri": credentials.token_uri,
            "scopes": list(credentials.scopes or []),
        }
    return None


def adc_key_info() -> dict[str, Any] | None:
    """The key file ``GOOGLE_APPLICATION_CREDENTIALS`` names, when it is a service-account key
    (ADC then is that key, refreshed like a connection's); None otherwise."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        return None
    try:
        info = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None  # google-auth reports it, with its own words, on the refresh
    return info if isinstance(info, dict) and info.get("type") == "service_account" else None


def google_bearer_auth(
    secret: str | None, extra: Mapping[str, Any], base_url: str, conn_id: str, scopes: list[str] | None = None
) -> RefreshingBearerAuth:
    """An ``httpx.Auth`` signing requests to ``base_url`` with a Google access token.

    :param secret: the connection's password (a service-account key as JSON, or empty).
    :param extra: the connection extra (``keyfile_dict``, ``key_path``, ``scope``).
    :param base_url: the API root; only its origin gets the token.
    :param conn_id: the connection id, for error messages.
    :param scopes: the OAuth scopes (default: cloud-platform, or extra ``scope``, comma-separated).
    """
    check_installed(conn_id)
    info = key_info(secret, extra, conn_id) or adc_key_info()
    wanted = scopes or [s.strip() for s in str(extra.get("scope") or CLOUD_SCOPE).split(",") if s.strip()]
    built: dict[str, Any] = {}

    def hidden() -> list[str]:
        # The key's private parts, and those of user credentials ADC found, are masked out of
        # every error (google-auth, or a token endpoint's answer, may quote them).
        grant = _grant_info(built["credentials"]) if "credentials" in built else None
        return [
            str(found[k])
            for found in (info, grant)
            if found
            for k in ("private_key", "refresh_token", "client_secret")
            if found.get(k)
        ]

    def credentials() -> Any:
        if "credentials" not in built:
            built["credentials"] = load_credentials(info, wanted)
        return built["credentials"]

    def fetch() -> Token:
        from google.auth.transport.requests import Request

        try:
            found = credentials()
            found.refresh(Request())
        except BatchApiAuthError as exc:
            raise _masked(exc, hidden()) from None
        except Exception as exc:
            raise _token_error(exc, hidden()) from None
        return _token_of(found)

    async def afetch() -> Token:
        try:
            if info is not None and info.get("type") == "service_account":
                token = await _afetch_by_grant(info, wanted)
                if token is not None:
                    return token
            # Any other kind is loaded by google-auth, off the loop (ADC reads files and may
            # probe the metadata server; user credentials get their token endpoint there).
            found = built.get("credentials") or await asyncio.to_thread(credentials)
            grant = _grant_info(found)
            if grant is not None:
                token = await _afetch_by_grant(grant, wanted)
                if token is not None:
                    return token
            if type(found).__module__ == "google.auth.compute_engine.credentials":
                return await _afetch_metadata(wanted)
            return await asyncio.to_thread(fetch)
        except BatchApiAuthError as exc:
            raise _masked(exc, hidden()) from None
        except (httpx.HTTPError, OSError) as exc:
            raise _masked(
                BatchApiAuthError(f"{WHAT}: the token request failed: {type(exc).__name__}: {exc}"),
                hidden(),
            ) from None
        except Exception as exc:
            raise _token_error(exc, hidden()) from None

    return RefreshingBearerAuth(base_url, fetch, afetch, what=WHAT)


def _token_error(exc: Exception, secrets: list[str]) -> BatchApiAuthError:
    """A failed refresh: its kind and first line, with the key's secrets masked."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    for secret in secrets:
        text = redact(text, secret)
    return BatchApiAuthError(f"{WHAT} gave no token: {type(exc).__name__}: {text}")


def _masked(exc: BatchApiAuthError, secrets: list[str]) -> BatchApiAuthError:
    """``exc``, or an error with its text's secrets masked when one shows (an endpoint echoed it)."""
    text = masked = str(exc)
    for secret in secrets:
        masked = redact(masked, secret)
    return exc if masked == text else BatchApiAuthError(masked)
