"""``airflow-batch summary``: how a user looks at a results table after the demo (or any merge)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from airflow_batch_provider import demo

ROOT = Path(__file__).resolve().parents[1]


def _run(command: str | list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command) if isinstance(command, str) else command
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["PYTHONPATH"] = str(ROOT)
    env["AIRFLOW_HOME"] = str(cwd / "untouched-airflow-home")
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture
def results_file(tmp_path: Path) -> Path:
    path = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(path)) as conn:
        conn.execute(
            "CREATE TABLE ticket_triage (ticket_id INTEGER, status TEXT, category TEXT, "
            "prompt_tokens INTEGER, completion_tokens INTEGER, total_tokens INTEGER)"
        )
        conn.execute(
            "INSERT INTO ticket_triage VALUES (1, 'succeeded', 'billing', 10, 4, 14), "
            "(2, 'succeeded', 'bug', 12, 5, 17), (3, 'rejected', NULL, NULL, NULL, NULL)"
        )
    return path


def test_the_printed_command_shows_the_results(results_file: Path, tmp_path: Path) -> None:
    hint = demo.summary_hint(results_file, kept=True)
    command = next(line.strip() for line in hint.splitlines() if " summary --duckdb " in line)
    assert str(results_file) in command and "--table ticket_triage" in command
    proc = _run(command, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Results table ticket_triage: 3 row(s)" in out
    assert re.search(r"^  rejected +1$", out, re.M) and re.search(r"^  succeeded +2$", out, re.M)
    assert "Tokens: prompt 22, completion 9, total 31" in out
    assert "ticket_id=1 | status=succeeded | category=billing" in out
    # Reading a DuckDB file needs no Airflow: nothing was created in AIRFLOW_HOME.
    assert not (tmp_path / "untouched-airflow-home").exists()


def test_a_removed_workdir_tells_how_to_keep_it(results_file: Path) -> None:
    hint = demo.summary_hint(results_file, kept=False)
    assert "--keep" in hint and "summary --duckdb DIR/warehouse.duckdb --table ticket_triage" in hint


def test_summary_errors_are_one_line(results_file: Path, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "airflow_batch_provider.cli", "summary"]
    proc = _run([*cli, "--duckdb", str(tmp_path / "none.duckdb")], tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "none.duckdb: No such file" in proc.stderr
    proc = _run([*cli, "--duckdb", str(results_file), "--table", "missing_table"], tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "cannot read table 'missing_table'" in proc.stderr
    # The same through the demo module's own command line.
    demo_cli = [sys.executable, "-m", "airflow_batch_provider.demo", "summary"]
    proc = _run([*demo_cli, "--duckdb", str(tmp_path / "none.duckdb")], tmp_path)
    assert proc.returncode == 1 and "none.duckdb: No such file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run(cli, tmp_path)
    assert proc.returncode == 2 and "--duckdb" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "none.duckdb").exists()


def test_summary_reads_a_connection_stored_in_the_metadata_database(
    results_file: Path, airflow_db: str, tmp_path: Path
) -> None:
    # `airflow connections add` keeps the connection in the metadata database only; the Task SDK
    # reads that database in a process it knows as a server one, as the command line now says.
    from tests.fixtures.airflow import AIRFLOW, airflow_env

    conn_id = f"abp_summary_db_{os.getpid()}"
    # As on a user's Airflow host: no connection in the environment, no unit-test configuration
    # (the suite's unit-test mode points the SDK's metastore lookup at another database).
    env = {
        k: v
        for k, v in airflow_env().items()
        if not k.startswith("AIRFLOW_CONN_") and k != "AIRFLOW__CORE__UNIT_TEST_MODE"
    }
    added = subprocess.run(
        [AIRFLOW, "connections", "add", conn_id, "--conn-type", "duckdb", "--conn-host", str(results_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert added.returncode == 0, added.stderr[-2000:]
    try:
        cli = [sys.executable, "-m", "airflow_batch_provider.cli", "summary"]
        proc = subprocess.run(
            [*cli, "--conn-id", conn_id, "--table", "ticket_triage"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Results table ticket_triage: 3 row(s)" in proc.stdout
    finally:
        subprocess.run([AIRFLOW, "connections", "delete", conn_id], capture_output=True, env=env, timeout=300)
