"""``scripts/bootstrap`` changes nothing outside the checkout, and ``.ci/run`` cannot pass by skipping.

bootstrap runs for real in a copy of ``scripts/`` with recording stand-ins first on PATH for
``apt-get``, ``pip``, ``pkg-config``, ``uv`` and the Python interpreter, so every command it
would run on the machine is in the log and nothing is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_RECORD = '#!/usr/bin/env bash\necho "{name} $*" >> "$SHIM_LOG"\n'
# `-m venv DIR` / `uv venv DIR` make DIR/bin/python, a recorder whose `-m pip install ... uv` adds DIR/bin/uv.
_MAKE_VENV = 'mkdir -p "$1/bin" && cp "$SHIM_TEMPLATES/python" "$1/bin/python"\n'
_VENV_PYTHON = 'case "$*" in *"pip install"*uv) cp "$SHIM_TEMPLATES/uv" "$(dirname "$0")/uv";; esac\n'


def _shim(directory: Path, name: str, body: str = "", label: str | None = None) -> None:
    path = directory / name
    path.write_text(_RECORD.format(name=label or name) + body)
    path.chmod(0o755)


def _run_bootstrap(
    tmp_path: Path, *args: str, uv_on_path: bool, headers: bool, venv_works: bool = True
) -> tuple[int, str, list[str]]:
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "bootstrap", checkout / "scripts" / "bootstrap")
    shims = tmp_path / "shims"
    shims.mkdir()
    templates = tmp_path / "templates"
    templates.mkdir()
    _shim(templates, "python", _VENV_PYTHON, label="venv-python")
    _shim(templates, "uv", label="venv-uv")
    log = tmp_path / "commands.log"
    log.touch()
    for name in ("apt-get", "apt", "sudo", "pip", "pip3", "docker-compose"):
        _shim(shims, name)
    _shim(shims, "pkg-config", "exit 0\n" if headers else "exit 1\n")
    # The interpreter: `-m venv DIR` makes DIR/bin/python, itself a recorder whose `pip install uv` adds uv.
    make_venv = _MAKE_VENV if venv_works else "exit 1\n"
    _shim(shims, "python3", 'if [ "$1 $2" = "-m venv" ]; then set -- "$3"; ' + make_venv + "fi\n")
    if uv_on_path:
        _shim(shims, "uv", 'if [ "$1" = venv ]; then set -- "${@: -1}"; ' + _MAKE_VENV + "fi\n")
    env = {
        "PATH": f"{shims}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SHIM_LOG": str(log),
        "SHIM_TEMPLATES": str(templates),
        "PYTHON": str(shims / "python3"),
    }
    proc = subprocess.run(
        ["bash", str(checkout / "scripts" / "bootstrap"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    commands = [line.replace(str(shims) + "/", "") for line in log.read_text().splitlines()]
    return proc.returncode, proc.stderr, commands


@pytest.mark.parametrize("uv_on_path", [True, False], ids=["uv-on-path", "no-uv"])
def test_bootstrap_installs_nothing_outside_the_checkout(tmp_path: Path, uv_on_path: bool) -> None:
    code, stderr, commands = _run_bootstrap(tmp_path, uv_on_path=uv_on_path, headers=False)
    assert code == 0, (stderr, commands)
    assert not [c for c in commands if c.split()[0] in ("apt-get", "apt", "sudo", "pip", "pip3")], commands
    # The system interpreter only creates the venv; it never installs anything.
    system = [c for c in commands if c.startswith("python3 ")]
    assert all(c.startswith("python3 -m venv") for c in system), commands
    # One clear line about the skipped extra, with the command to run.
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "mysql extra is skipped" in lines[0]
    assert "apt-get install -y pkg-config libmariadb-dev" in lines[0]
    install = [c for c in commands if "pip install" in c and "-e" in c.split()]
    assert len(install) == 1 and install[0].endswith("-e .[dev]"), commands
    if not uv_on_path:
        assert "python3 -m venv .venv" in commands
        assert any(c.startswith("venv-python -m pip install") and c.endswith(" uv") for c in commands)
        assert install[0].startswith("venv-uv pip install")


def test_bootstrap_without_venv_support_says_what_to_install(tmp_path: Path) -> None:
    code, stderr, commands = _run_bootstrap(tmp_path, uv_on_path=False, headers=True, venv_works=False)
    assert code == 1
    assert stderr.strip().splitlines() == [
        f"bootstrap: '{tmp_path}/shims/python3 -m venv .venv' failed; "
        "on Debian/Ubuntu run: apt-get install -y python3-venv"
    ]
    assert not [c for c in commands if "install" in c], commands
    assert not (tmp_path / "checkout" / ".venv").exists()


def test_bootstrap_adds_the_mysql_extra_when_headers_exist(tmp_path: Path) -> None:
    code, stderr, commands = _run_bootstrap(tmp_path, uv_on_path=True, headers=True)
    assert code == 0 and stderr == "", stderr
    assert [c for c in commands if "-e" in c.split()] == [
        "uv pip install --quiet --python .venv/bin/python -e .[dev,mysql]"
    ]


EMULATORS = "venv-python -m tests.fixtures.emulators"


def test_bootstrap_builds_the_test_emulators_only_for_the_tests(tmp_path: Path) -> None:
    """The demo's bootstrap builds no emulator virtualenv (moto, fakesnow, bqemulator); the
    tests' (scripts/test, which .ci/run runs) builds each from the fixtures' own requirements."""
    code, stderr, commands = _run_bootstrap(tmp_path / "demo", uv_on_path=True, headers=True)
    assert code == 0 and stderr == "", stderr
    assert not [c for c in commands if "emulators" in c or ".venv-" in c], commands
    code, stderr, commands = _run_bootstrap(tmp_path / "tests", "--tests", uv_on_path=True, headers=True)
    assert code == 0 and stderr == "", stderr
    assert commands[-1] == EMULATORS, commands
    code, stderr, _ = _run_bootstrap(tmp_path / "bad", "--test", uv_on_path=True, headers=True)
    assert code == 2 and "unknown option '--test'" in stderr
    scripts = {name: (ROOT / "scripts" / name).read_text().splitlines() for name in ("demo", "test")}
    assert "scripts/bootstrap" in scripts["demo"] and "scripts/bootstrap --tests" not in scripts["demo"]
    assert "scripts/bootstrap --tests" in scripts["test"]
    assert "scripts/test" in " ".join((ROOT / ".ci" / "run").read_text().splitlines())


def test_the_emulator_list_names_each_fixtures_virtualenv() -> None:
    from tests.fixtures.bigquery import BQEMULATOR_VENV
    from tests.fixtures.emulators import emulator_venvs
    from tests.fixtures.gcs import GCS_VENV
    from tests.fixtures.s3 import MOTO_REQUIREMENT, MOTO_VENV
    from tests.fixtures.snowflake import FAKESNOW_VENV

    venvs = {venv: (list(requirements), binary) for venv, requirements, binary in emulator_venvs()}
    assert set(venvs) == {MOTO_VENV, FAKESNOW_VENV, BQEMULATOR_VENV, GCS_VENV}
    assert venvs[MOTO_VENV] == ([MOTO_REQUIREMENT], "moto_server")


def _run_ci(
    tmp_path: Path,
    *,
    pg_up: bool = True,
    pg_starts: bool = False,
    mysql_up: bool = True,
    redis_up: bool = True,
    redis_starts: bool = False,
    headers: bool = True,
    test_exit: int = 0,
) -> tuple[int, str, list[str]]:
    """Run a copy of ``.ci/run`` with stand-ins for the services and a ``scripts/test`` that records."""
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    (checkout / "scripts").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", checkout / ".ci" / "run")
    record_test = f'echo "CI=$CI" >> "$SHIM_LOG"\nexit {test_exit}\n'
    _shim(checkout / "scripts", "test", record_test, label="scripts/test")
    shims = tmp_path / "shims"
    shims.mkdir()
    log = tmp_path / "commands.log"
    log.touch()
    state = tmp_path / "pg-started"
    _shim(shims, "pkg-config", "exit 0\n" if headers else "exit 1\n")
    _shim(shims, "docker-compose")
    _shim(shims, "apt-get")
    _shim(shims, "pg_isready", "exit 0\n" if pg_up else f'[ -e "{state}" ] && exit 0; exit 1\n')
    _shim(shims, "pg_ctlcluster", f'touch "{state}"; exit 0\n' if pg_starts else "exit 1\n")
    _shim(shims, "psql", "echo 1\n")
    _shim(shims, "createdb")
    _shim(shims, "mysqladmin", "exit 0\n" if mysql_up else "exit 1\n")
    _shim(shims, "start-stop-daemon")
    _shim(shims, "chown")
    redis_state = tmp_path / "redis-started"
    _shim(shims, "redis-cli", "echo PONG\n" if redis_up else f'[ -e "{redis_state}" ] && echo PONG; exit 0\n')
    _shim(shims, "redis-server", f'touch "{redis_state}"; exit 0\n' if redis_starts else "exit 1\n")
    _shim(shims, "mkdir")
    env = {
        "PATH": f"{shims}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SHIM_LOG": str(log),
        "CI_SERVICE_WAIT": "1",
    }
    proc = subprocess.run(
        ["bash", str(checkout / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60
    )
    return proc.returncode, proc.stdout + proc.stderr, log.read_text().splitlines()


def test_ci_fails_when_postgresql_cannot_start(tmp_path: Path) -> None:
    code, out, commands = _run_ci(tmp_path, pg_up=False)
    assert code != 0
    assert "ERROR" in out and "PostgreSQL" in out, out
    assert not [c for c in commands if c.startswith("scripts/test")], commands


def test_ci_fails_when_mariadb_does_not_answer(tmp_path: Path) -> None:
    code, out, commands = _run_ci(tmp_path, pg_up=False, pg_starts=True, mysql_up=False)
    assert code != 0
    assert "MariaDB does not answer on 127.0.0.1:3306" in out, out
    assert any(c.startswith("pg_ctlcluster") for c in commands)
    assert any(c.startswith("start-stop-daemon --start") for c in commands)
    assert not [c for c in commands if c.startswith("scripts/test")], commands


def test_ci_starts_redis_when_it_is_down(tmp_path: Path) -> None:
    code, out, commands = _run_ci(tmp_path, redis_up=False, redis_starts=True)
    assert code == 0, out
    assert "starting Redis" in out and "PostgreSQL, MariaDB and Redis are up" in out, out
    started = [c for c in commands if c.startswith("redis-server")]
    # The empty --save "" (no snapshots) records as two spaces.
    expected = "--daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save  --appendonly no"
    assert started and expected in started[0], started
    assert any(c.startswith("scripts/test") for c in commands), commands


def test_ci_fails_when_redis_does_not_answer(tmp_path: Path) -> None:
    code, out, commands = _run_ci(tmp_path, redis_up=False)
    assert code != 0
    assert "Redis" in out and "ERROR" in out, out
    assert not [c for c in commands if c.startswith("scripts/test")], commands


def test_ci_treats_no_tests_collected_as_failure(tmp_path: Path) -> None:
    code, out, commands = _run_ci(tmp_path, test_exit=5)
    assert code != 0 and "collected no test" in out, out
    code, out, commands = (
        _run_ci(tmp_path / "ok", test_exit=0) if (tmp_path / "ok").mkdir() is None else (0, "", [])
    )
    assert code == 0, out
    assert "CI=true" in commands


def test_ci_installs_the_mysql_headers_visibly(tmp_path: Path) -> None:
    code, out, commands = _run_ci(tmp_path, headers=False)
    assert code == 0, out
    assert any(c.startswith("apt-get install") and "pkg-config libmariadb-dev" in c for c in commands), (
        commands
    )
    assert "installing system packages for the test suite: pkg-config libmariadb-dev" in out
