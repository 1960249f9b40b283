"""docker/: the compose file is valid and wires the deployment the README describes.

There is no Docker engine on the test machines, so nothing is built or started: the
compose file is checked by ``docker-compose config`` (which validates it against the
Compose specification's JSON schema and resolves ``${VAR}`` interpolation from
``docker/.env.example``), then the resolved model is checked service by service.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
AIRFLOW_VERSION = "3.3.2"
AIRFLOW_SERVICES = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
}


def _compose_binary() -> str:
    found = shutil.which("docker-compose")
    if found:
        return found
    message = "docker-compose (Debian package docker-compose) is not installed; .ci/run installs it"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep, f"{ENV_EXAMPLE}:{number}: not NAME=value: {line!r}"
        values[name.strip()] = value.strip()
    return values


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The compose model after validation and interpolation with the example .env."""
    proc = subprocess.run(
        [_compose_binary(), "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"docker-compose config rejected {COMPOSE}:\n{proc.stderr}"
    model = yaml.safe_load(proc.stdout)
    assert isinstance(model, dict)
    return model


def test_compose_requires_every_secret_from_env(tmp_path: Path) -> None:
    """Without a .env, interpolation of a required secret fails with a message naming it."""
    env = {k: v for k, v in os.environ.items() if k not in _env_example()}
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = subprocess.run(
        [_compose_binary(), "-f", str(COMPOSE), "--env-file", str(empty), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert proc.returncode != 0
    assert "docker/.env" in proc.stderr, proc.stderr


def test_services_and_commands(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == {"postgres", "batch-server", "airflow-init", *AIRFLOW_SERVICES}
    for name, command in AIRFLOW_SERVICES.items():
        service = services[name]
        assert service["command"] in (command, [command]), name
        assert service["image"] == "airflow-batch-provider:local", name
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        assert Path(service["build"]["context"]).resolve() == ROOT
        depends = service["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy", name
        assert depends["airflow-init"]["condition"] == "service_completed_successfully", name
        assert "healthcheck" in service, name
    assert services["postgres"]["image"].startswith("postgres:")
    init_script = " ".join(services["airflow-init"]["command"])
    assert "airflow db migrate" in init_script
    seed = re.search(r"python -m airflow_batch_provider\.demo (seed [^\n]*)", init_script)
    assert seed, init_script
    from airflow_batch_provider.demo import build_parser

    args = build_parser().parse_args(seed.group(1).split())
    assert (args.command, args.conn_id) == ("seed", "warehouse")
    assert "AIRFLOW_CONN_WAREHOUSE" in services["airflow-init"]["environment"]


def test_airflow_environment_is_consistent(resolved: dict[str, Any]) -> None:
    """Every AIRFLOW__SECTION__KEY names a real Airflow option; components share secrets and the DB."""
    from airflow.configuration import conf

    environments = [resolved["services"][n]["environment"] for n in AIRFLOW_SERVICES]
    first = environments[0]
    for env in environments[1:]:
        assert env == first
    for name in first:
        match = re.fullmatch(r"AIRFLOW__([A-Z_]+?)__([A-Z_]+)", name)
        if match:
            section, key = match.group(1).lower(), match.group(2).lower()
            options = conf.configuration_description.get(section, {}).get("options", {})
            assert key in options, f"{name}: Airflow has no option [{section}] {key}"
    assert first["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert first["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://airflow:")
    assert first["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith("@postgres:5432/airflow")
    assert first["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"


def test_connections_resolve_to_valid_json(resolved: dict[str, Any]) -> None:
    from airflow_batch_provider.dialects import get_dialect

    env = resolved["services"]["airflow-scheduler"]["environment"]
    batch = orjson.loads(env["AIRFLOW_CONN_BATCH_API_DEFAULT"])
    assert batch["conn_type"] == "batch_api"
    assert batch["host"] == "http://batch-server:8000/v1"
    assert batch["password"] == _env_example()["BATCH_API_KEY"]
    get_dialect(batch["extra"]["dialect"])
    warehouse = orjson.loads(env["AIRFLOW_CONN_WAREHOUSE"])
    assert warehouse["conn_type"] == "postgres"
    assert (warehouse["host"], warehouse["schema"]) == ("postgres", "warehouse")
    assert warehouse["password"] == _env_example()["POSTGRES_PASSWORD"]


def test_batch_server_command_parses_with_the_provider_cli(
    resolved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = resolved["services"]["batch-server"]
    assert service["entrypoint"] == ["airflow-batch"]
    import argparse

    from airflow_batch_provider.server.options import add_arguments, config_from_args

    assert service["command"][0] == "serve"
    parser = argparse.ArgumentParser(prog="airflow-batch serve")
    add_arguments(parser)
    args = parser.parse_args(service["command"][1:])
    assert (args.host, args.port, args.backend) == ("0.0.0.0", 8000, "echo")
    # The key the server demands is the one the Airflow connection sends.
    assert args.api_key_env in service["environment"]
    monkeypatch.setenv(args.api_key_env, service["environment"][args.api_key_env])
    config = config_from_args(args)
    assert config.api_key == _env_example()["BATCH_API_KEY"]
    ports = service["ports"][0]
    assert str(ports["target"]) == "8000"


def test_no_secret_is_written_in_the_repository() -> None:
    """Secret values reach the compose file only through ${VAR} from the git-ignored docker/.env."""
    text = COMPOSE.read_text()
    secret_key = re.compile(r"(PASSWORD|FERNET_KEY|JWT_SECRET|SECRET_KEY|API_KEY)$")
    checked = 0
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if sep and secret_key.search(key.strip()):
            checked += 1
            assert value.strip().startswith("${"), f"{COMPOSE.name}: {key.strip()} is set literally"
    assert checked >= 5
    assert (DOCKER / ".gitignore").read_text().split() == [".env"]
    for name, value in _env_example().items():
        if any(s in name for s in ("PASSWORD", "SECRET", "FERNET", "_KEY")):
            assert value.startswith("CHANGE-ME"), f".env.example: {name} holds a value, not a placeholder"
    # "$${HOSTNAME}" is an escaped dollar: the container's shell expands it, not compose.
    referenced = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", text))
    assert referenced <= set(_env_example()), f"not in .env.example: {referenced - set(_env_example())}"


def test_dockerfile_builds_on_airflow_and_copies_existing_paths() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG AIRFLOW_VERSION={AIRFLOW_VERSION}" in text
    assert "FROM apache/airflow:${AIRFLOW_VERSION}" in text
    assert '"apache-airflow==${AIRFLOW_VERSION}"' in text, "pip must not move Airflow off the image's version"
    copies = re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, flags=re.M)
    assert copies
    for sources in copies:
        for source in sources.split():
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    assert (ROOT / "docker" / "postgres" / "10-warehouse.sql").read_text().count("CREATE DATABASE warehouse")
