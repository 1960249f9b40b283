"""Persistence: a restarted server loses no file or batch and resumes live batches where they stopped."""

from __future__ import annotations

from collections import Counter

import httpx

from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for


def test_restart_resumes_an_in_progress_batch_without_losing_or_repeating_lines(batch_server):
    server = batch_server(line_seconds=20.0, chunk_size=3)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(150)))
        batch = create(client, file_id, metadata={"k": "v"})
        running = wait_for(client, batch["id"], {"in_progress"})
        while running["request_counts"]["completed"] < 9:
            running = client.get(f"/batches/{batch['id']}").json()
    server.restart()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        resumed = client.get(f"/batches/{batch['id']}").json()
        assert resumed["status"] == "in_progress"
        assert resumed["request_counts"]["completed"] >= 9
        server.force(batch["id"], "complete")
        done = wait_for(client, batch["id"])
        outputs = read_lines(client, done["output_file_id"])
        assert client.get(f"/files/{file_id}").json()["bytes"] > 0
    assert done["status"] == "completed"
    assert done["metadata"] == {"k": "v"}
    assert done["request_counts"] == {"total": 150, "completed": 150, "failed": 0}
    seen = Counter(o["custom_id"] for o in outputs)
    assert seen == Counter(f"req-{i}" for i in range(150))


def test_restart_keeps_finished_batches_files_and_stall_flags(batch_server):
    server = batch_server()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl(chat_line(i) for i in range(4)))
        finished = wait_for(client, create(client, file_id)["id"])
        stalled = create(client, file_id, headers={"X-Batch-Fault": "stall"})
        wait_for(client, stalled["id"], {"in_progress"})
        before = read_lines(client, finished["output_file_id"])
    server.restart()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get(f"/batches/{finished['id']}").json() == finished
        assert read_lines(client, finished["output_file_id"]) == before
        listed = [b["id"] for b in client.get("/batches").json()["data"]]
        assert listed == [stalled["id"], finished["id"]]
        assert client.get(f"/batches/{stalled['id']}").json()["status"] == "in_progress"
        server.force(stalled["id"], "resume")
        assert wait_for(client, stalled["id"])["request_counts"]["completed"] == 4


def test_a_resumed_batch_can_be_cancelled(batch_server):
    server = batch_server()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        batch = create(
            client, upload(client, jsonl(chat_line(i) for i in range(3))), headers={"X-Batch-Fault": "stall"}
        )
        wait_for(client, batch["id"], {"in_progress"})
    # The stalled batch is resumed by the new process, which then honours a cancel.
    server.restart()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        client.post(f"/batches/{batch['id']}/cancel").raise_for_status()
        done = wait_for(client, batch["id"])
    assert done["status"] == "cancelled"
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}


def test_a_batch_still_validating_is_validated_again_after_restart(batch_server):
    server = batch_server(
        validate_seconds=1e6
    )  # ~17 minutes at the test time scale: it will not finish alone
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        batch = create(client, upload(client, jsonl(chat_line(i) for i in range(3))))
    server.restart()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get(f"/batches/{batch['id']}").json()["status"] == "validating"
        server.force(batch["id"], "complete")
        done = wait_for(client, batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"]["completed"] == 3
