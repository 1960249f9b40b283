"""Staging helpers: path resolution, atomic writes, manifest round trip, the sharded writer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.dialects import Limits
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.models import Manifest


def test_resolve_path_makes_file_uris(tmp_path: Path) -> None:
    p = staging.resolve_path(tmp_path / "a")
    assert str(p) == f"file://{tmp_path}/a" and staging.is_local(p)
    assert str(staging.resolve_path(f"file://{tmp_path}/b")) == f"file://{tmp_path}/b"
    assert staging.resolve_path(p) is p
    assert staging.safe_segment("manual__2026-01-01T00:00:00+00:00") == "manual__2026-01-01T00_00_00_00_00"


def test_atomic_writer_publishes_only_on_success(tmp_path: Path) -> None:
    target = staging.resolve_path(tmp_path / "f.txt")
    staging.write_bytes_atomic(target, b"old")
    with pytest.raises(RuntimeError), staging.atomic_writer(target) as fh:
        fh.write(b"half")
        raise RuntimeError("boom")
    assert (tmp_path / "f.txt").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temp file left
    with staging.atomic_writer(target) as fh:
        fh.write(b"new")
        assert (tmp_path / "f.txt").read_bytes() == b"old"  # not visible before close
    assert (tmp_path / "f.txt").read_bytes() == b"new"


def test_manifest_round_trip(tmp_path: Path) -> None:
    manifest = Manifest(endpoint="/v1/embeddings", key_columns=["id"], key_types=["integer"], rows_read=3)
    written = staging.write_manifest(tmp_path, manifest)
    assert str(written) == f"file://{tmp_path}/manifest.json"
    assert staging.read_manifest(tmp_path) == manifest
    assert staging.read_manifest(written) == manifest
    assert str(staging.staging_dir_of(written)) == f"file://{tmp_path}"


def test_sharded_writer_respects_both_limits(tmp_path: Path) -> None:
    directory = staging.resolve_path(tmp_path)
    limits = Limits(max_lines=3, max_file_bytes=25, max_line_bytes=10)
    with staging.ShardedJsonlWriter(directory, limits, endpoint="/v1/x") as writer:
        indexes = [writer.add(b"x" * n) for n in (4, 4, 4, 4, 9, 9, 9, 1)]
    # 3 lines max; 25 bytes max: 5 + 10 + 10 fills shard 1 exactly, the next 10 starts shard 2.
    assert indexes == [0, 0, 0, 1, 1, 1, 2, 2]
    shards = writer.shards
    assert [(s.lines, s.bytes) for s in shards] == [(3, 15), (3, 25), (2, 12)]
    for s in shards:
        data = (tmp_path / s.path).read_bytes()
        assert len(data) == s.bytes and s.fingerprint == hashlib.sha256(data).hexdigest()
        assert s.endpoint == "/v1/x"
    with pytest.raises(ValueError, match="does not fit"):
        staging.ShardedJsonlWriter(directory, limits).add(b"x" * 11)


def test_sharded_writer_discards_the_open_shard_on_error(tmp_path: Path) -> None:
    directory = staging.resolve_path(tmp_path)
    with pytest.raises(RuntimeError), staging.ShardedJsonlWriter(directory, Limits(max_lines=2)) as writer:
        for _ in range(3):
            writer.add(b"{}")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.jsonl"]


def test_model_shard_writer_gives_each_model_shards_of_its_own(tmp_path: Path) -> None:
    # Interleaved models, each past the per-shard line limit: every shard holds one model, the
    # numbering is one sequence with no gap, and the shards come back in index order.
    directory = staging.resolve_path(tmp_path)
    lines = [(f"{m}{i}".encode(), m) for i in range(5) for m in ("a", "b", None)]
    with staging.ModelShardWriter(directory, Limits(max_lines=2), endpoint="/v1/x") as writer:
        placed = [(writer.add(line, model), model) for line, model in lines]
    shards = writer.shards
    assert [s.index for s in shards] == list(range(9)) and sum(s.lines for s in shards) == 15
    for shard in shards:
        models = {model for index, model in placed if index == shard.index}
        assert len(models) == 1
        data = (tmp_path / shard.path).read_bytes()
        assert data.count(b"\n") == shard.lines == 2 - (shard.index >= 6)
        assert shard.fingerprint == hashlib.sha256(data).hexdigest()
    with (
        pytest.raises(staging.TooManyModelsError, match="more than 2 models"),
        staging.ModelShardWriter(directory, Limits(), max_models=2) as writer,
    ):
        for model in ("a", "b", "c"):
            writer.add(b"{}", model)


def test_remove_stale_shards(tmp_path: Path) -> None:
    for name in ("shard-00000.jsonl", "shard-00001.jsonl", "keys.jsonl"):
        (tmp_path / name).write_bytes(b"")
    removed = staging.remove_stale_shards(staging.resolve_path(tmp_path), {"shard-00000.jsonl"})
    assert removed == ["shard-00001.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.jsonl", "shard-00000.jsonl"]


# ---- staging_root and the shared-staging check ---------------------------------------------------


def test_staging_root_comes_from_the_provider_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_BATCH_STAGING_ROOT", raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "home"))
    assert staging.staging_root() == f"file://{tmp_path}/home/batch-staging"
    monkeypatch.setenv("AIRFLOW__BATCH_PROVIDER__STAGING_ROOT", "s3://aws_prod@bucket/staging")
    assert staging.staging_root() == "s3://aws_prod@bucket/staging"


@pytest.mark.parametrize(
    ("setting", "remote"),
    [
        ("LocalExecutor", []),
        ("SequentialExecutor", []),
        ("airflow.executors.local_executor.LocalExecutor", []),
        ("CeleryExecutor", ["CeleryExecutor"]),
        ("LocalExecutor,KubernetesExecutor", ["KubernetesExecutor"]),
        ("edge:x.EdgeExecutor", ["edge:x.EdgeExecutor"]),
        ("LocalExecutor;team1=CeleryExecutor", ["CeleryExecutor"]),
        ("my.company.ExecutorOfOurOwn", ["my.company.ExecutorOfOurOwn"]),
    ],
)
def test_remote_executors(setting: str, remote: list[str]) -> None:
    assert staging.remote_executors(setting) == remote


def test_local_staging_fails_at_once_on_a_distributed_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = staging.resolve_path(tmp_path / "stage")
    remote = staging.resolve_path("s3://aws_prod@bucket/stage")
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    staging.check_shared(local)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    staging.check_shared(remote)
    with pytest.raises(ConfigurationError) as caught:
        staging.check_shared(local)
    message = str(caught.value)
    assert "CeleryExecutor" in message and str(local) in message
    assert "AIRFLOW__BATCH_PROVIDER__STAGING_ROOT" in message and "s3://" in message
    monkeypatch.setenv("AIRFLOW__BATCH_PROVIDER__LOCAL_STAGING_IS_SHARED", "True")  # an NFS mount
    staging.check_shared(local)
