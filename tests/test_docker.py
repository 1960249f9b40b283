"""docker/: the compose file is valid and wires the deployment docs/examples-and-docker.md describes.

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
CELERY = DOCKER / "docker-compose.celery.yaml"
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


def _compose_config(*files: Path, env_file: Path = ENV_EXAMPLE, env: dict[str, str] | None = None) -> Any:
    """``docker-compose -f FILE... --env-file ENV config``, run to completion."""
    options = [arg for f in files for arg in ("-f", str(f))]
    return subprocess.run(
        [_compose_binary(), *options, "--env-file", str(env_file), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def _resolve(*files: Path) -> dict[str, Any]:
    proc = _compose_config(*files)
    assert proc.returncode == 0, f"docker-compose config rejected {files}:\n{proc.stderr}"
    model = yaml.safe_load(proc.stdout)
    assert isinstance(model, dict)
    return model


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The compose model after validation and interpolation with the example .env."""
    return _resolve(COMPOSE)


@pytest.fixture(scope="module")
def celery() -> dict[str, Any]:
    """The CeleryExecutor variant: the base file with docker-compose.celery.yaml over it."""
    return _resolve(COMPOSE, CELERY)


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, CELERY)], ids=["local", "celery"])
def test_compose_requires_every_secret_from_env(tmp_path: Path, files: tuple[Path, ...]) -> None:
    """Without a .env, interpolation of a required secret fails with a message naming it."""
    env = {k: v for k, v in os.environ.items() if k not in _env_example()}
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = _compose_config(*files, env_file=empty, env=env)
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


def _check_airflow_options(env: dict[str, str]) -> None:
    """Every AIRFLOW__SECTION__KEY of ``env`` names a real Airflow (or provider) option."""
    from airflow.configuration import conf

    for name in env:
        match = re.fullmatch(r"AIRFLOW__([A-Z_]+?)__([A-Z_]+)", name)
        if match:
            section, key = match.group(1).lower(), match.group(2).lower()
            options = conf.configuration_description.get(section, {}).get("options", {})
            assert key in options, f"{name}: Airflow has no option [{section}] {key}"


def test_airflow_environment_is_consistent(resolved: dict[str, Any]) -> None:
    """Every AIRFLOW__SECTION__KEY names a real Airflow option; components share secrets and the DB."""
    environments = [resolved["services"][n]["environment"] for n in AIRFLOW_SERVICES]
    first = environments[0]
    for env in environments[1:]:
        assert env == first
    _check_airflow_options(first)
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
    # The host the Airflow connection names is one the server answers (it refuses other names).
    from urllib.parse import urlsplit

    from airflow_batch_provider.server.hosts import allowed_hosts, host_of

    env = resolved["services"]["airflow-scheduler"]["environment"]
    batch_host = urlsplit(orjson.loads(env["AIRFLOW_CONN_BATCH_API_DEFAULT"])["host"]).hostname or ""
    assert batch_host == "batch-server"
    assert host_of(batch_host) in allowed_hosts(config.host, config.allowed_hosts)
    ports = service["ports"][0]
    assert str(ports["target"]) == "8000"


@pytest.mark.parametrize("compose", [COMPOSE, CELERY], ids=["local", "celery"])
def test_no_secret_is_written_in_the_repository(compose: Path) -> None:
    """Secret values reach the compose file only through ${VAR} from the git-ignored docker/.env."""
    text = compose.read_text()
    secret_key = re.compile(r"(PASSWORD|FERNET_KEY|JWT_SECRET|SECRET_KEY|API_KEY)$")
    checked = 0
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if sep and secret_key.search(key.strip()):
            checked += 1
            assert value.strip().startswith("${"), f"{compose.name}: {key.strip()} is set literally"
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


# ---- the CeleryExecutor variant ------------------------------------------------------------------

CELERY_WORKERS = ("airflow-worker-1", "airflow-worker-2")


def test_celery_variant_adds_broker_store_and_two_workers(celery: dict[str, Any]) -> None:
    services = celery["services"]
    base = {"postgres", "batch-server", "airflow-init", *AIRFLOW_SERVICES}
    assert set(services) == base | {"redis", "minio", "minio-init", *CELERY_WORKERS}
    assert services["redis"]["image"].startswith("redis:")
    assert services["minio"]["image"].startswith("minio/minio")
    for name in (*AIRFLOW_SERVICES, *CELERY_WORKERS):
        depends = services[name]["depends_on"]
        assert depends["redis"]["condition"] == "service_healthy", name
        assert depends["minio-init"]["condition"] == "service_completed_successfully", name
        assert depends["airflow-init"]["condition"] == "service_completed_successfully", name
    for name in CELERY_WORKERS:
        worker = services[name]
        assert worker["command"] == ["celery", "worker"], name
        assert worker["image"] == "airflow-batch-provider:local"
        assert "inspect ping" in " ".join(worker["healthcheck"]["test"])


def test_celery_variant_stages_on_object_storage(celery: dict[str, Any]) -> None:
    """Every component and worker shares one environment: Celery on Redis, staging on MinIO."""
    from airflow_batch_provider import staging

    services = celery["services"]
    env = services["airflow-scheduler"]["environment"]
    for name in (*AIRFLOW_SERVICES, *CELERY_WORKERS):
        assert services[name]["environment"] == env, f"{name} differs from airflow-scheduler"
    _check_airflow_options(env)
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert staging.remote_executors(env["AIRFLOW__CORE__EXECUTOR"]) == ["CeleryExecutor"]
    assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://redis:6379/0"
    root = staging.resolve_path(env["AIRFLOW__BATCH_PROVIDER__STAGING_ROOT"])
    assert (root.protocol, root.conn_id, root.bucket) == ("s3", "minio", "batch-staging")
    staging.check_shared(root)  # object storage: the shared-staging check lets it through
    connection = orjson.loads(env["AIRFLOW_CONN_MINIO"])
    assert connection["conn_type"] == "aws"
    assert connection["extra"]["endpoint_url"] == "http://minio:9000"
    minio = services["minio"]["environment"]
    assert (connection["login"], connection["password"]) == (
        minio["MINIO_ROOT_USER"],
        minio["MINIO_ROOT_PASSWORD"],
    )
    assert connection["password"] == _env_example()["MINIO_ROOT_PASSWORD"]
    init_script = " ".join(services["minio-init"]["command"])
    assert f"mc mb --ignore-existing staging/{root.bucket}" in init_script


def test_dockerfile_installs_what_the_celery_variant_runs() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert "apache-airflow-providers-celery" in text
    extras = re.search(r'"/opt/provider\[([a-z0-9,]+)\]"', text)
    assert extras and "s3" in extras.group(1).split(",")


def test_celery_variant_points_at_bedrock_by_configuration_alone(tmp_path: Path) -> None:
    """docker/.env alone turns the Celery deployment to Amazon Bedrock: the connection signs with
    SigV4 (keys from the env file), names the service role and region, and stages on real S3."""
    from airflow.models.connection import Connection

    from airflow_batch_provider import staging
    from airflow_batch_provider.hooks.settings import settings_from_connection

    values = {
        **_env_example(),
        "BATCH_API_DIALECT": "bedrock",
        "BATCH_API_BASE_URL": "https://bedrock.eu-west-1.amazonaws.com",
        "BATCH_API_LOGIN": "AKIAEXAMPLEKEYID",
        "BATCH_API_KEY": "example-secret-key",
        "BEDROCK_ROLE_ARN": "arn:aws:iam::123456789012:role/bedrock-batch",
        "BEDROCK_REGION": "eu-west-1",
        "BATCH_STAGING_ROOT": "s3://aws_default@my-bucket/batch-staging",
    }
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    proc = _compose_config(COMPOSE, CELERY, env_file=env_file)
    assert proc.returncode == 0, proc.stderr
    env = yaml.safe_load(proc.stdout)["services"]["airflow-worker-1"]["environment"]
    conn = Connection.from_json(env["AIRFLOW_CONN_BATCH_API_DEFAULT"], conn_id="batch_api_default")
    settings = settings_from_connection("batch_api_default", conn, conn.extra_dejson, conn_type="batch_api")
    dialect = settings.dialect
    assert dialect.name == "bedrock" and settings.base_url == "https://bedrock.eu-west-1.amazonaws.com"
    assert (dialect.region, dialect.role_arn) == ("eu-west-1", values["BEDROCK_ROLE_ARN"])  # type: ignore[attr-defined]
    assert settings.auth is not None and settings.auth.credentials.aws_conn_id is None  # type: ignore[attr-defined]
    root = staging.resolve_path(env["AIRFLOW__BATCH_PROVIDER__STAGING_ROOT"])
    assert (root.protocol, root.bucket) == ("s3", "my-bucket")
    dialect.check_staging(root)
