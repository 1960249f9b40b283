"""BatchApiHook against the live local batch server, in every dialect, sync and async."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects import DIALECTS as REGISTRY
from airflow_batch_provider.exceptions import (
    BatchApiAuthError,
    BatchApiNotFoundError,
    BatchApiQuotaError,
    BatchApiRateLimitError,
)
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.create import made_from
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.hooks.transport import FileBody
from airflow_batch_provider.models import Batch, BatchState
from airflow_batch_provider.upload_lines import ShardEncoder, write_inline_body
from tests.fixtures.s3 import cut_object_reads

# Every registered dialect: lines go up as each vendor takes them (encoded, with the model on
# the job, or inline in the create), through the same seams the submit operator uses.
ALL_DIALECTS = sorted(REGISTRY)
# Dialects whose batches are made from an uploaded file (the file-level API applies).
FILE_DIALECTS = [name for name in ALL_DIALECTS if REGISTRY[name].submission_mode == "file"]
KEY = "sk-live-secret-0987654321"
ENDPOINT = "/v1/chat/completions"
FAST = RetryPolicy(max_retries=4, backoff_initial=0.005, backoff_max=0.02, retry_after_max=0.05)
POLLS = 2000  # generous bound on polls; the fast server finishes a small batch in a few


def write_input(path: Path, n: int = 5, prefix: str = "row") -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(n)]
    with path.open("wb") as fh:
        for cid in ids:
            line = {
                "custom_id": cid,
                "method": "POST",
                "url": ENDPOINT,
                "body": {"model": "echo-1", "messages": [{"role": "user", "content": f"say {cid}"}]},
            }
            fh.write(orjson.dumps(line) + b"\n")
    return ids


# What a vendor requires on every request and the build would set (Anthropic: max_tokens).
DEFAULTS = {"max_tokens": 64}


def prepared(hook: BatchApiHook, source: Path) -> tuple[dict[str, Any], Path | FileBody | None]:
    """The create's arguments besides metadata, and what to upload (a path) or the inline body.

    Canonical lines are encoded as ``hook.dialect`` takes them, with the job's model for a
    dialect that puts it on the job.
    """
    dialect = hook.dialect
    encoder = ShardEncoder(dialect, where=str(source), defaults=DEFAULTS)
    if dialect.submission_mode == "inline":
        body = source.with_suffix(".create.json")
        fields = dialect.inline_create_body(
            endpoint=ENDPOINT, completion_window="24h", metadata=None, model=None
        )
        with source.open("rb") as src, body.open("wb") as out:
            size, count = write_inline_body(encoder, src, out, fields)
        return {"endpoint": ENDPOINT}, FileBody(body, filename=body.name, size=size, requests=count)
    if dialect.submission_mode == "object_store":
        # The job reads the encoded lines from the object store (the server's S3) and writes
        # its results under an output prefix; each create gets a folder (and job name) of its own.
        from airflow_batch_provider.hooks.objects import plain_uri

        name = f"live-{uuid.uuid4().hex[:12]}"
        folder = hook.object_root / name  # type: ignore[attr-defined]
        with source.open("rb") as src, (folder / "input" / source.name).open("wb") as out:
            for line in encoder.lines(src):
                out.write(line)
        return {
            "endpoint": ENDPOINT,
            "model": encoder.job_model,
            "input_file_id": plain_uri(folder / "input" / source.name),
            "output_uri": plain_uri(folder / "output") + "/",
            "name": name,
        }, None
    upload = source.with_suffix(".upload.jsonl")
    with source.open("rb") as src, upload.open("wb") as out:
        for line in encoder.lines(src):
            out.write(line)
    return {"endpoint": ENDPOINT, "model": encoder.job_model}, upload


def create(hook: BatchApiHook, source: Path, **kwargs: Any) -> Batch:
    """Upload (or inline, or write to the object store) ``source`` and create a batch of it."""
    args, payload = prepared(hook, source)
    if isinstance(payload, FileBody):
        return hook.create_batch(inline=payload, **args, **kwargs)
    if payload is None:
        return hook.create_batch(**args, **kwargs)
    return hook.create_batch(input_file_id=hook.upload_file(payload), **args, **kwargs)


async def acreate(hook: BatchApiHook, source: Path, **kwargs: Any) -> Batch:
    args, payload = prepared(hook, source)
    if isinstance(payload, FileBody):
        return await hook.acreate_batch(inline=payload, **args, **kwargs)
    if payload is None:
        return await hook.acreate_batch(**args, **kwargs)
    return await hook.acreate_batch(input_file_id=await hook.aupload_file(payload), **args, **kwargs)


def wait_terminal(hook: BatchApiHook, batch_id: str) -> Batch:
    for _ in range(POLLS):
        batch = hook.get_batch(batch_id)
        if batch.is_terminal:
            return batch
        time.sleep(0.01)
    raise AssertionError(f"batch {batch_id} did not finish; last state {batch.state}")


async def await_terminal(hook: BatchApiHook, batch_id: str) -> Batch:
    for _ in range(POLLS):
        batch = await hook.aget_batch(batch_id)
        if batch.is_terminal:
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch {batch_id} did not finish; last state {batch.state}")


@pytest.fixture
def live(batch_server, monkeypatch: pytest.MonkeyPatch):
    """Start a server in a dialect and point connection ``batch_live`` at it."""

    def start(dialect: str, **config: Any):
        server = batch_server(dialect=dialect, api_key=KEY, **config)
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_LIVE", server.connection_json())
        hook = BatchApiHook("batch_live", retry_policy=FAST)
        if server.s3 is not None:
            hook.object_root = server.s3.path("live")  # type: ignore[attr-defined]
        return server, hook

    return start


def metadata_for(dialect: str, run: str) -> dict[str, str] | None:
    """The run's tags; None for a vendor whose batches carry none (found by time and count)."""
    if REGISTRY[dialect].orphan_lookup != "tags":
        return None
    # Without metadata (xAI, Gemini) the run key becomes the batch's name (see the dialects).
    if not REGISTRY[dialect].supports_metadata:
        return {"airflow_batch_key": run}
    return {"airflow_batch_key": run, "shard": "0"}


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_round_trip(live, tmp_path: Path, dialect: str) -> None:
    server, hook = live(dialect)
    ids = write_input(tmp_path / "in.jsonl")
    with hook:
        ok, message = hook.test_connection()
        assert ok, message
        metadata = metadata_for(dialect, f"run-{dialect}")
        created = create(hook, tmp_path / "in.jsonl", metadata=metadata)
        assert not created.is_terminal or created.state is BatchState.COMPLETED
        batch = wait_terminal(hook, created.id)
        assert batch.state is BatchState.COMPLETED
        assert batch.request_counts.total == 5
        assert batch.request_counts.completed == 5

        results = list(hook.iter_results(batch))
        assert sorted(r.custom_id for r in results) == ids
        assert all(r.ok and r.body for r in results)

        listed = [b.id for b in hook.list_batches()]
        assert batch.id in listed
        if metadata is not None:
            assert [b.id for b in hook.find_batches(metadata)] == [batch.id]
            assert hook.find_batches({"airflow_batch_key": "another-run"}) == []
        with pytest.raises(BatchApiNotFoundError, match="batch 'batch_missing'"):
            hook.get_batch("batch_missing")
        if dialect not in FILE_DIALECTS:
            return
        file_id = batch.input_file_id or ""
        info = hook.get_file(file_id)
        # The vendor's file object names the file as the dialect reads it (id, file_id, Gemini's name).
        assert hook.dialect.parse_file_id(info) == file_id
        if batch.output_file_id:
            dest = tmp_path / "out" / "output.jsonl"
            size = hook.download_file(batch.output_file_id, dest)
            assert size == dest.stat().st_size > 0
            read = hook.dialect.parse_result_line
            assert (
                sorted(
                    read(orjson.loads(line), "output").custom_id for line in dest.read_bytes().splitlines()
                )
                == ids
            )
            assert len(list(hook.iter_file_lines(batch.output_file_id))) == 5

        hook.delete_file(file_id)
        with pytest.raises(BatchApiNotFoundError, match=f"file '{file_id}'"):
            hook.get_file(file_id)


def test_doubleword_results_endpoint_matches_files(live, tmp_path: Path) -> None:
    server, hook = live("doubleword")
    write_input(tmp_path / "in.jsonl", n=7)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    batch = wait_terminal(hook, hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT).id)
    from_files = {r.custom_id: r.body for r in hook.iter_results(batch, mode="files")}
    from_endpoint = {r.custom_id: r.body for r in hook.iter_results(batch, mode="results_endpoint")}
    assert from_files.keys() == from_endpoint.keys()
    assert len(from_files) == 7
    assert from_files == from_endpoint


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_failed_lines_come_back_as_errors(live, tmp_path: Path, dialect: str) -> None:
    server, hook = live(dialect, faults={"line_failure_rate": 0.5})
    ids = write_input(tmp_path / "in.jsonl", n=6)
    batch = wait_terminal(hook, create(hook, tmp_path / "in.jsonl").id)
    assert batch.state is BatchState.COMPLETED
    results = list(hook.iter_results(batch))
    assert sorted(r.custom_id for r in results) == ids
    failed = [r for r in results if not r.ok]
    assert len(failed) == 3 == batch.request_counts.failed
    assert all(r.error is not None and r.error.code for r in failed)


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_cancel(live, tmp_path: Path, dialect: str) -> None:
    server, hook = live(dialect, faults={"stall_batches": True})
    write_input(tmp_path / "in.jsonl")
    batch = create(hook, tmp_path / "in.jsonl")
    cancelled = hook.cancel_batch(batch.id)
    assert cancelled.state in (BatchState.CANCELLING, BatchState.CANCELLED)
    assert wait_terminal(hook, batch.id).state is BatchState.CANCELLED


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_list_pages_through_many_batches(live, tmp_path: Path, dialect: str) -> None:
    server, hook = live(dialect)
    write_input(tmp_path / "in.jsonl", n=1)
    created = {create(hook, tmp_path / "in.jsonl").id for _ in range(5)}
    assert {b.id for b in hook.list_batches(page_size=2)} == created
    assert len(list(hook.list_batches(page_size=2, limit=3))) == 3


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_retries_through_injected_429_and_5xx(live, tmp_path: Path, dialect: str) -> None:
    server, hook = live(dialect)
    write_input(tmp_path / "in.jsonl")
    batch = create(hook, tmp_path / "in.jsonl")
    server.set_faults(rate_429=0.5, rate_503=0.2, retry_after=0.01)
    done = wait_terminal(hook, batch.id)
    assert done.state is BatchState.COMPLETED
    assert len(list(hook.iter_results(done))) == 5
    faults = server.stats()["counters"]
    assert faults.get("status_429", 0) > 0


def test_429_forever_exhausts_retries(live) -> None:
    server, hook = live("openai")
    server.set_faults(rate_429=1.0, retry_after=0.01)
    with pytest.raises(BatchApiRateLimitError) as info:
        hook.get_batch("batch_x")
    assert info.value.status_code == 429
    assert server.stats()["counters"]["status_429"] == FAST.max_retries + 1


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_download_survives_dropped_connections(
    live, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dialect: str
) -> None:
    # Each vendor's results stream (output file, results endpoint pages or results URL) is read
    # whole through connections dropped mid-body.
    server, hook = live(dialect)
    ids = write_input(tmp_path / "in.jsonl", n=200)
    batch = wait_terminal(hook, create(hook, tmp_path / "in.jsonl").id)
    if REGISTRY[dialect].submission_mode == "object_store":
        # Results are read from the object store, not this server: its reads are cut instead.
        cuts = cut_object_reads(monkeypatch)  # the offsets each read of an object starts at
        assert sorted(r.custom_id for r in hook.iter_results(batch)) == sorted(ids)
        assert cuts and all(offset > 0 for offset in cuts[1:])
        return
    server.set_faults(drop_rate=0.5)
    if "files" in REGISTRY[dialect].results_modes:
        assert batch.output_file_id
        dest = tmp_path / "out.jsonl"
        hook.download_file(batch.output_file_id, dest)
        downloaded = dest.read_bytes().splitlines()
        # Each vendor names the request in its own field (custom_id, Gemini's key): the dialect reads it.
        read = hook.dialect.parse_result_line
        assert sorted(read(orjson.loads(line), "output").custom_id for line in downloaded) == sorted(ids)
    assert sorted(r.custom_id for r in hook.iter_results(batch)) == sorted(ids)
    assert server.stats()["counters"].get("drop", 0) >= 1


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
def test_wrong_key_is_rejected_without_leaking(live, batch_server, monkeypatch, dialect: str) -> None:
    server, _ = live(dialect)
    wrong = "sk-wrong-key-55555"
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_WRONG", server.connection_json(api_key=wrong))
    hook = BatchApiHook("batch_wrong", retry_policy=FAST)
    ok, message = hook.test_connection()
    assert ok is False
    assert "API key was rejected" in message
    assert wrong not in message
    with pytest.raises(BatchApiAuthError) as info:
        hook.get_batch("batch_x")
    assert wrong not in str(info.value) and wrong not in repr(info.value.body)


def test_connection_to_nothing_fails_cleanly(batch_conn) -> None:
    hook = BatchApiHook(batch_conn("batch_dead", host="http://127.0.0.1:9/v1"), max_retries=0)
    ok, message = hook.test_connection()
    assert ok is False
    assert "the connection to http://127.0.0.1:9/v1 failed" in message


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
async def test_async_round_trip(live, tmp_path: Path, dialect: str) -> None:
    server, hook = live(dialect)
    ids = write_input(tmp_path / "in.jsonl", n=4, prefix="async")
    async with hook:
        metadata = metadata_for(dialect, f"arun-{dialect}")
        created = await acreate(hook, tmp_path / "in.jsonl", metadata=metadata)
        batch = await await_terminal(hook, created.id)
        assert batch.state is BatchState.COMPLETED
        results = [r async for r in hook.aiter_results(batch.id)]
        assert sorted(r.custom_id for r in results) == ids
        assert all(r.ok for r in results)
        assert [b.id async for b in hook.alist_batches()] == [batch.id]
        if metadata is not None:
            assert [b.id for b in await hook.afind_batches(metadata)] == [batch.id]
        if batch.output_file_id:
            dest = tmp_path / "async-out.jsonl"
            assert await hook.adownload_file(batch.output_file_id, dest) == dest.stat().st_size
        server.set_faults(stall_batches=True)
        other = await acreate(hook, tmp_path / "in.jsonl")
        cancelled = await hook.acancel_batch(other.id)
        assert cancelled.state in (BatchState.CANCELLING, BatchState.CANCELLED)
        assert (await await_terminal(hook, other.id)).state is BatchState.CANCELLED
        if dialect in FILE_DIALECTS:
            file_id = batch.input_file_id or ""
            assert (await hook.aget_file(file_id)) is not None
            await hook.adelete_file(file_id)
            with pytest.raises(BatchApiNotFoundError):
                await hook.aget_file(file_id)


@pytest.mark.slow
def test_transfers_keep_memory_flat(live, tmp_path: Path) -> None:
    """A 24 MB file goes up, comes down and is iterated with a small fraction of it in memory."""
    import tracemalloc

    server, hook = live("openai")
    source = tmp_path / "big.jsonl"
    pad = "y" * 1000
    with source.open("wb") as fh:
        for i in range(22_000):
            fh.write(
                orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT, "body": {"p": pad}})
            )
            fh.write(b"\n")
    size = source.stat().st_size
    hook.get_conn()
    tracemalloc.start()
    try:
        file_id = hook.upload_file(source)
        peak_upload = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert hook.download_file(file_id, tmp_path / "copy.jsonl") == size
        peak_download = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert sum(1 for _ in hook.iter_file_lines(file_id)) == 22_000
        peak_iter = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The in-process server shares the traced heap, so these bounds cover client and server.
    for peak in (peak_upload, peak_download, peak_iter):
        assert peak < size / 3, f"peak {peak:,} bytes for a {size:,}-byte file"
    assert (tmp_path / "copy.jsonl").read_bytes() == source.read_bytes()


# ---- vendor conformance (issue #13) ----------------------------------------------------------


async def test_doubleword_results_with_the_default_page_size_yield_every_line(live, tmp_path: Path) -> None:
    # The doubleword server clamps limit to 101 however many are asked for (the default is 1000):
    # a walk that stopped at the first short page would lose 149 of these 250 lines.
    server, hook = live("doubleword")
    ids = write_input(tmp_path / "in.jsonl", n=250)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    batch = wait_terminal(hook, hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT).id)
    before = server.stats()["counters"]["requests"]
    lines = list(hook.iter_results(batch, mode="results_endpoint"))
    assert sorted(line.custom_id for line in lines) == sorted(ids) and all(line.ok for line in lines)
    assert (
        server.stats()["counters"]["requests"] - before == 3
    )  # 101 + 101 + 48, the last says X-Incomplete: false
    alines = [line async for line in hook.aiter_results(batch, mode="results_endpoint")]
    assert sorted(line.custom_id for line in alines) == sorted(ids)


async def test_zerogpu_cancel_of_a_completed_batch_answers_409_and_is_not_retried(
    live, tmp_path: Path
) -> None:
    server, hook = live("zerogpu")
    write_input(tmp_path / "in.jsonl", n=2)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    batch = wait_terminal(hook, hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT).id)
    before = server.stats()["counters"]["requests"]
    assert hook.cancel_batch(batch.id).state is BatchState.COMPLETED
    assert (await hook.acancel_batch(batch.id)).state is BatchState.COMPLETED
    assert server.stats()["counters"]["requests"] - before == 4  # cancel + get, twice; no retry


@pytest.mark.parametrize("dialect", ALL_DIALECTS)
async def test_quota_exhaustion_fails_at_once(live, monkeypatch: pytest.MonkeyPatch, dialect: str) -> None:
    server, _ = live(dialect)
    conn = json.loads(server.connection_json())
    conn["extra"]["headers"] = {"X-Batch-Fault": "quota"}
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_QUOTA", json.dumps(conn))
    hook = BatchApiHook("batch_quota", retry_policy=FAST)
    with pytest.raises(BatchApiQuotaError, match="out of quota") as caught:
        list(hook.list_batches())
    # 429 insufficient_quota (OpenAI's shape), 402 billing_error (Anthropic's), 400
    # ServiceQuotaExceededException (Bedrock's).
    assert caught.value.status_code in (400, 402, 429)
    with pytest.raises(BatchApiQuotaError):
        await hook.aget_batch("batch_x")
    assert server.stats()["counters"]["quota"] == 2  # one request each, never retried


def test_xai_batch_keeps_its_input_file_for_the_orphan_lookup(live, tmp_path: Path) -> None:
    server, hook = live("xai")
    write_input(tmp_path / "in.jsonl", n=2)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    created = hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT, name="run-x")
    assert created.input_file_id == file_id
    assert [b.input_file_id for b in hook.find_batches({"name": "run-x"})] == [file_id]
    # The lookup after a lost create skips a batch made from another file.
    assert made_from(created, file_id) and not made_from(created, "file-other")


def test_xai_cancelled_and_expired_lines_follow_the_vendor_state(live, tmp_path: Path) -> None:
    server, hook = live("xai", faults={"stall_batches": True})
    ids = write_input(tmp_path / "in.jsonl", n=3)
    file_id = hook.upload_file(tmp_path / "in.jsonl")
    batch = hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT)
    hook.cancel_batch(batch.id)
    cancelled = wait_terminal(hook, batch.id)
    assert cancelled.state is BatchState.CANCELLED
    lines = list(hook.iter_results(cancelled))
    assert sorted(line.custom_id for line in lines) == ids
    assert {line.error.code for line in lines if line.error} == {"batch_cancelled"}
    server.set_faults(stall_batches=False, expire_batches=True)
    expiring = hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT)
    ended = wait_terminal(hook, expiring.id)
    # xAI reports no "expired" state: the lines its expiry stopped end as errors (DEADLINE_EXCEEDED).
    assert ended.state is BatchState.COMPLETED and ended.request_counts.failed == 3
    assert {line.error.code for line in hook.iter_results(ended) if line.error} == {"batch_expired"}
