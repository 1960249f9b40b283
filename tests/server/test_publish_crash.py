"""A crash at any step of publishing a batch's results never turns an answered batch into `failed`.

Each test runs a server in a subprocess whose environment names one publishing step; the
process dies (``os._exit``) right after that step. A new server on the same data directory
must finish the batch as ``completed`` with every line in its output or error file.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from airflow_batch_provider.server.config import ServerConfig
from airflow_batch_provider.server.engine import CRASH_ENV, CRASH_STEPS
from tests.fixtures.server import SubprocessServer
from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for

LINES = 20
FAULTS = {"line_failure_rate": 0.3}  # some lines fail, so both files are published


@pytest.mark.parametrize("step", ["publish_output_moved"])
def test_restart_after_the_process_dies_while_publishing(batch_server, tmp_path, step):
    config = ServerConfig(port=0, data_dir=tmp_path, time_scale=0.001, faults=FAULTS)
    with SubprocessServer(config, env={CRASH_ENV: step}) as proc:
        with httpx.Client(base_url=proc.base_url, timeout=10) as client:
            file_id = upload(client, jsonl(chat_line(i) for i in range(LINES)))
            batch_id = create(client, file_id)["id"]
        assert proc.proc.wait(timeout=60) == 86, "the server did not crash at the step"
    _check_recovery(batch_server(data_dir=tmp_path, faults=FAULTS), tmp_path, file_id, batch_id)


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_restart_after_a_crash_at_each_publishing_step(batch_server, tmp_path, monkeypatch, step):
    """Every step, in-process: the batch's task stops dead at the step, then the server restarts."""
    monkeypatch.setenv(CRASH_ENV, f"{step}:raise")
    server = batch_server(data_dir=tmp_path, faults=FAULTS)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(LINES)))
        batch_id = create(client, file_id)["id"]
        deadline = time.monotonic() + 30
        while not server.stats()["counters"].get("simulated_crashes"):
            assert time.monotonic() < deadline, "the batch never reached the crash step"
            time.sleep(0.02)
        stuck = client.get(f"/batches/{batch_id}").json()
    assert stuck["status"] == "finalizing", stuck
    monkeypatch.delenv(CRASH_ENV)
    server.restart()
    _check_recovery(server, tmp_path, file_id, batch_id)


def _check_recovery(server, tmp_path, file_id, batch_id):
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        done = wait_for(client, batch_id)
        outputs = read_lines(client, done["output_file_id"])
        errors = read_lines(client, done["error_file_id"])
        listed = {f["id"] for f in client.get("/files").json()["data"]}
    assert done["status"] == "completed", done
    counts = done["request_counts"]
    assert counts["total"] == LINES
    assert 0 < counts["failed"] < LINES
    assert (len(outputs), len(errors)) == (counts["completed"], counts["failed"])
    seen = Counter(line["custom_id"] for line in outputs + errors)
    assert seen == Counter(f"req-{i}" for i in range(LINES))
    # Nothing is left behind: the three files are recorded, no work file remains.
    assert listed == {file_id, done["output_file_id"], done["error_file_id"]}
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(listed)
    assert list((tmp_path / "work").iterdir()) == []
