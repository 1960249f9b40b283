"""OpenLineage: what build, submit and merge report, in a real ``airflow dags test`` run.

The openlineage provider writes its events to a file (``file`` transport); the test reads them back
and checks each task's datasets and facets against what the run really did (the rows in the target
table, the batches on the server, the shard files in staging). Lineage errors are caught inside
:mod:`airflow_batch_provider.lineage`: an operator's lineage method returns empty lineage instead
of raising.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.server.config import FaultConfig
from tests.fixtures.warehouse import PG_DB, PG_HOST, PG_PORT, import_or_unavailable

ROOT = Path(__file__).resolve().parents[1]
DAG_FILE = ROOT / "tests" / "e2e" / "dags" / "lineage_pipeline.py"
TICKETS = 12
NO_BODY = (4, 9)  # rejected by the build: a NULL the prompt uses


@pytest.fixture
def lineage() -> Any:
    """:mod:`airflow_batch_provider.lineage` (needs the openlineage provider: the ``openlineage`` extra)."""
    import_or_unavailable("airflow.providers.openlineage")
    from airflow_batch_provider import lineage

    return lineage


def _events(path: Path) -> dict[str, dict[str, Any]]:
    """The COMPLETE event of each task, by task id."""
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = {}
    for event in events:
        dag, _, task = event["job"]["name"].partition(".")
        if dag == "lineage_pipeline" and task and event["eventType"] == "COMPLETE":
            done[task] = event
    return done


def _ids(datasets: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((d["namespace"], d["name"]) for d in datasets)


@pytest.mark.slow
@pytest.mark.postgres
def test_build_submit_merge_lineage_in_a_real_dags_test_run(
    lineage: Any,
    pg_warehouse: Any,
    batch_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    airflow_dags_test: Any,
    tmp_path: Path,
) -> None:
    wh = pg_warehouse
    wh.run("CREATE TABLE tickets (ticket_id integer PRIMARY KEY, body text)")
    wh.run_many(
        "INSERT INTO tickets VALUES (%s, %s)",
        [(i, None if i in NO_BODY else f"ticket {i} text") for i in range(1, TICKETS + 1)],
    )
    # Some lines fail on the server (which ones depends on the batch ids): the counts come from the table.
    server = batch_server(dialect="openai", faults=FaultConfig(line_failure_rate=0.3))
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    events_file = tmp_path / "openlineage.jsonl"
    transport = {"type": "file", "log_file_path": str(events_file), "append": True}
    result = airflow_dags_test(
        DAG_FILE,
        "lineage_pipeline",
        env={
            "LINEAGE_WAREHOUSE_CONN_ID": wh.conn_id,
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "lineage-test",
            "AIRFLOW__BATCH_PROVIDER__STAGING_ROOT": f"file://{tmp_path / 'staging'}",
        },
    )
    assert result.ok, result.tail()
    events = _events(events_file)
    assert {"build", "submit", "merge"} <= set(events), sorted(events)
    warehouse_ns = f"postgres://{PG_HOST}:{PG_PORT}"

    # build: the table its SQL reads (named although the SQL has a placeholder), the SQL, the shards.
    build = events["build"]
    assert _ids(build["inputs"]) == [(warehouse_ns, f"{PG_DB}.{wh.schema}.tickets")]
    read = build["inputs"][0]["facets"]["schema"]["fields"]
    assert [(f["name"], f["type"]) for f in read] == [("ticket_id", "int4"), ("body", "text")]
    query = build["job"]["facets"]["sql"]["query"]
    assert "FROM tickets WHERE ticket_id >= %(first)s" in query
    shards = sorted((tmp_path / "staging").rglob("shard-*.jsonl"))
    assert len(shards) == 2  # 10 lines, 5 per shard
    assert _ids(build["outputs"]) == sorted(("file", str(p)) for p in shards)
    stats = [o["outputFacets"]["outputStatistics"] for o in build["outputs"]]
    assert sum(s["rowCount"] for s in stats) == TICKETS - len(NO_BODY)
    assert sum(s["size"] for s in stats) == sum(p.stat().st_size for p in shards)

    # submit: the shards in, one batch per shard out, in the vendor endpoint's namespace.
    submit = events["submit"]
    assert _ids(submit["inputs"]) == _ids(build["outputs"])
    batch_ids = sorted(b.id for b in BatchApiHook().list_batches())
    assert len(batch_ids) == 2
    port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
    batch_ns = f"openai://127.0.0.1:{port}"
    assert _ids(submit["outputs"]) == [(batch_ns, b) for b in batch_ids]
    assert "sk-test" not in events_file.read_text()

    # merge: the batches in, the table out with its columns and rows, the run's figures.
    merge = events["merge"]
    assert _ids(merge["inputs"]) == _ids(submit["outputs"])
    (target,) = merge["outputs"]
    assert (target["namespace"], target["name"]) == (warehouse_ns, f"{PG_DB}.{wh.schema}.ticket_answers")
    columns = [f["name"] for f in target["facets"]["schema"]["fields"]]
    table_columns = [
        r[0]
        for r in wh.rows(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
            "AND table_name = 'ticket_answers' ORDER BY ordinal_position",
            [wh.schema],
        )
    ]
    assert columns == table_columns
    assert {f["name"]: f["type"] for f in target["facets"]["schema"]["fields"]}["prompt_tokens"] == "integer"
    assert target["outputFacets"]["outputStatistics"]["rowCount"] == TICKETS
    facet = merge["run"]["facets"][lineage.MERGE_STATS_FACET]
    by_status = dict(wh.rows("SELECT status, count(*) FROM ticket_answers GROUP BY status"))
    assert {k: v for k, v in facet["counts"].items() if v} == by_status
    assert by_status["rejected"] == len(NO_BODY) and sum(by_status.values()) == TICKETS
    prompt, completion, total = (
        int(n)
        for n in wh.rows(
            "SELECT sum(prompt_tokens), sum(completion_tokens), sum(total_tokens) FROM ticket_answers"
        )[0]
    )
    assert (facet["promptTokens"], facet["completionTokens"], facet["totalTokens"]) == (
        prompt,
        completion,
        total,
    )
    assert prompt > 0
    assert facet["cost"] == pytest.approx(prompt * 0.5 / 1e6 + completion * 1.5 / 1e6, abs=1e-6)
    assert facet["rowsWritten"] == TICKETS
    assert facet["_schemaURL"] == lineage.MERGE_STATS_SCHEMA["$id"]
    jsonschema.validate(facet, lineage.MERGE_STATS_SCHEMA)


def test_lineage_errors_never_fail_a_task(lineage: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Every lineage method returns empty lineage when what it needs fails (here: no such connection)."""
    operators: list[Any] = [
        SqlToBatchJsonlOperator(
            task_id="build",
            conn_id="no_such_warehouse",
            sql="SELECT 1 AS k",
            key_columns="k",
            input_column="k",
        ),
        SubmitBatchOperator(task_id="submit", source="/nowhere/in.jsonl", batch_conn_id="no_such_api"),
        MergeBatchResultsOperator(
            task_id="merge", conn_id="no_such_warehouse", target_table="t", batch_conn_id="no_such_api"
        ),
    ]
    # What a task that ran would have recorded: the lineage gets as far as the connections.
    operators[1].submission = {"batches": [{"shard": 0, "batch_id": "batch_1"}], "manifest_path": None}
    operators[2].merge_summary = {"batch_ids": ["batch_1"], "counts": {"succeeded": 1}}
    with caplog.at_level(logging.DEBUG, logger="airflow_batch_provider.lineage"):
        results = [op.get_openlineage_facets_on_complete(None) for op in operators]
    for result in results:
        assert type(result).__name__ == "OperatorLineage"
        assert (result.inputs, result.outputs, result.run_facets, result.job_facets) == ([], [], {}, {})
    failures = [r for r in caplog.records if r.name == "airflow_batch_provider.lineage"]
    assert [r.levelno for r in failures] == [logging.DEBUG] * 3
    assert all(r.exc_info for r in failures)


def test_dataset_names_carry_no_credentials(lineage: Any) -> None:
    s3 = lineage.file_dataset("s3://aws_staging@my-bucket/runs/a/shard-00000.jsonl")
    assert (s3.namespace, s3.name) == ("s3://my-bucket", "runs/a/shard-00000.jsonl")
    local = lineage.file_dataset("file:///tmp/staging/shard-00000.jsonl")
    assert (local.namespace, local.name) == ("file", "/tmp/staging/shard-00000.jsonl")
    relative = lineage.file_dataset("in.jsonl")
    assert (relative.namespace, relative.name) == ("file", os.path.abspath("in.jsonl"))
    assert lineage.batch_namespace("https://user:sk-x@api.example.com:8443/v1", "xai") == (
        "xai://api.example.com:8443"
    )
    assert lineage.batch_namespace("https://api.openai.com/v1", "openai") == "openai://api.openai.com"


def test_submit_lineage_after_a_deferral_reads_the_shards_from_the_manifest(
    lineage: Any, tmp_path: Path
) -> None:
    """A resumed submit has only its XCom: the shard files come from the manifest it names."""
    from airflow_batch_provider import staging
    from airflow_batch_provider.models import Manifest, Shard

    shards = [Shard(index=i, path=f"shard-{i:05d}.jsonl", lines=1, bytes=10, fingerprint="f") for i in (0, 1)]
    manifest_file = staging.write_manifest(
        staging.resolve_path(str(tmp_path)), Manifest(endpoint="/v1/chat/completions", shards=shards)
    )
    hook = SimpleNamespace(
        get_settings=lambda: SimpleNamespace(
            base_url="http://127.0.0.1:9/v1", dialect=SimpleNamespace(name="openai")
        )
    )
    submission = {"batches": [{"shard": 1, "batch_id": "batch_b"}], "manifest_path": str(manifest_file)}
    result = lineage.submit_lineage(hook=lambda: hook, source=str(tmp_path), submission=submission)
    assert [(d.namespace, d.name) for d in result.inputs] == [("file", str(tmp_path / "shard-00001.jsonl"))]
    assert [(d.namespace, d.name) for d in result.outputs] == [("openai://127.0.0.1:9", "batch_b")]


def test_operators_load_no_lineage_code_until_asked() -> None:
    """Importing the operators loads neither this module nor the OpenLineage client."""
    code = (
        "import sys\n"
        "import airflow_batch_provider.operators.build, airflow_batch_provider.operators.submit\n"
        "import airflow_batch_provider.operators.merge\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m == 'airflow_batch_provider.lineage' or m.startswith('openlineage')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_merge_target_on_mysql_is_named_database_dot_table(lineage: Any) -> None:
    """MySQL has no schema below its databases: the target is ``database.table`` in ``mysql://host:port``."""
    from airflow.providers.openlineage.sqlparser import DatabaseInfo

    hook = SimpleNamespace(
        get_connection=lambda conn_id: SimpleNamespace(schema="shop"),
        get_openlineage_database_info=lambda conn: DatabaseInfo(scheme="mysql", authority="db.example:3306"),
        get_openlineage_default_schema=lambda: None,
    )
    result = lineage.merge_lineage(
        conn_id="wh",
        warehouse_hook=lambda: hook,
        batch_hook=lambda: None,
        table="answers",
        schema=None,
        columns=[("id", "integer"), ("status", "text")],
        summary=None,
    )
    (target,) = result.outputs
    assert (target.namespace, target.name) == ("mysql://db.example:3306", "shop.answers")
    assert [(f.name, f.type) for f in target.facets["schema"].fields] == [
        ("id", "integer"),
        ("status", "text"),
    ]
    assert result.inputs == [] and result.run_facets == {}
