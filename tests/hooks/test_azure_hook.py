"""The hook with dialect azure: v1 and classic paths, the api-key header, Entra ID bearer tokens.

Each request the sync and async clients send is recorded at the transport, so the tests check
what goes on the wire: path, query (the classic API's ``api-version`` on every call), headers.
The Entra ID credentials are objects the tests provide, with azure-identity's real
``get_token`` / ``AccessToken`` shape (a real token endpoint cannot be reached offline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from azure.core.credentials import AccessToken

import airflow_batch_provider.dialects.azure as azure_module
from airflow_batch_provider.dialects.azure import ENTRA_SCOPE
from airflow_batch_provider.exceptions import BatchApiAuthError, BatchApiBadRequestError
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.hook import FAST, SECRET, openai_batch

ENDPOINT = "https://contoso-eastus.openai.azure.com"
FILE_OBJECT = {"id": "file-in", "object": "file", "purpose": "batch", "bytes": 10, "status": "processed"}


def json_response(status: int, data: Any, **headers: str) -> httpx.Response:
    return httpx.Response(
        status, content=orjson.dumps(data), headers={"content-type": "application/json", **headers}
    )


class Vendor:
    """Answers as Azure does (OpenAI's shapes) and records every request."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if request.url.host != "contoso-eastus.openai.azure.com":
            return httpx.Response(200, content=b'{"custom_id": "a"}\n')
        if path.endswith("/files") and request.method == "POST":
            return json_response(200, FILE_OBJECT)
        if path.endswith("/content"):
            return httpx.Response(302, headers={"location": "https://20.60.40.4/results/out.jsonl?sig=abc"})
        if path.endswith("/batches") and request.method == "POST":
            return json_response(200, openai_batch("batch_1", "validating"))
        if path.endswith("/batches"):
            return json_response(
                200, {"object": "list", "data": [openai_batch("batch_1")], "has_more": False}
            )
        if path.endswith("/cancel"):
            return json_response(200, openai_batch("batch_1", "cancelling"))
        return json_response(200, openai_batch("batch_1"))

    def seen(self) -> list[tuple[str, str, dict[str, str]]]:
        return [(r.method, r.url.path, dict(r.url.params)) for r in self.requests]


@pytest.fixture
def azure_hook(batch_conn: Callable[..., str]) -> Callable[..., tuple[BatchApiHook, Vendor]]:
    def make(password: str | None = SECRET, **extra: Any) -> tuple[BatchApiHook, Vendor]:
        vendor = Vendor()
        conn_id = batch_conn("azure_mock", host=ENDPOINT, password=password, dialect="azure", **extra)
        transport = httpx.MockTransport(vendor)
        hook = BatchApiHook(conn_id, retry_policy=FAST, transport=transport, async_transport=transport)
        return hook, vendor

    return make


def run_all_sync(hook: BatchApiHook, tmp_path: Path) -> None:
    shard = tmp_path / "shard.jsonl"
    shard.write_bytes(b'{"custom_id": "a"}\n')
    assert hook.upload_file(shard) == "file-in"
    hook.create_batch(input_file_id="file-in", endpoint="/v1/chat/completions", completion_window="24h")
    hook.get_batch("batch_1")
    assert [b.id for b in hook.list_batches()] == ["batch_1"]
    hook.cancel_batch("batch_1")
    hook.download_file("file-out", tmp_path / "out.jsonl")


async def run_all_async(hook: BatchApiHook, tmp_path: Path) -> None:
    shard = tmp_path / "shard.jsonl"
    shard.write_bytes(b'{"custom_id": "a"}\n')
    assert await hook.aupload_file(shard) == "file-in"
    await hook.acreate_batch(
        input_file_id="file-in", endpoint="/v1/chat/completions", completion_window="24h"
    )
    await hook.aget_batch("batch_1")
    assert [b.id async for b in hook.alist_batches()] == ["batch_1"]
    await hook.acancel_batch("batch_1")
    await hook.adownload_file("file-out", tmp_path / "out.jsonl")


EXPECTED_PATHS = [
    ("POST", "files"),
    ("POST", "batches"),
    ("GET", "batches/batch_1"),
    ("GET", "batches"),
    ("POST", "batches/batch_1/cancel"),
    ("GET", "files/file-out/content"),
]


def test_v1_paths_and_the_api_key_header(azure_hook: Callable[..., Any], tmp_path: Path) -> None:
    hook, vendor = azure_hook()
    run_all_sync(hook, tmp_path)
    azure = [r for r in vendor.requests if r.url.host.endswith("azure.com")]
    assert [(r.method, r.url.path) for r in azure] == [(m, f"/openai/v1/{p}") for m, p in EXPECTED_PATHS]
    assert all("api-version" not in r.url.params for r in azure)
    assert all(r.headers["api-key"] == SECRET and "authorization" not in r.headers for r in azure)
    # The result file's redirect to storage goes without the key.
    blob = [r for r in vendor.requests if r.url.host == "20.60.40.4"]
    assert len(blob) == 1 and "api-key" not in blob[0].headers


async def test_classic_paths_send_the_api_version_on_every_call(
    azure_hook: Callable[..., Any], tmp_path: Path
) -> None:
    hook, vendor = azure_hook(api_version="2024-10-21")
    await run_all_async(hook, tmp_path)
    run_all_sync(hook, tmp_path)
    azure = [r for r in vendor.requests if r.url.host.endswith("azure.com")]
    assert [(r.method, r.url.path) for r in azure] == [(m, f"/openai/{p}") for m, p in EXPECTED_PATHS] * 2
    assert all(r.url.params.get("api-version") == "2024-10-21" for r in azure)
    # A call's own parameters are kept beside the version.
    listing = [r for r in azure if r.method == "GET" and r.url.path == "/openai/batches"]
    assert all(r.url.params.get("limit") == "100" for r in listing)
    # The upload names the file's expiry (14 days by default), as the SDK's expires_after.
    upload = next(r for r in azure if r.method == "POST" and r.url.path.endswith("/files"))
    body = upload.read()
    assert b'name="expires_after[anchor]"\r\n\r\ncreated_at' in body
    assert b'name="expires_after[seconds]"\r\n\r\n1209600' in body


class SyncCredential:
    """azure-identity's sync credential shape: ``get_token(*scopes) -> AccessToken``."""

    def __init__(self, lifetime: float = 3600) -> None:
        self.lifetime = lifetime
        self.calls: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls.append(scopes)
        return AccessToken(f"sync-token-{len(self.calls)}", int(time.time() + self.lifetime))


class AsyncCredential:
    """azure.identity.aio's shape: ``await get_token(*scopes) -> AccessToken``, ``await close()``."""

    def __init__(self, lifetime: float = 3600) -> None:
        self.lifetime = lifetime
        self.calls: list[tuple[str, ...]] = []
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1

    async def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls.append(scopes)
        return AccessToken(f"async-token-{len(self.calls)}", int(time.time() + self.lifetime))


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The credentials the dialect builds, provided by the test (and what it was built from)."""
    made: dict[str, Any] = {"sync": SyncCredential(), "async": AsyncCredential(), "built": []}

    def make(extra: Any, secret: str | None, *, asynchronous: bool) -> Any:
        made["built"].append((asynchronous, secret))
        made.setdefault("threads", []).append(threading.get_ident())
        return made["async" if asynchronous else "sync"]

    monkeypatch.setattr(azure_module, "make_credential", make)
    return made


async def test_entra_async_client_gets_its_bearer_from_the_aio_credential(
    azure_hook: Callable[..., Any], credentials: dict[str, Any], tmp_path: Path
) -> None:
    hook, vendor = azure_hook(password="client-secret-xyz", auth="entra", tenant_id="t", client_id="c")
    await run_all_async(hook, tmp_path)
    azure = [r for r in vendor.requests if r.url.host.endswith("azure.com")]
    assert {r.headers["authorization"] for r in azure} == {"Bearer async-token-1"}
    assert all("api-key" not in r.headers for r in azure)
    # One token for every call; the loop never touched the blocking credential.
    assert credentials["async"].calls == [(ENTRA_SCOPE,)]
    assert credentials["sync"].calls == []
    assert credentials["built"] == [(True, "client-secret-xyz")]
    # The aio credential was built off the event loop's thread (its first build imports modules).
    assert credentials["threads"] != [threading.get_ident()]
    # Closing the hook closes the aio credential's session; the hook still works after it (the
    # cached token is still good, and a credential is built again when one is needed).
    await hook.aclose()
    assert credentials["async"].closed == 1
    assert (await hook.aget_batch("batch_1")).id == "batch_1"
    # The storage redirect got no token, and the client secret never left.
    blob = [r for r in vendor.requests if r.url.host == "20.60.40.4"]
    assert len(blob) == 1 and "authorization" not in blob[0].headers
    assert not any(b"client-secret-xyz" in r.read() + str(r.headers).encode() for r in azure)


def test_entra_token_is_refreshed_before_it_expires(
    azure_hook: Callable[..., Any], credentials: dict[str, Any]
) -> None:
    hook, vendor = azure_hook(password=None, auth="entra")
    # 200 s left is inside the refresh margin: every call fetches a new token.
    credentials["sync"].lifetime = 200
    for _ in range(3):
        hook.get_batch("batch_1")
    assert [r.headers["authorization"] for r in vendor.requests] == [
        "Bearer sync-token-1",
        "Bearer sync-token-2",
        "Bearer sync-token-3",
    ]
    # A token with an hour left is reused.
    credentials["sync"].lifetime = 3600
    hook.get_batch("batch_1")
    hook.get_batch("batch_1")
    hook.get_batch("batch_1")
    assert len(credentials["sync"].calls) == 4
    assert credentials["async"].calls == []


def test_entra_token_never_reaches_settings_text_or_errors(
    azure_hook: Callable[..., Any], credentials: dict[str, Any]
) -> None:
    hook, _ = azure_hook(password=None, auth="entra")

    def echo(request: httpx.Request) -> httpx.Response:
        # A hostile answer quoting the bearer back.
        return json_response(400, {"error": {"message": f"bad {request.headers['authorization']}"}})

    hook._transport = httpx.MockTransport(echo)
    with pytest.raises(BatchApiBadRequestError) as info:
        hook.get_batch("batch_1")
    assert "sync-token-1" not in str(info.value)
    settings = hook.get_settings()
    assert "sync-token" not in repr(settings) and "sync-token" not in str(settings)


def test_a_refused_token_is_an_auth_error_without_the_secret(
    azure_hook: Callable[..., Any], credentials: dict[str, Any]
) -> None:
    class Refusing:
        def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
            raise RuntimeError("AADSTS7000215: Invalid client secret provided: client-secret-xyz")

    credentials["sync"] = Refusing()
    hook, vendor = azure_hook(password="client-secret-xyz", auth="entra", tenant_id="t", client_id="c")
    with pytest.raises(BatchApiAuthError, match="Microsoft Entra ID refused a token") as info:
        hook.get_batch("batch_1")
    assert "client-secret-xyz" not in str(info.value)
    assert vendor.requests == []


def test_a_token_refused_before_expiry_is_dropped_and_the_next_call_fetches_a_new_one(
    azure_hook: Callable[..., Any], credentials: dict[str, Any]
) -> None:
    hook, _ = azure_hook(password=None, auth="entra")
    sent: list[str] = []

    def revoked_first(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["authorization"])
        if len(sent) == 1:
            return json_response(401, {"error": {"code": "401", "message": "Access denied"}})
        return json_response(200, openai_batch("batch_1"))

    hook._transport = httpx.MockTransport(revoked_first)
    with pytest.raises(BatchApiAuthError):
        hook.get_batch("batch_1")
    # The hour-long token was refused: the next call does not send it again.
    assert hook.get_batch("batch_1").id == "batch_1"
    assert sent == ["Bearer sync-token-1", "Bearer sync-token-2"]


def test_the_create_asks_the_output_files_to_expire_too(
    azure_hook: Callable[..., Any], tmp_path: Path
) -> None:
    hook, vendor = azure_hook(file_expiry_seconds=2_592_000)
    hook.create_batch(input_file_id="file-in", endpoint="/v1/chat/completions", completion_window="24h")
    (create,) = [r for r in vendor.requests if r.method == "POST"]
    body = orjson.loads(create.read())
    assert body["output_expires_after"] == {"anchor": "created_at", "seconds": 2_592_000}
    assert body["input_file_id"] == "file-in" and body["completion_window"] == "24h"


def _completed_with_empty_error_file(request: httpx.Request) -> httpx.Response:
    if request.url.path.endswith("/files/file-err/content"):
        return httpx.Response(200, content=b"")  # an error file Azure wrote with no line in it
    if request.url.path.endswith("/files/file-out/content"):
        line = {"custom_id": "a", "response": {"status_code": 200, "body": {"choices": []}}, "error": None}
        return httpx.Response(200, content=orjson.dumps(line) + b"\n")
    return json_response(
        200,
        openai_batch(
            "batch_1",
            "completed",
            output_file_id="file-out",
            error_file_id="file-err",
            request_counts={"total": 1, "completed": 1, "failed": 0},
        ),
    )


async def test_a_completed_batch_with_an_empty_error_file_reads_its_answers(
    azure_hook: Callable[..., Any],
) -> None:
    hook, _ = azure_hook()
    hook._transport = hook._async_transport = httpx.MockTransport(_completed_with_empty_error_file)
    assert [(r.custom_id, r.ok) for r in hook.iter_results("batch_1")] == [("a", True)]
    assert [(r.custom_id, r.ok) async for r in hook.aiter_results("batch_1")] == [("a", True)]
