"""The Airflow-free core: the CLI, the local server and the data modules never load Airflow.

Each check runs in a fresh interpreter, because the test process itself has Airflow loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]

CORE_MODULES = (
    "airflow_batch_provider.cli",
    "airflow_batch_provider.file_commands",
    "airflow_batch_provider.exceptions",
    "airflow_batch_provider.models",
    "airflow_batch_provider.dialects",
    "airflow_batch_provider.jsonl",
    "airflow_batch_provider.keys",
    "airflow_batch_provider.staging",
    "airflow_batch_provider.records",
    "airflow_batch_provider.rendering",
    "airflow_batch_provider.outcome",
    "airflow_batch_provider.waiting",
    "airflow_batch_provider.hooks.connection_form",
    "airflow_batch_provider.server.app",
    "airflow_batch_provider.server.options",
    "airflow_batch_provider.server.background",
)

# Runs a CLI command in-process (so sys.modules can be read afterwards) and reports what loaded.
_PROBE = """
import sys, json
from airflow_batch_provider.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
loaded = sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))
models = sorted(m for m in ("pydantic", "airflow_batch_provider.models") if m in sys.modules)
print("\\n@@" + json.dumps({"code": code, "airflow": loaded, "models": models}))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["PYTHONPATH"] = str(ROOT)
    # An AIRFLOW_HOME that must stay untouched: importing Airflow would create logs/ and a config there.
    env["AIRFLOW_HOME"] = str(tmp_path / "untouched-airflow-home")
    return env


def test_core_modules_do_not_import_airflow(tmp_path: Path) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {CORE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "    bad = sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))\n"
        "    assert not bad, (name, bad[:5])\n"
        "print('clean')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("clean")
    assert not (tmp_path / "untouched-airflow-home").exists()


def _probe(tmp_path: Path, *argv: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    marker = proc.stdout.rpartition("\n@@")[2]
    assert marker.startswith("{"), proc.stdout[-2000:] + proc.stderr[-2000:]
    result: dict[str, object] = orjson.loads(marker)
    result["stdout"] = proc.stdout
    result["stderr"] = proc.stderr
    return result


def _two_line_file(tmp_path: Path) -> Path:
    src = tmp_path / "two.jsonl"
    lines = [
        {
            "custom_id": str(i),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": []},
        }
        for i in range(2)
    ]
    src.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return src


@pytest.mark.parametrize(
    "argv",
    [
        ("--help",),
        ("validate", "--help"),
        ("prepare", "--help"),
        ("serve", "--help"),
        ("summary", "--help"),
        ("validate", "{file}"),
        ("validate", "{file}", "--dialect", "xai"),
        ("prepare", "{file}", "--model", "m", "--output", "{out}"),
        ("summary", "--duckdb", "{db}", "--table", "results"),
    ],
)
def test_cli_commands_do_not_import_airflow(tmp_path: Path, argv: tuple[str, ...]) -> None:
    src = _two_line_file(tmp_path)
    db = tmp_path / "w.duckdb"
    if "{db}" in argv:
        import duckdb

        with duckdb.connect(str(db)) as conn:
            conn.execute(
                "CREATE TABLE results AS SELECT 1 AS id, 'succeeded' AS status, 3 AS prompt_tokens, "
                "2 AS completion_tokens, 5 AS total_tokens"
            )
    args = [a.format(file=src, out=tmp_path / "out.jsonl", db=db) for a in argv]
    result = _probe(tmp_path, *args)
    assert result["code"] in (0, None), result
    assert result["airflow"] == [], result["airflow"]
    assert not (tmp_path / "untouched-airflow-home").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ("validate", "{file}"),
        ("validate", "{file}", "--dialect", "xai", "--endpoint", "/v1/chat/completions"),
        ("validate", "{file}", "--dialect", "doubleword"),
        ("prepare", "{file}", "--model", "m", "--output", "{out}"),
    ],
)
def test_file_commands_do_not_load_the_pydantic_models(tmp_path: Path, argv: tuple[str, ...]) -> None:
    """validate and prepare read a dialect's rules (limits.py, class attributes), never the models."""
    src = _two_line_file(tmp_path)
    result = _probe(tmp_path, *(a.format(file=src, out=tmp_path / "out.jsonl") for a in argv))
    assert result["code"] in (0, None), result
    assert result["models"] == [], result["models"]


def test_connection_form_reads_the_one_dialect_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from airflow_batch_provider import dialects
    from airflow_batch_provider.dialects.openai import OpenAIDialect
    from airflow_batch_provider.hooks import connection_form

    class ExtraDialect(OpenAIDialect):
        name = "extra-test-dialect"

    monkeypatch.setitem(dialects.DIALECTS, ExtraDialect.name, ExtraDialect)
    try:
        form = importlib.reload(connection_form)
        assert "extra-test-dialect" in form.CONN_FIELDS["dialect"]["schema"]["enum"]
        names = form.DIALECT_NAMES
        assert names == tuple(sorted(dialects.DIALECTS))
    finally:
        monkeypatch.undo()
        importlib.reload(connection_form)
