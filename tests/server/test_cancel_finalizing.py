"""Cancel answers the state the batch will really end in, also while it is finalizing."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import chat_line, create, jsonl, read_lines, upload, wait_for


@pytest.mark.parametrize("dialect", ["openai", "doubleword", "azure"])
def test_cancel_while_finalizing_answers_the_real_outcome(batch_server, dialect):
    # Finalizing lasts 3 real seconds: long enough to cancel inside it.
    server = batch_server(dialect=dialect, finalize_seconds=3000)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        batch = create(client, upload(client, jsonl(chat_line(i) for i in range(4))))
        wait_for(client, batch["id"], {"finalizing"})
        answered = client.post(f"/batches/{batch['id']}/cancel")
        assert answered.status_code == 200
        during = client.get(f"/batches/{batch['id']}").json()
        done = wait_for(client, batch["id"])
        outputs = read_lines(client, done["output_file_id"])
    # All four lines were answered before the cancel: the batch completes, and every
    # answer given on the way says so (never "cancelling" for a batch that completes).
    assert done["status"] == "completed"
    assert answered.json()["status"] == "finalizing"
    assert during["status"] == "finalizing"
    assert len(outputs) == 4


def test_cancel_while_validating_still_cancels(batch_server):
    server = batch_server(validate_seconds=3000)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        batch = create(client, upload(client, jsonl([chat_line(1)])))
        answered = client.post(f"/batches/{batch['id']}/cancel").json()
        done = wait_for(client, batch["id"])
    assert answered["status"] in ("cancelling", "cancelled")
    assert done["status"] == "cancelled"
