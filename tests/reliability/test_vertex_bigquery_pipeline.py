"""Vertex AI batch prediction with BigQuery in and out, through the whole pipeline (build ->
submit -> deferred wait -> merge) on the session's bqemulator.

The build writes the requests as BigQuery tables by SQL (``requests_table``), the job
(``serve --dialect vertex`` with ``--bigquery-endpoint-url``) reads them and writes a
prediction table, and the merge fills its staging table from those tables inside BigQuery
before the writer's one ``MERGE``: no row passes through the worker. The last test runs the
same input through the Cloud Storage file route and compares the two results tables.
"""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.warehouse.loaders.bigquery_load import load_rows
from airflow_batch_provider.warehouse.rows import Column
from tests.fixtures.gcs import GcsStaging
from tests.fixtures.reliability import Pipeline

TOKEN = "ya29.bq-pipeline"
ROWS = 24
HOSTILE = 'hostile "quotes" \\ back\nslash\t</script> 😀 é'
MESSAGES = [
    {"role": "system", "content": "You triage tickets."},
    {"role": "user", "content": "Ticket {{ id }}: {{ text }}"},
]


@pytest.fixture
def bq_pipeline(bigquery_warehouse: Any, tmp_path: Any, task_context: Any, google_key: Any) -> Pipeline:
    """The pipeline on the test's BigQuery dataset (the Google key the connection trades for a
    token set up before the test's loop runs)."""
    return Pipeline(bigquery_warehouse, tmp_path / "staging", task_context)


def serve(batch_server: Any, bqemulator: str, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Any:
    server = batch_server(dialect="vertex", api_key=TOKEN, bigquery_endpoint_url=bqemulator, **config)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    return server


def seed(pipeline: Pipeline, table: str = "tickets", count: int = ROWS) -> list[tuple[Any, ...]]:
    """``table(id INT64, text STRING)``: one row with hostile text, one NULL text, one NULL id."""
    rows: list[tuple[Any, ...]] = [(i, f"question {i}") for i in range(1, count + 1)]
    rows[2] = (3, HOSTILE)
    rows[4] = (5, None)
    rows.append((None, "no key"))
    client = pipeline.warehouse.hook.get_client()
    try:
        load_rows(
            client,
            f"{client.project}.{pipeline.warehouse.schema}.{table}",
            [Column("id", "integer"), Column("text", "text")],
            rows,
        )
    finally:
        client.close()
    return rows


def build_args(pipeline: Pipeline, name: str = "req") -> dict[str, Any]:
    return {
        "table": "tickets",
        "key_columns": "id",
        "messages": MESSAGES,
        "dialect": "vertex",
        "body": {"max_tokens": 40},
        "requests_table": f"{pipeline.warehouse.schema}.{name}",
    }


def results(pipeline: Pipeline, table: str = "answers") -> dict[int, tuple[Any, ...]]:
    return {
        r[0]: r[1:]
        for r in pipeline.warehouse.rows(
            f"SELECT id, status, error_code, content, prompt_tokens, request_hash FROM `{table}`"
        )
    }


async def test_succeeded_job_lands_every_row_and_a_second_merge_changes_nothing(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, bqemulator, monkeypatch)
    seed(bq_pipeline)
    record = await bq_pipeline.run("bq-ok", "answers", build=build_args(bq_pipeline))
    manifest = record.manifest
    assert manifest is not None
    assert manifest["rows_read"] == ROWS + 1 and manifest["rows_written"] == ROWS - 1
    assert manifest["rows_rejected"] == 2
    assert manifest["extra"]["rejects_by_code"] == {"null_key": 1, "null_value": 1}
    (shard,) = manifest["shards"]
    assert shard["table"].startswith("bq://") and shard["lines"] == ROWS - 1
    assert record.event is not None and record.event["status"] == "success", record.event
    (batch_id,) = record.event["batch_ids"]
    job = BatchApiHook().get_batch(batch_id)
    assert job.raw["state"] == "JOB_STATE_SUCCEEDED"
    assert job.raw["inputConfig"]["bigquerySource"]["inputUri"] == shard["table"]
    assert job.raw["outputInfo"]["bigqueryOutputTable"].startswith("predictions_")
    rows = results(bq_pipeline)
    # The row without a key is counted, never written (it has no key to write by).
    assert len(rows) == ROWS
    assert rows[5][:2] == ("rejected", "null_value")
    succeeded = {k: v for k, v in rows.items() if v[0] == "succeeded"}
    assert len(succeeded) == ROWS - 1
    assert rows[3][2] == f"echo: {HOSTILE}" or HOSTILE in str(rows[3][2])
    assert all(v[3] and v[3] > 0 for v in succeeded.values())
    merged = record.merge
    assert merged is not None and merged["counts"]["succeeded"] == ROWS - 1
    assert merged["counts"]["rejected"] == 1 and merged["unkeyed_rejects"] == 1
    before = bq_pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM `answers`")
    again = bq_pipeline.merge(record.submission, manifest, "answers")
    assert again["counts"] == merged["counts"]
    assert bq_pipeline.warehouse.rows("SELECT COUNT(*), COUNT(DISTINCT id) FROM `answers`") == before
    assert results(bq_pipeline) == rows


async def test_partially_succeeded_job_merges_what_it_answered(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(batch_server, bqemulator, monkeypatch, faults={"line_failure_rate": 0.3})
    seed(bq_pipeline)
    record = await bq_pipeline.run(
        "bq-partial", "answers", build=build_args(bq_pipeline), submit={"on_partial_failure": "succeed"}
    )
    failures = server.stats()["counters"]["line_failures"]
    assert 0 < failures < ROWS - 1
    (batch_id,) = record.event["batch_ids"]  # type: ignore[index]
    assert BatchApiHook().get_batch(batch_id).raw["state"] == "JOB_STATE_PARTIALLY_SUCCEEDED"
    rows = results(bq_pipeline)
    statuses = [v[0] for v in rows.values()]
    assert statuses.count("failed") == failures
    assert statuses.count("succeeded") == ROWS - 1 - failures
    assert {v[1] for v in rows.values() if v[0] == "failed"} == {"request_failed"}


@pytest.mark.parametrize(("how", "status"), [("expire", "expired"), ("cancel", "cancelled")])
async def test_expired_and_cancelled_jobs_keep_what_was_answered(
    batch_server: Any,
    bqemulator: str,
    bq_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    status: str,
) -> None:
    from airflow_batch_provider.exceptions import BatchFailedError
    from tests.fixtures.reliability import partly_done

    server = serve(batch_server, bqemulator, monkeypatch, line_seconds=50, chunk_size=5)
    seed(bq_pipeline)

    def interrupt(submission: dict[str, Any]) -> None:
        (batch_id,) = submission["batch_ids"]
        partly_done(batch_id, ROWS - 1)
        if how == "expire":
            server.force(batch_id, "expire")
        else:
            BatchApiHook().cancel_batch(batch_id)

    record = await bq_pipeline.run(
        f"bq-{how}", "answers", build=build_args(bq_pipeline), before_wait=interrupt
    )
    assert record.event is not None and record.event["status"] == status, record.event
    assert isinstance(record.submit_error, BatchFailedError)
    statuses = [v[0] for v in results(bq_pipeline).values()]
    # The prediction table holds what was answered; the rest takes the job's end as its status.
    assert statuses.count("succeeded") > 0 and statuses.count(status) > 0
    assert statuses.count("succeeded") + statuses.count(status) == ROWS - 1
    assert statuses.count("rejected") == 1


async def test_crash_between_create_and_record_adopts_the_job_found_by_label(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_batch_provider.submission import StateStore, SubmitState

    serve(batch_server, bqemulator, monkeypatch)
    seed(bq_pipeline)
    manifest = bq_pipeline.build("crash", **build_args(bq_pipeline))
    real_write = StateStore.write

    class Crash(Exception):
        pass

    def crash_when_recording_id(self: StateStore, state: SubmitState) -> None:
        if state.batch_id:
            raise Crash(state.batch_id)
        real_write(self, state)

    monkeypatch.setattr(StateStore, "write", crash_when_recording_id)
    with pytest.raises(Crash) as crashed:
        bq_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            bq_pipeline.context("submit", "crash")
        )
    monkeypatch.setattr(StateStore, "write", real_write)
    record = await bq_pipeline.submit_and_wait(manifest, "crash")
    assert record.event is not None and record.event["batch_ids"] == [str(crashed.value)]
    # The retry found the job by its label and created none.
    assert len(list(BatchApiHook().list_batches())) == 1
    merged = bq_pipeline.merge(record.submission, manifest, "answers")
    assert merged["counts"]["succeeded"] == ROWS - 1


def test_the_route_is_refused_by_name_where_it_cannot_run(
    bq_pipeline: Pipeline, duckdb_warehouse: Any
) -> None:
    seed(bq_pipeline)
    with pytest.raises(ConfigurationError, match="dialect 'openai' has no job that reads BigQuery"):
        bq_pipeline.build("refused", **{**build_args(bq_pipeline), "dialect": "openai"})
    with pytest.raises(ConfigurationError, match="compute the text in sql"):
        bq_pipeline.build(
            "refused",
            **{**build_args(bq_pipeline), "messages": [{"role": "user", "content": "{{ text | upper }}"}]},
        )
    with pytest.raises(ConfigurationError, match="does not take deduplicate"):
        bq_pipeline.build("refused", **{**build_args(bq_pipeline), "deduplicate": True})
    other = Pipeline(duckdb_warehouse, bq_pipeline.staging_root, bq_pipeline.make_context)
    with pytest.raises(ConfigurationError, match="not BigQuery"):
        other.build("refused", **{**build_args(bq_pipeline), "table": "anything"})


async def test_the_file_route_and_the_bigquery_route_land_the_same_results(
    batch_server: Any,
    bqemulator: str,
    bq_pipeline: Pipeline,
    gcs_staging: GcsStaging,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve(batch_server, bqemulator, monkeypatch)
    seed(bq_pipeline)
    await bq_pipeline.run("bq-route", "answers_bq", build=build_args(bq_pipeline))
    files = Pipeline(bq_pipeline.warehouse, gcs_staging.path("staging"), bq_pipeline.make_context)
    file_build = {k: v for k, v in build_args(bq_pipeline).items() if k != "requests_table"}
    await files.run("file-route", "answers_files", build=file_build)
    # batch_id: each route's own job; merged_at: when each merge ran. Every other column agrees.
    client = bq_pipeline.warehouse.hook.get_client()
    try:
        columns = [f.name for f in client.get_table(f"{bq_pipeline.warehouse.schema}.answers_files").schema]
    finally:
        client.close()
    compared = [c for c in columns if c not in ("batch_id", "merged_at")]
    assert {"id", "custom_id", "status", "content", "request_hash", "cost", "vendor"} <= set(compared)
    select = ", ".join(f"TO_JSON_STRING(`{c}`)" if c == "embedding" else f"`{c}`" for c in compared)

    def table(name: str) -> list[tuple[Any, ...]]:
        return sorted(
            (tuple(r) for r in bq_pipeline.warehouse.rows(f"SELECT {select} FROM `{name}`")),
            key=lambda r: str(r[0]),
        )

    by_files, by_tables = table("answers_files"), table("answers_bq")
    assert len(by_files) == ROWS
    assert by_tables == by_files


def test_both_builds_agree_on_ids_hashes_and_rejects(bq_pipeline: Pipeline) -> None:
    """Build only: the tables' custom_id / request_hash equal keys.jsonl's, and the rejects table
    equals rejects.jsonl (a line over a lowered byte limit included, with its reason)."""
    import orjson

    seed(bq_pipeline)
    args = {**build_args(bq_pipeline), "max_line_bytes": 240}
    tables = bq_pipeline.build("ids-tables", **args)
    files = bq_pipeline.build("ids-files", **{k: v for k, v in args.items() if k != "requests_table"})
    staged = bq_pipeline.staging_root / "reliability" / "ids-files"
    keys = [orjson.loads(x) for x in (staged / "keys.jsonl").read_bytes().splitlines()]
    rejects = [orjson.loads(x) for x in (staged / "rejects.jsonl").read_bytes().splitlines()]
    assert {r["code"] for r in rejects} == {"null_key", "null_value", "line_too_large"}
    assert tables["rows_rejected"] == files["rows_rejected"] == len(rejects)
    assert tables["extra"]["rejects_by_code"] == files["extra"]["rejects_by_code"]
    union = " UNION ALL ".join(
        f"SELECT custom_id, request_hash FROM `{s['table'].removeprefix('bq://')}`" for s in tables["shards"]
    )
    assert sorted(bq_pipeline.warehouse.rows(union)) == sorted(
        (k["custom_id"], k["request_hash"]) for k in keys
    )
    rejects_table = tables["extra"]["bigquery"]["rejects_table"].removeprefix("bq://")
    got = bq_pipeline.warehouse.rows(f"SELECT custom_id, code, reason FROM `{rejects_table}`")
    # Row numbers follow each read's order, which BigQuery does not fix: compared as sets.
    assert sorted(got, key=str) == sorted(
        ((r["custom_id"], r["code"], r["reason"]) for r in rejects), key=str
    )


async def test_overlapping_runs_of_one_requests_table_keep_their_own_tables(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs (a backfill, max_active_runs > 1) with one requests_table: the second build
    neither overwrites nor drops the first's tables, and each merge lands its own rows."""
    serve(batch_server, bqemulator, monkeypatch)
    seed(bq_pipeline)
    seed(bq_pipeline, "tickets_b", count=6)
    first = bq_pipeline.build("run-a", **build_args(bq_pipeline))
    second = bq_pipeline.build("run-b", **{**build_args(bq_pipeline), "table": "tickets_b"})
    tables = [m["shards"][0]["table"] for m in (first, second)]
    assert tables[0] != tables[1]
    assert first["extra"]["bigquery"]["rejects_table"] != second["extra"]["bigquery"]["rejects_table"]
    for manifest, run_id, target in ((first, "run-a", "answers_a"), (second, "run-b", "answers_b")):
        record = await bq_pipeline.submit_and_wait(manifest, run_id)
        assert record.event is not None and record.event["status"] == "success", record.event
        bq_pipeline.merge(record.submission, manifest, target)
    landed_a, landed_b = results(bq_pipeline, "answers_a"), results(bq_pipeline, "answers_b")
    assert len(landed_a) == ROWS and len(landed_b) == 6
    assert sum(v[0] == "succeeded" for v in landed_a.values()) == ROWS - 1
    assert sum(v[0] == "succeeded" for v in landed_b.values()) == 6 - 1


async def test_a_requests_table_changed_after_the_build_is_refused_by_name(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(batch_server, bqemulator, monkeypatch)
    seed(bq_pipeline)
    manifest = bq_pipeline.build("changed", **build_args(bq_pipeline))
    table = manifest["shards"][0]["table"].removeprefix("bq://")
    record = await bq_pipeline.submit_and_wait(manifest, "changed")
    assert record.event is not None and record.event["status"] == "success", record.event
    bq_pipeline.warehouse.rows(f"DELETE FROM `{table}` WHERE custom_id = '1'")
    with pytest.raises(ConfigurationError, match=f"requests table {table} changed since the build"):
        bq_pipeline.merge(record.submission, manifest, "answers")
    with pytest.raises(ConfigurationError, match=f"requests table {table} changed since the build"):
        bq_pipeline.submit_op(manifest, wait_for_completion=False).execute(
            bq_pipeline.context("submit", "changed-again")
        )


def test_an_all_rejected_build_still_writes_its_rejects(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """allow_empty and every row rejected: no shard, no batch, and the merge (on the BigQuery
    route by the manifest, not by its shards) writes each keyed reject."""
    serve(batch_server, bqemulator, monkeypatch)
    client = bq_pipeline.warehouse.hook.get_client()
    try:
        load_rows(
            client,
            f"{client.project}.{bq_pipeline.warehouse.schema}.tickets",
            [Column("id", "integer"), Column("text", "text")],
            [(1, None), (2, None), (None, "no key")],
        )
    finally:
        client.close()
    manifest = bq_pipeline.build("all-rejected", **build_args(bq_pipeline), allow_empty=True)
    assert manifest["shards"] == [] and manifest["rows_rejected"] == 3
    merged = bq_pipeline.merge([], manifest, "answers")
    assert merged["counts"]["rejected"] == 2 and merged["unkeyed_rejects"] == 1
    assert {k: v[:2] for k, v in results(bq_pipeline).items()} == {
        1: ("rejected", "null_value"),
        2: ("rejected", "null_value"),
    }


async def test_a_merge_of_bigquery_jobs_without_the_manifest_is_refused_by_name(
    batch_server: Any, bqemulator: str, bq_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_batch_provider.operators.merge import MergeBatchResultsOperator

    serve(batch_server, bqemulator, monkeypatch)
    seed(bq_pipeline, count=6)
    record = await bq_pipeline.run("no-manifest", "answers", build=build_args(bq_pipeline))
    assert record.event is not None
    op = MergeBatchResultsOperator(
        task_id="merge",
        target_table="answers_again",
        conn_id=bq_pipeline.warehouse.conn_id,
        batch_conn_id=bq_pipeline.batch_conn_id,
        batches=record.event["batch_ids"],
    )
    with pytest.raises(ConfigurationError, match="needs the build's manifest"):
        op.execute(bq_pipeline.context("merge", "no-manifest"))
