"""The ``batch_api`` connection form and connection test in a real Airflow 3 api-server.

The form's fields and per-dialect hints reach the UI through ``GET /ui/connections/hook_meta``
(what the React connection form renders from); ``POST /api/v2/connections/test`` (with ``[core]
test_connection = Enabled``) runs the hook's ``test_connection`` inside the api-server against a
live local batch server and answers its reachable / authenticated / dialect checks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from airflow_batch_provider.dialects import DIALECTS
from tests.fixtures.e2e import AirflowCluster

pytestmark = pytest.mark.slow

API_KEY = "sk-form-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A keyed local server in the OpenAI dialect and an open one speaking xAI."""
    from airflow_batch_provider.server.background import BackgroundServer
    from airflow_batch_provider.server.config import ServerConfig

    def config(name: str, dialect: str, key: str | None) -> ServerConfig:
        return ServerConfig(
            port=0, data_dir=tmp_path_factory.mktemp(name), dialect=dialect, backend="echo", api_key=key
        )

    with (
        BackgroundServer(config("form-openai", "openai", API_KEY)) as openai,
        BackgroundServer(config("form-xai", "xai", None)) as xai,
    ):
        yield {"openai": openai, "xai": xai}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowCluster]:
    dags = tmp_path_factory.mktemp("form-dags")
    env = {"AIRFLOW__CORE__TEST_CONNECTION": "Enabled"}
    with AirflowCluster(tmp_path_factory.mktemp("airflow-home"), dags, env=env) as running:
        yield running


def _ui(cluster: AirflowCluster) -> httpx.Client:
    token = cluster.client.headers["Authorization"]
    return httpx.Client(base_url=cluster.base_url, headers={"Authorization": token}, timeout=60)


def test_hook_meta_carries_the_fields_and_per_dialect_hints(cluster: AirflowCluster) -> None:
    with _ui(cluster) as ui:
        response = ui.get("/ui/connections/hook_meta")
    assert response.status_code == 200, response.text
    entry = next(m for m in response.json() if m["connection_type"] == "batch_api")
    assert entry["hook_class_name"] == "airflow_batch_provider.hooks.batch.BatchApiHook"
    standard = entry["standard_fields"]
    assert standard["host"]["title"] == "Base URL" and "api.openai.com/v1" in standard["host"]["placeholder"]
    assert standard["password"]["title"] == "API key"
    assert standard["port"]["hidden"] and standard["login"]["hidden"] and standard["url_schema"]["hidden"]
    extra = entry["extra_fields"]
    assert set(extra) >= {"dialect", "project", "organization", "headers", "timeout", "max_retries"}
    dialect = extra["dialect"]
    # Every registered dialect is offered, each with its default base URL in the hint.
    assert dialect["schema"]["enum"] == sorted(DIALECTS)
    # Fields a single dialect reads come from that dialect (Azure's API version, auth, expiry).
    assert set(extra) >= {"api_version", "auth", "tenant_id", "client_id", "file_expiry_seconds"}
    hint = dialect["description"]
    for cls in DIALECTS.values():
        assert cls.default_base_url in hint
    assert "zerogpu = ZeroGPU (https://api.zerogpu.ai/v1, needs 'project')" in hint
    assert "required for zerogpu" in extra["project"]["description"]


def _test(cluster: AirflowCluster, host: str, password: str, dialect: str) -> dict[str, Any]:
    body = {
        "connection_id": f"form_test_{uuid.uuid4().hex[:8]}",
        "conn_type": "batch_api",
        "host": host,
        "password": password,
        "extra": json.dumps({"dialect": dialect}),
    }
    response = cluster.client.post("/connections/test", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_connection_test_reports_its_checks_from_the_api_server(
    cluster: AirflowCluster, servers: dict[str, Any]
) -> None:
    good = _test(cluster, servers["openai"].base_url, API_KEY, "openai")
    assert good["status"] is True, good
    assert "reachable: yes (HTTP 200)" in good["message"] and "authenticated: yes" in good["message"]
    assert "dialect: yes (openai: the batch listing parses)" in good["message"]

    wrong = _test(cluster, servers["openai"].base_url, "sk-wrong-31337", "openai")
    assert wrong["status"] is False
    assert "authenticated: NO" in wrong["message"] and "sk-wrong-31337" not in wrong["message"]

    mismatched = _test(cluster, servers["xai"].base_url, "sk-any", "openai")
    assert mismatched["status"] is False
    assert "dialect: NO" in mismatched["message"] and "it looks like 'xai'" in mismatched["message"]
