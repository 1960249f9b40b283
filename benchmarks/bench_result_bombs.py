"""Benchmark reading hostile result files with the async hook: CPU seconds and the longest loop hold.

A tiny HTTP server in a thread serves gzip bodies that inflate to ``--mib`` MiB:

* ``newlines``: nothing but newlines (64 MiB gzip to ~65 KB), a "newline bomb";
* ``sparse``: one answer line after every 8,000 newlines (under the blank-run bound: read whole);
* ``answers``: ordinary answer lines, ~100 bytes each.

Each file is read with ``aiter_file_lines`` while a monitor task sleeps 1 ms in a loop and records
how late it wakes: the longest lateness is the longest time the reader held the event loop (what
every other trigger of a triggerer would wait). CPU is this process's CPU time for the read.

Usage: python benchmarks/bench_result_bombs.py [--mib 64] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import zlib
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MIB = 1 << 20


def gzip(blocks: Iterable[bytes]) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(packer.compress(block) for block in blocks) + packer.flush()


def bodies(mib: int) -> dict[str, bytes]:
    sparse = (b"\n" * 8000 + b'{"custom_id": "x"}\n') * (MIB // 8020)
    answer = b'{"custom_id": "r", "response": {"status_code": 200, "body": {"pad": "' + b"x" * 40 + b'"}}}\n'
    answers = answer * (MIB // len(answer))
    return {
        "newlines": gzip(b"\n" * MIB for _ in range(mib)),
        "sparse": gzip(sparse for _ in range(mib)),
        "answers": gzip(answers for _ in range(mib)),
    }


def serve(files: dict[str, bytes]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.rsplit("/", 2)[-2]
            body = files.get(name, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def read(hook: Any, file_id: str) -> dict[str, Any]:
    worst = 0.0
    stop = asyncio.Event()

    async def monitor() -> None:
        nonlocal worst
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.monotonic()
            worst, last = max(worst, now - last), now

    task = asyncio.create_task(monitor())
    await asyncio.sleep(0.01)
    cpu = time.process_time()
    lines, outcome = 0, "read"
    try:
        async for _ in hook.aiter_file_lines(file_id):
            lines += 1
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    cpu = time.process_time() - cpu
    stop.set()
    await task
    return {
        "file": file_id,
        "lines": lines,
        "outcome": outcome,
        "cpu_s": round(cpu, 3),
        "max_hold_ms": round(worst * 1000),
    }


async def main(mib: int) -> list[dict[str, Any]]:
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.hooks.retry import RetryPolicy

    files = bodies(mib)
    files["warm"] = gzip([b'{"custom_id": "w"}\n'])
    server = serve(files)
    host = f"http://127.0.0.1:{server.server_address[1]}/v1"
    os.environ["AIRFLOW_CONN_BENCH_BOMBS"] = json.dumps(
        {"conn_type": "batch_api", "host": host, "password": "bench-key", "extra": {"dialect": "openai"}}
    )
    hook = BatchApiHook("bench_bombs", retry_policy=RetryPolicy(max_retries=0), timeout=120)
    results = []
    try:
        await read(hook, "warm")  # the connection and the client, outside the figures
        for name in ("newlines", "sparse", "answers"):
            results.append({**await read(hook, name), "gzip_bytes": len(files[name]), "mib": mib})
    finally:
        await hook.aclose()
        server.shutdown()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB each file inflates to")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    figures = asyncio.run(main(args.mib))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for row in figures:
            print(
                f"{row['file']:>9}: {row['gzip_bytes']:>9,} B gzip -> {row['mib']} MiB; "
                f"{row['lines']:>9,} lines; "
                f"CPU {row['cpu_s']:.2f} s; longest loop hold {row['max_hold_ms']} ms; {row['outcome']}"
            )
