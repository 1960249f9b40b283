"""Under CI (``CI=true``) a missing database fails the test with a clear message; elsewhere it skips.

A small test module using the real warehouse fixtures runs in a child pytest whose PostgreSQL
and MySQL ports point at a port nothing listens on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
def test_pg(pg_warehouse):
    pass


def test_mysql(mysql_warehouse):
    pass
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_pytest(
    tmp_path: Path,
    ci: str | None,
    probe: str = _PROBE,
    plugins: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_probe.py").write_text(probe)
    port = str(_closed_port())
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("PYTEST")}
    env.update(
        PYTHONPATH=str(ROOT),
        BATCH_TEST_PG_PORT=port,
        BATCH_TEST_MYSQL_PORT=port,
        BATCH_TEST_REDIS_URL=f"redis://127.0.0.1:{port}/5",
        AIRFLOW_HOME=str(tmp_path / "airflow-home"),
        **(env_extra or {}),
    )
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + [arg for plugin in plugins for arg in ("-p", plugin)]
        + ["-p", "tests.fixtures.warehouse", "test_probe.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_missing_databases_fail_under_ci(tmp_path: Path, ci: str) -> None:
    proc = _child_pytest(tmp_path, ci)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "2 errors" in out or "2 failed" in out, out[-3000:]
    assert "PostgreSQL at 127.0.0.1:" in out and "MySQL at 127.0.0.1:" in out
    assert out.count("under CI=true a missing database is a failure, not a skip") >= 2, out[-3000:]
    assert "skipped" not in out


def test_missing_databases_skip_outside_ci(tmp_path: Path) -> None:
    proc = _child_pytest(tmp_path, None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 skipped" in out and "is not reachable" in out


@pytest.mark.parametrize("ci", ["true", None])
def test_missing_redis_fails_under_ci(tmp_path: Path, ci: str | None) -> None:
    """The Celery deployment's broker: under CI a Redis that does not answer fails, elsewhere skips."""
    probe = "def test_redis(celery_broker):\n    pass\n"
    proc = _child_pytest(tmp_path, ci, probe=probe, plugins=("tests.fixtures.workers",))
    out = proc.stdout + proc.stderr
    assert "Redis at redis://127.0.0.1:" in out and "is not reachable" in out, out[-3000:]
    if ci:
        assert proc.returncode == 1 and "1 error" in out and "skipped" not in out, out[-3000:]
    else:
        assert proc.returncode == 0 and "1 skipped" in out, out[-3000:]


EMULATORS = {
    # name: (probe, fixture module, virtualenv variable, install failure, CI failure)
    "s3": (
        "def test_s3(s3_staging):\n    pass\n",
        "tests.fixtures.s3",
        "BATCH_TEST_MOTO_VENV",
        "cannot install moto[server]",
        "under CI=true a missing S3 server is a failure",
    ),
    "bigquery": (
        "def test_bq(bigquery_warehouse):\n    pass\n",
        "tests.fixtures.bigquery",
        "BATCH_TEST_BQEMULATOR_VENV",
        "cannot install bqemulator",
        "under CI=true a missing database is a failure",
    ),
}


@pytest.mark.parametrize("emulator", sorted(EMULATORS))
@pytest.mark.parametrize("ci", ["true", None], ids=["ci", "developer"])
def test_an_emulator_that_cannot_start_fails_under_ci(tmp_path: Path, ci: str | None, emulator: str) -> None:
    """The moto S3 and bqemulator fixtures follow the same rule: a failure under CI, a skip elsewhere."""
    probe, plugin, venv_variable, cannot_install, ci_failure = EMULATORS[emulator]
    # A virtualenv path under a regular file: the emulator can be neither found nor installed there.
    (tmp_path / "not-a-dir").write_text("")
    proc = _child_pytest(
        tmp_path,
        ci,
        probe=probe,
        plugins=(plugin,),
        env_extra={venv_variable: str(tmp_path / "not-a-dir" / "venv")},
    )
    assert cannot_install in proc.stdout, proc.stdout[-3000:]
    if ci:
        assert proc.returncode == 1 and "1 error" in proc.stdout, proc.stdout[-3000:]
        assert ci_failure in proc.stdout
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("ci", ["true", None], ids=["ci", "developer"])
def test_a_snowflake_emulator_that_cannot_start_fails_under_ci(tmp_path: Path, ci: str | None) -> None:
    """The fakesnow fixture too: a failure under CI, a skip elsewhere."""
    (tmp_path / "not-a-dir").write_text("")
    proc = _child_pytest(
        tmp_path,
        ci,
        probe="def test_snowflake(snowflake_warehouse):\n    pass\n",
        plugins=("tests.fixtures.snowflake",),
        env_extra={"BATCH_TEST_FAKESNOW_VENV": str(tmp_path / "not-a-dir" / "venv")},
    )
    assert "cannot install fakesnow[server]" in proc.stdout, proc.stdout[-3000:]
    if ci:
        assert proc.returncode == 1 and "1 error" in proc.stdout, proc.stdout[-3000:]
        assert "under CI=true a missing emulator is a failure" in proc.stdout
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-3000:]
