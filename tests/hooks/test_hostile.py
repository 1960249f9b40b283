"""BatchApiHook against a real misbehaving HTTP server (tests/fixtures/hostile.py).

Redirects to another origin, redirect loops, dripped answers, huge and gzip-bomb bodies,
newline bombs in result files, garbage Retry-After and a key echoed back in a 200 answer:
each through the sync and the async client, over real sockets.
"""

from __future__ import annotations

import asyncio
import socket
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider.exceptions import (
    BatchApiConnectionError,
    BatchApiError,
    BatchApiRedirectError,
    BatchApiResponseError,
    BatchApiResponseTooLargeError,
)
from airflow_batch_provider.hooks import lines as lines_module
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.lines import LINES_PER_TURN
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.hooks.transport import MAX_BLANK_RUN
from tests.fixtures.hook import SECRET, openai_batch
from tests.fixtures.hostile import Exchange, HostileServer, drip, gzip_bomb, redirect, reply, sequence

CUSTOM_SECRET = "custom-header-secret-987654"
HEADERS = {"X-Gateway-Token": CUSTOM_SECRET, "X-Project-Id": "proj-visible"}
QUICK = RetryPolicy(max_retries=1, backoff_initial=0.001, backoff_max=0.002, retry_after_max=0.05)
NO_RETRY = RetryPolicy(max_retries=0)
BATCH = openai_batch("b1")


@pytest.fixture
def hostile_hook(batch_conn: Callable[..., str]) -> Callable[..., BatchApiHook]:
    """A hook (real sync and async transports) pointed at a hostile server, with a custom header."""

    def make(
        server: HostileServer, *, retry: RetryPolicy = QUICK, timeout: float = 5.0, **extra: Any
    ) -> BatchApiHook:
        extra.setdefault("headers", HEADERS)
        conn_id = batch_conn("hostile", host=server.base_url, **extra)
        return BatchApiHook(conn_id, retry_policy=retry, timeout=timeout)

    return make


def credentials_in(server: HostileServer) -> list[str]:
    """Every secret any request to ``server`` carried, in any header."""
    found = []
    for seen in server.requests:
        for value in seen.headers.values():
            if SECRET in value or CUSTOM_SECRET in value or "proj-visible" in value:
                found.append(value)
    return found


# ---- 10: redirects --------------------------------------------------------------------------


@pytest.mark.parametrize(("dialect", "status"), [("openai", 307), ("zerogpu", 302)])
async def test_cross_origin_redirect_is_refused_without_sending_credentials(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    dialect: str,
    status: int,
) -> None:
    # ZeroGPU sends the key as x-api-key, which httpx's own redirect handling keeps cross-origin.
    api, elsewhere = hostile_server(), hostile_server()
    elsewhere.route("/v1/batches/b1", reply(200, BATCH))
    api.route("/v1/batches/b1", redirect(f"{elsewhere.origin}/v1/batches/b1", status))
    hook = hostile_hook(api, dialect=dialect, project="proj-visible")
    assert SECRET in str(hook.get_settings().client_headers().values())
    with pytest.raises(BatchApiRedirectError) as sync_error:
        hook.get_batch("b1")
    with pytest.raises(BatchApiRedirectError) as async_error:
        await hook.aget_batch("b1")
    await hook.aclose()
    hook.close()
    for error in (sync_error.value, async_error.value):
        text = str(error)
        assert api.origin in text and elsewhere.origin in text, text
        assert SECRET not in text and CUSTOM_SECRET not in text
    # Not one request (so no key and no custom header) reached the other origin.
    assert elsewhere.requests == []


async def test_redirect_loop_is_a_typed_error(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", redirect("/v1/batches/b1"))
    hook = hostile_hook(api)
    with pytest.raises(BatchApiRedirectError, match="redirect"):
        hook.get_batch("b1")
    with pytest.raises(BatchApiRedirectError, match="redirect"):
        await hook.aget_batch("b1")
    await hook.aclose()
    hook.close()


async def test_same_origin_redirect_is_followed_with_credentials(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", redirect("/v1/batches/moved", 301))
    api.route("/v1/batches/moved", reply(200, BATCH))
    hook = hostile_hook(api)
    assert hook.get_batch("b1").id == "b1"
    assert (await hook.aget_batch("b1")).id == "b1"
    await hook.aclose()
    hook.close()
    moved = api.seen("/v1/batches/moved")
    assert len(moved) == 2
    assert all(r.headers["authorization"] == f"Bearer {SECRET}" for r in moved)


async def test_result_file_redirect_to_object_store_carries_no_credentials(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    api, store = hostile_server(), hostile_server()
    content = b'{"custom_id": "a", "response": {"status_code": 200, "body": {}}}\n'
    store.route("/signed/out.jsonl", reply(200, content))
    api.route("/v1/files/file-out/content", redirect(f"{store.origin}/signed/out.jsonl?sig=abc"))
    hook = hostile_hook(api)
    assert hook.download_file("file-out", tmp_path / "sync.jsonl") == len(content)
    assert await hook.adownload_file("file-out", tmp_path / "async.jsonl") == len(content)
    assert [obj["custom_id"] for obj in hook.iter_file_lines("file-out")] == ["a"]
    await hook.aclose()
    hook.close()
    assert (tmp_path / "async.jsonl").read_bytes() == content
    assert len(store.requests) == 3
    # The object store got the signed URL and nothing of the connection: no key, no custom header.
    assert credentials_in(store) == []
    assert all("authorization" not in r.headers for r in store.requests)


# ---- 23.8: where a file's redirect may lead ------------------------------------------------

SIGNATURE = "X-Amz-Signature=sig-secret-5551"


@pytest.mark.parametrize(
    ("target", "named", "reason"),
    [
        (f"https://10.1.2.3/out.jsonl?{SIGNATURE}", "https://10.1.2.3:443", "a private address"),
        (f"https://172.16.5.4:9000/o?{SIGNATURE}", "https://172.16.5.4:9000", "a private address"),
        (f"https://192.168.1.1/o?{SIGNATURE}", "https://192.168.1.1:443", "a private address"),
        (f"https://100.64.0.1/o?{SIGNATURE}", "https://100.64.0.1:443", "a private address"),
        (f"https://[fc00::5]/o?{SIGNATURE}", "https://fc00::5:443", "a private address"),
        (f"https://[fe80::1]:8443/o?{SIGNATURE}", "https://fe80::1:8443", "a link-local address"),
        (f"https://169.254.169.254/latest/meta-data/?{SIGNATURE}", "169.254.169.254", "instance-metadata"),
        (f"https://[fd00:ec2::254]/latest/?{SIGNATURE}", "fd00:ec2::254", "instance-metadata"),
        (
            f"http://metadata.google.internal/computeMetadata/v1/?{SIGNATURE}",
            "metadata.google.internal",
            "metadata",
        ),
        (f"http://93.184.216.34/out.jsonl?{SIGNATURE}", "http://93.184.216.34:80", "plain http"),
    ],
)
async def test_file_redirect_to_a_private_or_plain_http_target_is_refused(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    tmp_path: Path,
    target: str,
    named: str,
    reason: str,
) -> None:
    api = hostile_server()
    api.route("/v1/files/file-out/content", redirect(target))
    hook = hostile_hook(api, retry=NO_RETRY, timeout=1.0)
    errors = []
    for read in (
        lambda: list(hook.iter_file_lines("file-out")),
        lambda: hook.download_file("file-out", tmp_path / "sync.jsonl"),
    ):
        with pytest.raises(BatchApiRedirectError) as error:
            read()
        errors.append(error.value)
    with pytest.raises(BatchApiRedirectError) as error:
        [line async for line in hook.aiter_file_lines("file-out")]
    errors.append(error.value)
    with pytest.raises(BatchApiRedirectError) as error:
        await hook.adownload_file("file-out", tmp_path / "async.jsonl")
    errors.append(error.value)
    await hook.aclose()
    hook.close()
    for exc in errors:
        text = str(exc)
        assert "refused a redirect" in text and named in text and reason in text, text
        # The target's path and query (a signed URL's credentials) stay out of the message.
        assert "sig-secret" not in text and "?" not in text, text
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def private_name(monkeypatch: pytest.MonkeyPatch) -> str:
    """A host name that resolves to loopback and to a private address (as a rebinding name may)."""
    name = "store.internal.test"
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        # anyio (httpx's async client) asks with the IDNA-encoded name, as bytes.
        if (host.decode() if isinstance(host, bytes) else host) != name:
            return real(host, port, *args, **kwargs)
        # Loopback first, so a client that does connect reaches the test's store.
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port or 0)))
            for address in ("127.0.0.1", "10.0.0.7")
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return name


async def test_file_redirect_to_a_name_resolving_to_a_private_address_is_refused(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], private_name: str
) -> None:
    api, store = hostile_server(), hostile_server()
    store.route("/signed/out.jsonl", reply(200, b'{"custom_id": "a"}\n'))
    api.route(
        "/v1/files/file-out/content", redirect(f"http://{private_name}:{store.port}/signed/out.jsonl?sig=s")
    )
    hook = hostile_hook(api, retry=NO_RETRY)
    refused = (
        rf"refused a redirect to http://{private_name}:{store.port}: resolves to 10.0.0.7, a private address"
    )
    with pytest.raises(BatchApiRedirectError, match=refused):
        list(hook.iter_file_lines("file-out"))
    with pytest.raises(BatchApiRedirectError, match=refused):
        [line async for line in hook.aiter_file_lines("file-out")]
    await hook.aclose()
    hook.close()
    assert store.requests == []


async def test_private_redirect_is_followed_when_the_connection_allows_it(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], private_name: str
) -> None:
    api, store = hostile_server(), hostile_server()
    store.route("/signed/out.jsonl", reply(200, b'{"custom_id": "a"}\n'))
    api.route(
        "/v1/files/file-out/content", redirect(f"http://{private_name}:{store.port}/signed/out.jsonl?sig=s")
    )
    hook = hostile_hook(api, retry=NO_RETRY, allow_private_redirects=True)
    assert [obj["custom_id"] for obj in hook.iter_file_lines("file-out")] == ["a"]
    assert [obj["custom_id"] async for obj in hook.aiter_file_lines("file-out")] == ["a"]
    await hook.aclose()
    hook.close()
    assert len(store.requests) == 2 and credentials_in(store) == []


async def test_every_hop_of_a_file_redirect_is_checked(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # The first hop (another loopback port) is allowed; the store's own redirect is not.
    api, store = hostile_server(), hostile_server()
    store.route("/signed/out.jsonl", redirect(f"https://10.9.9.9/out.jsonl?{SIGNATURE}"))
    api.route("/v1/files/file-out/content", redirect(f"{store.origin}/signed/out.jsonl"))
    hook = hostile_hook(api, retry=NO_RETRY, timeout=1.0)
    refused = r"refused a redirect to https://10\.9\.9\.9:443: a private address"
    with pytest.raises(BatchApiRedirectError, match=refused):
        list(hook.iter_file_lines("file-out"))
    with pytest.raises(BatchApiRedirectError, match=refused):
        [line async for line in hook.aiter_file_lines("file-out")]
    await hook.aclose()
    hook.close()
    assert len(store.requests) == 2


# ---- 11: a deadline per call -----------------------------------------------------------------


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
async def test_dripped_answer_ends_at_the_call_deadline(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], headers_too: bool
) -> None:
    # One byte every 50 ms never trips a 0.5 s read timeout, and the whole answer takes ~20 s.
    api = hostile_server()
    api.route("/v1/batches/b1", drip(orjson.dumps(BATCH), 0.05, headers_too=headers_too))
    hook = hostile_hook(api, retry=NO_RETRY, timeout=0.5)
    with pytest.raises(BatchApiConnectionError, match="timed out"):
        hook.get_batch("b1")
    with pytest.raises(BatchApiConnectionError, match="timed out"):
        await hook.aget_batch("b1")
    await hook.aclose()
    hook.close()


async def test_dripped_result_file_fails_its_progress_deadline(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    api = hostile_server()
    api.route("/v1/files/file-out/content", drip(b'{"custom_id": "a"}\n' * 20, 0.05))
    hook = hostile_hook(api, retry=NO_RETRY, timeout=0.5)
    with pytest.raises(BatchApiConnectionError, match="timed out"):
        hook.download_file("file-out", tmp_path / "sync.jsonl")
    with pytest.raises(BatchApiConnectionError, match="timed out"):
        await hook.adownload_file("file-out", tmp_path / "async.jsonl")
    with pytest.raises(BatchApiConnectionError, match="timed out"):
        list(hook.iter_file_lines("file-out"))
    await hook.aclose()
    hook.close()
    assert not (tmp_path / "sync.jsonl").exists() and not (tmp_path / "async.jsonl").exists()


async def test_slow_but_moving_upload_outlives_the_call_deadline(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    # The server takes the 24 MiB body at ~10 MiB/s (over 2 s in all), far past the 1 s total
    # deadline: each 1 MiB chunk sent renews it, so the upload succeeds. (The last renewal must
    # also cover the few MB the kernel still buffers, ~0.4 s here.)
    api = hostile_server()
    api.read_pace = (512 << 10, 0.05)
    api.route("POST /v1/files", reply(200, {"id": "file-up", "object": "file"}))
    source = tmp_path / "big.jsonl"
    source.write_bytes(b"x" * (24 << 20))
    hook = hostile_hook(api, retry=NO_RETRY, timeout=1.0)
    assert hook.upload_file(source) == "file-up"
    assert await hook.aupload_file(source) == "file-up"
    await hook.aclose()
    hook.close()
    assert [len(r.body) > 24 << 20 for r in api.requests] == [True, True]


# ---- 12: bounded control-plane bodies --------------------------------------------------------


async def test_huge_batch_object_is_refused(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, {**BATCH, "padding": "x" * (9 << 20)}))
    hook = hostile_hook(api, retry=NO_RETRY)
    with pytest.raises(BatchApiResponseTooLargeError, match="getting batch b1.*8,388,608"):
        hook.get_batch("b1")
    with pytest.raises(BatchApiResponseTooLargeError, match="getting batch b1"):
        await hook.aget_batch("b1")
    await hook.aclose()
    hook.close()


async def test_gzip_bomb_stops_at_the_cap(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # 64 MB of spaces then a valid batch object, gzipped to ~64 KB: valid JSON if fully inflated.
    bomb = gzip_bomb(64 << 20, orjson.dumps(BATCH))
    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, bomb, Content_Encoding="gzip"))
    api.route("/v1/batches", reply(200, bomb, Content_Encoding="gzip"))
    hook = hostile_hook(api, retry=NO_RETRY)
    tracemalloc.start()
    try:
        with pytest.raises(BatchApiResponseTooLargeError, match="decompressed"):
            hook.get_batch("b1")
        with pytest.raises(BatchApiResponseTooLargeError, match="decompressed"):
            await hook.aget_batch("b1")
        with pytest.raises(BatchApiResponseTooLargeError, match="listing batches"):
            list(hook.list_batches())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    await hook.aclose()
    hook.close()
    assert peak < 32 << 20, f"peak {peak:,} bytes"


async def test_small_gzip_answer_still_reads(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, gzip_bomb(1 << 20, orjson.dumps(BATCH)), Content_Encoding="gzip"))
    hook = hostile_hook(api, retry=NO_RETRY)
    assert hook.get_batch("b1").id == "b1"
    assert (await hook.aget_batch("b1")).id == "b1"
    await hook.aclose()
    hook.close()


@pytest.mark.parametrize("wbits", [15, -15], ids=["zlib", "raw"])
async def test_deflate_answer_reads_and_is_capped(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], wbits: int
) -> None:
    def deflate(data: bytes) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
        return packer.compress(data) + packer.flush()

    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, deflate(orjson.dumps(BATCH)), Content_Encoding="deflate"))
    bomb = deflate(b" " * (16 << 20) + orjson.dumps(BATCH))
    api.route("/v1/batches/b2", reply(200, bomb, Content_Encoding="deflate"))
    hook = hostile_hook(api, retry=NO_RETRY)
    assert hook.get_batch("b1").id == "b1"
    assert (await hook.aget_batch("b1")).id == "b1"
    with pytest.raises(BatchApiResponseTooLargeError, match="decompressed"):
        hook.get_batch("b2")
    with pytest.raises(BatchApiResponseTooLargeError, match="decompressed"):
        await hook.aget_batch("b2")
    await hook.aclose()
    hook.close()


async def test_truncated_gzip_answer_is_a_clear_error(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, gzip_bomb(0, orjson.dumps(BATCH))[:-12], Content_Encoding="gzip"))
    hook = hostile_hook(api, retry=NO_RETRY)
    with pytest.raises(BatchApiError, match="gzip"):
        hook.get_batch("b1")
    with pytest.raises(BatchApiError, match="gzip"):
        await hook.aget_batch("b1")
    await hook.aclose()
    hook.close()


# ---- 23.4: streamed result files are bounded in bytes and CPU --------------------------------


def result_lines(count: int, pad: int = 0) -> bytes:
    """``count`` answer lines of an output file (each padded by ``pad`` bytes)."""
    return b"".join(
        orjson.dumps({"custom_id": f"r{i}", "response": {"status_code": 200, "body": {"pad": "x" * pad}}})
        + b"\n"
        for i in range(count)
    )


@pytest.mark.parametrize("gzip", [True, False], ids=["gzip", "identity"])
async def test_result_file_over_the_download_cap_is_refused(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    tmp_path: Path,
    gzip: bool,
) -> None:
    # 2 MiB of answers (gzipped to a few KB) against a 1 MiB cap set on the connection.
    content = result_lines(2048, pad=1000)
    body = gzip_bomb(0, content) if gzip else content
    api = hostile_server()
    headers = {"Content_Encoding": "gzip"} if gzip else {}
    api.route("/v1/files/file-out/content", reply(200, body, **headers))
    api.route("/v1/batches/b1", reply(200, openai_batch("b1", "completed", output_file_id="file-out")))
    hook = hostile_hook(api, retry=NO_RETRY, max_download_bytes=1 << 20)
    refused = r"file.file-out.*larger than 1,048,576 bytes.*'max_download_bytes'"
    with pytest.raises(BatchApiResponseTooLargeError, match=refused):
        list(hook.iter_file_lines("file-out"))
    with pytest.raises(BatchApiResponseTooLargeError, match=refused):
        [line async for line in hook.aiter_file_lines("file-out")]
    with pytest.raises(BatchApiResponseTooLargeError, match=refused):
        list(hook.iter_results("b1"))
    with pytest.raises(BatchApiResponseTooLargeError, match=refused):
        list(hook.iter_raw_lines("file-out"))
    with pytest.raises(BatchApiResponseTooLargeError, match=refused):
        hook.download_file("file-out", tmp_path / "sync.jsonl")
    with pytest.raises(BatchApiResponseTooLargeError, match=refused):
        await hook.adownload_file("file-out", tmp_path / "async.jsonl")
    await hook.aclose()
    hook.close()
    # Refused, not retried (the same file would be as large again), and nothing half-written.
    assert len(api.seen("/v1/files/file-out/content")) == 6
    assert list(tmp_path.iterdir()) == []


async def test_result_file_under_the_download_cap_reads_whole(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    # 3 MiB decoded, read in 1 MiB pieces: lines straddling the pieces arrive whole, in order.
    content = result_lines(3000, pad=1000)
    api = hostile_server()
    api.route("/v1/files/file-out/content", reply(200, gzip_bomb(0, content), Content_Encoding="gzip"))
    hook = hostile_hook(api, retry=NO_RETRY, max_download_bytes=len(content))
    expected = [f"r{i}" for i in range(3000)]
    assert [obj["custom_id"] for obj in hook.iter_file_lines("file-out")] == expected
    assert [obj["custom_id"] async for obj in hook.aiter_file_lines("file-out")] == expected
    assert await hook.adownload_file("file-out", tmp_path / "async.jsonl") == len(content)
    await hook.aclose()
    hook.close()
    assert (tmp_path / "async.jsonl").read_bytes() == content


async def test_newline_bomb_in_a_result_file_is_a_typed_error(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # 16 MiB of newlines gzipped to 16 KB, then one answer: every line split in Python took
    # seconds of CPU (31 s for 64 MiB) with the event loop held throughout.
    bomb = gzip_bomb(16 << 20, result_lines(1), fill=b"\n")
    api = hostile_server()
    api.route("/v1/files/file-out/content", reply(200, bomb, Content_Encoding="gzip"))
    hook = hostile_hook(api, retry=NO_RETRY)
    refused = rf"file 'file-out' has more than {MAX_BLANK_RUN:,} blank lines in a row \(from line 1\)"
    with pytest.raises(BatchApiResponseError, match=refused):
        list(hook.iter_file_lines("file-out"))
    with pytest.raises(BatchApiResponseError, match=refused):
        [line async for line in hook.aiter_file_lines("file-out")]
    await hook.aclose()
    hook.close()


async def test_blank_lines_are_counted_not_read_one_by_one(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Runs of blank lines (some with spaces and CRs) under the bound: skipped in one step each,
    # yet still numbered, so a bad line is named by its real line number.
    gap = b"\n" * (MAX_BLANK_RUN - 10) + b"  \r\n" * 5 + b"\t\n" * 4
    content = result_lines(1) + gap + result_lines(1) + gap + b"not json\n"
    api = hostile_server()
    api.route("/v1/files/file-out/content", reply(200, gzip_bomb(0, content), Content_Encoding="gzip"))
    hook = hostile_hook(api, retry=NO_RETRY)
    parsed: list[bytes] = []
    real_line_object = lines_module.line_object

    def counting_line_object(data: bytes, *args: Any, **kwargs: Any) -> Any:
        parsed.append(data)
        return real_line_object(data, *args, **kwargs)

    monkeypatch.setattr(lines_module, "line_object", counting_line_object)
    last = 2 * MAX_BLANK_RUN + 1  # an answer, a gap, an answer, a gap, then the bad line
    bad = rf"file 'file-out' line {last} is not valid JSON"
    with pytest.raises(BatchApiResponseError, match=bad):
        list(hook.iter_file_lines("file-out"))
    with pytest.raises(BatchApiResponseError, match=bad):
        [line async for line in hook.aiter_file_lines("file-out")]
    await hook.aclose()
    hook.close()
    # Three lines with content, per twin: not one call per blank line.
    assert len(parsed) == 6 and all(data.strip() for data in parsed)


async def test_async_result_reader_gives_the_event_loop_turns(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # 5,000 answers gzipped to a few KB arrive in one network read and decode at once: the
    # reader must still let other coroutines (other triggers) run while it splits them.
    count = 5000
    api = hostile_server()
    api.route(
        "/v1/files/file-out/content", reply(200, gzip_bomb(0, result_lines(count)), Content_Encoding="gzip")
    )
    hook = hostile_hook(api, retry=NO_RETRY)
    read: list[Any] = []
    seen_at: set[int] = set()
    done = asyncio.Event()

    async def other_coroutine() -> None:
        # Notes how far the reader had got each time this coroutine had a turn.
        while not done.is_set():
            seen_at.add(len(read))
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_coroutine())
    async for obj in hook.aiter_file_lines("file-out"):
        read.append(obj)  # never awaits: any turn the loop gets comes from the reader
    done.set()
    await ticker
    await hook.aclose()
    assert len(read) == count
    turns_while_splitting = {at for at in seen_at if 0 < at < count}
    # One turn per LINES_PER_TURN lines at least (19 here); a reader that never yields gives none.
    assert len(turns_while_splitting) >= count // LINES_PER_TURN - 1, sorted(turns_while_splitting)


# ---- 13: garbage Retry-After -----------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        {"Retry-After": "nan"},
        {"Retry-After": "inf"},
        {"Retry-After": "-Infinity"},
        {"Retry-After": "1e400"},
        {"Retry-After-Ms": "nan"},
        {"Retry-After-Ms": "NaN", "Retry-After": "soon"},
    ],
    ids=["nan", "inf", "-inf", "huge", "ms-nan", "ms-nan-and-text"],
)
async def test_garbage_retry_after_is_ignored(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    header: dict[str, str],
) -> None:
    api = hostile_server()
    limited = reply(
        429, {"error": {"message": "slow down"}}, **{k.replace("-", "_"): v for k, v in header.items()}
    )
    # Per client: one 429 with the garbage header, then the batch.
    api.route("/v1/batches/b1", sequence(limited, reply(200, BATCH), limited, reply(200, BATCH)))
    # A Retry-After taken at face value would be capped to 30 s; the backoff is at most 2 ms.
    retry = RetryPolicy(max_retries=1, backoff_initial=0.001, backoff_max=0.002, retry_after_max=30)
    hook = hostile_hook(api, retry=retry)
    assert hook.get_batch("b1").id == "b1"
    assert (await hook.aget_batch("b1")).id == "b1"
    await hook.aclose()
    hook.close()
    assert len(api.requests) == 4


# ---- 14: secrets echoed in a 200 answer -----------------------------------------------------


def echo_key(ex: Exchange) -> None:
    """A failed batch whose errors quote the request's headers back."""
    auth = ex.request.headers.get("authorization", "")
    token = ex.request.headers.get("x-gateway-token", "")
    batch = openai_batch(
        "b1",
        "failed",
        errors={
            "object": "list",
            "data": [{"code": "invalid_key", "message": f"key {auth} / token {token} refused", "line": 1}],
        },
        metadata={"echo": auth},
    )
    ex.respond(200, batch)


async def test_key_echoed_in_batch_errors_is_redacted(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", echo_key)
    api.route("/v1/batches", lambda ex: ex.respond(200, {"object": "list", "data": [], "has_more": False}))
    hook = hostile_hook(api)
    batches = [hook.get_batch("b1"), await hook.aget_batch("b1")]
    await hook.aclose()
    hook.close()
    for batch in batches:
        text = batch.model_dump_json()
        assert batch.errors and "***" in batch.errors[0].message
        assert SECRET not in text and CUSTOM_SECRET not in text, text
    assert credentials_in(api)  # the server did receive them, so the echo was real


def escaped(text: str) -> bytes:
    """``text`` as JSON \\u escapes: the same string once parsed, but not the same bytes."""
    return "".join(f"\\u{ord(c):04x}" for c in text).encode()


async def test_key_echoed_in_json_escapes_is_redacted(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # A byte search of the answer for the key finds nothing here; the parsed strings hold it.
    sent: list[bytes] = []

    def echo_escaped(ex: Exchange) -> None:
        auth = ex.request.headers.get("authorization", "")
        batch = openai_batch(
            "b1", "failed", errors={"object": "list", "data": [{"code": "k", "message": "key @KEY@"}]}
        )
        body = orjson.dumps(batch).replace(b"@KEY@", escaped(auth))
        if ex.request.path.endswith("/batches"):
            body = b'{"object": "list", "has_more": false, "data": [' + body + b"]}"
        sent.append(body)
        ex.respond(200, body)

    api = hostile_server()
    api.route("/v1/batches/b1", echo_escaped)
    api.route("/v1/batches", echo_escaped)
    hook = hostile_hook(api)
    batches = [hook.get_batch("b1"), await hook.aget_batch("b1"), *hook.list_batches()]
    batches += [b async for b in hook.alist_batches()]
    await hook.aclose()
    hook.close()
    assert len(batches) == 4
    for batch in batches:
        assert batch.errors[0].message == "key Bearer ***"
        assert SECRET not in batch.model_dump_json()
    assert all(escaped(SECRET) in body and SECRET.encode() not in body for body in sent)


async def test_key_echoed_in_a_result_file_is_redacted(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    def error_file(ex: Exchange) -> None:
        auth = ex.request.headers.get("authorization", "")
        line = {
            "custom_id": "a",
            "response": None,
            "error": {"code": "invalid_api_key", "message": f"Incorrect API key provided: {auth}"},
        }
        ex.respond(200, orjson.dumps(line) + b"\n")

    api = hostile_server()
    api.route("/v1/files/file-err/content", error_file)
    hook = hostile_hook(api)
    batch = openai_batch("b1", "completed", error_file_id="file-err")
    api.route("/v1/batches/b1", reply(200, batch))
    lines = [*hook.iter_results("b1"), *[line async for line in hook.aiter_results("b1")]]
    await hook.aclose()
    hook.close()
    assert len(lines) == 2
    for line in lines:
        assert line.error is not None and line.error.message == "Incorrect API key provided: Bearer ***"


@pytest.mark.parametrize("jsonl", [False, True], ids=["json", "jsonl"])
async def test_key_echoed_in_a_results_page_is_redacted(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], jsonl: bool
) -> None:
    def results_page(ex: Exchange) -> None:
        auth = ex.request.headers.get("authorization", "")
        item = {"custom_id": "a", "status": "failed", "error": {"code": "auth", "message": f"bad {auth}"}}
        # Doubleword marks the last page with X-Incomplete: false (without it, paging goes on).
        if jsonl:
            ex.respond(
                200,
                orjson.dumps(item) + b"\n",
                {"Content-Type": "application/jsonl", "X-Incomplete": "false"},
            )
        else:
            ex.respond(200, {"data": [item]}, {"X-Incomplete": "false"})

    api = hostile_server()
    api.route("/v1/batches/b1/results", results_page)
    api.route("/v1/batches/b1", reply(200, openai_batch("b1", "completed")))
    hook = hostile_hook(api, dialect="doubleword")
    lines = [
        *hook.iter_results("b1", mode="results_endpoint"),
        *[line async for line in hook.aiter_results("b1", mode="results_endpoint")],
    ]
    await hook.aclose()
    hook.close()
    assert len(lines) == 2
    for line in lines:
        assert line.error is not None and line.error.message == "bad Bearer ***"


async def test_results_endpoint_that_never_ends_is_stopped(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_batch_provider.dialects import DoublewordDialect, Limits
    from airflow_batch_provider.exceptions import BatchApiResponseError

    served = {"pages": 0}

    def endless_page(ex: Exchange) -> None:
        # Always one more line and "more to come": a cursor that never repeats and never ends.
        served["pages"] += 1
        item = {"custom_id": f"c{served['pages']}", "status": "completed", "response_body": {"ok": 1}}
        ex.respond(
            200, orjson.dumps(item) + b"\n", {"Content-Type": "application/jsonl", "X-Incomplete": "true"}
        )

    # A batch of 2 requests from a file of at most 3 lines: 4 results cannot be right.
    monkeypatch.setattr(DoublewordDialect, "limits", Limits(max_lines=3))
    api = hostile_server()
    api.route("/v1/batches/b1/results", endless_page)
    api.route("/v1/batches/b1", reply(200, openai_batch("b1", "completed")))
    hook = hostile_hook(api, dialect="doubleword")
    with pytest.raises(BatchApiResponseError, match=r"more result lines \(4\) than the batch can have \(3\)"):
        list(hook.iter_results("b1", mode="results_endpoint"))
    with pytest.raises(BatchApiResponseError, match=r"more result lines \(4\) than the batch can have \(3\)"):
        [line async for line in hook.aiter_results("b1", mode="results_endpoint")]
    await hook.aclose()
    hook.close()
    assert served["pages"] == 8


# ---- Anthropic: the one results stream at the batch's results_url ------------------------------


def anthropic_batch(results_url: str) -> dict[str, Any]:
    return {
        "id": "b1",
        "type": "message_batch",
        "processing_status": "ended",
        "request_counts": {"processing": 0, "succeeded": 2, "errored": 0, "canceled": 0, "expired": 0},
        "created_at": "2026-01-01T00:00:00Z",
        "expires_at": "2026-01-02T00:00:00Z",
        "ended_at": "2026-01-01T01:00:00Z",
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": results_url,
    }


def anthropic_line(custom_id: str) -> bytes:
    message = {
        "id": f"msg_{custom_id}",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [{"type": "text", "text": f"answer {custom_id}"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 2},
    }
    return orjson.dumps({"custom_id": custom_id, "result": {"type": "succeeded", "message": message}}) + b"\n"


async def test_results_url_on_another_origin_is_refused_without_sending_the_key(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api, elsewhere = hostile_server(), hostile_server()
    elsewhere.route("/results", reply(200, anthropic_line("a")))
    api.route("/v1/messages/batches/b1", reply(200, anthropic_batch(f"{elsewhere.origin}/results")))
    hook = hostile_hook(api, dialect="anthropic")
    with pytest.raises(BatchApiRedirectError) as sync_error:
        list(hook.iter_results("b1"))
    with pytest.raises(BatchApiRedirectError) as async_error:
        [line async for line in hook.aiter_results("b1")]
    await hook.aclose()
    hook.close()
    for error in (sync_error.value, async_error.value):
        text = str(error)
        assert elsewhere.origin.split("://")[1] in text and "never sent there" in text, text
        assert SECRET not in text
    assert elsewhere.requests == []


async def test_results_url_redirect_to_object_store_carries_no_credentials(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    api, store = hostile_server(), hostile_server()
    content = anthropic_line("a") + anthropic_line("b")
    store.route("/signed/results.jsonl", reply(200, content))
    api.route(
        "/v1/messages/batches/b1", reply(200, anthropic_batch(f"{api.base_url}/messages/batches/b1/results"))
    )
    api.route("/v1/messages/batches/b1/results", redirect(f"{store.origin}/signed/results.jsonl?sig=abc"))
    hook = hostile_hook(api, dialect="anthropic")
    assert [line.custom_id for line in hook.iter_results("b1")] == ["a", "b"]
    assert [line.custom_id async for line in hook.aiter_results("b1")] == ["a", "b"]
    await hook.aclose()
    hook.close()
    # The API got the key as x-api-key with the version; the object store got nothing of it.
    results = api.seen("/v1/messages/batches/b1/results")
    assert len(results) == 2 and all(r.headers["x-api-key"] == SECRET for r in results)
    assert all(r.headers["anthropic-version"] == "2023-06-01" for r in results)
    assert len(store.requests) == 2 and credentials_in(store) == []


async def test_results_stream_dropped_mid_way_is_resumed_each_line_once(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    content = b"".join(anthropic_line(f"r{i}") for i in range(6))

    def dropped(ex: Exchange) -> None:
        # Promise the whole stream, send half of it (cut inside a line), then close.
        ex.head(200, {"Content-Type": "application/binary"}, len(content))
        ex.send(content[: len(content) // 2 + 7])

    api = hostile_server()
    api.route("/v1/messages/batches/b1", reply(200, anthropic_batch("/v1/messages/batches/b1/results")))
    api.route(
        "/v1/messages/batches/b1/results",
        sequence(dropped, reply(200, content), dropped, reply(200, content)),
    )
    hook = hostile_hook(api, dialect="anthropic")
    ids = [f"r{i}" for i in range(6)]
    sync_lines = [line.custom_id for line in hook.iter_results("b1")]
    async_lines = [line.custom_id async for line in hook.aiter_results("b1")]
    await hook.aclose()
    hook.close()
    assert sync_lines == ids and async_lines == ids
    assert len(api.seen("/v1/messages/batches/b1/results")) == 4


async def test_inline_create_streams_the_file_with_its_exact_length(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    from airflow_batch_provider.hooks.transport import FileBody

    body = orjson.dumps(
        {"requests": [{"custom_id": f"r{i}", "params": {"x": "y" * 100}} for i in range(500)]}
    )
    path = tmp_path / "create.json"
    path.write_bytes(body)
    running = {**anthropic_batch(""), "processing_status": "in_progress", "results_url": None}
    api = hostile_server()
    api.route("POST /v1/messages/batches", reply(200, running))
    hook = hostile_hook(api, dialect="anthropic")
    inline = FileBody(path, filename="create.json", size=len(body))
    assert hook.create_batch(endpoint="/v1/chat/completions", inline=inline).id == "b1"
    assert (await hook.acreate_batch(endpoint="/v1/chat/completions", inline=inline)).id == "b1"
    await hook.aclose()
    hook.close()
    sent = api.seen("/v1/messages/batches")
    assert len(sent) == 2
    for seen in sent:
        assert seen.body == body
        assert seen.headers["content-length"] == str(len(body)) and "transfer-encoding" not in seen.headers
        assert seen.headers["content-type"] == "application/json" and seen.headers["x-api-key"] == SECRET


def _now_batch(batch_id: str, requests: int) -> dict[str, Any]:
    import datetime as dt

    created = dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    return {
        **anthropic_batch(""),
        "id": batch_id,
        "processing_status": "in_progress",
        "results_url": None,
        "ended_at": None,
        "created_at": created,
        "request_counts": {"processing": requests, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0},
    }


@pytest.mark.parametrize(
    ("listed", "outcome"),
    [
        (["lost:3", "other:4"], "adopted"),  # the one batch of its size created since: the lost create
        ([], "created"),  # nothing was created: the create is sent again, once
        (["lost:3", "twin:3"], "refused"),  # two of its size: not guessed, not retried
    ],
)
async def test_an_ambiguous_inline_create_is_found_by_its_time_and_request_count(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    tmp_path: Path,
    listed: list[str],
    outcome: str,
) -> None:
    from airflow_batch_provider.hooks.transport import FileBody

    path = tmp_path / "create.json"
    path.write_bytes(b'{"requests":[]}')
    batches = [_now_batch(item.split(":")[0], int(item.split(":")[1])) for item in listed]
    for client in ("sync", "async"):
        api = hostile_server()
        api.route(
            "GET /v1/messages/batches",
            reply(200, {"data": batches, "has_more": False, "first_id": None, "last_id": None}),
        )
        api.route(
            "POST /v1/messages/batches",
            sequence(reply(500, {"type": "error"}), reply(200, _now_batch("new", 3))),
        )
        hook = hostile_hook(api, dialect="anthropic")
        inline = FileBody(path, filename="create.json", size=path.stat().st_size, requests=3)

        async def create() -> Any:
            if client == "sync":
                return hook.create_batch(endpoint="/v1/chat/completions", inline=inline)
            return await hook.acreate_batch(endpoint="/v1/chat/completions", inline=inline)

        if outcome == "refused":
            with pytest.raises(BatchApiError, match="2 batches with its 3 request\\(s\\).*lost, twin"):
                await create()
        else:
            made = await create()
            assert made.id == {"adopted": "lost", "created": "new"}[outcome], client
        await hook.aclose()
        hook.close()
        posts = [r for r in api.seen("/v1/messages/batches") if r.method == "POST"]
        assert len(posts) == (2 if outcome == "created" else 1), client


# ---- listings end (issue #23, point 2) -----------------------------------------------------------


def barren_listing(dialect: str) -> tuple[Callable[[Exchange], None], dict[str, int]]:
    """A listing whose every page is empty yet names a new next page (a cursor that never repeats)."""
    served = {"pages": 0}

    def page(ex: Exchange) -> None:
        served["pages"] += 1
        cursor = f"cursor-{served['pages']}"
        if dialect == "xai":
            ex.respond(200, {"batches": [], "pagination_token": cursor})
        else:
            ex.respond(200, {"object": "list", "data": [], "has_more": True, "last_id": cursor})

    return page, served


@pytest.mark.parametrize("dialect", ["openai", "xai"])
async def test_a_listing_of_empty_pages_that_never_ends_is_stopped(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], dialect: str
) -> None:
    from airflow_batch_provider.exceptions import BatchApiResponseError
    from airflow_batch_provider.hooks.results import MAX_BARREN_PAGES

    api = hostile_server()
    route, served = barren_listing(dialect)
    api.route("GET /v1/batches", route)
    hook = hostile_hook(api, dialect=dialect)
    endless = "pages in a row with nothing on them"
    with pytest.raises(BatchApiResponseError, match=endless):
        list(hook.list_batches())
    assert served["pages"] == MAX_BARREN_PAGES + 1
    with pytest.raises(BatchApiResponseError, match=endless):
        [b async for b in hook.alist_batches()]
    assert served["pages"] == 2 * (MAX_BARREN_PAGES + 1)
    # The orphan lookup of a create (a search by tags over the listing) ends the same way.
    with pytest.raises(BatchApiResponseError, match=endless):
        await hook.afind_batches({"airflow_batch_key": "k"})
    await hook.aclose()
    hook.close()


async def test_a_listing_whose_items_do_not_parse_goes_on_past_them(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # Pages of unreadable items are progress, not barren: the listing reads on to the end.
    pages = {
        None: {"data": [5, openai_batch("bad", metadata=5)], "has_more": True, "last_id": "bad"},
        "bad": {"data": [openai_batch("x", "queued")], "has_more": True, "last_id": "x"},
        "x": {"data": [openai_batch("b1", metadata={"airflow_batch_key": "k"})], "has_more": False},
    }
    api = hostile_server()
    api.route("GET /v1/batches", lambda ex: ex.respond(200, pages[dict(_query(ex)).get("after")]))
    hook = hostile_hook(api)
    assert [b.id for b in hook.list_batches()] == ["b1"]
    assert [b.id for b in await hook.afind_batches({"airflow_batch_key": "k"})] == ["b1"]
    await hook.aclose()
    hook.close()


def _query(ex: Exchange) -> list[tuple[str, str]]:
    from urllib.parse import parse_qsl

    return parse_qsl(ex.request.target.partition("?")[2])


# ---- big listing pages do not stall the loop (issue #23, point 3) ------------------------------


def big_page(items: int, **fields: Any) -> dict[str, Any]:
    """A listing page of ``items`` small batch objects, whatever ``limit`` asked for."""
    data = [{"id": f"b{i:07d}", "status": "completed", **fields} for i in range(items)]
    return {"object": "list", "data": data, "has_more": False}


async def test_a_listing_page_past_its_bound_is_refused(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook]
) -> None:
    # ~5 MB: under the 8 MB of a batch object, past what a listing page may be.
    api = hostile_server()
    api.route("GET /v1/batches", reply(200, big_page(120_000)))
    hook = hostile_hook(api, retry=NO_RETRY)
    with pytest.raises(BatchApiResponseTooLargeError, match="listing batches.*4,194,304"):
        list(hook.list_batches())
    with pytest.raises(BatchApiResponseTooLargeError, match="listing batches.*4,194,304"):
        [b async for b in hook.alist_batches()]
    await hook.aclose()
    hook.close()


class Turns:
    """Counts the turns of the event loop while it runs (a task that only yields)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: Any = None

    async def _spin(self) -> None:
        import asyncio

        while True:
            self.count += 1
            await asyncio.sleep(0)

    def __enter__(self) -> Turns:
        import asyncio

        self._task = asyncio.get_running_loop().create_task(self._spin())
        return self

    def __exit__(self, *exc: object) -> None:
        self._task.cancel()


async def test_a_big_listing_page_is_parsed_in_slices_between_turns_of_the_loop(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_batch_provider.dialects.base import Dialect

    items = 3_000
    api = hostile_server()
    api.route("GET /v1/batches", reply(200, big_page(items)))
    hook = hostile_hook(api)
    turns = Turns()
    # The loop turn on which each item was parsed.
    parsed_at: list[int] = []
    real = Dialect.listed_batch

    def listed_batch(self: Dialect, item: Any, known: Any) -> Any:
        parsed_at.append(turns.count)
        return real(self, item, known)

    monkeypatch.setattr(Dialect, "listed_batch", listed_batch)
    with turns:
        listed = [b async for b in hook.alist_batches()]
    await hook.aclose()
    assert len(listed) == items == len(parsed_at)
    # Other tasks ran between slices of at most PARSE_SLICE items: never the whole page in one step.
    from airflow_batch_provider.hooks.batch import PARSE_SLICE

    assert len(set(parsed_at)) >= items // PARSE_SLICE
    assert max(parsed_at.count(turn) for turn in set(parsed_at)) <= PARSE_SLICE


async def test_a_big_listing_page_is_decoded_off_the_loop_and_a_small_one_on_it(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from airflow_batch_provider.hooks import batch as batch_module

    threads: list[bool] = []
    real = batch_module.parse_json_body

    def parse_json_body(*args: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*args)

    monkeypatch.setattr(batch_module, "parse_json_body", parse_json_body)
    api = hostile_server()
    # ~400 KB (past the 256 KB decoded in a thread), then one batch.
    api.route("GET /v1/batches", sequence(reply(200, big_page(10_000)), reply(200, big_page(1))))
    hook = hostile_hook(api)
    assert len([b async for b in hook.alist_batches()]) == 10_000
    assert len([b async for b in hook.alist_batches()]) == 1
    await hook.aclose()
    # (The loop runs on the main thread.)
    assert threads == [False, True]


@pytest.mark.parametrize(
    "fields",
    [{"metadata": 5}, {"created_at": 1e20}, {"status": "queued"}, {"id": 5}, {"request_counts": "x"}],
    ids=repr,
)
async def test_an_unreadable_batch_answer_is_a_response_error(
    hostile_server: Callable[[], HostileServer],
    hostile_hook: Callable[..., BatchApiHook],
    fields: dict[str, Any],
) -> None:
    from airflow_batch_provider.exceptions import BatchApiResponseError

    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, {**BATCH, **fields}))
    hook = hostile_hook(api)
    with pytest.raises(BatchApiResponseError):
        hook.get_batch("b1")
    with pytest.raises(BatchApiResponseError):
        await hook.aget_batch("b1")
    await hook.aclose()
    hook.close()


async def test_an_ambiguous_inline_create_never_adopts_a_batch_of_the_callers_other_shards(
    hostile_server: Callable[[], HostileServer], hostile_hook: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    # The submit's earlier shard made "shard-0", of the same size, a moment ago: it is not this one.
    from airflow_batch_provider.hooks.transport import FileBody

    path = tmp_path / "create.json"
    path.write_bytes(b'{"requests":[]}')
    api = hostile_server()
    api.route(
        "GET /v1/messages/batches",
        reply(
            200, {"data": [_now_batch("shard-0", 3)], "has_more": False, "first_id": None, "last_id": None}
        ),
    )
    api.route(
        "POST /v1/messages/batches", sequence(reply(500, {"type": "error"}), reply(200, _now_batch("new", 3)))
    )
    hook = hostile_hook(api, dialect="anthropic")
    inline = FileBody(path, filename="create.json", size=path.stat().st_size, requests=3)
    made = hook.create_batch(endpoint="/v1/chat/completions", inline=inline, not_these=["shard-0"])
    hook.close()
    assert made.id == "new"
    assert len([r for r in api.seen("/v1/messages/batches") if r.method == "POST"]) == 2
