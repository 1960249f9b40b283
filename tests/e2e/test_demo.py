"""The README's first command, ``scripts/demo``, and the sample data behind it.

``scripts/demo`` is ``scripts/bootstrap`` (environment) followed by
``python -m airflow_batch_provider.demo run``; the environment already exists under the test
suite, so the test runs the second half exactly as the script does, on a small table.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_batch_provider import demo

ROOT = Path(__file__).resolve().parents[2]


def test_sample_data_is_deterministic_and_has_rejectable_rows() -> None:
    first = list(demo.sample_tickets(200))
    assert first == list(demo.sample_tickets(200))
    assert [t[0] for t in first] == list(range(1, 201))
    empty = [t[0] for t in first if t[2] is None]
    assert empty == [97, 194]
    products = list(demo.sample_products(50))
    assert len({p[1] for p in products}) == 50
    assert all(p[3] and p[4] > 0 for p in products)


def test_seed_and_summary_on_sqlite(sqlite_warehouse: object) -> None:
    from tests.fixtures.warehouse import Warehouse

    assert isinstance(sqlite_warehouse, Warehouse)
    assert demo.seed_warehouse(sqlite_warehouse.conn_id, tickets=30, products=5) == {
        "support_tickets": 30,
        "products": 5,
    }
    # Seeding again replaces the tables instead of duplicating rows.
    demo.seed_warehouse(sqlite_warehouse.conn_id, tickets=30, products=5)
    assert sqlite_warehouse.rows("SELECT COUNT(*) FROM support_tickets") == [(30,)]
    sqlite_warehouse.run(
        [
            "CREATE TABLE results (ticket_id INTEGER, custom_id TEXT, status TEXT, prompt_tokens INTEGER, "
            "completion_tokens INTEGER, total_tokens INTEGER)",
            "INSERT INTO results VALUES (2, 'c2', 'succeeded', 10, 5, 15), "
            "(1, 'c1', 'rejected', NULL, NULL, NULL)",
        ]
    )
    summary = demo.results_summary(sqlite_warehouse.conn_id, "results", sample=1)
    assert summary["counts"] == {"rejected": 1, "succeeded": 1}
    assert (summary["prompt_tokens"], summary["completion_tokens"], summary["total_tokens"]) == (10, 5, 15)
    assert summary["sample"][0]["ticket_id"] == 1
    text = demo.format_summary(summary)
    assert "Results table results: 2 row(s)" in text and "succeeded" in text


@pytest.mark.slow
def test_demo_command_runs_example_1_and_prints_the_summary(tmp_path: Path) -> None:
    script = (ROOT / "scripts" / "demo").read_text()
    assert "scripts/bootstrap" in script and "airflow_batch_provider.demo run" in script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BATCH_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_batch_provider.demo", "run", "--tickets", "60"]
        + ["--workdir", str(tmp_path / "demo")],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    out = proc.stdout
    assert "Local batch server (echo backend, offline)" in out
    assert "Local batch server stopped" in out
    assert "Results table ticket_triage: 60 row(s)" in out
    assert re.search(r"^\s+succeeded\s+60$", out, flags=re.M), out
    tokens = re.search(r"Tokens: prompt (\d+), completion (\d+), total (\d+)", out)
    assert tokens and int(tokens.group(3)) == int(tokens.group(1)) + int(tokens.group(2)) > 0
    assert "ticket_id=1 | status=succeeded | category=" in out
    # The demo ends with the command that shows the results again; it works as printed.
    command = out.rstrip().splitlines()
    shown = [line.strip() for line in command if " summary --duckdb " in line]
    assert shown and str(tmp_path / "demo" / "warehouse.duckdb") in shown[-1], out[-2000:]
    again = subprocess.run(
        shlex.split(shown[-1]),
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Results table ticket_triage: 60 row(s)" in again.stdout
