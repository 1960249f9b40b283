"""Test configuration shared by the whole suite.

Airflow reads its settings at import time, so the isolated AIRFLOW_HOME is set here,
before any test module imports airflow. Fixture modules live in ``tests/fixtures/``
(one per area) and are all loaded as plugins, so areas never edit each other's files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_HOME = os.environ.get("BATCH_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix="abp-airflow-home-")
os.environ["BATCH_TEST_AIRFLOW_HOME"] = _HOME
os.environ.setdefault("AIRFLOW_HOME", _HOME)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_HOME}/airflow.db")

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if not p.stem.startswith("_")
)
