"""Benchmark the merge write path: result files -> committed results table.

Generates an output file and an error file (90% / 10% of ``--lines``) plus a keys.jsonl,
then, each in a fresh subprocess so peak memory is per measurement:

* ``merge``: the provider's path (parse lines with the dialect, stage keys + results,
  upsert by key -- on PostgreSQL in rounds while later lines are still parsed -- commit):
  what MergeBatchResultsOperator does after download;
* ``merge_sql``: the same merge with the raw lines handed to the database, which parses them
  (``parse_in="database"``: the worker only numbers and streams the lines);
* ``remerge``: the same merge again over the committed table (every row an update);
* ``insert_rows``: the same parsed rows through common-sql ``DbApiHook.insert_rows``
  (on DuckDB, measured on ``--baseline-lines`` rows and reported as a rate);
* ``copy``: a bare COPY (PostgreSQL) / read_json (DuckDB) of rows parsed beforehand
  into memory: the ceiling of the write alone, parsing excluded.

Memory: ``growth`` is peak RSS over RSS after a one-line merge in the same process (the
database client's start-up is paid by then); ``incl. start-up`` counts from before it.
DuckDB runs in-process with ``--duckdb-memory-limit`` (64MB) and ``--duckdb-threads`` (1).
A measurement that fails (e.g. out of memory) is reported and the others still run.

Usage: python benchmarks/bench_merge.py [--lines 1000000] [--db postgres,duckdb]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}


def generate(directory: Path, lines: int) -> None:
    """Typical chat-completion results: 90% answers, 10% errors, and the keys of every line."""
    errors_every = 10
    with (
        open(directory / "output.jsonl", "wb") as out,
        open(directory / "errors.jsonl", "wb") as err,
        open(directory / "keys.jsonl", "wb") as keys,
    ):
        for i in range(lines):
            cid = f"row-{i:09d}"
            keys.write(orjson.dumps({"custom_id": cid, "key": [i], "shard": i // 50_000}) + b"\n")
            if i % errors_every == errors_every - 1:
                line = {
                    "id": f"batch_req_{i}",
                    "custom_id": cid,
                    "response": None,
                    "error": {"code": "server_error", "message": "The upstream model failed."},
                }
                err.write(orjson.dumps(line) + b"\n")
                continue
            line = {
                "id": f"batch_req_{i}",
                "custom_id": cid,
                "response": {
                    "status_code": 200,
                    "request_id": f"req_{i:09d}",
                    "body": {
                        "id": f"chatcmpl-{i}",
                        "object": "chat.completion",
                        "created": 1_760_000_000,
                        "model": "gpt-4o-mini-2024-07-18",
                        "choices": [
                            {
                                "index": 0,
                                "message": {
                                    "role": "assistant",
                                    "content": f"Category: billing. Ticket {i} asks about an invoice.",
                                    "refusal": None,
                                },
                                "logprobs": None,
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 112, "completion_tokens": 14, "total_tokens": 126},
                        "system_fingerprint": "fp_bench",
                    },
                },
                "error": None,
            }
            out.write(orjson.dumps(line) + b"\n")


def result_lines(directory: Path) -> Iterator[tuple[Any, str]]:
    from airflow_batch_provider.dialects import get_dialect

    dialect = get_dialect("openai")
    for name, source in (("output.jsonl", "output"), ("errors.jsonl", "error")):
        with open(directory / name, "rb", buffering=1 << 20) as handle:
            for raw in handle:
                yield dialect.parse_result_line(orjson.loads(raw), source), "batch_bench"


def raw_results(directory: Path) -> Any:
    """The result files' raw lines, for the database to parse (``merge_sql``)."""
    from airflow_batch_provider.dialects import get_dialect
    from airflow_batch_provider.warehouse.lines import RawResults, ResultFile, file_line_reader

    dialect = get_dialect("openai")
    files = [
        ResultFile("output.jsonl", "output", "batch_bench"),
        ResultFile("errors.jsonl", "error", "batch_bench"),
    ]

    def lines() -> Iterator[tuple[int, int, bytes]]:
        for index, file in enumerate(files):
            with open(directory / file.file_id, "rb", buffering=1 << 20) as handle:
                for number, raw in enumerate(handle, start=1):
                    yield index, number, raw.rstrip(b"\n")

    def chunks() -> Iterator[tuple[int, bytes]]:
        # The files' bytes as they are: the worker sends them in chunks, not line by line.
        for index, file in enumerate(files):
            with open(directory / file.file_id, "rb") as handle:
                while data := handle.read(256 << 10):
                    yield index, data

    return RawResults(files, lines(), dialect.line_shape, file_line_reader(dialect, files), chunks())


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def hook_for(db: str, target: str) -> Any:
    if db == "postgres":
        from airflow.providers.postgres.hooks.postgres import PostgresHook

        os.environ["AIRFLOW_CONN_BENCH_PG"] = json.dumps(
            {
                "conn_type": "postgres",
                "host": PG["host"],
                "port": PG["port"],
                "login": PG["user"],
                "schema": PG["dbname"],
                "extra": {"options": f"-c search_path={target}"},
            }
        )
        return PostgresHook(postgres_conn_id="bench_pg")
    from duckdb_provider.hooks.duckdb_hook import DuckDBHook

    os.environ["AIRFLOW_CONN_BENCH_DUCKDB"] = json.dumps({"conn_type": "duckdb", "host": target})
    return DuckDBHook(duckdb_conn_id="bench_duckdb")


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(mode: str, db: str, directory: Path, target: str, baseline_lines: int) -> dict[str, Any]:
    from airflow_batch_provider.warehouse.rows import ANSWERED_BY_COLUMNS, Column, ResultMapper
    from airflow_batch_provider.warehouse.write import ResultsWriter

    hook = hook_for(db, target)
    table = f"results_{mode}"
    # DuckDB runs inside this process: cap its buffer pool so the figure is the merge's, not a cache's.
    settings = (
        {
            "memory_limit": os.environ.get("BENCH_DUCKDB_MEMORY_LIMIT", "64MB"),
            "threads": os.environ.get("BENCH_DUCKDB_THREADS", "1"),
        }
        if db == "duckdb"
        else {}
    )
    writer = ResultsWriter(
        hook,
        table,
        key_columns=[Column("id", "integer")],
        session_settings=settings,
        parse_in="database" if mode == "merge_sql" else "python",
    )
    cold_rss = rss_mb()
    # A one-line merge first, into a table of its own: the database client's start-up (DuckDB's
    # instance and JSON reader: ~27 MB, the same for one line or millions) is paid before the
    # measured merge, whose growth is then what the lines themselves cost.
    warm = ResultsWriter(hook, "warm_up", key_columns=[Column("id", "integer")], session_settings=settings)
    first = next(iter(result_lines(directory)))
    warm.merge(iter([first]), keys=[{"custom_id": first[0].custom_id, "key": [0], "shard": 0}])
    start_rss = rss_mb()
    rows = 0
    t0 = time.perf_counter()
    cpu0 = cpu_seconds()
    if mode == "merge":
        report = writer.merge(result_lines(directory), keys=directory / "keys.jsonl")
        rows = report.rows_written
    elif mode == "merge_sql":
        rows = writer.merge(raw_results(directory), keys=directory / "keys.jsonl").rows_written
    elif mode == "remerge":
        # The same merge again over the committed table: every row is an upsert of an existing key.
        writer.merge(result_lines(directory), keys=directory / "keys.jsonl")
        start_rss = rss_mb()
        t0 = time.perf_counter()
        rows = writer.merge(result_lines(directory), keys=directory / "keys.jsonl").rows_written
    else:
        # Same target table, same row content: keys joined up front in Python for the baselines.
        mapper = ResultMapper()
        columns = [c.name for c in writer.target_columns]
        conn = hook.get_conn()
        conn.cursor().execute(writer._create_sql())
        conn.commit()
        conn.close()
        now = time.time()

        def mapped() -> Iterator[tuple[Any, ...]]:
            for line, batch_id in result_lines(directory):
                row = mapper.row(line, batch_id)
                # The answered-by columns (vendor, batch_conn_id) stay NULL in the baselines.
                yield (int(row[0][4:]), row[0], *row[2:], *(None for _ in ANSWERED_BY_COLUMNS), now)

        if mode == "insert_rows":
            import itertools

            limit = baseline_lines if db == "duckdb" else None
            source = itertools.islice(mapped(), limit) if limit else mapped()
            stamp_rows = ((*r[:-1], _ts(db)) for r in source)
            t0 = time.perf_counter()
            hook.insert_rows(
                table,
                stamp_rows,
                target_fields=[writer.dialect.quote(c) for c in columns],
                commit_every=int(os.environ.get("BENCH_COMMIT_EVERY", "1000")),
            )
            rows = limit or 0
            if not limit:
                rows = _count(hook, writer.dialect.quote(table))
        else:  # copy ceiling: rows parsed into memory first, only the write is timed
            parsed = [(*r[:-1], _ts(db)) for r in mapped()]
            conn = hook.get_conn()
            t0 = time.perf_counter()
            # JSON travels as text, as in the merge's staging; the column casts it.
            cols = [Column(c.name, "text" if c.type == "json" else c.type) for c in writer.target_columns]
            writer.dialect.bulk_load(conn, table, cols, parsed)
            conn.commit()
            conn.close()
            rows = len(parsed)
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "mode": mode,
        "db": db,
        "rows": rows,
        "seconds": round(elapsed, 2),
        "rows_per_s": round(rows / elapsed),
        # Worker CPU per million rows (DuckDB's threads included: it runs in this process).
        "cpu_s_per_m": round(cpu / max(rows, 1) * 1e6, 2),
        "peak_rss_mb": round(peak),
        "start_rss_mb": round(start_rss),
        "growth_mb": round(peak - start_rss),
        "cold_growth_mb": round(peak - cold_rss),
    }


def _ts(db: str) -> Any:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc)


def _count(hook: Any, qtable: str) -> int:
    conn = hook.get_conn()
    cur = conn.cursor()
    cur.execute(f"SELECT COUNT(*) FROM {qtable}")
    n = int(cur.fetchone()[0])
    conn.close()
    return n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--db", default="postgres,duckdb")
    parser.add_argument("--modes", default="merge,merge_sql,remerge,insert_rows,copy")
    parser.add_argument(
        "--baseline-lines", type=int, default=50_000, help="insert_rows rows on DuckDB (slow)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument(
        "--commit-every", type=int, default=1000, help="insert_rows commit_every (common-sql's default: 1000)"
    )
    parser.add_argument(
        "--duckdb-memory-limit",
        default="64MB",
        help="DuckDB memory_limit for the merge (it runs in-process; 64MB needs --duckdb-threads 1)",
    )
    parser.add_argument("--duckdb-threads", default="1", help="DuckDB threads for the merge")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "DB", "DIR", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, db, directory, target = args.child
        print(json.dumps(child(mode, db, Path(directory), target, args.baseline_lines)))
        return

    os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="abp-bench-home-"))
    os.environ["BENCH_DUCKDB_MEMORY_LIMIT"] = args.duckdb_memory_limit
    os.environ["BENCH_DUCKDB_THREADS"] = args.duckdb_threads
    os.environ["BENCH_COMMIT_EVERY"] = str(args.commit_every)
    work = Path(tempfile.mkdtemp(prefix="abp-bench-merge-"))
    t0 = time.perf_counter()
    generate(work, args.lines)
    print(
        f"generated {args.lines:,} result lines in {time.perf_counter() - t0:.1f}s under {work}", flush=True
    )
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    for db in args.db.split(","):
        if db == "postgres":
            import psycopg

            target = f"abp_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(**PG, autocommit=True) as admin:
                admin.execute(f'CREATE SCHEMA "{target}"')
        else:
            target = str(work / "bench.duckdb")
        try:
            for mode in args.modes.split(","):
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--baseline-lines",
                        str(args.baseline_lines),
                        "--child",
                        mode,
                        db,
                        str(work),
                        target,
                    ],
                    check=False,
                    capture_output=True,
                    text=True,
                    env={
                        **os.environ,
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    },
                )
                if out.returncode:
                    last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
                    print(f"{db}/{mode} failed: {last}", flush=True)
                    failures.append(f"{db}/{mode}: {last}")
                    continue
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results.append(res)
                print(json.dumps(res), flush=True)
        finally:
            if db == "postgres":
                with psycopg.connect(**PG, autocommit=True) as admin:
                    admin.execute(f'DROP SCHEMA IF EXISTS "{target}" CASCADE')
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{'db':9} {'mode':12} {'rows':>10} {'s':>7} {'rows/s':>9} {'peak MB':>8} {'growth MB':>9} "
        f"{'incl. start-up':>14} {'CPU s/1M':>9}"
    )
    for r in results:
        print(
            f"{r['db']:9} {r['mode']:12} {r['rows']:>10,} {r['seconds']:>7} {r['rows_per_s']:>9,} "
            f"{r['peak_rss_mb']:>8} {r['growth_mb']:>9} {r['cold_growth_mb']:>14} {r['cpu_s_per_m']:>9}"
        )
    for db in args.db.split(","):
        by = {r["mode"]: r for r in results if r["db"] == db}
        for mode in ("merge", "merge_sql"):
            if mode not in by:
                continue
            rate = by[mode]["rows_per_s"]
            parts = [f"{db}: {mode} {rate:,} rows/s"]
            if "insert_rows" in by:
                parts.append(f"{rate / by['insert_rows']['rows_per_s']:.2f}x insert_rows")
            if "copy" in by:
                parts.append(f"{rate / by['copy']['rows_per_s']:.2f}x of the COPY ceiling")
            if mode == "merge_sql" and "merge" in by:
                cpu = by["merge_sql"]["cpu_s_per_m"] / by["merge"]["cpu_s_per_m"]
                parts.append(f"worker CPU {cpu:.2f}x the Python path's")
            print("; ".join(parts))
    for failure in failures:
        print(f"FAILED {failure}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
