"""The suite prints the figures its tests measure in its terminal summary (also with ``-q``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
def test_one(figures):
    figures("control-plane faults survived (probe)", requests=10, **{"429": 3}, dropped_downloads=1)


def test_two(figures):
    figures("load (probe)", rows=500, batches=41)
"""


def test_figures_are_printed_at_the_end_and_saved(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(_PROBE)
    saved = tmp_path / "figures.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PYTHONPATH=str(ROOT), BATCH_TEST_FIGURES=str(saved))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.fixtures.figures"]
        + ["test_probe.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "figures measured in this run" in line)
    assert lines[start + 1 : start + 3] == [
        "control-plane faults survived (probe): requests=10, 429=3, dropped_downloads=1",
        "load (probe): rows=500, batches=41",
    ]
    assert [orjson.loads(x) for x in saved.read_bytes().splitlines()] == [
        {"figure": "control-plane faults survived (probe)", "requests": 10, "429": 3, "dropped_downloads": 1},
        {"figure": "load (probe)", "rows": 500, "batches": 41},
    ]


def test_the_reliability_tests_record_their_figures() -> None:
    for name in ("test_control_plane.py", "test_load.py"):
        text = (ROOT / "tests" / "reliability" / name).read_text()
        assert "figures(" in text and "capsys.disabled()" not in text, name
