"""docs/your-own-dag.md, run as written: its commands in a new folder, its DAG file, `airflow dags test`.

The page tags each command block ``<!-- your-own-dag: all|duckdb|postgres -->`` and the DAG file
``<!-- your-own-dag-file: PATH -->``. The test joins the blocks of one warehouse into one bash
script (a user's shell session), writes the DAG file where the page says to save it, runs the
script in an empty directory with a clean Airflow environment, and reads the results table.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.pages import DOCS, ROOT, Block, blocks
from tests.fixtures.warehouse import PG_HOST, PG_PORT, PG_USER, import_or_unavailable, unavailable

PAGE = DOCS / "your-own-dag.md"
PG_DATABASE = "airflow_docs_demo"  # the database the page's PostgreSQL block creates
REVIEWS = {1, 2, 3}


def _script(warehouse: str, dag_block: Block) -> str:
    """The page's commands for one warehouse, in page order, stopping to save the DAG file."""
    parts = ["set -euo pipefail"]
    for block in blocks(PAGE):
        if block.tag == "your-own-dag" and block.value in ("all", warehouse):
            assert block.lang == "bash", block.where()
            parts.append(block.body)
        elif block == dag_block:
            # The user saves the file from the page here (the folder made in step 1 is the cwd).
            parts.append(f"cat > {shlex.quote(block.value or '')} <<'DAG_FILE_EOF'\n{block.body}DAG_FILE_EOF")
    return "\n".join(parts) + "\n"


def _dag_block() -> Block:
    tagged = [b for b in blocks(PAGE) if b.tag == "your-own-dag-file"]
    assert len(tagged) == 1, "the page names one DAG file"
    assert tagged[0].lang == "python" and tagged[0].value
    return tagged[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env(port: int) -> dict[str, str]:
    """The user's shell: the package's virtualenv on PATH, no Airflow settings of the suite's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "BATCH_TEST_"))
        and k not in ("AIRFLOW_HOME", "AIRFLOW_CONFIG")
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["BATCH_PORT"] = str(port)
    return env


def _run_page(tmp_path: Path, warehouse: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "page.sh"
    script.write_text(_script(warehouse, _dag_block()))
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=_clean_env(_free_port()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the server the page starts in the background goes with the group
    )
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _check_summary(output: str) -> None:
    """The summary's first lines, as the page shows them, are in what the page's commands printed."""
    shown = [b for b in blocks(PAGE) if b.tag == "your-own-dag-output"]
    assert len(shown) == 1
    for line in shown[0].body.splitlines()[:4]:
        assert line in output.splitlines(), line


def _check_rows(rows: list[tuple[object, ...]]) -> None:
    assert {int(r[0]) for r in rows} == REVIEWS, rows  # type: ignore[call-overload]
    for review_id, status, content, model in rows:
        assert status == "succeeded", (review_id, status)
        assert content, review_id
        assert str(model).startswith("echo:"), model  # answered by the local server's echo model


def test_page_blocks_are_tagged() -> None:
    """Both warehouses and the shared steps are on the page; the DAG file is complete Python."""
    values = [b.value for b in blocks(PAGE) if b.tag == "your-own-dag"]
    assert {"all", "duckdb", "postgres"} <= set(values)
    compile(_dag_block().body, "review_sentiment.py", "exec")
    text = PAGE.read_text()
    steps = ("AIRFLOW_HOME", "DAGS_FOLDER", "airflow db migrate", "airflow-batch serve", "airflow dags test")
    for needed in steps:
        assert needed in text, needed
    assert PG_DATABASE in text


@pytest.mark.slow
def test_your_own_dag_duckdb(tmp_path: Path) -> None:
    duckdb = import_or_unavailable("duckdb")
    result = _run_page(tmp_path, "duckdb")
    assert result.returncode == 0, result.stdout[-8000:]
    _check_summary(result.stdout)
    con = duckdb.connect(str(tmp_path / "my-airflow" / "warehouse.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT review_id, status, content, model FROM review_sentiment").fetchall()
    finally:
        con.close()
    _check_rows(rows)


def _psql(sql: str) -> subprocess.CompletedProcess[str]:
    cmd = ["psql", "-h", PG_HOST, "-p", str(PG_PORT), "-U", PG_USER, "-d", "postgres"]
    cmd += ["-v", "ON_ERROR_STOP=1"]
    return subprocess.run([*cmd, "-c", sql], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.slow
@pytest.mark.postgres
def test_your_own_dag_postgres(tmp_path: Path) -> None:
    psycopg2 = import_or_unavailable("psycopg2")
    try:
        dropped = _psql(f"DROP DATABASE IF EXISTS {PG_DATABASE}")
    except FileNotFoundError:
        unavailable("psql is not installed")
    if dropped.returncode != 0:
        unavailable(f"PostgreSQL at {PG_HOST}:{PG_PORT}: {dropped.stderr.strip()}")
    try:
        result = _run_page(tmp_path, "postgres")
        assert result.returncode == 0, result.stdout[-8000:]
        _check_summary(result.stdout)
        conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_DATABASE)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT review_id, status, content, model FROM review_sentiment")
                rows = cur.fetchall()
        finally:
            conn.close()
        _check_rows(rows)
    finally:
        _psql(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")
