"""Staging on object storage, for real: an S3-compatible server (moto) reached through an Airflow connection.

The pipeline writes every file (shards, keys, rejects, manifest, submission state, resubmission
shards) to ``s3://abp_s3@<bucket>/...``; a write that fails half way publishes nothing; a
200 MB shard streams through a bounded buffer.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.dialects import Limits
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts
from tests.fixtures.s3 import S3Staging

PART = staging.REMOTE_BLOCK_SIZE


@pytest.fixture(params=["in_place", "temporary_key"])
def upload_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a remote write stays atomic: an aborted upload, or a temporary key moved into place."""
    if request.param == "temporary_key":
        monkeypatch.setattr(staging, "_PUBLISHED_ON_CLOSE", frozenset())
    return str(request.param)


def test_paths_keep_their_connection(s3_staging: S3Staging) -> None:
    """The connection travels inside the URI, so a string in XCom reaches the same store."""
    path = staging.resolve_path(f"{s3_staging.root}/run/shard-00000.jsonl")
    assert path.conn_id == "abp_s3" and not staging.is_local(path)
    assert str(path.parent) == f"{s3_staging.root}/run"
    assert staging.resolve_path(str(path.parent / "x")).conn_id == "abp_s3"


@pytest.mark.parametrize("size", [100, PART + PART // 2], ids=["one_request", "multipart"])
def test_a_failed_write_publishes_nothing(s3_staging: S3Staging, upload_mode: str, size: int) -> None:
    old = s3_staging.path("stage", "shard.jsonl")
    staging.write_bytes_atomic(old, b"old content\n")
    for target in (old, s3_staging.path("stage", "new.jsonl")):
        with pytest.raises(RuntimeError, match="boom"), staging.atomic_writer(target) as handle:
            handle.write(b"x" * size)  # past one part: the multipart upload has begun
            raise RuntimeError("boom")
    gc.collect()  # a file object left open would upload on __del__
    assert s3_staging.keys() == ["stage/shard.jsonl"]
    assert s3_staging.read("stage/shard.jsonl") == b"old content\n"
    assert s3_staging.uploads_in_progress() == []


def test_a_write_appears_whole_when_it_completes(s3_staging: S3Staging, upload_mode: str) -> None:
    target = s3_staging.path("stage", "big.jsonl")
    staging.write_bytes_atomic(target, b"old\n")
    data = b"0123456789abcde\n" * ((PART * 2) // 16 + 3)
    with staging.atomic_writer(target) as handle:
        for start in range(0, len(data), 1 << 20):
            handle.write(data[start : start + (1 << 20)])
        assert s3_staging.read("stage/big.jsonl") == b"old\n"  # parts uploaded, nothing published
    assert s3_staging.read("stage/big.jsonl") == data
    with staging.open_read(target) as handle:
        assert handle.read() == data
    assert s3_staging.keys() == ["stage/big.jsonl"] and s3_staging.uploads_in_progress() == []


def _peak_rss_reset() -> int | None:
    """Reset this process's peak RSS to its current RSS (Linux); returns it in bytes, None elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _peak_rss()
    except OSError:
        return None


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.slow
def test_a_200_mb_shard_streams_with_flat_memory(s3_staging: S3Staging, figures: Any) -> None:
    """The build's writer sends a 200 MB shard in fixed-size parts: memory does not grow with it."""
    directory = s3_staging.path("big")
    line = orjson.dumps({"custom_id": "c", "method": "POST", "url": "/v1/x", "body": {"t": "y" * 4000}})
    count = (200 << 20) // (len(line) + 1)
    limits = Limits(max_lines=count + 1, max_file_bytes=(200 << 20) + 1)
    staging.write_bytes_atomic(directory / "warm-up", b"x")  # connection and client set up outside the figure
    gc.collect()
    rss_before = _peak_rss_reset()
    tracemalloc.start()
    try:
        with staging.ShardedJsonlWriter(directory, limits) as writer:
            for _ in range(count):
                writer.add(line)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_growth = None if rss_before is None else _peak_rss() - rss_before
    (shard,) = writer.shards
    assert shard.bytes >= 199 << 20
    assert (directory / shard.path).stat()["size"] == shard.bytes
    figures(
        "s3 staging: 200 MB shard written",
        shard_mb=round(shard.bytes / 2**20),
        peak_traced_mb=round(peak / 2**20, 1),
        peak_rss_growth_mb=None if rss_growth is None else round(rss_growth / 2**20, 1),
    )
    # A part being filled, the copy sent, the writer's 1 MB batch: a few parts, never the shard.
    assert peak < 6 * PART, f"peak {peak / 2**20:.1f} MB while writing a {shard.bytes / 2**20:.0f} MB shard"


async def test_the_pipeline_stages_everything_on_s3(
    s3_staging: S3Staging,
    batch_server: Any,
    sqlite_warehouse: Any,
    task_context: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """build -> submit -> trigger -> merge (with resubmission) on a Celery deployment staging on S3."""
    # Batches stay running ~0.3 s per phase, so the submit really defers to the trigger.
    server = batch_server(dialect="openai", backend="echo", validate_seconds=300, finalize_seconds=300)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")  # S3 passes the shared-staging check
    monkeypatch.setenv("AIRFLOW__BATCH_PROVIDER__STAGING_ROOT", f"{s3_staging.root}/batch-staging")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "home"))
    rows = seed_texts(sqlite_warehouse, "tickets", [f"question {i}" for i in range(30)])
    sqlite_warehouse.run("INSERT INTO tickets (id, text) VALUES (31, NULL)")  # a rejected row
    server.set_faults(line_failure_rate=0.3)
    pipeline = Pipeline(sqlite_warehouse, tmp_path / "unused", task_context)
    build = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "staging_path": None}
    record = await pipeline.run("run-1", "answers", build=build, merge={"resubmit_failed": True})

    assert record.manifest is not None and record.merge is not None
    prefix = "batch-staging/reliability/run-1/build"
    assert record.manifest["staging_path"] == f"{s3_staging.root}/{prefix}"
    keys = s3_staging.keys()
    expected = {f"{prefix}/{name}" for name in ("manifest.json", "shard-00000.jsonl", "keys.jsonl")}
    assert expected | {f"{prefix}/rejects.jsonl"} <= set(keys), keys
    assert any(k.startswith(f"{prefix}/submit-state/") for k in keys), keys
    assert record.merge["counts"]["rejected"] == 1
    failed = record.merge["counts"]["failed"]
    assert failed > 0 and record.merge["resubmit_lines"] == failed
    assert record.merge["resubmit_manifest_path"] == f"{s3_staging.root}/{prefix}/attempt-2/manifest.json"
    retry = staging.read_manifest(record.merge["resubmit_manifest_path"])
    assert retry.rows_written == failed and f"{prefix}/attempt-2/{retry.shards[0].path}" in keys
    # Nothing went to local disk.
    assert not (tmp_path / "home").exists() and not (tmp_path / "unused").exists()

    # The resubmission runs from S3 too, and lands every remaining row.
    server.set_faults(line_failure_rate=0.0)
    again = await pipeline.submit_and_wait(record.merge["resubmit_manifest_path"], "run-1", task_id="submit2")
    batches = again.submission or again.xcom.get("return_value")
    second = pipeline.merge(batches, {"manifest_path": record.merge["resubmit_manifest_path"]}, "answers")
    assert second["counts"]["succeeded"] == failed
    statuses = pipeline.status_counts("answers")
    assert statuses == {"succeeded": len(rows), "rejected": 1}
