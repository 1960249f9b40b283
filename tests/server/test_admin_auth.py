"""With an API key set, /admin and the X-Batch-Fault header need it; admin input is checked."""

from __future__ import annotations

import httpx
import pytest

KEY = "sk-admin-secret"


@pytest.fixture
def server(batch_server):
    return batch_server(api_key=KEY)


def test_admin_endpoints_need_the_api_key(server):
    root = f"{server.root_url}/admin"
    assert httpx.get(f"{root}/faults").status_code == 401
    assert httpx.get(f"{root}/stats").status_code == 401
    changed = httpx.post(f"{root}/faults", json={"rate_500": 1})
    assert changed.status_code == 401
    assert KEY not in changed.text
    wrong = httpx.post(f"{root}/faults", json={"rate_500": 1}, headers={"Authorization": "Bearer sk-no"})
    assert wrong.status_code == 401
    forced = httpx.post(f"{root}/batches/batch_x/force", json={"action": "fail"})
    assert forced.status_code == 401
    # Nothing was changed by the refused calls; the key opens the same endpoints.
    assert server.admin("GET", "faults")["rate_500"] == 0
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}) as client:
        assert client.get("/files").status_code == 200


def test_zerogpu_admin_reads_its_own_auth_header(batch_server):
    server = batch_server(dialect="zerogpu", api_key="zg-admin")
    root = f"{server.root_url}/admin"
    assert httpx.get(f"{root}/faults", headers={"Authorization": "Bearer zg-admin"}).status_code == 401
    assert httpx.get(f"{root}/faults", headers={"x-api-key": "zg-admin"}).status_code == 200


def test_fault_header_is_applied_only_after_authentication(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        anonymous = client.get("/batches", headers={"X-Batch-Fault": "500"})
        slow = client.get("/batches", headers={"X-Batch-Fault": "slow"})
        keyed = client.get("/batches", headers={"X-Batch-Fault": "503", "Authorization": f"Bearer {KEY}"})
    assert anonymous.status_code == 401
    assert slow.status_code == 401
    assert keyed.status_code == 503
    counters = server.stats()["counters"]
    assert "status_500" not in counters
    assert "slow" not in counters
    assert counters["status_503"] == 1


def test_configured_faults_never_answer_before_authentication(server):
    server.set_faults(rate_429=1.0)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get("/files").status_code == 401
        assert client.get("/files", headers={"Authorization": f"Bearer {KEY}"}).status_code == 429


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
def test_admin_refuses_bodies_that_are_not_json(batch_server, content_type):
    server = batch_server()  # no key: the content-type rule alone stops a cross-site page
    headers = {"Content-Type": content_type} if content_type else {}
    refused = httpx.post(f"{server.root_url}/admin/faults", content=b'{"rate_500": 1}', headers=headers)
    assert refused.status_code == 415
    assert "application/json" in refused.json()["error"]["message"]
    assert server.admin("GET", "faults")["rate_500"] == 0
    accepted = httpx.post(
        f"{server.root_url}/admin/faults",
        content=b'{"rate_500": 0.5}',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert accepted.status_code == 200
    assert accepted.json()["rate_500"] == 0.5


@pytest.mark.parametrize(
    "settings",
    [
        {"retry_after": 1e308, "rate_429": 1},
        {"retry_after": 86_401},
        {"slow_seconds": 1e9},
        {"retry_after": -1},
        [1, 2],
    ],
)
def test_admin_values_are_validated(batch_server, settings):
    server = batch_server()
    refused = httpx.post(f"{server.root_url}/admin/faults", json=settings)
    assert refused.status_code == 400
    assert "bad fault settings" in refused.json()["error"]["message"]
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get("/batches").status_code == 200
