"""Fault injection: configured at start, changed at runtime, forced per request; all counted."""

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


def test_429_carries_retry_after_and_fires_at_the_configured_rate(server, client):
    server.set_faults(rate_429=0.5, retry_after=3)
    statuses = [client.get("/batches").status_code for _ in range(6)]
    assert statuses == [429, 200, 429, 200, 429, 200]
    limited = client.get("/batches")
    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "3"
    assert limited.headers["retry-after-ms"] == "3000"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert server.stats()["counters"]["status_429"] == 4


def test_faults_set_at_start(batch_server):
    server = batch_server(faults={"rate_500": 1.0})
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        response = client.get("/files")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert server.stats()["counters"]["status_500"] == 1


@pytest.mark.parametrize("status", [429, 500, 503])
def test_fault_header_forces_one_status(server, client, status):
    response = client.get("/batches", headers={"X-Batch-Fault": str(status)})
    assert response.status_code == status
    if status == 503:
        assert "retry-after" in response.headers
    assert client.get("/batches").status_code == 200
    assert server.stats()["counters"][f"status_{status}"] == 1


def test_unknown_fault_header_is_a_400(client):
    response = client.get("/batches", headers={"X-Batch-Fault": "explode"})
    assert response.status_code == 400
    assert "explode" in response.json()["error"]["message"]


def test_slow_responses_are_counted(server, client):
    server.set_faults(slow_rate=1.0, slow_seconds=0.01)
    assert client.get("/batches").status_code == 200
    assert client.get("/batches", headers={"X-Batch-Fault": "slow"}).status_code == 200
    assert server.stats()["counters"]["slow"] == 2


def test_dropped_download_is_truncated_mid_body(server, client):
    data = jsonl(chat_line(i) for i in range(3000))
    file_id = upload(client, data)
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(f"/files/{file_id}/content", headers={"X-Batch-Fault": "drop"})
    server.set_faults(drop_rate=0.5)
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(f"/files/{file_id}/content")
    assert client.get(f"/files/{file_id}/content").content == data
    assert server.stats()["counters"]["drop"] == 2


def test_a_fraction_of_lines_fails(server, client):
    server.set_faults(line_failure_rate=0.5)
    done = wait_for(client, create(client, upload(client, jsonl(chat_line(i) for i in range(200))))["id"])
    counts = done["request_counts"]
    assert done["status"] == "completed"
    assert 0 < counts["failed"] < 200
    assert counts["completed"] + counts["failed"] == 200
    errors = read_lines(client, done["error_file_id"])
    assert len(errors) == counts["failed"]
    assert {e["response"]["status_code"] for e in errors} == {500}
    assert server.stats()["counters"]["line_failures"] == counts["failed"]


def test_force_validation_failure_by_header_and_config(server, client):
    file_id = upload(client, jsonl([chat_line(1)]))
    done = wait_for(client, create(client, file_id, headers={"X-Batch-Fault": "fail_validation"})["id"])
    assert done["status"] == "failed"
    assert done["errors"]["data"][0]["code"] == "forced_failure"
    server.set_faults(fail_validation=True)
    assert wait_for(client, create(client, file_id)["id"])["status"] == "failed"
    server.set_faults(fail_validation=False)
    assert wait_for(client, create(client, file_id)["id"])["status"] == "completed"
    assert server.stats()["counters"]["batch_fail"] == 2


def test_expire_by_config(server, client):
    server.set_faults(expire_batches=True)
    done = wait_for(client, create(client, upload(client, jsonl(chat_line(i) for i in range(3))))["id"])
    assert done["status"] == "expired"
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}


def test_stall_then_resume_and_force_complete(server, client):
    file_id = upload(client, jsonl(chat_line(i) for i in range(5)))
    stalled = create(client, file_id, headers={"X-Batch-Fault": "stall"})
    running = wait_for(client, stalled["id"], {"in_progress"})
    # Stalled: nothing moves while the server polls it (a few checks, no timing asserted).
    for _ in range(5):
        running = client.get(f"/batches/{stalled['id']}").json()
        assert running["status"] == "in_progress"
        assert running["request_counts"]["completed"] == 0
    assert server.force(stalled["id"], "resume")["flags"]["stall"] is False
    assert wait_for(client, stalled["id"])["status"] == "completed"

    slow = create(client, file_id, headers={"X-Batch-Fault": "stall"})
    wait_for(client, slow["id"], {"in_progress"})
    server.force(slow["id"], "complete")
    assert wait_for(client, slow["id"])["status"] == "completed"


def test_force_fail_a_running_batch(server, client):
    batch = create(client, upload(client, jsonl([chat_line(1)])), headers={"X-Batch-Fault": "stall"})
    wait_for(client, batch["id"], {"in_progress"})
    server.force(batch["id"], "fail")
    done = wait_for(client, batch["id"])
    assert done["status"] == "failed"
    assert done["errors"]["data"][0]["code"] == "forced_failure"


def test_admin_rejects_bad_actions_and_settings(server, client):
    batch = create(client, upload(client, jsonl([chat_line(1)])), headers={"X-Batch-Fault": "stall"})
    bad_action = httpx.post(
        f"{server.root_url}/admin/batches/{batch['id']}/force", json={"action": "explode"}
    )
    assert bad_action.status_code == 400
    bad_rate = httpx.post(f"{server.root_url}/admin/faults", json={"rate_429": 2})
    assert bad_rate.status_code == 400
    unknown = httpx.post(f"{server.root_url}/admin/faults", json={"nonsense": 1})
    assert unknown.status_code == 400
    assert httpx.get(f"{server.root_url}/admin/faults").json()["rate_429"] == 0
    server.force(batch["id"], "resume")
    wait_for(client, batch["id"])
