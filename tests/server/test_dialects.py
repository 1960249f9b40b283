"""Each dialect mode speaks its vendor's wire shape; the provider's client dialects read it back."""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.models import BatchState
from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for


def _client(server, **headers):
    return httpx.Client(base_url=server.base_url, timeout=10, headers=headers)


# ---- Doubleword ------------------------------------------------------------------------------
def test_doubleword_uuid_ids_1h_window_and_repeated_custom_ids(batch_server):
    server = batch_server(dialect="doubleword")
    with _client(server) as client:
        lines = [chat_line(1, custom_id="same"), chat_line(2, custom_id="same"), chat_line(3)]
        file_id = upload(client, jsonl(lines))
        uuid.UUID(file_id)
        batch = create(client, file_id, completion_window="1h")
        uuid.UUID(batch["id"])
        done = wait_for(client, batch["id"])
        assert done["status"] == "completed"
        assert done["request_counts"]["completed"] == 3
        outputs = read_lines(client, done["output_file_id"])
    # The output file keeps the OpenAI line shape.
    assert sorted(o["custom_id"] for o in outputs) == ["req-3", "same", "same"]
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    parsed = get_dialect("doubleword").parse_batch(done)
    assert parsed.state is BatchState.COMPLETED


def test_doubleword_results_endpoint_pages_with_skip_and_limit(batch_server):
    server = batch_server(dialect="doubleword")
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
    lines = [chat_line(i) for i in range(7)]
    lines.insert(3, bad)
    with _client(server) as client:
        done = wait_for(client, create(client, upload(client, jsonl(lines)))["id"])
        items = []
        skip = 0
        while True:
            response = client.get(f"/batches/{done['id']}/results", params={"skip": skip, "limit": 3})
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("application/x-ndjson")
            page = [orjson.loads(line) for line in response.content.splitlines()]
            items += page
            skip += len(page)
            if len(page) < 3:
                break
        # A second walk answers from the page cache the same way.
        again = client.get(f"/batches/{done['id']}/results", params={"skip": 3, "limit": 3}).content
    assert [i["custom_id"] for i in items] == [
        "req-0",
        "req-1",
        "req-2",
        "bad",
        "req-3",
        "req-4",
        "req-5",
        "req-6",
    ]
    assert [orjson.loads(x)["custom_id"] for x in again.splitlines()] == ["bad", "req-3", "req-4"]
    first = items[0]
    assert set(first) == {"id", "custom_id", "model", "input_body", "response_body", "error", "status"}
    assert first["status"] == "completed"
    assert first["model"] == "echo:gpt-test"
    assert first["input_body"]["messages"][0]["content"] == "hello number 0"
    assert first["response_body"]["choices"][0]["message"]["content"] == "echo: hello number 0"
    failed = items[3]
    assert failed["status"] == "failed" and failed["response_body"] is None
    assert failed["error"]["message"]
    dialect = get_dialect("doubleword")
    parsed = dialect.parse_results_page(jsonl(items), {"skip": 0, "limit": 100})
    assert [line.ok for line in parsed.lines].count(False) == 1


def test_doubleword_never_reports_expired(batch_server):
    server = batch_server(dialect="doubleword")
    with _client(server) as client:
        batch = create(
            client, upload(client, jsonl(chat_line(i) for i in range(4))), headers={"X-Batch-Fault": "expire"}
        )
        done = wait_for(client, batch["id"])
        errors = read_lines(client, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


# ---- ZeroGPU ------------------------------------------------------------------------------------
def test_zerogpu_authenticates_with_x_api_key(batch_server):
    server = batch_server(dialect="zerogpu", api_key="zg-key")
    with _client(server, Authorization="Bearer zg-key") as client:
        refused = client.get("/batches")
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    with _client(server, **{"x-api-key": "zg-key", "x-project-id": "p1"}) as client:
        assert client.get("/batches").status_code == 200


def test_zerogpu_validates_synchronously_with_the_line(batch_server):
    server = batch_server(dialect="zerogpu")
    with _client(server) as client:
        file_id = upload(client, jsonl([chat_line(1), chat_line(2, custom_id="req-1")]))
        response = client.post(
            "/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        embeddings = client.post(
            "/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        )
        good = create(client, upload(client, jsonl([chat_line(1)])))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["line"] == 2
    assert error["code"] == "invalid_request_error"
    assert error["param"] == "custom_id"
    assert error["message"].startswith("[legacy:duplicate_custom_id] line 2:")
    assert error["type"] == "invalid_request_error"
    assert embeddings.status_code == 400  # chat completions only
    assert good["status"] == "in_progress"
    assert good["request_counts"]["total"] == 1


def test_zerogpu_error_lines_have_null_response_and_its_codes(batch_server):
    server = batch_server(dialect="zerogpu")
    server.set_faults(line_failure_rate=1.0)
    with _client(server) as client:
        done = wait_for(client, create(client, upload(client, jsonl([chat_line(1), chat_line(2)])))["id"])
        errors = read_lines(client, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    for line in errors:
        assert line["response"] is None
        assert line["error"]["code"] == "internal_error"
        assert line["error"]["message"].startswith("[legacy:http_500]")
        assert line["error"]["code"] in get_dialect("zerogpu").error_codes


# ---- xAI ------------------------------------------------------------------------------------------
def _xai_lines(n):
    for i in range(n):
        if i % 2:
            yield {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"model": "grok", "input": [{"role": "user", "content": f"hi {i}"}]},
            }
        else:
            yield chat_line(i)


def test_xai_batch_object_mixed_endpoints_and_results_paging(batch_server):
    server = batch_server(dialect="xai")
    with _client(server) as client:
        file_id = upload(client, jsonl(_xai_lines(5)), purpose=None)
        response = client.post("/batches", json={"name": "run-1", "input_file_id": file_id})
        assert response.status_code == 200
        batch = response.json()
        assert "status" not in batch
        assert batch["name"] == "run-1"
        batch_id = batch["batch_id"]
        uuid.UUID(batch_id)
        while True:
            batch = client.get(f"/batches/{batch_id}").json()
            if batch["state"]["num_requests"] and not batch["state"]["num_pending"]:
                break
        assert batch["state"] == {
            "num_requests": 5,
            "num_pending": 0,
            "num_success": 5,
            "num_error": 0,
            "num_cancelled": 0,
        }
        assert batch["cancel_time"] is None and batch["cancel_by_xai_message"] is None
        assert batch["create_time"].endswith("Z")
        results = []
        params: dict = {"limit": 2}
        while True:
            page = client.get(f"/batches/{batch_id}/results", params=params).json()
            results += page["results"]
            if not page["pagination_token"]:
                break
            params = {"limit": 2, "pagination_token": page["pagination_token"]}
    assert sorted(r["batch_request_id"] for r in results) == [f"req-{i}" for i in range(5)]
    dialect = get_dialect("xai")
    parsed = dialect.parse_results_page({"results": results, "pagination_token": None}, {})
    assert all(line.ok for line in parsed.lines)
    by_id = {line.custom_id: line for line in parsed.lines}
    assert by_id["req-0"].body["choices"][0]["message"]["content"] == "echo: hello number 0"
    assert by_id["req-1"].body["output"][0]["content"][0]["text"] == "echo: hi 1"
    assert dialect.parse_batch(batch).state is BatchState.COMPLETED


def test_xai_cancel_uses_colon_path(batch_server):
    server = batch_server(dialect="xai")
    with _client(server) as client:
        file_id = upload(client, jsonl(_xai_lines(3)), purpose=None)
        batch_id = client.post(
            "/batches", json={"name": "c", "input_file_id": file_id}, headers={"X-Batch-Fault": "stall"}
        ).json()["batch_id"]
        assert client.post(f"/batches/{batch_id}/cancel").status_code == 404
        assert client.post(f"/batches/{batch_id}:cancel").status_code == 200
        while True:
            batch = client.get(f"/batches/{batch_id}").json()
            if batch["state"]["num_requests"] and not batch["state"]["num_pending"]:
                break
    assert batch["cancel_time"] is not None
    assert batch["state"]["num_cancelled"] == 3
    assert get_dialect("xai").parse_batch(batch).state is BatchState.CANCELLED


def test_xai_invalid_file_is_cancelled_by_xai_with_a_message(batch_server):
    server = batch_server(dialect="xai")
    bad = {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}
    with _client(server) as client:
        file_id = upload(client, jsonl([chat_line(1), bad]), purpose=None)
        batch_id = client.post("/batches", json={"name": "bad", "input_file_id": file_id}).json()["batch_id"]
        while True:
            batch = client.get(f"/batches/{batch_id}").json()
            if batch["cancel_by_xai_message"]:
                break
    assert "line 2" in batch["cancel_by_xai_message"]
    assert get_dialect("xai").parse_batch(batch).state is BatchState.FAILED


def test_xai_list_pages_with_pagination_token(batch_server):
    server = batch_server(dialect="xai")
    with _client(server) as client:
        file_id = upload(client, jsonl(_xai_lines(1)), purpose=None)
        ids = [
            client.post("/batches", json={"name": f"b{i}", "input_file_id": file_id}).json()["batch_id"]
            for i in range(3)
        ]
        seen = []
        params: dict = {"limit": 2}
        while True:
            page = client.get("/batches", params=params).json()
            assert set(page) == {"batches", "pagination_token"}
            seen += [b["batch_id"] for b in page["batches"]]
            if not page["pagination_token"]:
                break
            params = {"limit": 2, "pagination_token": page["pagination_token"]}
    assert seen == ids[::-1]


@pytest.mark.parametrize("dialect", ["openai", "doubleword", "zerogpu", "xai", "azure"])
def test_client_dialect_reads_every_batch_state_it_sees(batch_server, dialect):
    server = batch_server(dialect=dialect)
    client_dialect = get_dialect(dialect)
    with _client(server) as client:
        file_id = upload(client, jsonl([chat_line(1)]), purpose=client_dialect.upload_purpose)
        body = client_dialect.create_batch_body(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"k": "v"},
        )
        response = client.post("/batches", json=body)
        assert response.status_code == 200, response.text
        batch = client_dialect.parse_batch(response.json())
        while not batch.state.is_terminal:
            batch = client_dialect.parse_batch(client.get(client_dialect.batch_path(batch.id)).json())
        listed = client_dialect.parse_list_page(client.get("/batches").json(), {})
    assert batch.state is BatchState.COMPLETED
    assert batch.request_counts.completed == 1
    assert [b.id for b in listed.batches] == [batch.id]


def test_zerogpu_size_limits_answer_request_too_large(batch_server):
    server = batch_server(dialect="zerogpu", max_lines=2)
    with _client(server) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(3)))
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        response = client.post("/batches", json=body)
        forced = client.post("/batches", json=body, headers={"X-Batch-Fault": "fail_validation"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "request_too_large"
    assert response.json()["error"]["line"] is None
    assert forced.status_code == 400


def test_xai_expired_batch_ends_its_pending_lines_as_deadline_errors(batch_server):
    # xAI reports only counters: the lines its expiry stopped end as errors (gRPC
    # DEADLINE_EXCEEDED), so nothing stays pending and the client follows that state.
    server = batch_server(dialect="xai")
    with _client(server) as client:
        file_id = upload(client, jsonl(_xai_lines(3)), purpose=None)
        batch_id = client.post(
            "/batches", json={"name": "e", "input_file_id": file_id}, headers={"X-Batch-Fault": "expire"}
        ).json()["batch_id"]
        dialect = get_dialect("xai")
        batch = dialect.parse_batch(client.get(f"/batches/{batch_id}").json())
        while not batch.state.is_terminal:
            batch = dialect.parse_batch(client.get(f"/batches/{batch_id}").json())
        results = client.get(f"/batches/{batch_id}/results").json()["results"]
    assert batch.state is BatchState.COMPLETED
    assert batch.raw["state"]["num_pending"] == 0 and batch.raw["state"]["num_error"] == 3
    assert batch.input_file_id == file_id
    assert {r["batch_result"]["error"]["code"] for r in results} == {4}


def test_xai_cancelled_lines_carry_grpc_cancelled_and_successes_an_empty_status(batch_server):
    server = batch_server(dialect="xai")
    with _client(server) as client:
        file_id = upload(client, jsonl(_xai_lines(2)), purpose=None)
        done_id = client.post("/batches", json={"name": "ok", "input_file_id": file_id}).json()["batch_id"]
        stalled = client.post(
            "/batches", json={"name": "c", "input_file_id": file_id}, headers={"X-Batch-Fault": "stall"}
        ).json()["batch_id"]
        client.post(f"/batches/{stalled}:cancel")
        while client.get(f"/batches/{stalled}").json()["state"]["num_pending"]:
            pass
        while client.get(f"/batches/{done_id}").json()["state"]["num_success"] < 2:
            pass
        cancelled = client.get(f"/batches/{stalled}/results").json()["results"]
        done = client.get(f"/batches/{done_id}/results").json()["results"]
    assert {r["batch_result"]["error"]["code"] for r in cancelled} == {1}
    assert [r["batch_result"]["error"] for r in done] == [{}, {}]
    lines = get_dialect("xai").parse_results_page({"results": cancelled + done}, {}).lines
    assert [line.error.code if line.error else None for line in lines] == ["batch_cancelled"] * 2 + [None] * 2


def test_doubleword_results_clamp_limit_and_mark_the_last_page(batch_server):
    server = batch_server(dialect="doubleword")
    with _client(server) as client:
        done = wait_for(client, create(client, upload(client, jsonl(chat_line(i) for i in range(120))))["id"])
        first = client.get(f"/batches/{done['id']}/results", params={"limit": 1000})
        last = client.get(f"/batches/{done['id']}/results", params={"skip": 101, "limit": 1000})
        default = client.get(f"/batches/{done['id']}/results")
        past = client.get(f"/batches/{done['id']}/results", params={"skip": 120, "limit": 5})
    assert len(first.content.splitlines()) == 101
    assert first.headers["X-Incomplete"] == "true" and first.headers["X-Last-Line"] == "101"
    assert len(last.content.splitlines()) == 19
    assert last.headers["X-Incomplete"] == "false" and last.headers["X-Last-Line"] == "120"
    assert len(default.content.splitlines()) == 10  # limit defaults to 10
    assert past.content == b"" and past.headers["X-Incomplete"] == "false"


def test_zerogpu_needs_the_project_on_every_request(batch_server):
    server = batch_server(dialect="zerogpu", api_key="zg-key")
    with _client(server, **{"x-api-key": "zg-key"}) as client:
        refused = client.get("/batches")
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert "x-project-id" in refused.json()["error"]["message"]
    with _client(server, **{"x-api-key": "zg-key", "x-project-id": "p1"}) as client:
        assert client.get("/batches").status_code == 200


def test_zerogpu_upload_limit_answers_413(batch_server):
    server = batch_server(dialect="zerogpu", max_upload_bytes=2000)
    small = jsonl(chat_line(i) for i in range(3))
    big = jsonl(chat_line(i) for i in range(40))
    assert len(small) < 2000 < len(big)
    with _client(server) as client:
        upload(client, small)
        refused = client.post("/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})
    assert refused.status_code == 413
    assert refused.json()["error"]["message"] == "Uploaded file is larger than 2,000 bytes"
    assert refused.json()["error"]["type"] == "request_too_large"
    # The vendor's own limit, without the override, is 100 MB.
    assert batch_server(dialect="zerogpu").config.limits().max_upload_bytes == 100 << 20


def test_zerogpu_cancel_of_a_finished_batch_answers_409(batch_server):
    server = batch_server(dialect="zerogpu")
    with _client(server) as client:
        done = wait_for(client, create(client, upload(client, jsonl([chat_line(1)])))["id"])
        refused = client.post(f"/batches/{done['id']}/cancel")
    assert done["status"] == "completed"
    assert refused.status_code == 409


@pytest.mark.parametrize("dialect", ["openai", "doubleword", "zerogpu", "xai", "azure"])
def test_quota_fault_answers_insufficient_quota(batch_server, dialect):
    server = batch_server(dialect=dialect)
    with _client(server, **{"X-Batch-Fault": "quota"}) as client:
        refused = client.get("/batches")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert get_dialect(dialect).is_quota_error(429, refused.json())
    assert server.stats()["counters"]["quota"] == 1


def test_openai_mode_fails_a_batch_that_mixes_models(batch_server):
    server = batch_server(dialect="openai")
    with _client(server) as client:
        lines = [chat_line(1), chat_line(2, model="other-model")]
        done = wait_for(client, create(client, upload(client, jsonl(lines)))["id"])
    assert done["status"] == "failed"
    assert done["errors"]["data"][0]["line"] == 2
    assert done["errors"]["data"][0]["code"] == "mismatched_model"
