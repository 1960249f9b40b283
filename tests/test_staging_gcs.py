"""Staging on Google Cloud Storage without the google provider: ``gs://`` through this provider's
gcsfs filesystem (``fs/gcs.py``), against a GCS emulator reached through an Airflow connection.

A write is published whole or not at all (gcsfs's resumable upload is finalized on close and
cancelled on error), and the pipeline stages every file on ``gs://``.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.fs.gcs import gcs_options, schemes
from tests.fixtures.gcs import GcsStaging
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts

PART = staging.REMOTE_BLOCK_SIZE


def test_gs_is_served_here_when_the_google_provider_is_absent(gcs_staging: GcsStaging) -> None:
    import importlib.util

    assert importlib.util.find_spec("airflow.providers.google") is None
    assert schemes == ["gs", "gcs"]
    path = staging.resolve_path(f"{gcs_staging.root}/run/shard-00000.jsonl")
    assert path.conn_id == "abp_gcs" and not staging.is_local(path)
    assert type(path.fs).__module__ == "gcsfs.core"
    assert staging.resolve_path(str(path.parent / "x")).conn_id == "abp_gcs"


def test_connection_credentials_become_gcsfs_options(tmp_path: Path) -> None:
    key = '{"type": "service_account", "client_email": "a@p.iam.gserviceaccount.com", "private_key": "k"}'
    assert gcs_options(key, {"project": "p"}, "c") == {
        "project": "p",
        "token": orjson.loads(key),
    }
    assert gcs_options(None, {}, "c") == {"token": "google_default"}
    assert gcs_options(None, {"anonymous": "true", "endpoint_url": "http://h:1/"}, "c") == {
        "endpoint_url": "http://h:1",
        "token": "anon",
    }


@pytest.mark.parametrize(
    "size",
    [
        100,
        # The emulator answers the cancel of a resumable session with 501 (not implemented), which
        # gcsfs retries for ~30 s: the session is left unfinished, and nothing is published.
        pytest.param(PART + PART // 2, marks=pytest.mark.slow),
    ],
    ids=["one_request", "resumable"],
)
def test_a_failed_write_publishes_nothing(gcs_staging: GcsStaging, size: int) -> None:
    old = gcs_staging.path("stage", "shard.jsonl")
    staging.write_bytes_atomic(old, b"old content\n")
    targets = [old, gcs_staging.path("stage", "new.jsonl")] if size < PART else [old]
    for target in targets:
        with pytest.raises(RuntimeError, match="boom"), staging.atomic_writer(target) as handle:
            handle.write(b"x" * size)  # past one part: the resumable upload has begun
            raise RuntimeError("boom")
    gc.collect()  # a file object left open would upload on __del__
    assert gcs_staging.keys() == ["stage/shard.jsonl"]
    assert gcs_staging.read("stage/shard.jsonl") == b"old content\n"


def test_a_write_appears_whole_when_it_completes(gcs_staging: GcsStaging) -> None:
    target = gcs_staging.path("stage", "big.jsonl")
    staging.write_bytes_atomic(target, b"old\n")
    data = b"0123456789abcde\n" * ((PART * 2) // 16 + 3)
    with staging.atomic_writer(target) as handle:
        for start in range(0, len(data), 1 << 20):
            handle.write(data[start : start + (1 << 20)])
        assert gcs_staging.read("stage/big.jsonl") == b"old\n"  # chunks sent, nothing published
    assert gcs_staging.read("stage/big.jsonl") == data
    with staging.open_read(target) as handle:
        assert handle.read() == data


async def test_the_pipeline_stages_everything_on_gcs(
    gcs_staging: GcsStaging,
    batch_server: Any,
    sqlite_warehouse: Any,
    task_context: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """build -> submit -> trigger -> merge on a Celery deployment staging on gs://."""
    server = batch_server(dialect="gemini", backend="echo", validate_seconds=300, finalize_seconds=300)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")  # gs:// passes the shared-staging check
    monkeypatch.setenv("AIRFLOW__BATCH_PROVIDER__STAGING_ROOT", f"{gcs_staging.root}/batch-staging")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "home"))
    rows = seed_texts(sqlite_warehouse, "tickets", [f"question {i}" for i in range(20)])
    pipeline = Pipeline(sqlite_warehouse, tmp_path / "unused", task_context)
    build = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "staging_path": None}
    record = await pipeline.run("run-1", "answers", build=build)
    assert record.manifest is not None and record.merge is not None
    prefix = "batch-staging/reliability/run-1/build"
    assert record.manifest["staging_path"] == f"{gcs_staging.root}/{prefix}"
    keys = gcs_staging.keys()
    expected = {f"{prefix}/{name}" for name in ("manifest.json", "shard-00000.jsonl", "keys.jsonl")}
    assert expected <= set(keys), keys
    assert any(k.startswith(f"{prefix}/submit-state/") for k in keys), keys
    assert pipeline.status_counts("answers") == {"succeeded": len(rows)}
    assert not (tmp_path / "home").exists() and not (tmp_path / "unused").exists()
