"""Benchmark the local batch server: echo throughput and memory on a large upload/download.

The server runs as ``airflow-batch serve`` in its own process so its memory is measured
alone (``/proc/<pid>/status``: VmRSS before, VmHWM peak after). Each figure is printed
with a baseline measured in the same run:

* ``echo batch``: a ``--lines`` chat batch from create to ``completed`` (validation,
  answering, writing output, publishing), against the echo backend called in a plain
  loop without the server (parse line, answer, serialise) on the same file; meanwhile a
  client probes ``/health`` every 50 ms (the event loop must stay free: target < 100 ms);
* ``upload + download``: a ``--mb`` MB file uploaded (multipart, streamed) and downloaded
  (streamed to disk), against a raw local file copy of the same file; the server's peak
  RSS growth over the whole transfer is the memory figure (target < 100 MB).

Usage: python benchmarks/bench_server.py [--lines 50000] [--mb 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_batch(path: Path, lines: int) -> None:
    with open(path, "wb") as fh:
        for i in range(lines):
            line = {
                "custom_id": f"row-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "gpt-4o-mini",
                    "messages": [
                        {"role": "system", "content": "Classify the sentiment of the review."},
                        {
                            "role": "user",
                            "content": f"Review {i}: the product arrived on time and works well.",
                        },
                    ],
                    "max_tokens": 50,
                },
            }
            fh.write(orjson.dumps(line) + b"\n")


def write_blob(path: Path, mb: int) -> None:
    line = orjson.dumps(
        {"custom_id": "x" * 20, "method": "POST", "url": "/v1/embeddings", "body": {"input": "y" * 900}}
    )
    block = (line + b"\n") * (1024 * 1024 // (len(line) + 1))
    with open(path, "wb") as fh:
        # Exactly ``mb`` MiB of whole lines at most: the dialect's 200 MB file limit is enforced
        # at upload, so a blob that overshot it by a partial block would be refused.
        written = 0
        while written + len(block) <= mb * 1024 * 1024:
            fh.write(block)
            written += len(block)
        rest = mb * 1024 * 1024 - written
        fh.write((line + b"\n") * (rest // (len(line) + 1)))


def proc_kb(pid: int, field: str) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def start_server(data_dir: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "airflow_batch_provider.cli",
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
    ]
    cmd += ["--validate-seconds", "0", "--finalize-seconds", "0", "--time-scale", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for _ in range(100):
        row = proc.stdout.readline()
        if "Local batch server" in row:
            url = row.split(" at ", 1)[1].split()[0]
            break
    else:
        raise RuntimeError("server did not print its URL")
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url.removesuffix("/v1") + "/health").raise_for_status()
            return proc, url
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def baseline_echo(path: Path) -> float:
    from airflow_batch_provider.server.backends import EchoBackend

    echo = EchoBackend()
    start = time.perf_counter()
    with open(path, "rb") as src, open(os.devnull, "wb") as sink:
        for raw in src:
            line = orjson.loads(raw)
            status, body = echo.answer(line["url"], line["body"])
            sink.write(
                orjson.dumps(
                    {"custom_id": line["custom_id"], "response": {"status_code": status, "body": body}}
                )
            )
    return time.perf_counter() - start


def probe_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(url.removesuffix("/v1") + "/health").raise_for_status()
            latencies.append(time.perf_counter() - t0)
            stop.wait(0.05)


def bench_echo(url: str, path: Path, lines: int, latencies: list[float]) -> tuple[float, float]:
    with httpx.Client(base_url=url, timeout=120) as client:
        t0 = time.perf_counter()
        with open(path, "rb") as fh:
            file_id = client.post(
                "/files", files={"file": ("batch.jsonl", fh)}, data={"purpose": "batch"}
            ).json()["id"]
        upload_s = time.perf_counter() - t0
        stop = threading.Event()
        prober = threading.Thread(target=probe_health, args=(url, stop, latencies))
        prober.start()
        t1 = time.perf_counter()
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = client.post("/batches", json=body).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.02)
            batch = client.get(f"/batches/{batch['id']}").json()
        run_s = time.perf_counter() - t1
        stop.set()
        prober.join()
        if batch["status"] != "completed" or batch["request_counts"]["completed"] != lines:
            raise RuntimeError(f"batch did not complete cleanly: {batch}")
    return upload_s, run_s


def bench_transfer(url: str, pid: int, blob: Path, work: Path) -> tuple[float, float, float]:
    rss_before = proc_kb(pid, "VmRSS")
    with httpx.Client(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        with open(blob, "rb") as fh:
            file_id = client.post(
                "/files", files={"file": ("blob.jsonl", fh)}, data={"purpose": "batch"}
            ).json()["id"]
        dest = work / "downloaded.jsonl"
        with client.stream("GET", f"/files/{file_id}/content") as response, open(dest, "wb") as out:
            response.raise_for_status()
            for chunk in response.iter_bytes(1 << 20):
                out.write(chunk)
        seconds = time.perf_counter() - t0
    if dest.stat().st_size != blob.stat().st_size:
        raise RuntimeError("downloaded size differs from the upload")
    peak = proc_kb(pid, "VmHWM")
    dest.unlink()
    return seconds, rss_before / 1024, (peak - rss_before) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        work = Path(tmp)
        batch_file = work / "batch.jsonl"
        blob = work / "blob.jsonl"
        write_batch(batch_file, args.lines)
        write_blob(blob, args.mb)

        base_s = baseline_echo(batch_file)
        t0 = time.perf_counter()
        shutil.copyfile(blob, work / "copy.jsonl")
        copy_s = time.perf_counter() - t0
        (work / "copy.jsonl").unlink()

        proc, url = start_server(work / "data")
        try:
            latencies: list[float] = []
            upload_s, run_s = bench_echo(url, batch_file, args.lines, latencies)
            transfer_s, rss_before, growth = bench_transfer(url, proc.pid, blob, work)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    server_rate = args.lines / run_s
    base_rate = args.lines / base_s
    blob_mb = args.mb
    print(f"echo batch, {args.lines:,} lines (create -> completed, after a {upload_s:.2f} s upload):")
    print(f"  server        {server_rate:>10,.0f} lines/s  ({run_s:.2f} s)   target >= 5,000 lines/s")
    print(f"  baseline loop {base_rate:>10,.0f} lines/s  ({base_s:.2f} s)   echo backend without the server")
    print(f"  ratio server/baseline = {server_rate / base_rate:.2f}")
    latencies.sort()
    median_ms, max_ms = latencies[len(latencies) // 2] * 1000, latencies[-1] * 1000
    print(
        f"  /health during the batch: {len(latencies)} probes, median {median_ms:.1f} ms,"
        f" max {max_ms:.1f} ms   target < 100 ms"
    )
    print(f"upload + download of {blob_mb} MB:")
    print(f"  server        {2 * blob_mb / transfer_s:>10,.0f} MB/s moved  ({transfer_s:.2f} s)")
    print(f"  baseline copy {2 * blob_mb / copy_s:>10,.0f} MB/s moved  ({copy_s:.2f} s, local file copy)")
    print(f"  ratio server/baseline = {copy_s / transfer_s:.2f}")
    print(f"  server RSS {rss_before:.0f} MB before, peak growth {growth:.1f} MB   target < 100 MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
