"""The reliability suite's servers take a realistic moment to validate and finalize.

At the shared fixture's default time scale a batch finishes a few milliseconds after it is
created, before a task could defer; the operators then decide it on the worker without a
trigger. These tests are about the deferred path (faults while the trigger polls, a
triggerer restart, the one terminal event), so batches here stay running for ~0.3 s per
phase, as real ones stay running for minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.reliability import Pipeline


@pytest.fixture
def batch_server(batch_server: Any) -> Any:
    def start(*args: Any, **config: Any) -> Any:
        config.setdefault("validate_seconds", 300)
        config.setdefault("finalize_seconds", 300)
        return batch_server(*args, **config)

    return start


@pytest.fixture(params=["postgres", "duckdb"])
def wh_pipeline(request: pytest.FixtureRequest, tmp_path: Path, task_context: Any) -> Pipeline:
    """A pipeline on PostgreSQL and on DuckDB (the test runs once on each)."""
    warehouse = request.getfixturevalue("pg_warehouse" if request.param == "postgres" else "duckdb_warehouse")
    return Pipeline(warehouse, tmp_path / "staging", task_context)
