"""Dialect azure against a real misbehaving HTTP server (tests/fixtures/hostile.py), over sockets.

The Entra ID bearer is fetched at run time, outside the connection's headers, so it needs its own
proof that it stays home: a result file's redirect to another origin gets no token, and a token a
server quotes back in an answer is redacted like the key. Sync and async clients alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken

import airflow_batch_provider.dialects.azure as azure_module
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.retry import RetryPolicy
from tests.fixtures.hook import SECRET, openai_batch
from tests.fixtures.hostile import Exchange, HostileServer, redirect, reply

TOKEN = "entra-hostile-token-24680"
QUICK = RetryPolicy(max_retries=1, backoff_initial=0.001, backoff_max=0.002, retry_after_max=0.05)


class Credential:
    async def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(TOKEN, int(time.time()) + 3600)


class SyncCredential:
    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(TOKEN, int(time.time()) + 3600)


@pytest.fixture
def entra_hook(
    batch_conn: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., BatchApiHook]:
    """A hook with auth entra on the classic path of a hostile server (real transports)."""
    monkeypatch.setattr(
        azure_module,
        "make_credential",
        lambda extra, secret, *, asynchronous: Credential() if asynchronous else SyncCredential(),
    )

    def make(server: HostileServer) -> BatchApiHook:
        conn_id = batch_conn(
            "azure_hostile",
            host=server.origin,
            password=None,
            dialect="azure",
            auth="entra",
            api_version="2024-10-21",
        )
        return BatchApiHook(conn_id, retry_policy=QUICK, timeout=5.0)

    return make


def tokens_in(server: HostileServer) -> list[str]:
    return [v for seen in server.requests for v in seen.headers.values() if TOKEN in v or SECRET in v]


async def test_result_file_redirect_to_another_origin_carries_no_token(
    hostile_server: Callable[[], HostileServer], entra_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    api, store = hostile_server(), hostile_server()
    content = b'{"custom_id": "a", "response": {"status_code": 200, "body": {}}}\n'
    store.route("/signed/out.jsonl", reply(200, content))
    api.route("/openai/files/file-out/content", redirect(f"{store.origin}/signed/out.jsonl?sig=abc"))
    hook = entra_hook(api)
    assert hook.download_file("file-out", tmp_path / "sync.jsonl") == len(content)
    assert await hook.adownload_file("file-out", tmp_path / "async.jsonl") == len(content)
    await hook.aclose()
    hook.close()
    # The API got the bearer and the version on both calls; the store got neither the token nor
    # any header of the connection.
    sent = api.seen("/openai/files/file-out/content")
    assert len(sent) == 2 and all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in sent)
    assert all("api-version=2024-10-21" in r.target for r in sent)
    assert len(store.requests) == 2 and tokens_in(store) == []
    assert all("authorization" not in r.headers and "api-key" not in r.headers for r in store.requests)


def echo_token(ex: Exchange) -> None:
    """A failed batch whose error quotes the request's bearer back."""
    auth = ex.request.headers.get("authorization", "")
    batch = openai_batch(
        "b1",
        "failed",
        errors={"object": "list", "data": [{"code": "bad", "message": f"refused {auth}", "line": None}]},
    )
    ex.respond(200, batch)


async def test_token_quoted_back_by_the_server_is_redacted(
    hostile_server: Callable[[], HostileServer], entra_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/openai/batches/b1", echo_token)
    hook = entra_hook(api)
    batches = [hook.get_batch("b1"), await hook.aget_batch("b1")]
    await hook.aclose()
    hook.close()
    for batch in batches:
        text = batch.model_dump_json()
        assert batch.errors and "***" in (batch.errors[0].message or "")
        assert TOKEN not in text, text
    assert tokens_in(api)  # the server did receive the token, so the echo was real
