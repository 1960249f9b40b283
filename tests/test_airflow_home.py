"""The suite runs in an AIRFLOW_HOME of its own, ignores the caller's, and removes it at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_home_is_the_runs_own() -> None:
    from airflow.configuration import AIRFLOW_HOME, conf

    home = os.environ["AIRFLOW_HOME"]
    assert home == os.environ["BATCH_TEST_AIRFLOW_HOME"] == AIRFLOW_HOME
    assert conf.get("database", "sql_alchemy_conn") == f"sqlite:///{home}/airflow.db"
    assert not os.environ.get("AIRFLOW_CONFIG") or os.environ["AIRFLOW_CONFIG"].startswith(home)
    if not os.environ.get("ABP_PROBE_CHILD"):
        return
    # In the child session below: the home is a fresh directory in the (child's) temp folder.
    assert Path(home).parent == Path(tempfile.gettempdir())
    assert Path(home).name.startswith("abp-airflow-home-")


def test_a_session_ignores_the_callers_home_and_leaves_nothing_behind(tmp_path: Path) -> None:
    caller_home = tmp_path / "callers-airflow-home"
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BATCH_TEST", "PYTEST"))}
    env.update(
        AIRFLOW_HOME=str(caller_home),
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{caller_home}/airflow.db",
        TMPDIR=str(temp),
        ABP_PROBE_CHILD="1",
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["tests/test_airflow_home.py::test_home_is_the_runs_own"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout
    assert not caller_home.exists()
    assert sorted(p.name for p in temp.iterdir()) == []
