"""``airflow-batch serve`` starts a server and prints the URL to use."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx
import pytest

from airflow_batch_provider.server import options


def test_options_build_the_config(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    monkeypatch.setenv("MY_SERVER_KEY", "sk-abc")
    args = parser.parse_args(
        [
            "--dialect", "xai", "--data-dir", str(tmp_path), "--time-scale", "0.01",
            "--api-key-env", "MY_SERVER_KEY",
            "--fault-429", "0.25", "--fault-line-failure", "0.1", "--stall-batches", "--max-lines", "10",
        ]
    )  # fmt: skip
    config = options.config_from_args(args)
    assert config.dialect == "xai"
    assert config.api_key == "sk-abc"
    assert config.time_scale == 0.01
    assert config.faults.rate_429 == 0.25
    assert config.faults.line_failure_rate == 0.1
    assert config.faults.stall_batches is True
    assert config.limits().max_lines == 10


def test_missing_key_variable_is_refused(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    monkeypatch.delenv("NOT_SET_KEY", raising=False)
    with pytest.raises(SystemExit, match="NOT_SET_KEY"):
        options.config_from_args(
            parser.parse_args(["--data-dir", str(tmp_path), "--api-key-env", "NOT_SET_KEY"])
        )


def test_serve_command_prints_the_url_and_serves(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "SERVE_TEST_KEY": "sk-cli"}
    cmd = [
        sys.executable,
        "-m",
        "airflow_batch_provider.cli",
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
    ]
    cmd += ["--dialect", "doubleword", "--api-key-env", "SERVE_TEST_KEY"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        # Importing the package may make Airflow log a line first; the banner follows.
        first = ""
        for _ in range(50):
            first = proc.stdout.readline()
            if "Local batch server" in first or not first:
                break
        assert "http://127.0.0.1:" in first and "/v1" in first, first
        url = first.split(" at ", 1)[1].split()[0]
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(f"{url}/batches", headers={"Authorization": "Bearer sk-cli"})
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert response.status_code == 200
        assert httpx.get(f"{url}/batches").status_code == 401
        assert "sk-cli" not in first
    finally:
        proc.terminate()
        proc.wait(timeout=20)
