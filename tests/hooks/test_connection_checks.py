"""``test_connection`` reports each check (reachable, authenticated, dialect) against live servers."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from airflow_batch_provider.exceptions import BatchApiConnectionError
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.hook import FAST

DIALECTS = ["openai", "doubleword", "zerogpu", "xai", "mistral", "anthropic", "azure"]
KEY = "sk-checks-secret-4242"


def _hook(monkeypatch: pytest.MonkeyPatch, connection: str) -> BatchApiHook:
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_CHECK", connection)
    return BatchApiHook("batch_check", retry_policy=FAST)


def _with(connection: str, **changes: object) -> str:
    conn = json.loads(connection)
    extra = conn["extra"]
    extra.update(changes.pop("extra", {}))  # type: ignore[call-overload]
    conn.update(changes)
    return json.dumps(conn)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_check_passes_in_the_servers_own_dialect(batch_server, monkeypatch, dialect: str) -> None:
    server = batch_server(dialect=dialect, api_key=KEY)
    ok, message = _hook(monkeypatch, server.connection_json()).test_connection()
    assert ok, message
    assert "reachable: yes (HTTP 200)" in message
    assert "authenticated: yes (the key was accepted)" in message
    assert f"dialect: yes ({dialect}: the batch listing parses)" in message
    assert KEY not in message


@pytest.mark.parametrize(
    ("configured", "spoken", "hint"), [("openai", "xai", "'xai'"), ("xai", "openai", "'openai'")]
)
def test_another_vendors_shape_is_reported_with_a_hint(
    batch_server, monkeypatch, configured: str, spoken: str, hint: str
) -> None:
    server = batch_server(dialect=spoken)  # no key: the listing answers in any dialect's auth
    connection = _with(server.connection_json(), extra={"dialect": configured})
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok
    assert "reachable: yes (HTTP 200)" in message and "authenticated: yes" in message
    assert f"dialect: NO (the listing answer is not in {configured}'s shape" in message
    assert hint in message and "set extra 'dialect'" in message


def test_a_wrong_key_fails_authenticated_and_skips_the_dialect(batch_server, monkeypatch) -> None:
    server = batch_server(api_key=KEY)
    wrong = "sk-wrong-77777"
    ok, message = _hook(monkeypatch, server.connection_json(api_key=wrong)).test_connection()
    assert not ok
    assert "reachable: yes (HTTP 401)" in message
    assert message.startswith("BatchApiAuthError: ")
    assert "authenticated: NO (HTTP 401)" in message and "dialect: not checked" in message
    assert wrong not in message and KEY not in message


def test_an_unreachable_host_fails_reachable(monkeypatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    connection = json.dumps(
        {"conn_type": "batch_api", "host": f"http://127.0.0.1:{port}/v1", "password": KEY, "extra": {}}
    )
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok
    assert message.startswith("BatchApiConnectionError: ")
    assert f"reachable: NO (BatchApiConnectionError at http://127.0.0.1:{port}/v1)" in message
    assert "authenticated: not checked" in message and KEY not in message


def test_a_base_url_without_the_version_is_hinted(batch_server, monkeypatch) -> None:
    server = batch_server()
    connection = _with(server.connection_json(), host=server.root_url + "/api")
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok
    assert "reachable: yes (HTTP 404)" in message
    assert "dialect: NO (HTTP 404; check that the base URL ends with the API version" in message


def test_a_server_error_leaves_the_dialect_unchecked(mock_hook, sleeps) -> None:
    hook = mock_hook(lambda r: json_response(503, {"error": {"message": "overloaded"}}))
    ok, message = hook.test_connection()
    assert not ok
    assert message.startswith("BatchApiServerError: ")
    assert "reachable: yes (HTTP 503) | authenticated: yes | dialect: not checked" in message


def json_response(status: int, data: object) -> httpx.Response:
    return httpx.Response(status, json=data)


def test_a_wrong_key_at_mistral_fails_authenticated_and_never_shows_a_key(batch_server, monkeypatch) -> None:
    # Mistral refuses a wrong key with a bare {"message": "Unauthorized", "request_id"} body.
    server = batch_server(dialect="mistral", api_key=KEY)
    wrong = "mistral-wrong-88888"
    ok, message = _hook(monkeypatch, server.connection_json(api_key=wrong)).test_connection()
    assert not ok
    assert message.startswith("BatchApiAuthError: ") and "Unauthorized" in message
    assert "reachable: yes (HTTP 401)" in message and "authenticated: NO (HTTP 401)" in message
    assert wrong not in message and KEY not in message


@pytest.mark.parametrize(("configured", "spoken"), [("mistral", "openai"), ("openai", "mistral")])
def test_mistral_and_openai_paths_are_told_apart(
    batch_server, monkeypatch, configured: str, spoken: str
) -> None:
    # The two vendors keep batches under different paths: the other one's answers 404 in its shape.
    server = batch_server(dialect=spoken)
    connection = _with(server.connection_json(), extra={"dialect": configured})
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok
    assert "reachable: yes (HTTP 404)" in message and "dialect: NO (HTTP 404" in message


def test_a_wrong_key_at_anthropic_fails_authenticated_and_never_shows_a_key(
    batch_server, monkeypatch
) -> None:
    # Anthropic refuses a wrong key with {"type": "error", "error": {"type": "authentication_error"}}.
    server = batch_server(dialect="anthropic", api_key=KEY)
    wrong = "sk-ant-wrong-99999"
    ok, message = _hook(monkeypatch, server.connection_json(api_key=wrong)).test_connection()
    assert not ok
    assert message.startswith("BatchApiAuthError: ") and "invalid x-api-key" in message


def test_a_wrong_key_at_azure_fails_authenticated_and_never_shows_a_key(batch_server, monkeypatch) -> None:
    # Azure refuses a wrong api-key with its own 401 body ({"error": {"code": "401", ...}}).
    server = batch_server(dialect="azure", api_key=KEY)
    wrong = "azure-wrong-99999"
    ok, message = _hook(monkeypatch, server.connection_json(api_key=wrong)).test_connection()
    assert not ok
    assert message.startswith("BatchApiAuthError: ") and "Access denied" in message
    assert "reachable: yes (HTTP 401)" in message and "authenticated: NO (HTTP 401)" in message
    assert wrong not in message and KEY not in message


@pytest.mark.parametrize(("configured", "spoken"), [("anthropic", "openai"), ("openai", "anthropic")])
def test_anthropic_and_openai_paths_are_told_apart(
    batch_server, monkeypatch, configured: str, spoken: str
) -> None:
    # Message batches live under /v1/messages/batches: OpenAI's server answers 404 there; an
    # Anthropic server refuses a call without its anthropic-version header (400, naming it).
    server = batch_server(dialect=spoken)
    connection = _with(server.connection_json(), extra={"dialect": configured})
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok
    status = 400 if spoken == "anthropic" else 404
    assert f"reachable: yes (HTTP {status})" in message and f"dialect: NO (HTTP {status}" in message
    if spoken == "anthropic":
        assert "anthropic-version: header is required" in message


@pytest.mark.parametrize("api_version", [None, "2024-10-21"])
def test_an_azure_connection_at_an_openai_server_is_told_apart(
    batch_server, monkeypatch, api_version
) -> None:
    # Azure's /openai/... paths are not OpenAI's /v1: a 404 whose hint names Azure's API root.
    server = batch_server(dialect="openai")
    extra = {"dialect": "azure", **({"api_version": api_version} if api_version else {})}
    connection = _with(server.connection_json(), host=server.root_url, extra=extra)
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok
    root = "/openai" if api_version else "/openai/v1"
    assert "reachable: yes (HTTP 404)" in message
    assert (
        f"dialect: NO (HTTP 404; check that the base URL ends with the API version (e.g. {root})" in message
    )


def test_an_azure_entra_token_is_checked(batch_server, monkeypatch) -> None:
    import time

    from azure.core.credentials import AccessToken

    import airflow_batch_provider.dialects.azure as azure_module

    token = "entra-check-token-31337"
    server = batch_server(dialect="azure", api_key=KEY, bearer_token=token)

    class Credential:
        def __init__(self, value: str | None) -> None:
            self.value = value

        def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:
            if self.value is None:
                raise RuntimeError("AADSTS700016: application not found in the directory")
            return AccessToken(self.value, int(time.time()) + 3600)

    connection = _with(server.connection_json(), password=None, extra={"auth": "entra"})
    monkeypatch.setattr(azure_module, "make_credential", lambda *a, **k: Credential(token))
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert ok, message
    assert "authenticated: yes (the token was accepted)" in message and token not in message
    # A token the API refuses, and no token at all (the identity provider said no).
    monkeypatch.setattr(azure_module, "make_credential", lambda *a, **k: Credential("not-the-token"))
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok and "authenticated: NO (HTTP 401)" in message and "not-the-token" not in message
    monkeypatch.setattr(azure_module, "make_credential", lambda *a, **k: Credential(None))
    ok, message = _hook(monkeypatch, connection).test_connection()
    assert not ok and message.startswith("BatchApiAuthError: Microsoft Entra ID refused a token")
    assert "reachable: not checked | authenticated: NO (no token)" in message


def test_a_refused_connection_names_the_base_url_tried(monkeypatch) -> None:
    """Both the error text and the reachable check say which API root was tried, never the key."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}/v1"
    connection = json.dumps({"conn_type": "batch_api", "host": base_url, "password": KEY, "extra": {}})
    hook = _hook(monkeypatch, connection)
    with pytest.raises(BatchApiConnectionError) as caught:
        hook.get_batch("batch_1")
    assert f"the connection to {base_url} failed" in str(caught.value)
    assert KEY not in str(caught.value)
    ok, message = hook.test_connection()
    assert not ok
    assert f"reachable: NO (BatchApiConnectionError at {base_url})" in message
    assert KEY not in message
