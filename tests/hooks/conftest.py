"""Fixtures of the hook tests: connections in env vars and hooks over an httpx.MockTransport."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from airflow_batch_provider.constants import CONN_TYPE, DEFAULT_CONN_ID
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.retry import RetryPolicy
from tests.fixtures.hook import FAST, MOCK_URL, SECRET


@pytest.fixture
def batch_conn(monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Define a ``batch_api`` connection in the environment; returns its conn id."""

    def make(
        conn_id: str = DEFAULT_CONN_ID,
        *,
        host: str = MOCK_URL,
        password: str | None = SECRET,
        dialect: str = "openai",
        **extra: Any,
    ) -> str:
        conn: dict[str, Any] = {
            "conn_type": CONN_TYPE,
            "host": host,
            "extra": {"dialect": dialect, **extra},
        }
        if password is not None:
            conn["password"] = password
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
        return conn_id

    return make


@pytest.fixture
def mock_hook(batch_conn: Callable[..., str]) -> Callable[..., BatchApiHook]:
    """A hook whose sync and async clients talk to ``handler`` instead of the network."""

    def make(
        handler: Callable[[httpx.Request], httpx.Response],
        *,
        dialect: str = "openai",
        retry_policy: RetryPolicy | None = FAST,
        **extra: Any,
    ) -> BatchApiHook:
        conn_id = batch_conn("batch_mock", dialect=dialect, **extra)
        transport = httpx.MockTransport(handler)
        return BatchApiHook(
            conn_id, retry_policy=retry_policy, transport=transport, async_transport=transport
        )

    return make


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the hook's retry waits (sync and async) instead of sleeping them."""
    recorded: list[float] = []

    def fake_sleep(seconds: float) -> None:
        recorded.append(seconds)

    async def fake_asleep(seconds: float) -> None:
        recorded.append(seconds)

    import airflow_batch_provider.hooks.batch as batch_module

    monkeypatch.setattr(batch_module.time, "sleep", fake_sleep)
    monkeypatch.setattr(batch_module.asyncio, "sleep", fake_asleep)
    return recorded
