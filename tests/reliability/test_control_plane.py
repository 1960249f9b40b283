"""Control-plane faults: 429s with Retry-After, 500s, 503s and dropped downloads, survived with counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.reliability import DAGS, MESSAGES, Pipeline, seed_texts, task_states
from tests.fixtures.s3 import cut_object_reads

# Each kind fires on ceil(n * rate) of the n calls that reach its check, one after the other,
# so 0.12 each makes 1 - 0.88**3 ~ 32% of API calls fail; the suite asserts at least 30%.
FAULTS = {"rate_429": 0.12, "rate_500": 0.12, "rate_503": 0.12, "retry_after": 0.05, "drop_rate": 0.5}
ROWS = 60
DAG_FILE = DAGS / "reliability_pipeline.py"


def fault_counts(stats: dict[str, Any]) -> dict[str, int]:
    c = stats["counters"]
    return {
        "requests": int(c.get("requests", 0)),
        "429": int(c.get("status_429", 0)),
        "500": int(c.get("status_500", 0)),
        "503": int(c.get("status_503", 0)),
        "dropped_downloads": int(c.get("drop", 0)),
    }


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_pipeline_survives_control_plane_faults(
    batch_server: Any,
    pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    figures: Any,
    dialect: str,
) -> None:
    # Validating and finalizing last ~2 s each (ZeroGPU validates at create; xAI has no
    # finalizing state): submitting six shards through the faults takes a while, and the
    # batches must still be running when the task defers so the trigger polls through faults too.
    server = batch_server(dialect=dialect, faults=FAULTS, validate_seconds=2000, finalize_seconds=2000)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    rows = seed_texts(pipeline.warehouse, "tickets", [f"ticket {i}: printer on fire" for i in range(ROWS)])
    cuts: list[int] = []
    if server.s3 is not None:
        # Jobs that read object storage: the run stages there, and its results come from there,
        # so the dropped downloads are S3 reads cut mid-object.
        pipeline.staging_root = server.s3.path("staging")
        cuts = cut_object_reads(monkeypatch)

    record = await pipeline.run(
        "faults",
        "answers",
        build={
            "table": "tickets",
            "key_columns": "id",
            "messages": MESSAGES,
            "max_lines": 10,
            "dialect": dialect,
            # Some vendors require max_tokens on every request (the canonical line carries it).
            "body": {"max_tokens": 64},
        },
    )

    counts = fault_counts(server.stats())
    server.set_faults(rate_429=0, rate_500=0, rate_503=0, drop_rate=0)
    errors = counts["429"] + counts["500"] + counts["503"]
    # The task loggers write to stdout: count the creates the hook had to disambiguate.
    ambiguous = capsys.readouterr().out.count("create failed ambiguously")
    figures(f"control-plane faults survived ({dialect})", **counts, ambiguous_creates=ambiguous)
    assert record.submit_error is None, record.submit_error
    assert record.event is not None and record.event["status"] == "success", record.event
    # The faults really happened, at the advertised rate, and the downloads really dropped.
    assert errors / counts["requests"] >= 0.30, counts
    assert min(counts["429"], counts["500"], counts["503"]) > 0, counts
    # Results downloads (files, results pages, a results stream or objects) really dropped mid-body.
    assert counts["dropped_downloads"] + sum(1 for offset in cuts if offset > 0) >= 1, counts
    # Every input row is in the results table once, answered, with its own answer.
    got = dict(pipeline.warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {text}" for i, text in rows}
    assert record.merge is not None and record.merge["counts"]["succeeded"] == ROWS
    # Ambiguous creates (500/503 on POST /batches) happened and never paid twice: one batch per shard.
    assert ambiguous >= 1
    shards = len(record.manifest["shards"]) if record.manifest else 0
    assert shards == 6
    assert len(list(BatchApiHook().list_batches())) == shards


@pytest.mark.slow
def test_airflow_dag_with_mapped_shards_survives_faults(
    batch_server: Any,
    pg_warehouse: Any,
    monkeypatch: pytest.MonkeyPatch,
    airflow_dags_test: Any,
    tmp_path: Path,
    figures: Any,
) -> None:
    """The same claim through real Airflow: ``airflow dags test`` runs every task, the mapped
    submits defer and their triggers run from the serialised kwargs."""
    server = batch_server(dialect="openai", faults=FAULTS)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    rows = seed_texts(pg_warehouse, "tickets", [f"row {i} \u2014 r\u00e9sum\u00e9" for i in range(ROWS)])
    result = airflow_dags_test(
        DAG_FILE,
        "reliability_pipeline",
        env={"REL_STAGING": f"file://{tmp_path}/staging", "REL_MAX_LINES": "15"},
    )
    counts = fault_counts(server.stats())
    server.set_faults(rate_429=0, rate_500=0, rate_503=0, drop_rate=0)
    figures("control-plane faults survived (airflow dags test, 4 mapped shards)", **counts)
    assert result.ok, result.tail()
    assert counts["429"] + counts["500"] + counts["503"] >= 0.30 * counts["requests"], counts
    assert counts["dropped_downloads"] >= 1, counts
    states = task_states("reliability_pipeline")
    assert states.get("merge") == ["success"] and states.get("submit") == ["success"] * 4, states
    got = dict(pg_warehouse.rows("SELECT id, content FROM answers WHERE status = 'succeeded'"))
    assert pg_warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM answers") == [(ROWS, ROWS)]
    assert got == {i: f"echo: {text}" for i, text in rows}
    assert len(list(BatchApiHook().list_batches())) == 4
