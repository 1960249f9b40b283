"""One table, any vendor (issue #24 section 3): rows the first vendor could not answer are
resubmitted to a second vendor of another dialect (``fallback_conn_id``), and every results
row records which vendor, connection and model answered it; on PostgreSQL and DuckDB.

The first server speaks OpenAI and fails some lines; the fallback speaks Mistral (the model
on the job, ``{custom_id, body}`` lines): the whole pipeline runs (build -> submit -> deferred
wait -> merge with resubmission -> submit attempt 2 to the fallback -> wait -> merge).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts

ROWS = 24
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES}
FALLBACK = "fallback_api"


@pytest.fixture(params=["postgres", "duckdb"])
def warehouse(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("pg_warehouse" if request.param == "postgres" else "duckdb_warehouse")


def two_vendors(batch_server: Any, monkeypatch: pytest.MonkeyPatch, **first_config: Any) -> tuple[Any, Any]:
    """An OpenAI-dialect server as ``batch_api_default`` and a Mistral one as ``fallback_api``."""
    first = batch_server(dialect="openai", **first_config)
    second = batch_server(dialect="mistral")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", first.connection_json())
    monkeypatch.setenv(f"AIRFLOW_CONN_{FALLBACK.upper()}", second.connection_json())
    return first, second


def answered(warehouse: Any) -> dict[int, tuple[Any, ...]]:
    q = warehouse.quote
    rows = warehouse.rows(f"SELECT id, status, vendor, batch_conn_id, model FROM {q('answers')} ORDER BY id")
    return {r[0]: tuple(r[1:]) for r in rows}


async def test_rows_the_first_vendor_failed_are_answered_by_the_fallback_vendor(
    batch_server: Any, warehouse: Any, tmp_path: Path, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = two_vendors(batch_server, monkeypatch, faults={"line_failure_rate": 0.3})
    primary = Pipeline(warehouse, tmp_path / "staging", task_context)
    fallback = Pipeline(warehouse, tmp_path / "staging", task_context, batch_conn_id=FALLBACK)
    seed_texts(warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    resubmit = {"resubmit_failed": True, "fallback_conn_id": FALLBACK, "fallback_model": "mistral-echo"}
    record = await primary.run(
        "fallback", "answers", build=BUILD, submit={"on_partial_failure": "succeed"}, merge=resubmit
    )
    failures = first.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS
    merged = record.merge
    assert merged is not None
    assert merged["resubmit_lines"] == failures and merged["resubmit_conn_id"] == FALLBACK
    assert merged["resubmit_model"] == "mistral-echo"
    after_first = answered(warehouse)
    failed = {key for key, row in after_first.items() if row[0] == "failed"}
    assert len(failed) == failures
    assert all(row[1:3] == ("openai", "batch_api_default") for row in after_first.values())

    # The attempt's manifest names the fallback's dialect, connection and model; staging keeps
    # canonical lines with the model rewritten.
    attempt = staging.read_manifest(merged["resubmit_manifest_path"])
    assert attempt.dialect == "mistral" and attempt.model == "mistral-echo"
    assert attempt.extra["batch_conn_id"] == FALLBACK and attempt.extra["attempt"] == 2

    second = await fallback.submit_and_wait(merged["resubmit_manifest_path"], "fallback-attempt-2")
    assert second.submit_error is None and second.event is not None
    (batch_id,) = second.event["batch_ids"]
    job = BatchApiHook(FALLBACK).get_batch(batch_id)
    assert job.raw["model"] == "mistral-echo" and job.request_counts.total == failures
    final = await asyncio.to_thread(
        fallback.merge,
        second.submission,
        {"manifest_path": merged["resubmit_manifest_path"]},
        "answers",
        **resubmit,
    )
    assert final["counts"]["succeeded"] == failures and final["resubmit"] is False
    rows = answered(warehouse)
    assert len(rows) == ROWS and {row[0] for row in rows.values()} == {"succeeded"}
    for key, (_, vendor, conn_id, model) in rows.items():
        if key in failed:
            assert (vendor, conn_id, model) == ("mistral", FALLBACK, "echo:mistral-echo"), key
        else:
            assert (vendor, conn_id, model) == ("openai", "batch_api_default", "echo:echo-1"), key


async def test_a_fallback_that_cannot_express_a_row_fails_before_anything_is_written(
    batch_server: Any, warehouse: Any, tmp_path: Path, task_context: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral has no logprobs: the merge fails naming the line, the feature and the vendor, its
    rows are rolled back, no attempt manifest is written and nothing reaches the fallback."""
    two_vendors(batch_server, monkeypatch, faults={"line_failure_rate": 0.5})
    primary = Pipeline(warehouse, tmp_path / "staging", task_context)
    seed_texts(warehouse, "tickets", [f"question {i}" for i in range(ROWS)])
    build = {**BUILD, "body": {"logprobs": True}}
    with pytest.raises(ConfigurationError) as caught:
        await primary.run(
            "cannot",
            "answers",
            build=build,
            submit={"on_partial_failure": "succeed"},
            merge={"resubmit_failed": True, "fallback_conn_id": FALLBACK},
        )
    message = str(caught.value)
    assert "logprobs not supported by Mistral" in message and FALLBACK in message
    q = warehouse.quote
    try:
        written = warehouse.rows(f"SELECT COUNT(*) FROM {q('answers')}")
    except Exception:  # the table the merge created went with its rollback
        written = [(0,)]
    assert written == [(0,)]
    assert not list((tmp_path / "staging").rglob("attempt-2/manifest.json"))
    assert list(BatchApiHook(FALLBACK).list_batches()) == []
