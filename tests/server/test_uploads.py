"""Uploads: complete bodies only, size and storage caps enforced while uploading, crash leftovers swept."""

from __future__ import annotations

import threading

import httpx
import pytest

from airflow_batch_provider.server.store import Store
from tests.server.helpers import chat_line, create, jsonl, upload, wait_for


def _leftovers(server) -> list[str]:
    return sorted(p.name for p in (server.config.data_dir / "work").iterdir()) + sorted(
        p.name for p in (server.config.data_dir / "files").iterdir()
    )


def _body(data: bytes, *, closed: bool = True) -> tuple[bytes, dict[str, str]]:
    body = (
        b"--bnd\r\n"
        b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--bnd\r\n"
        b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n' + data
    )
    if closed:
        body += b"\r\n--bnd--\r\n"
    return body, {"Content-Type": "multipart/form-data; boundary=bnd"}


@pytest.mark.parametrize("cut", ["no_closing_boundary", "mid_file"])
def test_a_truncated_multipart_body_is_refused(batch_server, cut):
    server = batch_server()
    data = jsonl(chat_line(i) for i in range(50))
    body, headers = _body(data, closed=False)
    if cut == "mid_file":
        body = body[: len(body) - len(data) // 2]
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        refused = client.post("/files", content=body, headers=headers)
        assert refused.status_code == 400
        assert "closing boundary" in refused.json()["error"]["message"]
        assert client.get("/files").json()["data"] == []
        whole, headers = _body(data)
        assert client.post("/files", content=whole, headers=headers).json()["bytes"] == len(data)
    assert [name for name in _leftovers(server) if name.endswith(".part")] == []


def test_max_file_bytes_is_enforced_while_uploading(batch_server):
    server = batch_server(max_file_bytes=1_000_000)
    big = b"x" * (19 * 1024 * 1024)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        refused = client.post("/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})
        assert refused.status_code == 413
        assert "1,000,000" in refused.json()["error"]["message"]
        assert client.get("/files").json()["data"] == []
        # Exactly at the limit is fine.
        ok = client.post("/files", files={"file": ("ok.jsonl", b"y" * 1_000_000)}, data={"purpose": "batch"})
        assert ok.status_code == 200
    assert len(_leftovers(server)) == 1  # the accepted file only


def test_storage_cap_refuses_uploads_and_batches_when_full(batch_server):
    data = jsonl(chat_line(i) for i in range(150))
    cap = len(data) * 3 // 2
    server = batch_server(max_storage_bytes=cap)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        first = upload(client, data)
        second = client.post("/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
        assert second.status_code == 507
        assert "storage is full" in second.json()["error"]["message"]
        assert [f["id"] for f in client.get("/files").json()["data"]] == [first]
        # The first batch's output (larger than its input) would overfill the store: it fails.
        done = wait_for(client, create(client, first)["id"])
        assert done["status"] == "failed"
        assert [e["code"] for e in done["errors"]["data"]] == ["insufficient_storage"]
        assert done["output_file_id"] is None
        assert _disk_usage(server) <= cap
        # Filling the store to the byte: a batch is refused up front, and so is an upload.
        filler = upload(client, b"x" * (cap - len(data)))
        refused = client.post(
            "/batches",
            json={"input_file_id": first, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        assert refused.status_code == 507
        tiny = client.post("/files", files={"file": ("c", b"y")}, data={"purpose": "batch"})
        assert tiny.status_code == 507
        client.delete(f"/files/{filler}")
        assert upload(client, data[: len(data) // 3])
    assert [name for name in _leftovers(server) if name.endswith(".part")] == []


def _disk_usage(server) -> int:
    return sum(
        p.stat().st_size for folder in ("files", "work") for p in (server.config.data_dir / folder).iterdir()
    )


def test_concurrent_uploads_cannot_pass_the_storage_cap_between_them(batch_server):
    """The issue's case scaled down: three uploads streaming at once against a cap for one and a half."""
    size = 3 * 1024 * 1024
    cap = size * 5 // 3
    server = batch_server(max_storage_bytes=cap)
    started = threading.Barrier(3, timeout=30)
    results: list[httpx.Response] = []

    def body():
        head, _ = _body(b"", closed=False)
        yield head  # the purpose field and the file part's headers
        yield b"x" * (size // 8)
        # Every upload has begun (and passed any check made at its start) before one finishes.
        started.wait()
        for _ in range(7):
            yield b"x" * (size // 8)
        yield b"\r\n--bnd--\r\n"

    def send():
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            headers = {"Content-Type": "multipart/form-data; boundary=bnd"}
            results.append(client.post("/files", content=body(), headers=headers))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    accepted = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code != 200]
    assert len(accepted) == 1, [r.status_code for r in results]
    assert accepted[0].json()["bytes"] == size
    assert [r.status_code for r in refused] == [507, 507]
    assert all("storage is full" in r.json()["error"]["message"] for r in refused)
    assert _disk_usage(server) == size <= cap
    assert server.stats()["storage"]["peak_bytes"] <= cap
    assert [name for name in _leftovers(server) if name.endswith(".part")] == []


def test_batch_output_stops_at_the_storage_cap_and_the_batch_fails(batch_server):
    """The issue's case scaled down: answers many times the input's size stop at the cap."""
    lines = [chat_line(i, n=32) for i in range(200)]  # each answer repeats the prompt 32 times
    data = jsonl(lines)
    cap = len(data) + 256 * 1024
    server = batch_server(max_storage_bytes=cap)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        file_id = upload(client, data)
        done = wait_for(client, create(client, file_id)["id"])
        files = client.get("/files").json()["data"]
    assert done["status"] == "failed"
    assert done["output_file_id"] is None and done["error_file_id"] is None
    [error] = done["errors"]["data"]
    assert error["code"] == "insufficient_storage"
    assert f"storage limit of {cap:,} bytes" in error["message"]
    assert [f["id"] for f in files] == [file_id]
    storage = server.stats()["storage"]
    assert storage["peak_bytes"] <= cap
    assert storage["used_bytes"] == _disk_usage(server) == len(data)
    assert sorted(p.name for p in (server.config.data_dir / "work").iterdir()) == []


@pytest.mark.parametrize("form", ["many_fields", "large_field"])
def test_upload_forms_are_bounded(batch_server, form):
    data = jsonl(chat_line(i) for i in range(3))
    file_part = b'--bnd\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    if form == "many_fields":
        extra = b"".join(
            b'--bnd\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n' % i for i in range(5000)
        )
        expected = "more than 16 parts"
    else:
        extra = b'--bnd\r\nContent-Disposition: form-data; name="note"\r\n\r\n' + b"v" * 100_000 + b"\r\n"
        expected = "'note' is larger than 65,536 bytes"
    purpose = b'--bnd\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    body = purpose + extra + file_part + data + b"\r\n--bnd--\r\n"
    server = batch_server()
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        multipart = {"Content-Type": "multipart/form-data; boundary=bnd"}
        refused = client.post("/files", content=body, headers=multipart)
        assert refused.status_code == 400, refused.content[:300]
        assert expected in refused.json()["error"]["message"]
        assert client.get("/files").json()["data"] == []
        # The same upload without the extra form data is taken.
        ok = client.post(
            "/files",
            content=purpose + file_part + data + b"\r\n--bnd--\r\n",
            headers=multipart,
        )
        assert ok.status_code == 200
    assert [name for name in _leftovers(server) if name.endswith(".part")] == []


def test_crash_leftovers_are_removed_at_start_up(batch_server, tmp_path):
    store = Store(tmp_path)
    (store.work_dir / "file-abc.0123.part").write_bytes(b"half an upload")
    (store.work_dir / "batch_gone.output.jsonl").write_bytes(b"{}\n")
    (store.files_dir / "file-orphan").write_bytes(b"no record")
    store.add_file({"id": "file-kept", "bytes": 3, "created_at": 0, "filename": "k", "purpose": "batch"})
    (store.files_dir / "file-kept").write_bytes(b"{}\n")
    store.close()
    server = batch_server(data_dir=tmp_path)
    assert _leftovers(server) == ["file-kept"]
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get("/files/file-kept/content").content == b"{}\n"


def test_request_bodies_are_bounded(batch_server):
    server = batch_server(max_line_bytes=10_000)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        sync = client.post("/chat/completions", json={**chat_line(0)["body"], "pad": "x" * 20_000})
        ok = client.post("/chat/completions", json={**chat_line(0)["body"], "pad": "x" * 5_000})
        created = client.post(
            "/batches",
            json={
                "input_file_id": "file-x",
                "endpoint": "/v1/chat/completions",
                "metadata": {"k": "v" * 10**6},
            },
        )
        admin = httpx.post(f"{server.root_url}/admin/faults", json={"retry_after": 1, "pad": "x" * 10**6})
    assert sync.status_code == 413
    assert sync.json()["error"]["code"] == "request_too_large"
    assert ok.status_code == 200
    assert created.status_code == 413
    assert admin.status_code == 413


def test_a_file_over_a_limit_lowered_after_its_upload_fails_validation(batch_server, tmp_path):
    first = batch_server(data_dir=tmp_path)
    with httpx.Client(base_url=first.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(20)))
    first.stop()
    server = batch_server(data_dir=tmp_path, max_file_bytes=1000)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        done = wait_for(client, create(client, file_id)["id"])
    assert done["status"] == "failed"
    assert [e["code"] for e in done["errors"]["data"]] == ["file_too_large"]
