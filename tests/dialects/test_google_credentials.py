"""Google credentials as a refreshing bearer token: a service-account key traded at a real OAuth
token endpoint (a local HTTP server checking the signed assertion), through google-auth for the
sync client and the async client's own grant, with the token refreshed before it expires."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.dialects.google_credentials import (
    CLOUD_SCOPE,
    JWT_GRANT,
    google_bearer_auth,
    key_info,
)
from airflow_batch_provider.exceptions import BatchApiAuthError, ConfigurationError

API = "/v1/projects/p/locations/us-central1/batchPredictionJobs"


def test_sync_client_trades_the_key_for_a_token_and_reuses_it(google_token: Any) -> None:
    state, info = google_token
    auth = google_bearer_auth(orjson.dumps(info).decode(), {}, state.url + "/v1", "vx")
    with httpx.Client(base_url=state.url, auth=auth) as client:
        for _ in range(3):
            assert client.get(API).status_code == 200
    # One token for three calls: it is fresh for an hour.
    assert state.seen == ["Bearer ya29.test-0"] * 3
    assert auth.fetches == 1
    grant = state.grants[0]
    assert grant["grant_type"] == JWT_GRANT
    assert grant["iss"] == info["client_email"]
    assert grant["scope"] == CLOUD_SCOPE


def test_async_client_gets_its_token_without_google_auth_blocking(google_token: Any) -> None:
    state, info = google_token

    async def run() -> None:
        auth = google_bearer_auth(None, {"keyfile_dict": info}, state.url + "/v1", "vx")
        async with httpx.AsyncClient(base_url=state.url, auth=auth) as client:
            assert (await client.get(API)).status_code == 200
            assert (await client.get(API)).status_code == 200
        assert auth.fetches == 1

    asyncio.run(run())
    assert state.seen == ["Bearer ya29.test-0"] * 2
    assert state.grants[0]["iss"] == info["client_email"]


def test_a_token_near_its_expiry_is_refreshed_before_use(google_token: Any, tmp_path: Any) -> None:
    state, info = google_token
    # 100 s left is inside the refresh margin (300 s): every call fetches a new token.
    state.expires_in = 100
    path = tmp_path / "key.json"
    path.write_bytes(orjson.dumps(info))
    auth = google_bearer_auth(None, {"key_path": str(path)}, state.url + "/v1", "vx")
    with httpx.Client(base_url=state.url, auth=auth) as client:
        client.get(API)
        client.get(API)
    assert state.seen == ["Bearer ya29.test-0", "Bearer ya29.test-1"]

    async def run() -> None:
        async with httpx.AsyncClient(base_url=state.url, auth=auth) as client:
            await client.get(API)

    asyncio.run(run())
    assert state.seen[-1] == "Bearer ya29.test-2"


def test_a_token_goes_only_to_the_api_origin(google_token: Any) -> None:
    state, info = google_token
    auth = google_bearer_auth(
        orjson.dumps(info).decode(), {}, "https://us-central1-aiplatform.googleapis.com", "vx"
    )
    with httpx.Client(base_url=state.url, auth=auth) as client:
        client.get(API)
    assert state.seen == [None]
    assert auth.fetches == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_refused_key_is_an_auth_error_without_the_key(google_token: Any, asynchronous: bool) -> None:
    state, info = google_token
    state.refuse = True
    auth = google_bearer_auth(orjson.dumps(info).decode(), {}, state.url, "vx")
    with pytest.raises(BatchApiAuthError) as caught:
        if asynchronous:
            asyncio.run(auth.atoken())
        else:
            auth.token()
    text = str(caught.value)
    assert "invalid_grant" in text
    assert "PRIVATE KEY" not in text
    assert info["private_key"].splitlines()[1] not in text


@pytest.mark.parametrize(
    ("secret", "extra", "message"),
    [
        ("not json", {}, "the password is not JSON"),
        ("[1]", {}, "must be a JSON object"),
        ('{"type": "service_account", "client_email": "a@b"}', {}, "has no private_key"),
        (None, {"keyfile_dict": '{"private_key": "x"}'}, "has no 'type'"),
        (None, {"key_path": "/nonexistent/key.json"}, "cannot read key file"),
    ],
)
def test_bad_credentials_are_refused_by_name(secret: str | None, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        key_info(secret, extra, "vx")
    assert "connection 'vx'" in str(caught.value)


def test_no_key_means_application_default_credentials() -> None:
    assert key_info(None, {}, "vx") is None
