"""Batch lifecycle paths of the local batch server (openai dialect, echo backend)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for


@pytest.fixture
def server(batch_server):
    return batch_server()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as c:
        yield c


def test_completed_batch_has_one_answer_per_line(client):
    file_id = upload(client, jsonl(chat_line(i) for i in range(25)))
    batch = create(client, file_id, metadata={"run": "r1"})
    assert batch["status"] == "validating"
    assert batch["object"] == "batch"
    assert batch["metadata"] == {"run": "r1"}
    done = wait_for(client, batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 25, "completed": 25, "failed": 0}
    assert done["error_file_id"] is None
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert done[stamp] is not None
    lines = read_lines(client, done["output_file_id"])
    by_id = {line["custom_id"]: line for line in lines}
    assert sorted(by_id) == sorted(f"req-{i}" for i in range(25))
    answer = by_id["req-7"]["response"]
    assert answer["status_code"] == 200
    body = answer["body"]
    assert body["model"] == "echo:gpt-test"
    assert body["choices"][0]["message"]["content"] == "echo: hello number 7"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert by_id["req-7"]["error"] is None
    assert by_id["req-7"]["id"].startswith("batch_req_")


def test_output_file_object_and_listing(client):
    file_id = upload(client, jsonl(chat_line(i) for i in range(3)))
    done = wait_for(client, create(client, file_id)["id"])
    meta = client.get(f"/files/{done['output_file_id']}").json()
    assert meta["purpose"] == "batch_output"
    assert meta["bytes"] > 0
    listed = client.get("/files", params={"purpose": "batch"}).json()
    assert [f["id"] for f in listed["data"]] == [file_id]


def test_failed_lines_go_to_the_error_file_and_batch_still_completes(client):
    # The echo model answers 400 to a chat line without messages: a per-line failure.
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-test"}}
    file_id = upload(client, jsonl([chat_line(1), bad, chat_line(2)]))
    done = wait_for(client, create(client, file_id)["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    errors = read_lines(client, done["error_file_id"])
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "messages"
    assert {o["custom_id"] for o in read_lines(client, done["output_file_id"])} == {"req-1", "req-2"}


def test_validation_failure_lists_every_problem_with_its_line(client):
    lines = [
        chat_line(1),
        b"not json",
        chat_line(3, custom_id="req-1"),
        {**chat_line(4), "method": "GET"},
        {**chat_line(5), "url": "/v1/embeddings"},
    ]
    file_id = upload(client, jsonl(lines))
    done = wait_for(client, create(client, file_id)["id"])
    assert done["status"] == "failed"
    assert done["failed_at"] is not None
    assert done["errors"]["object"] == "list"
    found = {(e["line"], e["code"]) for e in done["errors"]["data"]}
    assert found == {
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "invalid_method"),
        (5, "mismatched_url"),
    }
    assert done["output_file_id"] is None and done["error_file_id"] is None


def test_cancel_keeps_partial_results_and_cancels_the_rest(batch_server):
    server = batch_server(line_seconds=20.0, chunk_size=2)  # 20 ms per line: slow enough to cancel mid-way
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(200)))
        batch = create(client, file_id)
        running = wait_for(client, batch["id"], {"in_progress"})
        # request_counts move while it runs
        while running["request_counts"]["completed"] < 4:
            running = client.get(f"/batches/{batch['id']}").json()
        cancelled = client.post(f"/batches/{batch['id']}/cancel").json()
        assert cancelled["status"] in ("cancelling", "cancelled")
        done = wait_for(client, batch["id"])
    assert done["status"] == "cancelled"
    assert done["cancelled_at"] is not None and done["cancelling_at"] is not None
    counts = done["request_counts"]
    assert 4 <= counts["completed"] < 200
    assert counts["completed"] + counts["failed"] == 200
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        outputs = read_lines(client, done["output_file_id"])
        errors = read_lines(client, done["error_file_id"])
    assert len(outputs) == counts["completed"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {line["custom_id"] for line in outputs + errors} == {f"req-{i}" for i in range(200)}


def test_cancel_a_finished_batch_is_refused(client):
    done = wait_for(client, create(client, upload(client, jsonl([chat_line(1)])))["id"])
    response = client.post(f"/batches/{done['id']}/cancel")
    assert response.status_code == 400
    assert "completed" in response.json()["error"]["message"]


def test_expiry_keeps_completed_lines_and_expires_the_rest(batch_server):
    server = batch_server(line_seconds=20.0, chunk_size=2)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        batch = create(client, upload(client, jsonl(chat_line(i) for i in range(200))))
        running = wait_for(client, batch["id"], {"in_progress"})
        while running["request_counts"]["completed"] < 4:
            running = client.get(f"/batches/{batch['id']}").json()
        server.force(batch["id"], "expire")
        done = wait_for(client, batch["id"])
        assert done["status"] == "expired"
        assert done["expired_at"] is not None
        outputs = read_lines(client, done["output_file_id"])
        errors = read_lines(client, done["error_file_id"])
    assert len(outputs) == done["request_counts"]["completed"] >= 4
    assert errors and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(outputs) + len(errors) == 200


def test_completion_window_passing_expires_the_batch(batch_server):
    # time_scale 1e-5: the 24 h window lasts 0.864 s; 10 ms per line cannot finish 2,000 lines.
    server = batch_server(time_scale=1e-5, line_seconds=1000.0, chunk_size=5)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        batch = create(client, upload(client, jsonl(chat_line(i) for i in range(2000))))
        done = wait_for(client, batch["id"])
    assert done["status"] == "expired"
    assert done["request_counts"]["failed"] > 0


def test_list_batches_pages_with_after_and_has_more(client):
    file_id = upload(client, jsonl([chat_line(1)]))
    ids = [create(client, file_id)["id"] for _ in range(5)]
    first = client.get("/batches", params={"limit": 2}).json()
    assert first["object"] == "list"
    assert [b["id"] for b in first["data"]] == ids[::-1][:2]
    assert first["has_more"] is True
    seen = [b["id"] for b in first["data"]]
    after = first["last_id"]
    while True:
        page = client.get("/batches", params={"limit": 2, "after": after}).json()
        seen += [b["id"] for b in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids[::-1]
    for batch_id in ids:
        wait_for(client, batch_id)


def test_unknown_batch_and_file_are_404(client):
    assert client.get("/batches/batch_nope").status_code == 404
    assert client.get("/files/file-nope").status_code == 404
    assert client.get("/files/file-nope/content").status_code == 404
    assert client.delete("/files/file-nope").status_code == 404


def test_create_rejects_bad_requests(client):
    file_id = upload(client, jsonl([chat_line(1)]))
    other = upload(client, jsonl([chat_line(1)]), purpose="fine-tune")
    cases = [
        ({"input_file_id": file_id, "endpoint": "/v1/images", "completion_window": "24h"}, "endpoint"),
        (
            {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "1h"},
            "completion_window",
        ),
        ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
        (
            {"input_file_id": other, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            "input_file_id",
        ),
        (
            {
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {f"k{i}": "v" for i in range(17)},
            },
            "metadata",
        ),
    ]
    for body, param in cases:
        response = client.post("/batches", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    assert (
        client.post(
            "/batches",
            json={
                "input_file_id": "file-missing",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).status_code
        == 404
    )


def test_file_delete_and_upload_needs_purpose(client):
    file_id = upload(client, b'{"a": 1}\n')
    assert client.delete(f"/files/{file_id}").json() == {"id": file_id, "object": "file", "deleted": True}
    assert client.get(f"/files/{file_id}").status_code == 404
    response = client.post("/files", files={"file": ("x.jsonl", b"{}\n")})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "purpose"


def test_embeddings_batch(client):
    line = {
        "custom_id": "e1",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "emb", "input": "some text", "dimensions": 8},
    }
    done = wait_for(client, create(client, upload(client, jsonl([line])), endpoint="/v1/embeddings")["id"])
    (out,) = read_lines(client, done["output_file_id"])
    vector = out["response"]["body"]["data"][0]["embedding"]
    assert len(vector) == 8
    assert abs(sum(x * x for x in vector) - 1) < 1e-3
    assert out["response"]["body"]["model"] == "echo:emb"


def test_bearer_key_is_checked(batch_server):
    server = batch_server(api_key="sk-secret")
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        missing = client.get("/batches")
        wrong = client.get("/batches", headers={"Authorization": "Bearer sk-wrong"})
        right = client.get("/batches", headers={"Authorization": "Bearer sk-secret"})
    assert missing.status_code == 401
    assert wrong.status_code == 401
    assert "sk-wrong" not in wrong.text
    assert right.status_code == 200


def test_upload_needs_a_multipart_file_part(client):
    not_multipart = client.post("/files", content=b'{"a": 1}', headers={"Content-Type": "application/json"})
    assert not_multipart.status_code == 400
    no_file = client.post("/files", data={"purpose": "batch"}, files={"other": ("x.txt", b"abc")})
    assert no_file.status_code == 400
    assert no_file.json()["error"]["param"] == "file"


def test_files_list_pages_with_after_and_limit(client):
    ids = [upload(client, b'{"n": %d}\n' % i, name=f"f{i}.jsonl") for i in range(5)]
    first = client.get("/files", params={"limit": 3}).json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:3]
    assert first["has_more"] is True
    rest = client.get("/files", params={"limit": 3, "after": first["last_id"]}).json()
    assert [f["id"] for f in rest["data"]] == ids[::-1][3:]
    assert rest["has_more"] is False
    meta = client.get(f"/files/{ids[0]}").json()
    assert meta["filename"] == "f0.jsonl"
    assert meta["bytes"] == len(b'{"n": 0}\n')
