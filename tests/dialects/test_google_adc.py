"""Application Default Credentials in their three forms, each through the sync client (google-auth's
refresh) and the async client (the provider's own grant over httpx, never blocking the loop), each
against a local endpoint: a service-account key file and an authorized user's file named by
``GOOGLE_APPLICATION_CREDENTIALS``, and the GCE metadata server found through google-auth's
``GCE_METADATA_HOST`` / ``GCE_METADATA_IP``. Each checks the token reaches the API, is refreshed
before it expires, and was fetched by the client that should fetch it (google-auth's ``requests``
for the sync client, ``httpx`` for the async one). gcloud's own configuration never leaks in
(``CLOUDSDK_CONFIG`` is an empty directory)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.dialects.google_credentials import CLOUD_SCOPE, JWT_GRANT, google_bearer_auth
from airflow_batch_provider.exceptions import BatchApiAuthError
from tests.fixtures.google_token import TokenServer

API = "/v1/projects/p/locations/us-central1/batchPredictionJobs"
ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST", "GCE_METADATA_ROOT", "GCE_METADATA_IP")
REFRESH_TOKEN = "1//0g-adc-refresh-token-abcdefghijklmnopqrstuvwxyz"
CLIENT_SECRET = "GOCSPX-adc-client-secret-abcdefghijklmnop"
USER = {"client_id": "764086051850-adc.apps.googleusercontent.com", "client_secret": CLIENT_SECRET}
REPO = Path(__file__).resolve().parents[2]


def closed_port() -> str:
    """``127.0.0.1:<port>`` where nothing listens (a metadata server that is not there)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def point_metadata_at(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """google-auth's metadata server at ``host``: its documented variables, and the host it read
    from ``GCE_METADATA_HOST`` when first imported (a deployment sets it before the process starts;
    ``test_the_metadata_server_variables_alone_suffice`` checks that path in a fresh process)."""
    from google.auth.compute_engine import _metadata

    monkeypatch.setenv("GCE_METADATA_HOST", host)
    monkeypatch.setenv("GCE_METADATA_IP", host)
    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)


@pytest.fixture
def adc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, google_token: Any) -> TokenServer:
    """A clean ADC environment: no credentials variable, an empty gcloud configuration and no
    metadata server (a probe finds nothing listening); the token server to add them with."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    gcloud = tmp_path / "gcloud"
    gcloud.mkdir()
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(gcloud))
    point_metadata_at(monkeypatch, closed_port())
    state: TokenServer = google_token[0]
    # 100 s left is inside the refresh margin (300 s): every call needs a new token.
    state.expires_in = 100
    return state


def call_twice(auth: Any, url: str, asynchronous: bool) -> None:
    """Two API calls through the sync or the async client."""
    if not asynchronous:
        with httpx.Client(base_url=url, auth=auth) as client:
            for _ in range(2):
                assert client.get(API).status_code == 200
        return

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, auth=auth) as client:
            for _ in range(2):
                assert (await client.get(API)).status_code == 200

    asyncio.run(run())


def agent(asynchronous: bool) -> str:
    """Who sends the token request: google-auth (requests) for the sync client, httpx for the async."""
    return "python-httpx/" if asynchronous else "python-requests/"


def credentials_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: dict[str, Any]) -> None:
    path = tmp_path / "adc.json"
    path.write_bytes(orjson.dumps(content))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_service_account_key_named_by_the_environment(
    adc: TokenServer,
    google_key: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    asynchronous: bool,
) -> None:
    credentials_file(tmp_path, monkeypatch, google_key)
    auth = google_bearer_auth(None, {}, adc.url + "/v1", "vx")
    call_twice(auth, adc.url, asynchronous)
    assert adc.seen == ["Bearer ya29.test-0", "Bearer ya29.test-1"]
    assert auth.fetches == 2
    assert [g["grant_type"] for g in adc.grants] == [JWT_GRANT] * 2
    assert {(g["path"], g["iss"], g["scope"]) for g in adc.grants} == {
        ("/token", google_key["client_email"], CLOUD_SCOPE)
    }
    assert all(g["agent"].startswith(agent(asynchronous)) for g in adc.grants), adc.grants


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_authorized_user_file_named_by_the_environment(
    adc: TokenServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    import google.oauth2.credentials

    adc.user = {**USER, "refresh_token": REFRESH_TOKEN}
    # google-auth sends an authorized user's refresh token to Google's endpoint whatever the
    # file's token_uri says (so a planted file cannot send it elsewhere): Google's endpoint is
    # stood in for here, and the file names another one, which must see nothing.
    monkeypatch.setattr(google.oauth2.credentials, "_GOOGLE_OAUTH2_TOKEN_ENDPOINT", f"{adc.url}/google/token")
    credentials_file(
        tmp_path,
        monkeypatch,
        {"type": "authorized_user", **adc.user, "token_uri": f"{adc.url}/planted/token"},
    )
    auth = google_bearer_auth(None, {}, adc.url + "/v1", "vx")
    call_twice(auth, adc.url, asynchronous)
    assert adc.seen == ["Bearer ya29.test-0", "Bearer ya29.test-1"]
    assert auth.fetches == 2
    assert [(g["grant_type"], g["path"]) for g in adc.grants] == [("refresh_token", "/google/token")] * 2
    # No scope, as google-auth sends it: ADC leaves user credentials unscoped (their token has
    # the scopes the user consented to).
    assert {(g["client_id"], g["scope"]) for g in adc.grants} == {(USER["client_id"], None)}
    assert all(g["agent"].startswith(agent(asynchronous)) for g in adc.grants), adc.grants


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_metadata_server(adc: TokenServer, monkeypatch: pytest.MonkeyPatch, asynchronous: bool) -> None:
    point_metadata_at(monkeypatch, adc.url.removeprefix("http://"))
    auth = google_bearer_auth(None, {}, adc.url + "/v1", "vx")
    call_twice(auth, adc.url, asynchronous)
    assert adc.seen == ["Bearer ya29.test-0", "Bearer ya29.test-1"]
    assert auth.fetches == 2
    assert [(g["grant_type"], g["scopes"]) for g in adc.grants] == [("metadata", CLOUD_SCOPE)] * 2
    assert all(g["agent"].startswith(agent(asynchronous)) for g in adc.grants), adc.grants


SCRIPT = """
import asyncio, sys
import httpx
from airflow_batch_provider.dialects.google_credentials import google_bearer_auth

url = sys.argv[1]
auth = google_bearer_auth(None, {}, url + "/v1", "vx")
with httpx.Client(base_url=url, auth=auth) as client:
    client.get(sys.argv[2]).raise_for_status()

async def run():
    async with httpx.AsyncClient(base_url=url, auth=auth) as client:
        (await client.get(sys.argv[2])).raise_for_status()

asyncio.run(run())
"""


def test_the_metadata_server_variables_alone_suffice(adc: TokenServer, tmp_path: Path) -> None:
    # A fresh interpreter, as a deployment starts one: google-auth reads GCE_METADATA_HOST at
    # import, so only a new process shows the variables alone reach the server.
    host = adc.url.removeprefix("http://")
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env.update(
        GCE_METADATA_HOST=host,
        GCE_METADATA_IP=host,
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
    )
    done = subprocess.run(  # noqa: S603 (this interpreter, a fixed script)
        [sys.executable, "-c", SCRIPT, adc.url, API], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert adc.seen == ["Bearer ya29.test-0", "Bearer ya29.test-1"]
    assert [g["agent"].split("/")[0] for g in adc.grants] == ["python-requests", "python-httpx"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_refused_user_grant_is_an_auth_error_without_the_secrets(
    adc: TokenServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    import google.oauth2.credentials

    adc.user = {**USER, "refresh_token": "1//0g-another-token-that-was-not-revoked"}
    # A hostile endpoint echoes the grant in its refusal: the error masks it.
    adc.refusal = f"Token has been expired or revoked: {REFRESH_TOKEN} {CLIENT_SECRET}"
    monkeypatch.setattr(google.oauth2.credentials, "_GOOGLE_OAUTH2_TOKEN_ENDPOINT", f"{adc.url}/google/token")
    credentials_file(
        tmp_path, monkeypatch, {"type": "authorized_user", **USER, "refresh_token": REFRESH_TOKEN}
    )
    auth = google_bearer_auth(None, {}, adc.url + "/v1", "vx")
    with pytest.raises(BatchApiAuthError) as caught:
        asyncio.run(auth.atoken()) if asynchronous else auth.token()
    text = str(caught.value)
    assert "invalid_grant" in text and "expired or revoked" in text
    assert REFRESH_TOKEN not in text and CLIENT_SECRET not in text
    assert [g.get("refused") for g in adc.grants] == [True]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_metadata_server_refusing_a_token_is_an_auth_error(
    adc: TokenServer, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    point_metadata_at(monkeypatch, adc.url.removeprefix("http://"))
    adc.metadata_refuse = True
    auth = google_bearer_auth(None, {}, adc.url + "/v1", "vx")
    with pytest.raises(BatchApiAuthError) as caught:
        asyncio.run(auth.atoken()) if asynchronous else auth.token()
    assert "403" in str(caught.value) and "metadata" in str(caught.value), caught.value
    assert adc.issued == []


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_no_credentials_and_no_metadata_server_is_an_auth_error(adc: TokenServer, asynchronous: bool) -> None:
    # Nothing named, gcloud's directory empty, nothing listening where the metadata server would
    # be: google-auth's search ends without credentials (after its detection retries, ~3 s).
    auth = google_bearer_auth(None, {}, adc.url + "/v1", "vx")
    with pytest.raises(BatchApiAuthError) as caught:
        asyncio.run(auth.atoken()) if asynchronous else auth.token()
    assert "DefaultCredentialsError" in str(caught.value), caught.value
    assert adc.grants == []
