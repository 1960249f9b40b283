"""The package as a user installs it: a built wheel installs, carries its LICENSE and registers with Airflow.

The wheel is built from this checkout (``uv build --wheel --offline``, or ``pip wheel --no-deps``
where uv is missing) and installed with ``--no-deps`` into a fresh virtualenv whose only view of
the dependencies is a ``.pth`` line naming the test environment's site-packages, so the test runs
offline and the package it imports is the wheel's copy, not this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_CHECK = """
import importlib.metadata as md, json, sys
import airflow_batch_provider
from airflow.providers_manager import ProvidersManager
manager = ProvidersManager()
providers = manager.providers
hooks = manager.hooks
(entry,) = [
    e for e in md.entry_points(group="apache_airflow_provider")
    if e.module.startswith("airflow_batch_provider")
]
info = entry.load()()
print(json.dumps({
    "package_file": airflow_batch_provider.__file__,
    "provider": "airflow-batch-provider" in providers,
    "version": providers["airflow-batch-provider"].version if "airflow-batch-provider" in providers else None,
    "batch_api": "batch_api" in hooks,
    "entry_point": info["package-name"],
    "console_script": [
        e.value for e in md.entry_points(group="console_scripts") if e.name == "airflow-batch"
    ],
}))
"""


def _build_wheel(out: Path) -> Path:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        cmd = [uv, "build", "--wheel", "--offline", "--out-dir", str(out), str(ROOT)]
    else:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "-w", str(out), str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (wheel,) = out.glob("airflow_batch_provider-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_the_package_and_the_license(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "airflow_batch_provider/cli.py" in names
    assert "airflow_batch_provider/server/app.py" in names
    assert not [n for n in names if n.startswith("tests/")]
    (license_name,) = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
    text = zipfile.ZipFile(wheel).read(license_name).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert (ROOT / "LICENSE").read_text() == text


def test_wheel_installs_and_registers_with_airflow(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    # Install the wheel alone: its dependencies are the test environment's (the .pth line below).
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        cmd = [uv, "pip", "install", "--offline", "--no-deps", "--python", str(python), str(wheel)]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site)]
        cmd.append(str(wheel))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The dependencies come from the test environment, after the new venv's own site-packages.
    (site / "zz_test_env_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON"))}
    env["AIRFLOW_HOME"] = str(tmp_path / "airflow-home")
    proc = subprocess.run(
        [str(python), "-c", _CHECK], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import orjson

    result = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert result["package_file"].startswith(str(site)), result
    assert result["provider"] and result["batch_api"], result
    assert result["entry_point"] == "airflow-batch-provider"
    assert result["console_script"] == ["airflow_batch_provider.cli:main"]
    from airflow_batch_provider import __version__

    assert result["version"] == __version__
