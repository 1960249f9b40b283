"""Small clients for driving a local batch server in tests (plain httpx, no provider code)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx
import orjson

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def chat_line(
    i: int, *, custom_id: str | None = None, url: str = "/v1/chat/completions", **body: Any
) -> dict[str, Any]:
    return {
        "custom_id": custom_id or f"req-{i}",
        "method": "POST",
        "url": url,
        "body": {"model": "gpt-test", "messages": [{"role": "user", "content": f"hello number {i}"}], **body},
    }


def jsonl(lines: Iterable[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines)


def upload(
    client: httpx.Client, data: bytes, *, purpose: str | None = "batch", name: str = "in.jsonl"
) -> str:
    form = {"purpose": purpose} if purpose else {}
    response = client.post("/files", files={"file": (name, data)}, data=form)
    response.raise_for_status()
    body = response.json()
    return str(body.get("id") or body["file_id"])


def create(
    client: httpx.Client, file_id: str, endpoint: str = "/v1/chat/completions", **extra: Any
) -> dict[str, Any]:
    headers = extra.pop("headers", None)
    response = client.post(
        "/batches",
        json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra},
        headers=headers,
    )
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def wait_for(
    client: httpx.Client, batch_id: str, statuses: set[str] = TERMINAL, timeout: float = 30
) -> dict[str, Any]:
    """Poll until the batch's status is one of ``statuses`` (a bounded wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        batch: dict[str, Any] = client.get(f"/batches/{batch_id}").json()
        if batch.get("status") in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} stuck in {batch.get('status')!r}: {batch}")
        time.sleep(0.02)


def read_lines(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    response = client.get(f"/files/{file_id}/content")
    response.raise_for_status()
    return [orjson.loads(line) for line in response.content.splitlines() if line.strip()]
