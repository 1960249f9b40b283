"""One bad line never fails a batch, and every error is JSON in the vendor's shape."""

from __future__ import annotations

import base64
import socket
import time
from urllib.parse import unquote

import httpx
import pytest

from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for

BAD_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "n",
        "schema": {"type": "object", "properties": {"x": {"type": "integer", "minimum": "abc"}}},
    },
}


def test_a_line_with_an_invalid_schema_value_fails_alone(batch_server):
    server = batch_server()
    lines = [chat_line(i) for i in range(21)]
    lines[7]["body"] = {**lines[7]["body"], "response_format": BAD_SCHEMA}
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, jsonl(lines)))["id"])
        outputs = read_lines(client, done["output_file_id"])
        errors = read_lines(client, done["error_file_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 21, "completed": 20, "failed": 1}
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"req-{i}" for i in range(21) if i != 7)
    assert [e["custom_id"] for e in errors] == ["req-7"]
    error = errors[0]["response"]
    assert error["status_code"] == 400
    assert "minimum" in error["body"]["error"]["message"]


def test_sync_request_with_an_invalid_schema_value_is_a_json_400(batch_server):
    server = batch_server()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        response = client.post(
            "/chat/completions", json={**chat_line(0)["body"], "response_format": BAD_SCHEMA}
        )
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert "minimum" in response.json()["error"]["message"]


def _raw_request(port: int, request: bytes) -> bytes:
    """Send bytes as they are (no client-side path normalisation) and read the whole reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("ident", ["%2E%2E", "%2e", "%00", "..%2Fserver.db", "a%00b"])
@pytest.mark.parametrize("method", ["DELETE", "GET"])
def test_odd_file_ids_are_a_json_404(batch_server, ident, method):
    server = batch_server()
    reply = _raw_request(
        server.config.port,
        f"{method} /v1/files/{ident} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode(),
    )
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404"), reply
    assert b"application/json" in head
    assert b'"not_found"' in body
    content = httpx.get(f"{server.base_url}/files/{ident}/content")
    assert content.status_code == 404
    assert content.json()["error"]["code"] == "not_found"
    # The data directory is intact.
    assert (server.config.data_dir / "server.db").exists()
    assert (server.config.data_dir / "files").is_dir()


def _multipart(filename: bytes, data: bytes, boundary: bytes = b"b0undary") -> tuple[bytes, dict[str, str]]:
    body = (
        b"--" + boundary + b"\r\n"
        b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--" + boundary + b"\r\n"
        b'Content-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n"
        b"--" + boundary + b"--\r\n"
    )
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary.decode()}"}


@pytest.mark.parametrize(
    ("raw_name", "expected"),
    [
        ("日本語 データ.jsonl".encode(), "日本語 データ.jsonl"),
        ("€uro.jsonl".encode(), "€uro.jsonl"),
        (b'quote\\"d.jsonl', 'quote"d.jsonl'),
        (b"nul\x00.jsonl", "nul\x00.jsonl"),
    ],
)
def test_content_of_a_file_with_an_awkward_name(batch_server, raw_name, expected):
    server = batch_server()
    data = jsonl([chat_line(1)])
    body, headers = _multipart(raw_name, data)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        uploaded = client.post("/files", content=body, headers=headers)
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        assert uploaded.json()["filename"] == expected
        response = client.get(f"/files/{file_id}/content")
    assert response.status_code == 200
    assert response.content == data
    disposition = response.headers["content-disposition"]
    assert disposition.isascii()
    fallback = disposition.split('filename="', 1)[1].split('"', 1)[0]
    assert '"' not in fallback and "\x00" not in fallback
    assert unquote(disposition.split("filename*=UTF-8''", 1)[1]) == expected


def test_xai_pagination_token_out_of_range_is_a_400(batch_server):
    server = batch_server(dialect="xai")
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(3)), purpose=None)
        batch = client.post("/batches", json={"name": "b", "input_file_id": file_id})
        batch_id = batch.json()["batch_id"]
        deadline = time.monotonic() + 30
        while client.get(f"/batches/{batch_id}").json()["state"]["num_success"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        first = client.get(f"/batches/{batch_id}/results", params={"limit": 1})
        assert first.status_code == 200 and first.json()["pagination_token"]
        for raw in ("o:999999999", "o:-1", "e:0", "z:0", "o:" + "9" * 40):
            token = base64.urlsafe_b64encode(raw.encode()).decode()
            response = client.get(f"/batches/{batch_id}/results", params={"pagination_token": token})
            assert response.status_code == 400, (raw, response.text)
            assert "pagination_token" in response.json()["error"]["message"]


def test_doubleword_results_after_the_input_file_was_deleted(batch_server):
    server = batch_server(dialect="doubleword")
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(3)))
        done = wait_for(client, create(client, file_id)["id"])
        assert client.delete(f"/files/{file_id}").status_code == 200
        response = client.get(f"/batches/{done['id']}/results")
        assert response.status_code == 404
        error = response.json()["error"]
        assert file_id in error["message"]
        assert "output_file_id" in error["message"]
        # The output file itself is still there.
        assert len(read_lines(client, done["output_file_id"])) == 3


def test_unknown_paths_and_methods_answer_in_the_vendor_shape(batch_server):
    server = batch_server(dialect="zerogpu")
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        missing = client.get("/nothing-here")
        wrong = client.put("/files")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert wrong.status_code == 405
    assert "message" in wrong.json()["error"]
