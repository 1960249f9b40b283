"""The build's input-token estimate against counts of the same requests, on the demo data.

    /work/main/.venv/bin/python benchmarks/bench_estimate.py              # 300 demo tickets
    /work/main/.venv/bin/python benchmarks/bench_estimate.py --tickets 3000

The demo's tickets (``airflow_batch_provider.demo``) are seeded into a DuckDB file and built
with the demo DAG's prompt (``dags_examples/support_ticket_triage.py``: system prompt, ticket
template, JSON-schema response format) twice: ``token_counter="exact"`` (o200k from
bpe-openai, offline) and ``"heuristic"`` (a private tokenizer's estimate is this times its
dialect's ``token_factor``).
Every line of the exact build is then answered by the local server's echo model, whose
``usage.prompt_tokens`` counts whitespace-separated words of the messages' text (no framing,
no schema): it is not a tokenizer, so its figure shows how far a word count is from tokens,
not an error of the estimate. The estimate's error is measured against the exact count, per
line (the spread) and in total (what a budget sees).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent


def dag_prompt() -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The demo DAG's messages and body, read from the DAG file itself."""
    spec = importlib.util.spec_from_file_location(
        "triage", REPO / "dags_examples" / "support_ticket_triage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    task = module.dag.get_task("build_requests")
    return list(task.messages), dict(task.body)


def _lines(result: dict[str, Any]) -> list[dict[str, Any]]:
    from airflow_batch_provider.staging import resolve_path

    out: list[dict[str, Any]] = []
    for shard in result["shards"]:
        out.extend(orjson.loads(line) for line in resolve_path(shard["uri"]).read_bytes().splitlines())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tickets", type=int, default=300)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-estimate-"))
    os.environ.setdefault("AIRFLOW_HOME", str(work / "airflow-home"))
    os.environ["AIRFLOW_CONN_BENCH_DUCKDB"] = json.dumps(
        {"conn_type": "duckdb", "host": str(work / "demo.duckdb")}
    )

    from airflow_batch_provider.demo import TICKETS_TABLE, seed_warehouse
    from airflow_batch_provider.estimate import exact_counter
    from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
    from airflow_batch_provider.server.backends import EchoBackend

    seed_warehouse("bench_duckdb", tickets=args.tickets, products=1)
    messages, body = dag_prompt()
    builds: dict[str, dict[str, Any]] = {}
    for name, counter, dialect in (
        ("exact", "exact", "openai"),
        ("heuristic", "heuristic", "openai"),
    ):
        op = SqlToBatchJsonlOperator(
            task_id=f"build_{name}",
            conn_id="bench_duckdb",
            sql=f"SELECT ticket_id, subject, body, customer_tier FROM {TICKETS_TABLE} ORDER BY ticket_id",
            key_columns="ticket_id",
            messages=messages,
            body=body,
            model="gpt-4o-mini",
            dialect=dialect,
            token_counter=counter,
            price_table="none",
            staging_path=str(work / name),
        )
        builds[name] = op.execute({})  # type: ignore[arg-type]

    lines = _lines(builds["exact"])
    exact = exact_counter("o200k_base")
    from airflow_batch_provider.estimate import heuristic_counter

    guess = heuristic_counter()
    per_line = [guess(line["body"]) / exact(line["body"]) - 1 for line in lines]

    async def echo_usage() -> int:
        backend = EchoBackend()
        total = 0
        try:
            for line in lines:
                status, answer = await backend.call(line["url"], line["body"])
                assert status == 200, answer
                total += int(answer["usage"]["prompt_tokens"])
        finally:
            await backend.aclose()
        return total

    words = asyncio.run(echo_usage())
    counts = {name: b["estimate"]["input_tokens"] for name, b in builds.items()}
    base = counts["exact"]
    print(f"demo data: {len(lines)} requests (support_ticket_triage prompt, {args.tickets} tickets)")
    for name, n in counts.items():
        print(f"  {name:<20} {n:>9,} input tokens  {n / base - 1:+.1%} vs exact o200k")
    print(f"  {'echo usage (words)':<20} {words:>9,} prompt tokens {words / base - 1:+.1%} vs exact o200k")
    print(
        f"heuristic error per line vs exact: mean {statistics.mean(per_line):+.1%}, "
        f"min {min(per_line):+.1%}, max {max(per_line):+.1%}"
    )
    max_out = builds["exact"]["estimate"]["max_output_tokens"]
    print(f"worst-case output: {max_out:,} tokens (max_tokens x requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
