"""Benchmark the start-up of the ``airflow-batch`` command line.

Each command is started as a new process several times (after one warm-up run, so the OS file
cache is warm for all of them alike) and the median wall time is printed next to the baseline
measured in the same run: ``python -c pass`` with the same interpreter. Commands:

* ``airflow-batch --help``;
* ``airflow-batch validate`` of a 2-line batch file;
* ``airflow-batch prepare`` of the same file into another one;
* ``airflow-batch serve --help``.

None of them imports Airflow (``tests/test_no_airflow_core.py`` checks that); before that fix
``--help`` took about 10 s and ``validate`` about 6 s on the CI machine.

Usage: python benchmarks/bench_cli.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("airflow-batch")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "airflow_batch_provider.cli"]


def _time(command: list[str], repeats: int) -> tuple[float, float, float]:
    """(median, min, max) wall seconds of ``command`` over ``repeats`` runs after one warm-up."""
    subprocess.run(command, capture_output=True, check=True, cwd=ROOT)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times), max(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per command (default 7)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        batch = Path(tmp) / "two.jsonl"
        batch.write_bytes(
            b"".join(
                orjson.dumps(
                    {
                        "custom_id": f"r{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    }
                )
                + b"\n"
                for i in range(2)
            )
        )
        cli = _cli()
        out = str(Path(tmp) / "out.jsonl")
        commands = {
            "python -c pass (baseline)": [sys.executable, "-c", "pass"],
            "airflow-batch --help": [*cli, "--help"],
            "airflow-batch validate (2 lines)": [*cli, "validate", str(batch)],
            "airflow-batch prepare (2 lines)": [*cli, "prepare", str(batch), "--model", "x", "-o", out],
            "airflow-batch serve --help": [*cli, "serve", "--help"],
        }
        print(f"{args.repeats} runs each after one warm-up; median (min-max) wall time")
        baseline = None
        for name, command in commands.items():
            median, low, high = _time(command, args.repeats)
            baseline = baseline or median
            print(
                f"{name:<36} {median * 1000:7.0f} ms ({low * 1000:.0f}-{high * 1000:.0f})"
                f"  {median / baseline:5.1f}x baseline"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
