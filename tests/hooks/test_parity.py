"""Sync/async parity of every public BatchApiHook method, against one live server per dialect.

Each row of ``ROWS`` names a scenario (``method`` or ``method[variant]``), a sync call, its async
twin and a normaliser. Both calls run against the SAME local batch server, one after the other,
and must end the same way: the same normalised value, or the same error (type, status code and
message, ids scrubbed), with the same server-side effects (requests sent, batches created, files
uploaded, faults injected). Adding a method is adding a row; ``test_every_public_method_has_a_row``
fails until it has one.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from airflow.sdk import BaseHook

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import BatchApiNotFoundError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Batch, BatchState
from airflow_batch_provider.server.config import FaultConfig, ServerConfig
from tests.fixtures.hostile import Exchange, HostileServer, Route, redirect
from tests.fixtures.server import FAST_TIME_SCALE, BatchServerHandle
from tests.hooks.test_batch_live import (
    ENDPOINT,
    FAST,
    KEY,
    REGISTRY,
    await_terminal,
    metadata_for,
    wait_terminal,
    write_input,
)

# The server refuses uploads above this (413), so an oversize upload costs little to send.
SERVER_UPLOAD_LIMIT = 64 << 10
# Batches in the world besides the completed one, stalled (stable, no work), so listings page.
STALLED = 4
# A file the proxy serves itself: past the hook's 1 MiB read chunk, so a drop after BIG_DROP bytes
# comes after lines were already yielded, and resuming must skip them.
BIG_FILE = "file-big"
BIG_LINES = 1100
# A file the proxy redirects to a private address (a signed URL's query included): refused.
PRIVATE_FILE = "file-private"
PRIVATE_TARGET = "https://10.1.2.3/out.jsonl?X-Amz-Signature=parity-secret"
BIG_DROP = 1_050_000
# The "capped" connection's max_download_bytes: every file read through it is over the cap.
CAPPED_DOWNLOAD = 64
# Server counters moved by the engine in the background, not by the calls compared.
BACKGROUND_COUNTERS = {"inference_calls", "line_failures", "simulated_crashes"}
# Public methods with no async twin, on purpose.
SYNC_ONLY = {"test_connection"}
# Connection-form classmethods: the UI calls them, no I/O, nothing to twin.
FORM_METHODS = {"get_ui_field_behaviour", "get_connection_form_widgets"}
# Parameters one twin has and the other lacks, known today (reported; remove when fixed).
KNOWN_SIGNATURE_GAPS: dict[str, set[str]] = {}
# Headers the proxy does not pass on (hop-by-hop, or set again by its own client).
HOP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}

_ID = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|(?<=[_-])[0-9a-f]{24}\b|parity-\d+"
)
_TIME_KEY = re.compile(r"(^|_)(at|time|created|timestamp)$")


# ---- the world: one live server per dialect and what the rows read ---------------------------


@dataclass
class World:
    """The live server of one dialect, its connections and the objects the rows read.

    :param dialect: the dialect name.
    :param server: the live local batch server speaking it.
    :param proxy: a hostile server in front of it: it drops every create's answer after the
        server made the batch, and serves ``BIG_FILE`` dropping every other download after a MiB.
    :param tmp: a directory for inputs and downloads.
    """

    dialect: str
    server: BatchServerHandle
    proxy: HostileServer
    tmp: Path
    input_path: Path = field(init=False)
    input_file_id: str = ""
    # A file whose lines no dialect can read as answers.
    junk_file_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    batch: Batch | None = None
    hooks: list[BatchApiHook] = field(default_factory=list)
    _runs: Iterator[int] = field(default_factory=itertools.count)
    # One client for the many admin and proxy calls: a new httpx client per call costs ~0.1 s.
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10))

    def __post_init__(self) -> None:
        self.input_path = self.tmp / "in.jsonl"

    def hook(self, variant: str = "plain") -> BatchApiHook:
        """A new hook on connection ``variant`` (plain, quota, stall, proxy, capped); closed after use."""
        hook = BatchApiHook(f"parity_{self.dialect}_{variant}", retry_policy=FAST)
        self.hooks.append(hook)
        return hook

    @property
    def done(self) -> Batch:
        assert self.batch is not None
        return self.batch

    @property
    def readable_file(self) -> str:
        """A file with content: the batch's output (xAI keeps none: its input)."""
        return self.done.output_file_id or self.input_file_id

    @property
    def big_path(self) -> str:
        """Where the proxy serves ``BIG_FILE``."""
        return f"/v1/{get_dialect(self.dialect).file_content_path(BIG_FILE)}"

    def big_requests(self) -> int:
        return len(self.proxy.seen(self.big_path))

    def run_key(self) -> dict[str, str]:
        """Metadata no other call used, so a lookup finds only this call's batch."""
        return metadata_for(self.dialect, f"parity-{next(self._runs)}")

    def path(self, name: str, size: int | None = None) -> Path:
        """A fresh path under the world's directory; a sparse file of ``size`` bytes if given."""
        target = self.tmp / f"{next(self._runs)}-{name}"
        if size is not None:
            with target.open("wb") as fh:
                fh.truncate(size)
        return target

    def counters(self) -> dict[str, int]:
        """The server's request and fault counters (``BatchServerHandle.stats``, on the shared client)."""
        response = self.client.get(f"{self.server.root_url}/admin/stats", headers=self.server.auth_headers())
        counters: dict[str, int] = response.raise_for_status().json()["counters"]
        return counters


def _forward(world: World, *, drop: bool) -> Route:
    """Pass the request to the live server; with ``drop`` close the socket instead of answering."""

    def route(ex: Exchange) -> None:
        seen = ex.request
        headers = {k: v for k, v in seen.headers.items() if k not in HOP_HEADERS}
        answer = world.client.request(
            seen.method, world.server.root_url + seen.target, headers=headers, content=seen.body
        )
        if drop:
            return  # the batch exists now; the client only sees the connection close
        ex.respond(answer.status_code, answer.content, {"Content-Type": answer.headers["content-type"]})

    return route


def _big_content() -> bytes:
    return b"".join(
        json.dumps({"custom_id": f"big-{i}", "pad": "x" * 1000}).encode() + b"\n" for i in range(BIG_LINES)
    )


def _drop_every_other(content: bytes) -> Route:
    """Odd requests get BIG_DROP bytes of ``content`` then a closed socket; even ones all of it.

    Each twin makes two requests (dropped, then resumed), so each sees the same pattern.
    """
    calls = itertools.count()

    def route(ex: Exchange) -> None:
        if next(calls) % 2:
            ex.respond(200, content, {"Content-Type": "application/octet-stream"})
            return
        ex.head(200, {"Content-Type": "application/octet-stream"}, len(content))
        ex.send(content[:BIG_DROP])

    return route


def _connections(world: World) -> dict[str, str]:
    """``AIRFLOW_CONN_*`` values: plain, with a forced fault header, through the proxy, and with a
    download cap smaller than any file."""
    plain = json.loads(world.server.connection_json())
    conns = {"plain": plain}
    for variant in ("quota", "stall"):
        conns[variant] = {**plain, "extra": {**plain["extra"], "headers": {"X-Batch-Fault": variant}}}
    conns["proxy"] = {**plain, "host": world.proxy.base_url}
    conns["capped"] = {**plain, "extra": {**plain["extra"], "max_download_bytes": CAPPED_DOWNLOAD}}
    return {
        f"AIRFLOW_CONN_PARITY_{world.dialect.upper()}_{variant.upper()}": json.dumps(conn)
        for variant, conn in conns.items()
    }


# The dialects whose batches are made from an uploaded file of canonical lines with the model
# on each line: the scenarios below call the file-level API with such files. The dialects that
# encode lines, take the model on the job or submit inline have their sync and async paths
# driven side by side in tests/hooks/test_batch_live.py and their pipeline tests.
PARITY_DIALECTS = [
    name
    for name, cls in sorted(REGISTRY.items())
    if cls.submission_mode == "file" and not cls.encodes_lines and cls.model_placement == "line"
]


@pytest.fixture(scope="module", params=PARITY_DIALECTS)
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One server per dialect for the whole module, with a completed batch and stalled ones."""
    dialect: str = request.param
    tmp = tmp_path_factory.mktemp(f"parity-{dialect}")
    server = BatchServerHandle(
        ServerConfig(
            port=0,
            data_dir=tmp / "server",
            dialect=dialect,
            api_key=KEY,
            time_scale=FAST_TIME_SCALE,
            max_upload_bytes=SERVER_UPLOAD_LIMIT,
        )
    )
    proxy = HostileServer()
    world = World(dialect, server, proxy, tmp)
    proxy.route("POST /v1/batches", _forward(world, drop=True))
    proxy.route("GET /v1/batches", _forward(world, drop=False))
    proxy.route(f"GET {world.big_path}", _drop_every_other(_big_content()))
    proxy.route(f"GET /v1/{get_dialect(dialect).file_content_path(PRIVATE_FILE)}", redirect(PRIVATE_TARGET))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in _connections(world).items():
                mp.setenv(name, value)
            write_input(world.input_path, n=6)
            with world.hook() as hook, world.hook("stall") as stall:
                world.input_file_id = hook.upload_file(world.input_path)
                junk = world.tmp / "junk.jsonl"
                junk.write_bytes(b'{"custom_id": "row-0", "respo\n[1, 2]\nnot json at all\n')
                world.junk_file_id = hook.upload_file(junk)
                for _ in range(STALLED):
                    stall.create_batch(input_file_id=world.input_file_id, endpoint=ENDPOINT)
                world.batch = _partly_failed_batch(world, hook)
            world.hooks.clear()
            yield world
    finally:
        proxy.stop()
        server.stop()
        world.client.close()


def _partly_failed_batch(world: World, hook: BatchApiHook) -> Batch:
    """A completed batch with answers and failed lines, so results read an output and an error file.

    Which lines fail is a hash of the batch id: the rare batch where none or all fail is made again.
    """
    world.server.set_faults(line_failure_rate=0.5)
    try:
        for _ in range(10):
            world.metadata = world.run_key()
            created = hook.create_batch(
                input_file_id=world.input_file_id, endpoint=ENDPOINT, metadata=world.metadata
            )
            batch = wait_terminal(hook, created.id)
            assert batch.state is BatchState.COMPLETED
            if 0 < batch.request_counts.failed < batch.request_counts.total:
                return batch
    finally:
        world.server.set_faults(line_failure_rate=0.0)
    raise AssertionError("ten batches in a row had no failed line or no answer")


# ---- normalisers ------------------------------------------------------------------------------


def scrub(value: Any) -> Any:
    """Ids and timestamps replaced by placeholders (None stays None), models dumped to JSON shapes."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        return {
            k: "<t>" if v is not None and _TIME_KEY.search(str(k)) else scrub(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    if isinstance(value, str):
        return _ID.sub("<id>", value)
    return value


def exact(value: Any) -> Any:
    """The value as is (models dumped): both twins read the same server objects."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [exact(v) for v in value]
    return value


def created(batch: Batch) -> Any:
    """What a create decided (the adopted batch runs on meanwhile: its state depends on timing)."""
    fixed = batch.model_dump(mode="json", include={"endpoint", "completion_window", "input_file_id"})
    return fixed | {"metadata": scrub(batch.metadata)}


def ids(batches: list[Batch]) -> list[str]:
    """Batch ids in order (states of batches still running may move between the two calls)."""
    return [b.id for b in batches]


def page_shapes(pages: list[Any]) -> list[Any]:
    """Per listing page: the batch ids, the items skipped and the items that did not parse."""
    return [(ids(p.batches), p.skipped, len(p.unreadable), p.next_params is None) for p in pages]


def by_custom_id(lines: list[Any]) -> list[Any]:
    return sorted(exact(lines), key=lambda line: (line["custom_id"], line["source"]))


def all_recorded(lines: list[Any]) -> list[Any]:
    """``by_custom_id``, after checking every line was recorded as unreadable (not read, not dropped)."""
    shaped = by_custom_id(lines)
    assert shaped and all(line["error"]["code"] == "invalid_result_line" for line in shaped), shaped
    return shaped


# ---- rows -------------------------------------------------------------------------------------

SyncCall = Callable[[World], Any]
# An awaitable or an async iterator.
AsyncCall = Callable[[World], Any]


@dataclass(frozen=True)
class Row:
    """One scenario, run sync and async against the same server.

    :param name: ``method`` or ``method[variant]``; ``method`` is the public sync name.
    :param sync_call: the sync call, given the world.
    :param async_call: its async twin (None for a method that is sync only, see ``SYNC_ONLY``).
    :param normaliser: what of a return value must be equal (error outcomes are scrubbed).
    :param faults: server fault settings applied (counters reset) before each twin, reset after.
    :param polls: the call polls until a state, so its request count may differ.
    :param expect: for a sync-only row, the normalised outcome it must have.
    """

    name: str
    sync_call: SyncCall
    async_call: AsyncCall | None
    normaliser: Callable[[Any], Any] = exact
    faults: dict[str, Any] | None = None
    polls: bool = False
    expect: Any = None

    @property
    def method(self) -> str:
        return self.name.split("[", 1)[0]


async def collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


def given(w: World, value: Any) -> Any:
    """``value``, or what it returns for the world if it is a function."""
    return value(w) if callable(value) else value


def never(batch: Batch) -> bool:
    """An ``accept`` test no batch passes."""
    return False


def misread(w: World) -> Batch:
    """The finished batch with a file of unreadable lines (not JSON, not an object) as its output."""
    return w.done.model_copy(update={"output_file_id": w.junk_file_id, "error_file_id": None})


def twins(method: str, *args: Any, variant: str = "plain", **kwargs: Any) -> tuple[SyncCall, AsyncCall]:
    """``method`` and ``a<method>`` called with the same arguments on a fresh hook each.

    An argument that is a function is called with the world first (for values known only once
    the world exists, or made anew for each twin). Iterators are collected by the runner.
    """

    def resolve(w: World) -> tuple[list[Any], dict[str, Any]]:
        return [given(w, a) for a in args], {k: given(w, v) for k, v in kwargs.items()}

    def sync_call(w: World) -> Any:
        call_args, call_kwargs = resolve(w)
        return getattr(w.hook(variant), method)(*call_args, **call_kwargs)

    def async_call(w: World) -> Any:
        call_args, call_kwargs = resolve(w)
        return getattr(w.hook(variant), f"a{method}")(*call_args, **call_kwargs)

    return sync_call, async_call


def client_shape(client: httpx.Client | httpx.AsyncClient) -> Any:
    return (
        str(client.base_url),
        sorted(client.headers.items()),
        repr(client.timeout),
        client.follow_redirects,
    )


def settings_shape(settings: Any) -> Any:
    return (repr(settings), settings.base_url, settings.secrets, sorted(settings.client_headers().items()))


def close_sync(w: World) -> Any:
    hook = w.hook()
    client = hook.get_conn()
    hook.close()
    hook.close()  # closing twice is harmless
    return client.is_closed, hook.get_conn() is not client


async def close_async(w: World) -> Any:
    hook = w.hook()
    client = await hook.aget_conn()
    await hook.aclose()
    await hook.aclose()
    return client.is_closed, (await hook.aget_conn()) is not client


def context_sync(w: World) -> Any:
    hook = w.hook()
    with hook as entered:
        client = entered.get_conn()
        batch = entered.get_batch(w.done.id)
    return entered is hook, client.is_closed, exact(batch)


async def context_async(w: World) -> Any:
    hook = w.hook()
    async with hook as entered:
        client = await entered.aget_conn()
        batch = await entered.aget_batch(w.done.id)
    return entered is hook, client.is_closed, exact(batch)


def upload_sync(w: World, **kwargs: Any) -> Any:
    hook = w.hook()
    return hook.get_file(hook.upload_file(w.input_path, **kwargs))


async def upload_async(w: World, **kwargs: Any) -> Any:
    hook = w.hook()
    return await hook.aget_file(await hook.aupload_file(w.input_path, **kwargs))


def oversize(w: World, *, server: bool) -> Path:
    """A sparse file one byte over the server's upload limit or over the dialect's (refused locally)."""
    limit = SERVER_UPLOAD_LIMIT if server else get_dialect(w.dialect).limits.max_shard_bytes
    return w.path("big.jsonl", size=limit + 1)


def delete_sync(w: World) -> Any:
    hook = w.hook()
    file_id = hook.upload_file(w.input_path)
    deleted = hook.delete_file(file_id)
    with pytest.raises(BatchApiNotFoundError):
        hook.get_file(file_id)
    return deleted


async def delete_async(w: World) -> Any:
    hook = w.hook()
    file_id = await hook.aupload_file(w.input_path)
    deleted = await hook.adelete_file(file_id)
    with pytest.raises(BatchApiNotFoundError):
        await hook.aget_file(file_id)
    return deleted


def download_sync(w: World, file_id: str, variant: str = "plain") -> Any:
    dest = w.path("download.jsonl")
    written = w.hook(variant).download_file(file_id, dest)
    return written, hashlib.sha256(dest.read_bytes()).hexdigest()


async def download_async(w: World, file_id: str, variant: str = "plain") -> Any:
    dest = w.path("download.jsonl")
    written = await w.hook(variant).adownload_file(file_id, dest)
    return written, hashlib.sha256(dest.read_bytes()).hexdigest()


def big_download_sync(w: World) -> Any:
    before = w.big_requests()
    return download_sync(w, BIG_FILE, "proxy"), w.big_requests() - before


async def big_download_async(w: World) -> Any:
    before = w.big_requests()
    return await download_async(w, BIG_FILE, "proxy"), w.big_requests() - before


def big_lines_sync(w: World) -> Any:
    before = w.big_requests()
    return lines_shape(list(w.hook("proxy").iter_file_lines(BIG_FILE)), w.big_requests() - before)


async def big_lines_async(w: World) -> Any:
    before = w.big_requests()
    return lines_shape(await collect(w.hook("proxy").aiter_file_lines(BIG_FILE)), w.big_requests() - before)


def lines_shape(lines: list[dict[str, Any]], requests: int) -> Any:
    """How many lines, how many distinct, their digest, and how many requests were made for them."""
    digest = hashlib.sha256(json.dumps(lines).encode()).hexdigest()
    return len(lines), len({line["custom_id"] for line in lines}), digest, requests


def create_kwargs(w: World) -> dict[str, Any]:
    return {name: given(w, value) for name, value in CREATE.items()}


def cancel_sync(w: World) -> Any:
    hook = w.hook("stall")
    batch = hook.create_batch(**create_kwargs(w))
    asked = hook.cancel_batch(batch.id)
    return asked.state in (BatchState.CANCELLING, BatchState.CANCELLED), wait_terminal(hook, batch.id).state


async def cancel_async(w: World) -> Any:
    hook = w.hook("stall")
    batch = await hook.acreate_batch(**create_kwargs(w))
    asked = await hook.acancel_batch(batch.id)
    final = await await_terminal(hook, batch.id)
    return asked.state in (BatchState.CANCELLING, BatchState.CANCELLED), final.state


@contextlib.contextmanager
def small_result_pages(w: World, size: int = 2) -> Iterator[None]:
    """Results pages of ``size`` lines, so a six-line batch takes several pages."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(get_dialect(w.dialect)), "results_page_size", size)
        yield


def paged_results_sync(w: World) -> Any:
    with small_result_pages(w):
        return list(w.hook().iter_results(w.done, mode="results_endpoint"))


async def paged_results_async(w: World) -> Any:
    with small_result_pages(w):
        return await collect(w.hook().aiter_results(w.done, mode="results_endpoint"))


DROP = {"drop_rate": 0.5}  # deterministic: the first download of each twin drops half way, the next does not
MISSING_FILE = "file-00000000000000000000missing"
MISSING_BATCH = "batch_00000000000000000000missing"


def done(w: World) -> Batch:
    return w.done


def done_id(w: World) -> str:
    return w.done.id


def readable(w: World) -> str:
    return w.readable_file


def inline_match(requests: int) -> Any:
    from datetime import datetime, timezone

    from airflow_batch_provider.hooks.create import InlineMatch

    return InlineMatch(since=datetime(2000, 1, 1, tzinfo=timezone.utc), requests=requests)


# The create arguments; each twin gets metadata of its own, so a lookup finds only its batch.
CREATE: dict[str, Any] = {
    "input_file_id": lambda w: w.input_file_id,
    "endpoint": ENDPOINT,
    "metadata": World.run_key,
}

ROWS: list[Row] = [
    # -- settings, clients, lifecycle
    Row("get_settings", *twins("get_settings"), settings_shape),
    Row("get_conn", *twins("get_conn"), client_shape),
    Row("close", close_sync, close_async),
    Row("__enter__", context_sync, context_async),
    # -- files
    Row("upload_file", upload_sync, upload_async, scrub),
    Row(
        "upload_file[filename]",
        lambda w: upload_sync(w, filename="named.jsonl"),
        lambda w: upload_async(w, filename="named.jsonl"),
        scrub,
    ),
    Row("upload_file[no such local file]", *twins("upload_file", lambda w: w.tmp / "absent.jsonl")),
    Row(
        "upload_file[over the dialect limit]",
        *twins("upload_file", lambda w: oversize(w, server=False), filename="big.jsonl"),
    ),
    Row(
        "upload_file[over the server limit]",
        *twins("upload_file", lambda w: oversize(w, server=True), filename="big.jsonl"),
    ),
    Row("upload_file[quota]", *twins("upload_file", lambda w: w.input_path, variant="quota")),
    Row("get_file", *twins("get_file", lambda w: w.input_file_id)),
    Row("get_file[missing]", *twins("get_file", MISSING_FILE)),
    Row("delete_file", delete_sync, delete_async),
    Row("delete_file[missing]", *twins("delete_file", MISSING_FILE)),
    Row(
        "download_file",
        lambda w: download_sync(w, w.readable_file),
        lambda w: download_async(w, w.readable_file),
    ),
    Row(
        "download_file[dropped mid-stream]",
        lambda w: download_sync(w, w.readable_file),
        lambda w: download_async(w, w.readable_file),
        faults=DROP,
    ),
    Row("download_file[dropped after a MiB]", big_download_sync, big_download_async),
    Row(
        "download_file[over the download cap]",
        lambda w: download_sync(w, w.readable_file, "capped"),
        lambda w: download_async(w, w.readable_file, "capped"),
    ),
    Row(
        "download_file[redirect to a private address]",
        lambda w: download_sync(w, PRIVATE_FILE, "proxy"),
        lambda w: download_async(w, PRIVATE_FILE, "proxy"),
    ),
    Row(
        "download_file[missing]",
        lambda w: download_sync(w, MISSING_FILE),
        lambda w: download_async(w, MISSING_FILE),
    ),
    Row("iter_file_lines", *twins("iter_file_lines", readable)),
    Row("iter_file_lines[dropped mid-stream]", *twins("iter_file_lines", readable), faults=DROP),
    Row("iter_file_lines[dropped after a MiB, resumed]", big_lines_sync, big_lines_async),
    Row("iter_file_lines[missing]", *twins("iter_file_lines", MISSING_FILE)),
    Row("iter_file_lines[quota]", *twins("iter_file_lines", readable, variant="quota")),
    Row("iter_file_lines[over the download cap]", *twins("iter_file_lines", readable, variant="capped")),
    Row(
        "iter_file_lines[redirect to a private address]",
        *twins("iter_file_lines", PRIVATE_FILE, variant="proxy"),
    ),
    Row("iter_raw_lines", *twins("iter_raw_lines", readable)),
    Row("iter_raw_lines[over the download cap]", *twins("iter_raw_lines", readable, variant="capped")),
    Row("iter_raw_lines[dropped mid-stream]", *twins("iter_raw_lines", readable), faults=DROP),
    # -- batches
    Row("create_batch", *twins("create_batch", **CREATE), scrub),
    Row(
        "create_batch[missing input file]", *twins("create_batch", **CREATE | {"input_file_id": MISSING_FILE})
    ),
    Row("create_batch[bad window]", *twins("create_batch", **CREATE | {"completion_window": "7m"})),
    Row("create_batch[quota]", *twins("create_batch", **CREATE, variant="quota")),
    # The proxy creates the batch, then drops the answer: the lookup by metadata adopts it.
    Row("create_batch[answer dropped, adopted]", *twins("create_batch", **CREATE, variant="proxy"), created),
    # Nothing to look for: raise rather than risk paying twice.
    Row(
        "create_batch[answer dropped, no metadata]",
        *twins("create_batch", **CREATE | {"metadata": None}, variant="proxy"),
    ),
    Row("get_batch", *twins("get_batch", done_id)),
    Row("get_batch[missing]", *twins("get_batch", MISSING_BATCH)),
    Row("get_batch[quota]", *twins("get_batch", done_id, variant="quota")),
    Row("cancel_batch", cancel_sync, cancel_async, polls=True),
    Row("cancel_batch[finished]", *twins("cancel_batch", done_id)),
    Row("cancel_batch[missing]", *twins("cancel_batch", MISSING_BATCH)),
    Row("list_batches", *twins("list_batches"), ids),
    Row("list_batches[page_size=2]", *twins("list_batches", page_size=2), ids),
    Row("list_batches[page_size=2, limit=3]", *twins("list_batches", page_size=2, limit=3), ids),
    Row("list_batches[page_size over the server's]", *twins("list_batches", page_size=5000), ids),
    Row("list_batches[quota]", *twins("list_batches", variant="quota")),
    Row("list_batch_pages", *twins("list_batch_pages", page_size=2), page_shapes),
    Row("list_batch_pages[wanted none]", *twins("list_batch_pages", wanted=frozenset()), page_shapes),
    Row("find_batches", *twins("find_batches", lambda w: w.metadata)),
    Row("find_batches[no match]", *twins("find_batches", {"airflow_batch_key": "nothing"})),
    Row("find_batches[empty]", *twins("find_batches", {})),
    Row("find_batches[limit=2]", *twins("find_batches", lambda w: w.metadata, limit=2)),
    Row("find_created_batch", *twins("find_created_batch", lambda w: w.metadata)),
    # Batches of one size created since a time (an inline create's lookup): the same ids both ways.
    Row(
        "find_inline_batches",
        *twins("find_inline_batches", lambda w: inline_match(w.done.request_counts.total)),
        lambda match: sorted(b.id for b in match.found),
    ),
    Row("find_inline_batches[no such size]", *twins("find_inline_batches", lambda w: inline_match(10**9))),
    Row("find_created_batch[no match]", *twins("find_created_batch", {"airflow_batch_key": "nothing"})),
    Row(
        "find_created_batch[other input file]",
        *twins("find_created_batch", lambda w: w.metadata, input_file_id=MISSING_FILE),
    ),
    Row(
        "find_created_batch[none accepted]",
        *twins("find_created_batch", lambda w: w.metadata, accept=lambda w: never),
    ),
    # -- results
    Row("iter_results", *twins("iter_results", done), by_custom_id),
    Row("iter_results[by id]", *twins("iter_results", done_id), by_custom_id),
    Row("iter_results[files]", *twins("iter_results", done, mode="files"), by_custom_id),
    Row("iter_results[results_endpoint, pages of 2]", paged_results_sync, paged_results_async, by_custom_id),
    Row("iter_results[dropped mid-stream]", *twins("iter_results", done), by_custom_id, faults=DROP),
    Row(
        "iter_results[unreadable lines recorded]",
        *twins("iter_results", misread, mode="files", on_bad_line="record"),
        all_recorded,
    ),
    Row("iter_results[unreadable lines fail]", *twins("iter_results", misread, mode="files")),
    Row("iter_results[over the download cap]", *twins("iter_results", done, variant="capped"), by_custom_id),
    Row("iter_results[bad mode]", *twins("iter_results", done, mode="carrier-pigeon")),
    Row("iter_results[missing]", *twins("iter_results", MISSING_BATCH)),
    Row("iter_results[quota]", *twins("iter_results", done_id, variant="quota")),
    # -- sync only
    Row(
        "test_connection",
        lambda w: w.hook().test_connection(),
        None,
        lambda result: (result[0], "listing batches works" in result[1]),
        expect=("ok", (True, True)),
    ),
    Row(
        "test_connection[quota]",
        lambda w: w.hook("quota").test_connection(),
        None,
        lambda result: (result[0], result[1].startswith("BatchApiQuotaError: listing batches: ")),
        expect=("ok", (False, True)),
    ),
]


# ---- the runner -------------------------------------------------------------------------------


def _error(exc: BaseException) -> tuple[Any, ...]:
    return ("error", type(exc).__name__, getattr(exc, "status_code", None), scrub(str(exc)))


def _delta(before: dict[str, int], after: dict[str, int], row: Row) -> dict[str, int]:
    skip = BACKGROUND_COUNTERS | ({"requests"} if row.polls else set())
    keys = (before.keys() | after.keys()) - skip
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys) if after.get(k, 0) != before.get(k, 0)
    }


@contextlib.contextmanager
def _faults(world: World, row: Row) -> Iterator[None]:
    if row.faults:
        world.server.set_faults(**row.faults)  # also restarts the rate counters: same pattern per twin
    try:
        yield
    finally:
        if row.faults:
            world.server.set_faults(**FaultConfig().model_dump())


def run_sync(world: World, row: Row) -> tuple[Any, dict[str, int]]:
    before = world.counters()
    try:
        with _faults(world, row):
            result = row.sync_call(world)
            if isinstance(result, Iterator):
                result = list(result)
            outcome: Any = ("ok", row.normaliser(result))
    except Exception as exc:
        outcome = _error(exc)
    finally:
        for hook in world.hooks:
            hook.close()
        world.hooks.clear()
    return outcome, _delta(before, world.counters(), row)


async def run_async(world: World, row: Row) -> tuple[Any, dict[str, int]]:
    assert row.async_call is not None
    before = world.counters()
    try:
        with _faults(world, row):
            result = row.async_call(world)
            result = await (collect(result) if isinstance(result, AsyncIterator) else result)
            outcome: Any = ("ok", row.normaliser(result))
    except Exception as exc:
        outcome = _error(exc)
    finally:
        for hook in world.hooks:
            await hook.aclose()
            hook.close()
        world.hooks.clear()
    return outcome, _delta(before, world.counters(), row)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
async def test_sync_and_async_end_the_same(world: World, row: Row) -> None:
    sync_outcome, sync_effects = run_sync(world, row)
    if row.async_call is None:
        assert sync_outcome == row.expect
        return
    async_outcome, async_effects = await run_async(world, row)
    assert async_outcome == sync_outcome
    assert async_effects == sync_effects
    # A drop row that dropped nothing proves nothing (xAI pages results as JSON: no file to drop).
    if row.faults is DROP and not (row.method == "iter_results" and world.dialect == "xai"):
        assert sync_effects.get("drop", 0) >= 1, sync_effects


# ---- the table covers the hook ----------------------------------------------------------------


def public_methods() -> dict[str, Any]:
    """Public callables of BatchApiHook that it defines or overrides (not BaseHook's inherited ones)."""
    found = {}
    for name in dir(BatchApiHook):
        if name.startswith("_") or name in FORM_METHODS:
            continue
        attr = inspect.getattr_static(BatchApiHook, name)
        if attr is inspect.getattr_static(BaseHook, name, None):
            continue
        if isinstance(attr, staticmethod | classmethod):
            attr = attr.__func__
        if inspect.isfunction(attr):
            found[name] = attr
    return found


def is_async(function: Any) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


def test_every_public_method_has_a_row() -> None:
    methods = public_methods()
    covered = {row.method for row in ROWS}
    sync_methods = {name for name, fn in methods.items() if not is_async(fn)}
    assert sync_methods - covered == set(), "add a row to ROWS for each"
    # Rows name the sync method; every async one is reached through its twin.
    assert covered - sync_methods - {"__enter__"} == set(), "rows for methods the hook no longer has"
    assert {row.method for row in ROWS if row.async_call is None} == SYNC_ONLY
    # The context managers are twins too (their row is ``__enter__``).
    assert all(
        inspect.getattr_static(BatchApiHook, name) is not inspect.getattr_static(BaseHook, name, None)
        for name in ("__enter__", "__exit__", "__aenter__", "__aexit__")
    )


def test_every_async_method_has_its_sync_twin() -> None:
    methods = public_methods()
    for name, function in methods.items():
        if is_async(function):
            assert name.startswith("a") and name[1:] in methods, f"{name} has no sync twin"
            assert not is_async(methods[name[1:]]), f"{name[1:]} should be the sync twin of {name}"
        elif name not in SYNC_ONLY:
            assert is_async(methods.get(f"a{name}")), f"{name} has no async twin a{name}"


def test_twins_take_the_same_parameters() -> None:
    methods = public_methods()
    for name, function in methods.items():
        if not is_async(function):
            continue
        sync = inspect.signature(methods[name[1:]]).parameters
        twin = inspect.signature(function).parameters
        shape = {p: (sync[p].kind, sync[p].default) for p in sync.keys() & twin.keys() if sync[p] != twin[p]}
        assert shape == {}, f"{name}: parameters differ in kind or default: {shape}"
        gap = (sync.keys() ^ twin.keys()) - KNOWN_SIGNATURE_GAPS.get(name[1:], set())
        assert gap == set(), f"{name} and {name[1:]} differ in parameters {gap}"
