"""The package is a real Airflow provider: discovered by the CLI with its connection type and form."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from airflow_batch_provider.get_provider_info import get_provider_info


def _airflow(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "airflow", *args],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.slow
def test_airflow_cli_lists_the_provider_and_its_connection_type() -> None:
    providers = _airflow("providers", "list", "--output", "json")
    assert "airflow-batch-provider" in providers
    hooks = _airflow("providers", "hooks", "--output", "json")
    assert "batch_api" in hooks
    assert "airflow_batch_provider.hooks.batch.BatchApiHook" in hooks


def test_provider_info_modules_import() -> None:
    import importlib

    info = get_provider_info()
    modules = [
        m
        for kind in ("hooks", "operators", "sensors", "triggers")
        for e in info[kind]
        for m in e["python-modules"]
    ]
    for module in modules:
        importlib.import_module(module)
    # The Batch API connection (the other one is the BigQuery warehouse's).
    (conn,) = [c for c in info["connection-types"] if c["connection-type"] != "bigquery"]
    hook_module, _, hook_class = conn["hook-class-name"].rpartition(".")
    hook = getattr(importlib.import_module(hook_module), hook_class)
    assert hook.conn_type == conn["connection-type"] == "batch_api"
    from airflow_batch_provider.dialects import DIALECTS

    assert conn["conn-fields"]["dialect"]["schema"]["enum"] == sorted(DIALECTS)
