"""Secrets: a recognisable API key never reaches a log, XCom, rendered field, trigger kwargs or error.

The server demands the key, so a run that succeeds proves the key was sent on every call;
everything the run left behind is then searched for it (and for a distinctive slice of it,
so a half-masked key is caught too).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_batch_provider.exceptions import BatchApiAuthError, BatchApiConnectionError, BatchFailedError
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.reliability import (
    DAGS,
    MESSAGES,
    Pipeline,
    first_event,
    rebuild_trigger,
    seed_texts,
    task_states,
)

SECRET = f"sk-reliability-S3CR3T-{uuid.uuid4().hex}"
# A slice from the middle: a key shown as "sk-rel...abcd" still leaks; this catches most of it.
SLICE = SECRET[14:34]


def leaks(text: str) -> bool:
    return SECRET in text or SLICE in text


def is_upstream_masksecret_line(line: str) -> bool:
    return "loc=supervisor.py" in line and "msg=MaskSecret(" in line


def leaking_lines(text: str) -> list[str]:
    """The lines holding the key, with it blanked out, for a readable failure."""
    return [
        line.replace(SECRET, "<KEY>").replace(SLICE, "<KEY-SLICE>")[:400]
        for line in text.splitlines()
        if leaks(line)
    ][:10]


def files_leaking(root: Path) -> tuple[int, list[str]]:
    """(files scanned, files holding the key) under ``root``, read as bytes."""
    scanned, found = 0, []
    needles = (SECRET.encode(), SLICE.encode())
    for path in root.rglob("*"):
        if path.is_file():
            scanned += 1
            data = path.read_bytes()
            if any(n in data for n in needles):
                found.append(str(path))
    return scanned, found


def connection(server: Any, key: str = SECRET) -> str:
    return json.dumps(
        {"conn_type": "batch_api", "host": server.base_url, "password": key, "extra": {"dialect": "openai"}}
    )


async def test_key_stays_out_of_logs_xcom_trigger_and_errors(
    batch_server: Any,
    pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.DEBUG)
    server = batch_server(
        dialect="openai", api_key=SECRET, faults={"rate_500": 0.2, "rate_429": 0.1, "retry_after": 0.05}
    )
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", connection(server))
    seed_texts(pipeline.warehouse, "tickets", [f"t{i}" for i in range(12)])
    manifest = pipeline.build("secrets", table="tickets", key_columns="id", messages=MESSAGES)
    op = pipeline.submit_op(manifest)
    ctx = pipeline.context("submit", "secrets")
    with pytest.raises(TaskDeferred) as info:
        op.execute(ctx)
    classpath, kwargs = info.value.trigger.serialize()
    assert not leaks(repr(kwargs)) and not leaks(json.dumps(kwargs, default=str))
    event = await first_event(rebuild_trigger(info.value.trigger))
    result = op.execute_complete(ctx, event, **info.value.kwargs)
    summary = pipeline.merge(result, manifest, "answers")
    assert summary["counts"]["succeeded"] == 12  # the server demanded the key: it was sent
    assert server.stats()["counters"].get("status_500", 0) > 0  # error paths ran too

    # Errors raised with the key configured: a wrong key (the server's 401), an unreachable server.
    errors: list[BaseException] = []
    wrong = batch_server(dialect="openai", api_key="sk-the-server-wants-another-key")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", connection(wrong))
    with pytest.raises(BatchApiAuthError) as auth:
        BatchApiHook().get_batch("batch_x")
    errors.append(auth.value)
    wrong.stop()
    with pytest.raises(BatchApiConnectionError) as down:
        BatchApiHook(max_retries=0).get_batch("batch_x")
    errors.append(down.value)
    # A failed wait's error, raised by the operator with the key configured.
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", connection(server))
    server.set_faults(rate_500=0, rate_429=0, fail_validation=True)
    failed = await pipeline.submit_and_wait(manifest, "secrets-failed")
    assert isinstance(failed.submit_error, BatchFailedError)
    errors.append(failed.submit_error)
    for exc in errors:
        text = " ".join(
            [str(exc), repr(exc), repr(exc.args), repr(getattr(exc, "body", None)), repr(exc.__dict__)]
        )
        assert not leaks(text), f"{type(exc).__name__} leaks the key: {text}"
    assert not leaks(repr(BatchApiHook().get_settings()))

    out, err = capfd.readouterr()
    assert caplog.records, "nothing was logged: the check would be vacuous"
    assert any(r.levelno == logging.DEBUG for r in caplog.records)
    for text in (caplog.text, out, err):
        assert not leaks(text), leaking_lines(text)
    for record in (ctx["ti"].xcom, failed.xcom, summary, manifest):
        assert not leaks(json.dumps(record, default=str))
    scanned, found = files_leaking(tmp_path)
    assert scanned > 0 and found == [], found


@pytest.mark.slow
def test_key_stays_out_of_an_airflow_run_at_debug_level(
    batch_server: Any,
    pg_warehouse: Any,
    monkeypatch: pytest.MonkeyPatch,
    airflow_dags_test: Any,
    tmp_path: Path,
) -> None:
    """A full DAG run under ``airflow dags test`` with DEBUG logging: its output, task log files,
    the metadata database (XCom, rendered template fields, trigger rows) and staging hold no key."""
    server = batch_server(dialect="openai", api_key=SECRET, faults={"rate_500": 0.2, "retry_after": 0.05})
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", connection(server))
    seed_texts(pg_warehouse, "tickets", [f"t{i}" for i in range(20)])
    result = airflow_dags_test(
        DAGS / "reliability_pipeline.py",
        "reliability_secrets",
        env={
            "REL_DAG_ID": "reliability_secrets",
            "REL_STAGING": f"file://{tmp_path}/staging",
            "REL_MAX_LINES": "10",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "DEBUG",
        },
    )
    assert result.ok, result.tail()
    assert task_states("reliability_secrets").get("merge") == ["success"]
    assert pg_warehouse.rows("SELECT status, COUNT(*) FROM answers GROUP BY status") == [("succeeded", 20)]
    # Debug logging really was on, and the run really went through retries.
    assert "[debug" in result.output.lower() or " DEBUG " in result.output, result.tail()
    assert server.stats()["counters"].get("status_500", 0) > 0
    # Known upstream leak, exempted narrowly: at DEBUG, ``airflow dags test``'s in-process
    # supervisor (InProcessSupervisorComms.send) logs every MaskSecret request with its value;
    # the real supervisor omits that body. Every other line must be clean.
    upstream = [line for line in result.output.splitlines() if is_upstream_masksecret_line(line)]
    own = "\n".join(line for line in result.output.splitlines() if not is_upstream_masksecret_line(line))
    assert not leaks(own), leaking_lines(own)
    print(f"\n[reliability] airflow-core MaskSecret debug lines exempted: {len(upstream)}")
    home = Path(os.environ["AIRFLOW_HOME"])
    db_files = [p for p in home.glob("airflow.db*") if p.is_file()]
    assert db_files
    for db in db_files:
        data = db.read_bytes()
        assert SECRET.encode() not in data and SLICE.encode() not in data, f"the key is in {db}"
    # The things the DB scan covered are really there for this DAG (so the scan was not vacuous).
    import sqlite3

    conn = sqlite3.connect(home / "airflow.db")
    try:
        xcoms = conn.execute("SELECT COUNT(*) FROM xcom WHERE dag_id = 'reliability_secrets'").fetchone()[0]
        rendered = conn.execute(
            "SELECT rendered_fields FROM rendered_task_instance_fields WHERE dag_id = 'reliability_secrets'"
        ).fetchall()
    finally:
        conn.close()
    assert xcoms > 0 and rendered, (xcoms, rendered)
    assert not any(leaks(str(r[0])) for r in rendered)
    scanned, found = files_leaking(home / "logs") if (home / "logs").exists() else (0, [])
    assert found == [], found
    staged, found = files_leaking(tmp_path / "staging")
    assert staged > 0 and found == [], found
