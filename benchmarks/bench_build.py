"""Benchmark SqlToBatchJsonlOperator: rows/s and memory growth vs a naive build and PostgreSQL's own export.

    /work/venv/bin/python benchmarks/bench_build.py                 # 1,000,000 rows
    /work/venv/bin/python benchmarks/bench_build.py --rows 100000   # quick run

Data: a table ``(id bigint, title text, body text)`` in a fresh PostgreSQL schema (db ``test``
on 127.0.0.1) and in a DuckDB file, with the same rows. Every line uses a two-column chat
template of about 200 characters. Each scenario runs in its own process so the peak memory
(VmHWM minus the RSS after imports) belongs to that scenario alone:

* ``operator-postgres`` / ``operator-duckdb``: the operator, 50,000-line shards.
* ``naive-postgres`` / ``naive-duckdb``: fetchall, render each row with Jinja, ``json.dumps``, one file.
* ``pg-copy``: PostgreSQL builds the same lines itself, ``COPY (SELECT json_build_object(...)) TO STDOUT``
  into a file: the practical ceiling.
* ``operator-<db>-<counter>``: the operator with ``token_counter=<counter>`` (``none``: no estimate,
  today's build before counting; ``heuristic``; ``exact``: o200k from bpe-openai); plain
  ``operator-<db>`` uses the default (``auto``). ``--scenarios counting`` runs the DuckDB and
  PostgreSQL ones and prints each counter's rows/s against ``none`` measured in the same run
  (with ``price_table="none"``), then the one-off costs of a build that counts: loading the
  o200k vocabulary (bpe-openai) and the genai-prices table, each timed in a fresh process.

CPU seconds are counted for the client process and its PostgreSQL backend (found by
application_name), so rows per CPU-second compare fairly even on a busy machine.

DuckDB keeps the blocks of a scanned table in its buffer pool up to its ``memory_limit``
(80% of RAM by default), so the DuckDB figure grows with the table, not with the build;
``--duckdb-memory-limit 64MB`` passes ``session_sql`` to bound it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}
SYSTEM = "You label customer support tickets. Answer with one word: billing, bug, account or other."
USER = "Ticket title: {{ title }}\nTicket text: {{ body }}\nWhich label fits best?"
BODY = {"max_tokens": 5, "temperature": 0}
MODEL = "gpt-4o-mini"
ENDPOINT = "/v1/chat/completions"
SCENARIOS = ("operator-postgres", "operator-duckdb", "naive-postgres", "naive-duckdb", "pg-copy")
COUNTERS = ("none", "heuristic", "exact")
ONE_OFF = {
    "o200k vocabulary (bpe-openai)": (
        "import time; t = time.perf_counter(); import bpe_openai; bpe_openai.get_encoding('o200k_base'); "
        "print(f'{time.perf_counter() - t:.2f}s')"
    ),
    "genai-prices lookup": (
        "import time; t = time.perf_counter(); from airflow_batch_provider.prices import PriceBook; "
        "from airflow_batch_provider.dialects import get_dialect; "
        "PriceBook.for_dialect(get_dialect('openai'), {}, 'prices').price('gpt-4o-mini'); "
        "print(f'{time.perf_counter() - t:.2f}s')"
    ),
}
COUNTING = tuple(f"operator-{kind}-{c}" for kind in ("duckdb", "postgres") for c in COUNTERS)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


APP = f"abp-bench-{os.getpid()}"


def _pg_options() -> str:
    return f"-c search_path={os.environ['BENCH_SCHEMA']}"


class BackendCpu:
    """CPU seconds used by this process's PostgreSQL backends (found by application_name).

    The server does real work in the export and the streaming scenarios, so comparing only
    client CPU would flatter the export; on a shared, busy machine CPU seconds are also far
    steadier than wall-clock time.
    """

    def __init__(self) -> None:
        import threading

        self._ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import psycopg

        with psycopg.connect(**PG, autocommit=True, application_name="abp-bench-monitor") as conn:  # type: ignore[arg-type]
            while not self._stop.is_set():
                self._sample(conn)
                self._stop.wait(0.05)
            self._sample(conn)

    def _sample(self, conn: Any) -> None:
        pids = [
            r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [APP])
        ]
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            self._ticks[pid] = max(self._ticks.get(pid, 0), int(fields[11]) + int(fields[12]))

    def __enter__(self) -> BackendCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return sum(self._ticks.values()) / os.sysconf("SC_CLK_TCK")


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM, so the peak excludes import-time spikes.
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


# ---- data ----------------------------------------------------------------------------------------


def create_data(rows: int, schema: str, duck_path: Path) -> None:
    import duckdb
    import psycopg

    title = "'Order #' || g || ' cannot be refunded'"
    body = "'I was charged twice for order ' || g || ' and the refund button gives an error. Please help.'"
    with psycopg.connect(**PG, autocommit=True) as conn:  # type: ignore[arg-type]
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(
            f'CREATE TABLE "{schema}".tickets AS SELECT g::bigint AS id, {title} AS title, {body} AS body '
            f"FROM generate_series(1, {rows}) g"
        )
        conn.execute(f'ANALYZE "{schema}".tickets')
    with duckdb.connect(str(duck_path)) as duck:
        duck.execute(
            f"CREATE TABLE tickets AS SELECT g::BIGINT AS id, {title} AS title, {body} AS body "
            f"FROM range(1, {rows + 1}) t(g)"
        )


def drop_data(schema: str) -> None:
    import psycopg

    with psycopg.connect(**PG, autocommit=True) as conn:  # type: ignore[arg-type]
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# ---- scenarios (each runs in a child process) ---------------------------------------------------


def run_operator(kind: str, out: Path, shard_lines: int, counter: str | None = None) -> int:
    from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator

    op = SqlToBatchJsonlOperator(
        task_id="bench",
        conn_id=f"bench_{kind}",
        sql="SELECT id, title, body FROM tickets",
        key_columns="id",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        body=BODY,
        model=MODEL,
        staging_path=str(out),
        max_lines=shard_lines,
        session_sql=os.environ.get("BENCH_SESSION_SQL_" + kind.upper()) or None,
        token_counter=counter,
        # The counting comparison is per row: the price table's one-off load is timed apart.
        price_table="none" if counter else None,
    )
    result = op.execute({})  # type: ignore[arg-type]
    return int(result["rows_written"])


def run_naive(kind: str, out: Path) -> int:
    from jinja2 import Template

    if kind == "postgres":
        import psycopg

        conn: Any = psycopg.connect(**PG, options=_pg_options(), application_name=APP)  # type: ignore[arg-type]
        rows = conn.execute("SELECT id, title, body FROM tickets").fetchall()
    else:
        import duckdb

        conn = duckdb.connect(os.environ["BENCH_DUCKDB"])
        rows = conn.execute("SELECT id, title, body FROM tickets").fetchall()
    template = Template(USER)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "batch.jsonl", "w") as fh:
        for row_id, title, body in rows:
            line = {
                "custom_id": str(row_id),
                "method": "POST",
                "url": ENDPOINT,
                "body": {
                    "model": MODEL,
                    **BODY,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": template.render(title=title, body=body)},
                    ],
                },
            }
            fh.write(json.dumps(line) + "\n")
    conn.close()
    return len(rows)


def run_pg_copy(out: Path) -> int:
    import psycopg

    user_sql = "'Ticket title: ' || title || E'\\nTicket text: ' || body || E'\\nWhich label fits best?'"
    query = f"""
        SELECT json_build_object(
            'custom_id', id::text, 'method', 'POST', 'url', '{ENDPOINT}',
            'body', json_build_object(
                'model', '{MODEL}', 'max_tokens', 5, 'temperature', 0,
                'messages', json_build_array(
                    json_build_object('role', 'system', 'content', '{SYSTEM}'),
                    json_build_object('role', 'user', 'content', {user_sql}))))
        FROM tickets"""
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    # CSV with control characters as quote/delimiter: no escaping, the JSON comes out as is.
    copy_sql = f"COPY ({query}) TO STDOUT WITH (FORMAT csv, QUOTE E'\\x01', DELIMITER E'\\x02')"
    with (
        psycopg.connect(**PG, options=_pg_options(), application_name=APP) as conn,  # type: ignore[arg-type]
        conn.cursor() as cur,
        cur.copy(copy_sql) as copy,
        open(out / "batch.jsonl", "wb") as fh,
    ):
        for chunk in copy:
            fh.write(chunk)
            count += bytes(chunk).count(b"\n")
    return count


def child(scenario: str, out: Path, shard_lines: int) -> dict[str, Any]:
    # Import everything first so the memory figure is growth during the build only.
    import jinja2  # noqa: F401
    import psycopg  # noqa: F401

    import airflow_batch_provider.operators.build  # noqa: F401

    if scenario.startswith("operator"):
        from airflow.sdk import BaseHook

        # Tag the operator's PostgreSQL session so BackendCpu can find its backend.
        spec = json.loads(os.environ["AIRFLOW_CONN_BENCH_POSTGRES"])
        spec["extra"]["application_name"] = APP
        os.environ["AIRFLOW_CONN_BENCH_POSTGRES"] = json.dumps(spec)

        BaseHook.get_connection(f"bench_{scenario.split('-')[1]}").get_hook()
    _reset_peak()
    base = _rss_kb("VmRSS")
    backend = BackendCpu()
    backend.__enter__()
    cpu0 = os.times()
    start = time.perf_counter()
    if scenario.startswith("operator-"):
        parts = scenario.split("-")
        rows = run_operator(parts[1], out, shard_lines, parts[2] if len(parts) > 2 else None)
    elif scenario == "naive-postgres":
        rows = run_naive("postgres", out)
    elif scenario == "naive-duckdb":
        rows = run_naive("duckdb", out)
    elif scenario == "pg-copy":
        rows = run_pg_copy(out)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    seconds = time.perf_counter() - start
    cpu1 = os.times()
    backend.__exit__()
    client_cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    cpu = client_cpu + backend.seconds
    peak = _rss_kb("VmHWM")
    size = sum(p.stat().st_size for p in out.rglob("*.jsonl"))
    return {
        "scenario": scenario,
        "rows": rows,
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds),
        "cpu_s": round(cpu, 2),
        "server_cpu_s": round(backend.seconds, 2),
        "rows_per_cpu_s": round(rows / cpu) if cpu else None,
        "mem_growth_mb": round(max(peak - base, 0) / 1024, 1),
        "output_mb": round(size / 1e6, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shard-lines", type=int, default=50_000)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run every scenario N times (interleaved); keep the best"
    )
    parser.add_argument(
        "--duckdb-memory-limit",
        default=None,
        help="run SET memory_limit on the operator's DuckDB connection (bounds DuckDB's block cache)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.out), args.shard_lines)))
        return 0

    # A terminated benchmark still drops its schema and files (finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="bench-build-"))
    schema = f"bench_build_{uuid.uuid4().hex[:8]}"
    duck = work / "bench.duckdb"
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
            "BENCH_SCHEMA": schema,
            "BENCH_SESSION_SQL_DUCKDB": (
                f"SET memory_limit = '{args.duckdb_memory_limit}'" if args.duckdb_memory_limit else ""
            ),
            "BENCH_DUCKDB": str(duck),
            "AIRFLOW_HOME": env.get("AIRFLOW_HOME", str(work / "airflow-home")),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
            "AIRFLOW_CONN_BENCH_POSTGRES": json.dumps(
                {
                    "conn_type": "postgres",
                    "host": PG["host"],
                    "port": PG["port"],
                    "login": PG["user"],
                    "schema": PG["dbname"],
                    "extra": {"options": f"-c search_path={schema}"},
                }
            ),
            "AIRFLOW_CONN_BENCH_DUCKDB": json.dumps({"conn_type": "duckdb", "host": str(duck)}),
        }
    )
    try:
        t0 = time.perf_counter()
        create_data(args.rows, schema, duck)
        took = time.perf_counter() - t0
        print(f"data: {args.rows:,} rows in PostgreSQL schema {schema} and {duck} ({took:.1f}s)")
        runs: dict[str, list[dict[str, Any]]] = {}
        scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        if scenarios == ["counting"]:
            scenarios = list(COUNTING)
        # Interleaved repeats, best rows/s kept: other load on a shared machine only ever slows a run down.
        for attempt in range(args.repeat):
            for scenario in scenarios:
                out = work / scenario
                cmd = [sys.executable, __file__, "--child", scenario, "--out", str(out)]
                proc = subprocess.run(
                    [*cmd, "--shard-lines", str(args.shard_lines)], env=env, capture_output=True, text=True
                )
                shutil.rmtree(out, ignore_errors=True)
                if proc.returncode != 0:
                    print(f"{scenario}: FAILED\n{proc.stderr[-3000:]}")
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                print(
                    f"[{attempt + 1}] {scenario:<18} {r['rows']:>10,} rows {r['seconds']:>7.2f}s "
                    f"{r['rows_per_s']:>9,} rows/s  cpu {r['cpu_s']:>6.2f}s "
                    f"(server {r['server_cpu_s']:>5.2f}s) "
                    f"{r['rows_per_cpu_s']:>9,} rows/cpu-s  mem +{r['mem_growth_mb']:>6.1f} MB"
                )
                runs.setdefault(scenario, []).append(r)
        results = {
            name: {
                **max(rs, key=lambda r: r["rows_per_s"]),
                "rows_per_cpu_s": max(r["rows_per_cpu_s"] for r in rs),
                "mem_growth_mb": max(r["mem_growth_mb"] for r in rs),
            }
            for name, rs in runs.items()
        }
        print(f"\nbest of {args.repeat} run(s); memory: the worst run")
        for name, r in results.items():
            print(
                f"{name:<18} {r['rows_per_s']:>9,} rows/s  {r['rows_per_cpu_s']:>9,} rows/cpu-s  "
                f"mem +{r['mem_growth_mb']:>6.1f} MB"
            )
        print()
        for kind in ("postgres", "duckdb"):
            op, naive = results.get(f"operator-{kind}"), results.get(f"naive-{kind}")
            if op and naive:
                print(
                    f"operator vs naive ({kind}): {op['rows_per_s'] / naive['rows_per_s']:.2f}x rows/s, "
                    f"{op['rows_per_cpu_s'] / naive['rows_per_cpu_s']:.2f}x rows/cpu-s (target >= 1.5x)"
                )
        op, copy = results.get("operator-postgres"), results.get("pg-copy")
        if op and copy:
            print(
                f"pg-copy vs operator (postgres): {copy['rows_per_s'] / op['rows_per_s']:.2f}x rows/s, "
                f"{copy['rows_per_cpu_s'] / op['rows_per_cpu_s']:.2f}x rows/cpu-s (target <= 1.5x)"
            )
        for kind in ("duckdb", "postgres"):
            base = results.get(f"operator-{kind}-none")
            for counter in COUNTERS[1:]:
                r = results.get(f"operator-{kind}-{counter}")
                if base and r:
                    print(
                        f"token_counter={counter} vs none ({kind}): "
                        f"{r['rows_per_s'] / base['rows_per_s']:.3f}x rows/s, "
                        f"{r['rows_per_cpu_s'] / base['rows_per_cpu_s']:.3f}x rows/cpu-s"
                        + (" (target >= 0.90x)" if counter == "heuristic" else "")
                    )
        if any(s.startswith("operator-") and s.count("-") == 2 for s in scenarios):
            for what, code in ONE_OFF.items():
                proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                print(f"one-off per build: {what}: {proc.stdout.strip() or proc.stderr[-300:]}")
        if args.json:
            print(json.dumps(results, indent=2))
    finally:
        drop_data(schema)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
