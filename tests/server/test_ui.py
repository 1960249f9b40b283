"""The server's HTML pages (``/ui``): listing with paging, a batch's page, files, escaping, auth."""

from __future__ import annotations

import base64
import re
from typing import Any

import httpx
import orjson
import pytest

from tests.server.helpers import chat_line, create, jsonl, upload, wait_for

XSS = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def _ui(server: Any, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=server.root_url, timeout=30, headers=headers)


def _api(server: Any) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=30, headers=server.auth_headers())


def _batch(api: httpx.Client, lines: int, *, fault: str | None = None, **extra: Any) -> dict[str, Any]:
    file_id = upload(api, jsonl(chat_line(i) for i in range(lines)), name=extra.pop("name", "in.jsonl"))
    return create(api, file_id, headers={"X-Batch-Fault": fault} if fault else None, **extra)


def _cell(html: str, batch_id: str, column: str) -> str:
    row = re.search(rf'<tr data-batch="{re.escape(batch_id)}">(.*?)</tr>', html, re.S)
    assert row, f"no row for {batch_id}"
    cell = re.search(rf'<td class="n {column}">(\d+)</td>', row.group(1))
    assert cell
    return cell.group(1)


def test_listing_and_batch_page_show_status_counts_and_file_links(batch_server: Any) -> None:
    server = batch_server()
    with _api(server) as api, _ui(server) as ui:
        done = _batch(api, 3, name="tickets.jsonl")
        wait_for(api, done["id"])
        page = ui.get("/ui/batches")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "script-src" not in page.headers["content-security-policy"]  # no script at all
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert _cell(page.text, done["id"], "total") == "3"
        assert _cell(page.text, done["id"], "completed") == "3"
        assert 'data-status="completed"' in page.text

        detail = ui.get(f"/ui/batches/{done['id']}").text
        assert '<td class="n completed">3</td>' in detail
        assert "tickets.jsonl" in detail
        assert '<progress max="3" value="3">' in detail and "100%" in detail
        rec = api.get(f"/batches/{done['id']}").json()
        for key in ("input_file_id", "output_file_id"):
            assert f"href='/ui/files/{rec[key]}'" in detail
        content = ui.get(f"/ui/files/{rec['output_file_id']}")
        assert content.headers["content-type"] == "text/plain; charset=utf-8"
        assert content.headers["x-content-type-options"] == "nosniff"
        assert content.text.count("\n") == 3 and '"custom_id"' in content.text
        assert ui.get("/ui/batches/batch_nope").status_code == 404
        assert ui.get("/ui/files/file-nope").status_code == 404


def test_listing_pages_through_many_batches(batch_server: Any) -> None:
    server = batch_server()
    with _api(server) as api, _ui(server) as ui:
        file_id = upload(api, jsonl([chat_line(0)]))
        ids = [create(api, file_id)["id"] for _ in range(7)]
        seen: list[str] = []
        url: str | None = "/ui/batches?limit=3"
        pages = 0
        while url:
            html = ui.get(url).text
            seen += re.findall(r'<tr data-batch="([^"]+)">', html)
            nxt = re.search(r'<a rel="next" href="([^"]+)">', html)
            url = nxt.group(1).replace("&amp;", "&") if nxt else None
            pages += 1
        assert pages == 3
        assert seen == ids[::-1]  # newest first, each batch once


def test_user_input_is_escaped(batch_server: Any) -> None:
    server = batch_server()
    with _api(server) as api, _ui(server) as ui:
        rec = _batch(api, 1, name=f"{XSS}.jsonl", metadata={"note": XSS, XSS[:40]: "v"})
        wait_for(api, rec["id"])
        for html in (ui.get(f"/ui/batches/{rec['id']}").text, ui.get("/ui/batches").text):
            assert "<script>" not in html and "<img" not in html
        detail = ui.get(f"/ui/batches/{rec['id']}").text
        assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in detail
        missing = ui.get(f"/ui/batches/{XSS}")
        assert missing.status_code == 404 and "<script>" not in missing.text


def test_a_server_with_a_key_demands_it(batch_server: Any) -> None:
    server = batch_server(api_key="sk-ui-secret")
    with _api(server) as api:
        rec = _batch(api, 2)
        wait_for(api, rec["id"])
        out = api.get(f"/batches/{rec['id']}").json()["output_file_id"]
    for path in ("/ui/batches", f"/ui/batches/{rec['id']}", f"/ui/files/{out}"):
        with _ui(server) as anonymous:
            refused = anonymous.get(path)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"].startswith("Basic ")
            assert rec["id"] not in refused.text
            assert anonymous.get(path, params={"key": "sk-ui-secret"}).status_code == 401
        wrong = base64.b64encode(b"me:sk-wrong").decode()
        with _ui(server, Authorization=f"Basic {wrong}") as guess:
            assert guess.get(path).status_code == 401
        basic = base64.b64encode(b"anyone:sk-ui-secret").decode()
        with _ui(server, Authorization=f"Basic {basic}") as browser:
            assert browser.get(path).status_code == 200
        with _ui(server, Authorization="Bearer sk-ui-secret") as client:
            assert client.get(path).status_code == 200


@pytest.mark.parametrize("dialect", ["doubleword", "zerogpu", "xai"])
def test_pages_work_under_every_dialect(batch_server: Any, dialect: str) -> None:
    server = batch_server(dialect=dialect)
    with httpx.Client(base_url=server.base_url, timeout=30, headers={"x-project-id": "p"}) as api:
        file_id = upload(api, jsonl([chat_line(0), chat_line(1)]))
        batch = api.post(
            "/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "name": "n",
            },
        )
        assert batch.status_code < 300, batch.text
    with _ui(server) as ui:
        html = ui.get("/ui/batches").text
        ids = re.findall(r'<tr data-batch="([^"]+)">', html)
        assert len(ids) == 1
        assert _cell(html, ids[0], "total") in {"0", "2"}
        assert ui.get(f"/ui/batches/{ids[0]}").status_code == 200


def test_pages_work_under_mistral(batch_server: Any) -> None:
    # Mistral's jobs live under /v1/batch/jobs with the model on the job and {custom_id, body} lines.
    server = batch_server(dialect="mistral")
    lines = [orjson.dumps({"custom_id": f"r{i}", "body": {"messages": []}}) + b"\n" for i in range(2)]
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        file_id = upload(api, b"".join(lines))
        job = api.post(
            "/batch/jobs",
            json={"input_files": [file_id], "endpoint": "/v1/chat/completions", "model": "m"},
        )
        assert job.status_code < 300, job.text
    with _ui(server) as ui:
        html = ui.get("/ui/batches").text
        ids = re.findall(r'<tr data-batch="([^"]+)">', html)
        assert ids == [job.json()["id"]]
        assert _cell(html, ids[0], "total") in {"0", "2"}
        assert ui.get(f"/ui/batches/{ids[0]}").status_code == 200
