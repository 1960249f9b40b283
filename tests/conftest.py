"""Test configuration shared by the whole suite.

Airflow reads its settings at import time, so the isolated AIRFLOW_HOME is set here,
before any test module imports airflow. Fixture modules live in ``tests/fixtures/``
(one per area) and are all loaded as plugins, so areas never edit each other's files.

The caller's ``AIRFLOW_HOME``, ``AIRFLOW_CONFIG`` and ``AIRFLOW__*`` settings are ignored: a run
never reads or writes a real Airflow installation. The per-run home is a new temporary
directory, removed when the session ends (``BATCH_TEST_AIRFLOW_HOME`` names one to reuse
instead, which is then left in place).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

for _name in list(os.environ):
    if _name in ("AIRFLOW_HOME", "AIRFLOW_CONFIG") or _name.startswith("AIRFLOW__"):
        del os.environ[_name]

_OWN_HOME = not os.environ.get("BATCH_TEST_AIRFLOW_HOME")
_HOME = os.environ.get("BATCH_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix="abp-airflow-home-")
os.environ["BATCH_TEST_AIRFLOW_HOME"] = _HOME
os.environ["AIRFLOW_HOME"] = _HOME
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "True"
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_HOME}/airflow.db"

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if not p.stem.startswith("_")
)


def pytest_unconfigure() -> None:
    """Remove the per-run AIRFLOW_HOME this session created (nothing is left in the temp folder)."""
    if _OWN_HOME and os.environ.get("BATCH_TEST_AIRFLOW_HOME") == _HOME:
        shutil.rmtree(_HOME, ignore_errors=True)
