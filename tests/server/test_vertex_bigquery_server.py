"""``serve --dialect vertex`` with BigQuery in and out, driven over plain HTTP and the official
``google-genai`` SDK: the input table read from the session's bqemulator, the output table
(input columns + ``response`` + ``status`` + ``processed_time``) written back to it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.fixtures.bigquery import BQ_PROJECT

TOKEN = "ya29.vertex-bq-test"
MODEL = "gemini-2.5-flash"
DONE = {"JOB_STATE_SUCCEEDED", "JOB_STATE_PARTIALLY_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}


@pytest.fixture
def bq_dataset(bqemulator: str) -> Iterator[tuple[Any, str]]:
    """A fresh dataset on the session's bqemulator and a client to it."""

    from airflow_batch_provider.server.vertex_bigquery import client

    bq = client(bqemulator, BQ_PROJECT)
    dataset = f"abp_vx_{uuid.uuid4().hex[:10]}"
    bq.create_dataset(dataset)
    try:
        yield bq, dataset
    finally:
        bq.delete_dataset(dataset, delete_contents=True, not_found_ok=True)
        bq.close()


def input_table(bq: Any, dataset: str, count: int, json_column: bool = False) -> str:
    """A table of ``count`` requests (``id``, ``topic``, ``request``) and its bq:// URI."""
    from google.cloud import bigquery

    table = f"{BQ_PROJECT}.{dataset}.requests"
    schema = [
        bigquery.SchemaField("id", "INT64"),
        bigquery.SchemaField("topic", "STRING"),
        bigquery.SchemaField("request", "JSON" if json_column else "STRING"),
    ]
    bq.create_table(bigquery.Table(table, schema=schema))
    rows = [
        {
            "id": i,
            "topic": f'topic {i} </script> "q"',
            "request": orjson.dumps(
                {"contents": [{"role": "user", "parts": [{"text": f"hello number {i}"}]}]}
            ).decode()
            if not json_column
            else {"contents": [{"role": "user", "parts": [{"text": f"hello number {i}"}]}]},
        }
        for i in range(count)
    ]
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    import io

    config = bigquery.LoadJobConfig(source_format="NEWLINE_DELIMITED_JSON", schema=schema)
    bq.load_table_from_file(io.BytesIO(data), table, job_config=config).result()
    return f"bq://{table}"


def job_body(source: str, dest: str, display: str = "bq-run") -> dict[str, Any]:
    return {
        "displayName": display,
        "model": f"publishers/google/models/{MODEL}",
        "inputConfig": {"instancesFormat": "bigquery", "bigquerySource": {"inputUri": source}},
        "outputConfig": {"predictionsFormat": "bigquery", "bigqueryDestination": {"outputUri": dest}},
        "labels": {"airflow_batch_key": "k1"},
    }


def wait_done(http: httpx.Client, url: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        job = http.get(url).raise_for_status().json()
        if job["state"] in DONE:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.02)


def rows_of(bq: Any, dataset: str, table: str) -> list[dict[str, Any]]:
    return sorted((dict(r) for r in bq.list_rows(f"{BQ_PROJECT}.{dataset}.{table}")), key=lambda r: r["id"])


@pytest.mark.parametrize("json_column", [False, True], ids=["string-request", "json-request"])
def test_bigquery_in_bigquery_out_over_http(
    batch_server: Any, bqemulator: str, bq_dataset: tuple[Any, str], json_column: bool
) -> None:
    bq, dataset = bq_dataset
    server = batch_server(dialect="vertex", api_key=TOKEN, bigquery_endpoint_url=bqemulator)
    source = input_table(bq, dataset, 5, json_column)
    jobs = f"{server.root_url}/v1/projects/p1/locations/us-central1/batchPredictionJobs"
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        created = http.post(jobs, json=job_body(source, f"bq://{BQ_PROJECT}.{dataset}")).raise_for_status()
        job = created.json()
        assert job["inputConfig"]["bigquerySource"]["inputUri"] == source
        assert job["outputConfig"]["bigqueryDestination"]["outputUri"] == f"bq://{BQ_PROJECT}.{dataset}"
        job = wait_done(http, f"{jobs}/{job['name'].rsplit('/', 1)[-1]}")
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert job["completionStats"]["successfulCount"] == "5"
    info = job["outputInfo"]
    assert info["bigqueryOutputDataset"] == f"bq://{BQ_PROJECT}.{dataset}"
    assert info["bigqueryOutputTable"].startswith("predictions_")
    rows = rows_of(bq, dataset, info["bigqueryOutputTable"])
    assert [r["id"] for r in rows] == list(range(5))
    for row in rows:
        # Every input column is copied; response, status and processed_time are added.
        assert row["topic"] == f'topic {row["id"]} </script> "q"'
        request = row["request"] if json_column else orjson.loads(row["request"])
        assert request["contents"][0]["parts"][0]["text"] == f"hello number {row['id']}"
        assert row["status"] == ""
        assert row["response"]["candidates"][0]["content"]["parts"][0]["text"]
        assert row["processed_time"] is not None


def test_failed_rows_carry_their_status_and_a_named_table_is_written(
    batch_server: Any, bqemulator: str, bq_dataset: tuple[Any, str]
) -> None:
    bq, dataset = bq_dataset
    server = batch_server(dialect="vertex", api_key=TOKEN, bigquery_endpoint_url=bqemulator)
    server.set_faults(line_failure_rate=1.0)
    source = input_table(bq, dataset, 3)
    jobs = f"{server.root_url}/v1/projects/p1/locations/us-central1/batchPredictionJobs"
    dest = f"bq://{BQ_PROJECT}.{dataset}.answers"
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        job = http.post(jobs, json=job_body(source, dest)).raise_for_status().json()
        job = wait_done(http, f"{jobs}/{job['name'].rsplit('/', 1)[-1]}")
        assert job["outputInfo"]["bigqueryOutputTable"] == "answers"
        rows = rows_of(bq, dataset, "answers")
        assert len(rows) == 3 and all(r["status"] and r["response"] is None for r in rows)
        missing = http.post(jobs, json=job_body(f"bq://{BQ_PROJECT}.{dataset}.nope", dest))
        assert missing.status_code == 404
        not_bq = http.post(jobs, json=job_body(f"bq://{BQ_PROJECT}.{dataset}", dest))
        assert not_bq.status_code == 400 and "table" in not_bq.json()["error"]["message"]


def test_google_genai_sdk_creates_a_bigquery_job(
    batch_server: Any, bqemulator: str, bq_dataset: tuple[Any, str]
) -> None:
    from google import genai
    from google.genai import types
    from google.oauth2.credentials import Credentials

    bq, dataset = bq_dataset
    server = batch_server(dialect="vertex", api_key=TOKEN, bigquery_endpoint_url=bqemulator)
    source = input_table(bq, dataset, 2)
    client = genai.Client(
        vertexai=True,
        project="my-project",
        location="us-central1",
        credentials=Credentials(token=TOKEN),
        http_options=types.HttpOptions(base_url=server.root_url, api_version="v1", timeout=10_000),
    )
    dest = f"bq://{BQ_PROJECT}.{dataset}.sdk_out"
    job = client.batches.create(model=MODEL, src=source, config={"display_name": "sdk-bq", "dest": dest})
    assert job.src is not None and job.src.bigquery_uri == source
    deadline = time.monotonic() + 30
    assert job.name is not None
    while job.state not in DONE:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
        job = client.batches.get(name=job.name)
    assert job.state == "JOB_STATE_SUCCEEDED"
    assert job.dest is not None and job.dest.bigquery_uri == dest
    assert [r["id"] for r in rows_of(bq, dataset, "sdk_out")] == [0, 1]
