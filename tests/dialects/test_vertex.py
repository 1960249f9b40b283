"""Vertex AI batch prediction: the job's control plane (create body, states, counts, listing with
a label filter, cancel), its connection (project, location, API root) and its output lines, checked
against the google-genai SDK's own Vertex conversions where it has them."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials
from google.genai import Client, types
from google.genai import batches as sdk_batches

from airflow_batch_provider.dialects.gemini import GeminiDialect
from airflow_batch_provider.dialects.vertex import STATES, VertexDialect, label_pairs
from airflow_batch_provider.exceptions import (
    BatchApiResponseError,
    ConfigurationError,
    UnknownBatchStatusError,
)
from airflow_batch_provider.hooks.create import create_identity
from airflow_batch_provider.hooks.settings import settings_from_connection
from airflow_batch_provider.models import BatchState
from airflow_batch_provider.submission import FINGERPRINT_NAME, KEY_NAME, RunIdentity, batch_metadata

NAME = "projects/p/locations/us-central1/batchPredictionJobs/4471"
KEY = "abp-0123456789abcdef01234567-s00000"
SA = '{"type": "service_account", "client_email": "a@p.iam.gserviceaccount.com", "private_key": "x"}'


def vertex() -> VertexDialect:
    return VertexDialect(project="p", location="us-central1")


def job(state: str = "JOB_STATE_RUNNING", **fields: Any) -> dict[str, Any]:
    return {
        "name": NAME,
        "displayName": KEY,
        "model": "publishers/google/models/gemini-2.5-flash",
        "state": state,
        "createTime": "2026-12-04T06:00:00.123456Z",
        "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": ["gs://b/run/shard-00000.jsonl"]}},
        "outputConfig": {
            "predictionsFormat": "jsonl",
            "gcsDestination": {"outputUriPrefix": "gs://b/run/output/shard-00000"},
        },
        "labels": {"airflow_batch_key": KEY},
        **fields,
    }


def settings(host: str | None = None, **extra: Any) -> Any:
    conn = SimpleNamespace(host=host, port=None, schema=None, password=SA)
    return settings_from_connection(
        "vx", conn, {"dialect": "vertex", **extra}, conn_type="llm_batch", dialect=VertexDialect()
    )


def test_the_connection_names_project_and_location_and_the_api_root_follows() -> None:
    found = settings(project="my-proj", location="europe-west4")
    assert (
        found.base_url
        == "https://europe-west4-aiplatform.googleapis.com/v1/projects/my-proj/locations/europe-west4"
    )
    assert (
        found.dialect.batch_path("projects/x/locations/y/batchPredictionJobs/12") == "batchPredictionJobs/12"
    )
    assert found.dialect.cancel_path("12") == "batchPredictionJobs/12:cancel"
    assert found.auth is not None  # a Google token, not a header
    assert found.dialect.auth_headers(SA) == {}
    assert settings(project="p", location="global").base_url.startswith(
        "https://aiplatform.googleapis.com/v1/"
    )
    # A local server (or a private endpoint): the path still follows from the extras.
    assert settings("http://127.0.0.1:8123", project="p", location="us-central1").base_url == (
        "http://127.0.0.1:8123/v1/projects/p/locations/us-central1"
    )


@pytest.mark.parametrize(
    ("host", "extra", "message"),
    [
        (None, {"project": "p"}, "extra 'location'"),
        (None, {"location": "us-central1"}, "extra 'project'"),
        (None, {"project": "p", "location": "us central1"}, "extra 'location'"),
        (
            "https://us-central1-aiplatform.googleapis.com/v1",
            {"project": "p", "location": "us-central1"},
            "give only the endpoint",
        ),
    ],
)
def test_a_connection_without_project_location_or_with_another_path_is_refused(
    host: str | None, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        settings(host, **extra)


@pytest.mark.parametrize(("state", "mapped"), sorted(STATES.items()))
def test_every_state_maps(state: str, mapped: str) -> None:
    assert vertex().parse_batch(job(state)).state is BatchState(mapped)
    # The SDK knows every state this dialect maps.
    assert types.JobState(state).value == state


def test_an_unspecified_state_is_an_unknown_status() -> None:
    with pytest.raises(UnknownBatchStatusError, match="JOB_STATE_UNSPECIFIED"):
        vertex().parse_batch(job("JOB_STATE_UNSPECIFIED"))


def test_a_partially_succeeded_job_is_completed_with_its_failed_and_unrun_counts() -> None:
    raw = job(
        "JOB_STATE_PARTIALLY_SUCCEEDED",
        completionStats={"successfulCount": "7", "failedCount": "2", "incompleteCount": "1"},
        outputInfo={"gcsOutputDirectory": "gs://b/run/output/shard-00000/prediction-model-2026"},
        endTime="2026-12-04T07:00:00Z",
        startTime="2026-12-04T06:01:00Z",
    )
    batch = vertex().parse_batch(raw)
    assert batch.id == "4471"
    assert batch.state is BatchState.COMPLETED
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        10,
        7,
        2,
    )
    assert vertex().output_directory(batch.raw) == "gs://b/run/output/shard-00000/prediction-model-2026"
    assert vertex().output_directory(job()) is None
    assert batch.completed_at is not None and batch.in_progress_at is not None
    assert batch.metadata == {"airflow_batch_key": KEY}
    # The SDK reads the same job object (fields and counts) into its BatchJob.
    sdk = types.BatchJob._from_response(response=sdk_batches._BatchJob_from_vertex(raw), kwargs={})
    assert sdk.state == types.JobState.JOB_STATE_PARTIALLY_SUCCEEDED
    assert sdk.completion_stats is not None and sdk.completion_stats.successful_count == 7
    assert sdk.dest is not None and sdk.dest.gcs_uri == "gs://b/run/output/shard-00000"


def test_a_failed_job_carries_its_error() -> None:
    batch = vertex().parse_batch(job("JOB_STATE_FAILED", error={"code": 3, "message": "bad input line 4"}))
    assert batch.state is BatchState.FAILED
    assert [(e.code, e.message) for e in batch.errors] == [("3", "bad input line 4")]


@pytest.mark.parametrize(
    "raw",
    [
        {"state": "JOB_STATE_RUNNING"},
        job(completionStats={"successfulCount": "x"}),
        job(completionStats=[1]),
        job(labels={"a": 1}),
        job(outputInfo={"gcsOutputDirectory": 5}),
    ],
)
def test_an_unreadable_job_is_a_response_error(raw: dict[str, Any]) -> None:
    with pytest.raises(BatchApiResponseError):
        vertex().parse_batch(raw)


def test_the_create_body_is_the_one_the_sdk_sends_plus_labels() -> None:
    metadata = {
        "airflow_batch_key": KEY,
        "airflow_fingerprint": "f" * 64,  # over 63 characters: its first 63
        "airflow_run_id": "manual__2026-12-04T06:00:00+00:00",  # capitals and colons: no label
        "airflow_dag_id": "tickets",
    }
    body = vertex().object_create_body(
        input_uri="gs://b/run/shard-00000.jsonl",
        output_uri="gs://b/run/output/shard-00000/",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata,
        name=KEY,
        model="gemini-2.5-flash",
    )
    assert body.pop("labels") == {
        "airflow_batch_key": KEY,
        "airflow_fingerprint": "f" * 63,
        "airflow_dag_id": "tickets",
    }
    client = Client(vertexai=True, project="p", location="us-central1", credentials=AnonymousCredentials())
    sent = sdk_batches._CreateBatchJobParameters_to_vertex(
        client._api_client,
        {
            "model": "gemini-2.5-flash",
            "src": "gs://b/run/shard-00000.jsonl",
            "config": {"display_name": KEY, "dest": "gs://b/run/output/shard-00000"},
        },
    )
    assert body == sent
    assert vertex().create_name(body) == KEY
    with pytest.raises(ConfigurationError, match="names one model"):
        vertex().object_create_body(
            input_uri="gs://b/x.jsonl",
            output_uri="gs://b/o/",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=None,
            name=None,
            model=None,
        )


def test_the_fingerprint_label_round_trips_and_another_is_refused() -> None:
    dialect = vertex()
    identity = RunIdentity("tickets", "submit", "manual__2026-12-04T06:00:00+00:00")
    fingerprint = hashlib.sha256(b"shard 0").hexdigest()
    metadata = batch_metadata(identity, shard=0, fingerprint=fingerprint, dialect=dialect)
    body = dialect.object_create_body(
        input_uri="gs://b/run/shard-00000.jsonl",
        output_uri="gs://b/run/output/",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata,
        name=identity.key(0),
        model="gemini-2.5-flash",
    )
    labels = body["labels"]
    assert labels == dialect.stored_metadata(metadata)
    assert labels[FINGERPRINT_NAME] == fingerprint[:63] and labels[KEY_NAME] == identity.key(0)
    assert "airflow_run_id" not in labels  # capitals and colons: no label
    # What Google gives back is what the lookups compare with.
    found = dialect.parse_batch(job(labels=labels))
    assert dialect.metadata_of(found) == labels
    assert dialect.tags_agree(found, {FINGERPRINT_NAME: fingerprint})
    other = hashlib.sha256(b"shard 0, rebuilt").hexdigest()
    assert not dialect.tags_agree(found, {FINGERPRINT_NAME: other})
    # Only the 64th character differs: it is not sent, so it cannot be told apart (252 bits are).
    assert dialect.tags_agree(found, {FINGERPRINT_NAME: fingerprint[:63] + "x"})
    # A job without the label (made before it was sent) is judged by the rest of the lookup.
    assert dialect.tags_agree(dialect.parse_batch(job()), {FINGERPRINT_NAME: other})
    # A lost create is looked for by the labels it was sent with, not the pairs that never fit.
    assert create_identity(dialect, body, metadata, identity.key(0)) == labels


def test_the_orphan_lookup_filters_the_listing_by_label_server_side() -> None:
    dialect = vertex()
    assert dialect.filter_params({"airflow_batch_key": KEY}) == {
        "filter": f'labels.airflow_batch_key="{KEY}"'
    }
    assert dialect.filter_params({"airflow_batch_key": KEY, "airflow_fingerprint": "f" * 64}) == {
        "filter": f'labels.airflow_batch_key="{KEY}" AND labels.airflow_fingerprint="{"f" * 63}"'
    }
    assert dialect.filter_params({"Name": "x"}) == {}
    assert label_pairs({"airflow_map_index": "-1", "9bad": "x"}) == {"airflow_map_index": "-1"}
    params = dialect.list_params(50)
    page = dialect.parse_list_page(
        {"batchPredictionJobs": [job(), {"name": NAME + "9"}], "nextPageToken": "t2"}, params
    )
    assert [b.id for b in page.batches] == ["4471"]
    assert [u.batch_id for u in page.unreadable] == ["44719"]
    assert page.next_params == {"pageSize": 50, "pageToken": "t2"}
    assert dialect.parse_list_page({}, params).next_params is None


def test_lines_are_encoded_as_the_gemini_api_encodes_them() -> None:
    line = {
        "custom_id": "k1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 5,
        },
    }
    encoded = vertex().encode_line(dict(line))
    assert encoded == GeminiDialect().encode_line(dict(line))
    assert encoded["key"] == "k1" and encoded["request"]["generationConfig"] == {"maxOutputTokens": 5}
    assert "embeddings" in (vertex().unsupported({**line, "url": "/v1/embeddings"}) or "")
    assert "logit_bias" in (
        vertex().unsupported({**line, "body": {**line["body"], "logit_bias": {"1": 2}}}) or ""
    )


def test_output_lines_become_answers_and_errors() -> None:
    ok = vertex().parse_result_line(
        {
            "key": "k1",
            "status": "",
            "request": {"contents": []},
            "response": {
                "candidates": [
                    {"content": {"role": "model", "parts": [{"text": "Hello"}]}, "finishReason": "STOP"}
                ],
                "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1, "totalTokenCount": 4},
                "modelVersion": "gemini-2.5-flash",
                "responseId": "r1",
            },
            "processed_time": "2026-12-04T06:30:00Z",
        },
        "output",
    )
    assert ok.ok and ok.body is not None
    assert ok.body["choices"][0]["message"]["content"] == "Hello"
    assert ok.body["usage"]["prompt_tokens"] == 3
    failed = vertex().parse_result_line(
        {"key": "k2", "status": "Bad Request: invalid argument", "request": {}}, "output"
    )
    assert not failed.ok and failed.error is not None
    assert (failed.error.code, failed.error.message) == ("request_failed", "Bad Request: invalid argument")
    blocked = vertex().parse_result_line(
        {"key": "k3", "status": "", "response": {"promptFeedback": {"blockReason": "SAFETY"}}}, "output"
    )
    assert not blocked.ok and blocked.error is not None and blocked.error.code == "prompt_blocked"
    with pytest.raises(BatchApiResponseError, match="no key"):
        vertex().parse_result_line({"status": "", "response": {}}, "output")
