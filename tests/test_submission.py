"""Choosing and using the submission state store (the crash-window behaviour is in tests/reliability)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.staging import resolve_path
from airflow_batch_provider.submission import (
    STATE_RETENTION,
    StateStore,
    SubmitState,
    TaskStateStore,
    choose_state_store,
)


class DictTaskStateStore:
    """The get/set of Airflow's ``context["task_state_store"]``, kept in a dict."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.retentions: dict[str, timedelta | None] = {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def set(self, key: str, value: Any, *, retention: timedelta | None = None) -> None:
        self.values[key] = value
        self.retentions[key] = retention


def _state(**changes: Any) -> SubmitState:
    base = {
        "key": "abp-k-s00000",
        "shard": 0,
        "fingerprint": "f",
        "dag_id": "d",
        "task_id": "t",
        "run_id": "r",
    }
    return SubmitState.model_validate({**base, **changes})


def test_choice_by_capability_and_setting(tmp_path: Path) -> None:
    accessor = DictTaskStateStore()
    directory = resolve_path(str(tmp_path / "submit-state"))
    assert isinstance(choose_state_store({"task_state_store": accessor}, "auto", directory), TaskStateStore)
    assert isinstance(choose_state_store({}, "auto", directory), StateStore)
    # Something without get/set under that name (not Airflow's accessor) is no store.
    assert isinstance(choose_state_store({"task_state_store": object()}, "auto", directory), StateStore)
    assert isinstance(choose_state_store({"task_state_store": accessor}, "file", directory), StateStore)
    with pytest.raises(ConfigurationError, match="no task state store"):
        choose_state_store({}, "task_state_store", directory)
    with pytest.raises(ConfigurationError, match="state_store must be one of"):
        SubmitBatchOperator(task_id="submit", source="x.jsonl", state_store="db")  # type: ignore[arg-type]


def test_task_state_store_round_trip_json_with_retention() -> None:
    accessor = DictTaskStateStore()
    store = TaskStateStore(accessor)
    assert store.read("abp-k-s00000") is None
    store.write(_state(input_file_id="file-1"))
    store.write(_state(input_file_id="file-1", batch_id="batch-1"))
    # One small JSON value per shard key, kept for the chosen retention on every write.
    assert list(accessor.values) == ["abp-k-s00000"]
    assert accessor.values["abp-k-s00000"]["batch_id"] == "batch-1"
    assert accessor.retentions == {"abp-k-s00000": STATE_RETENTION}
    got = store.read("abp-k-s00000")
    assert got is not None and got.batch_id == "batch-1" and got.status == "created"
    accessor.values["abp-bad-s00000"] = {"shard": "not a number"}
    with pytest.raises(ConfigurationError, match="unreadable"):
        store.read("abp-bad-s00000")
