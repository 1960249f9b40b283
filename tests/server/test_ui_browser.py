"""The ``/ui`` pages in a real headless browser (Debian's Chromium): DOM counts and screenshots.

Under CI (``CI=true``) a missing ``chromium`` fails the test (``.ci/run`` installs it); elsewhere it skips.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.warehouse import in_ci
from tests.server.helpers import chat_line, create, jsonl, upload, wait_for

WIDTH, HEIGHT = 1280, 900
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    """Path of the Chromium binary; skips without one, fails under CI."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    message = "chromium is not installed (apt-get install chromium)"
    if in_ci():
        pytest.fail(f"{message} -- under CI=true this is a failure (.ci/run installs it)", pytrace=False)
    pytest.skip(message)


def browse(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium on ``url`` with a fresh profile; ``args`` pick --dump-dom or --screenshot."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run(
            [
                chromium(),
                *_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                *args,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def dom(url: str) -> str:
    """The DOM Chromium built from ``url`` (what a user's browser renders, not the raw bytes)."""
    return browse(url, "--dump-dom").stdout


def screenshot(url: str, dest: Path) -> tuple[int, int]:
    """Save a PNG of ``url`` to ``dest``; returns its (width, height) read from the PNG header."""
    browse(url, f"--screenshot={dest}")
    head = dest.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def _counts(html: str) -> dict[str, str]:
    return dict(re.findall(r'<td class="n (total|completed|failed|pending)">(\d+)</td>', html))


def test_running_and_completed_batches_render_in_chromium(batch_server: Any, tmp_path: Path) -> None:
    chromium()
    server = batch_server()
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        done = create(api, upload(api, jsonl(chat_line(i) for i in range(5)), name="tickets.jsonl"))
        wait_for(api, done["id"])
        stalled = create(
            api, upload(api, jsonl(chat_line(i) for i in range(4))), headers={"X-Batch-Fault": "stall"}
        )
        running = wait_for(api, stalled["id"], {"in_progress"})

    listing = dom(f"{server.root_url}/ui/batches")
    assert f'data-batch="{done["id"]}"' in listing and f'data-batch="{running["id"]}"' in listing
    assert 'data-status="completed"' in listing and 'data-status="in_progress"' in listing

    completed = dom(f"{server.root_url}/ui/batches/{done['id']}")
    assert _counts(completed) == {"total": "5", "completed": "5", "failed": "0", "pending": "0"}
    assert "tickets.jsonl" in completed and 'data-status="completed"' in completed

    live = dom(f"{server.root_url}/ui/batches/{running['id']}")
    counts = running["request_counts"]
    assert _counts(live)["total"] == "4" == str(counts["total"])
    assert int(_counts(live)["pending"]) == 4 - counts["completed"] - counts["failed"] > 0
    assert 'data-status="in_progress"' in live and 'http-equiv="refresh"' in live

    for name, batch_id in (("completed", done["id"]), ("running", running["id"])):
        png = tmp_path / f"{name}.png"
        assert screenshot(f"{server.root_url}/ui/batches/{batch_id}", png) == (WIDTH, HEIGHT)
        # A blank page compresses to a few KB; a rendered table, bar and text do not.
        assert png.stat().st_size > 20_000, png.stat().st_size
