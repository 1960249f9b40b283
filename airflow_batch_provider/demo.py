"""Sample data for the example DAGs and the one-command demo (``scripts/demo``).

``python -m airflow_batch_provider.demo`` has three subcommands:

* ``seed --conn-id ID``: create (or replace) the ``support_tickets`` and ``products`` sample
  tables in any common-sql warehouse connection (DuckDB, PostgreSQL, SQLite, MySQL...).
* ``summary --conn-id ID --table T`` (or ``--duckdb FILE``; also ``airflow-batch summary``):
  print a results table in a readable form (rows per status, tokens, a few rows).
* ``run``: the demo itself. In a fresh ``AIRFLOW_HOME`` with a SQLite metadata database it
  starts the local batch server (echo backend) on a free port, seeds an embedded DuckDB
  warehouse, runs the ``support_ticket_triage`` example with ``airflow dags test``, prints the
  summary, stops the server and prints the command that shows the summary again. Set
  ``BATCH_DEMO_CONNECTION`` to a ``batch_api`` connection URI (or JSON), e.g.
  ``batch-api://:sk-...@api.openai.com/v1?dialect=openai``, to run the same DAG against a
  real vendor instead of the local server (``BATCH_DEMO_MODEL`` picks the model, default
  ``gpt-4o-mini``).

The sample data is generated deterministically (same seed, same rows), so the demo and the
tests see the same tickets every time. A handful of tickets have no body on purpose: they
cannot become a prompt, land in the results table as ``rejected`` and show that no input row
is ever dropped silently.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow_batch_provider.constants import CONN_TYPE, DEFAULT_CONN_ID

# The environment variable Airflow reads the demo's batch connection from.
BATCH_CONN_ENV = f"AIRFLOW_CONN_{DEFAULT_CONN_ID.upper()}"

TICKETS_TABLE = "support_tickets"
PRODUCTS_TABLE = "products"
DEFAULT_TICKETS = 300
DEFAULT_PRODUCTS = 200
#: Every this-many-th ticket has no body (a NULL the build operator rejects, by design).
EMPTY_BODY_EVERY = 97
DEMO_DAG_ID = "support_ticket_triage"
DEMO_RESULTS_TABLE = "ticket_triage"

_TOPICS: dict[str, list[tuple[str, str]]] = {
    "billing": [
        (
            "Charged twice this month",
            "My card was charged twice for the {plan} plan on {day}. Please refund one.",
        ),
        ("Invoice shows wrong VAT number", "The invoice for order {order} lists an old VAT number."),
        (
            "Refund not received",
            "You promised a refund for order {order} two weeks ago; nothing arrived yet.",
        ),
    ],
    "bug": [
        ("Export to CSV fails", "Exporting the {plan} report to CSV fails with error {code} since {day}."),
        ("App crashes on login", "The mobile app closes right after I enter my password (version 4.{code})."),
        ("Dashboard charts empty", "All charts on the dashboard are empty since the update on {day}."),
    ],
    "account": [
        ("Cannot reset password", "The reset link in the e-mail says it expired, every time I try."),
        ("Add a second admin", "How do I give admin rights to a colleague on the {plan} plan?"),
        ("Close my account", "Please close my account and delete my data (customer {order})."),
    ],
    "shipping": [
        ("Parcel stuck in customs", "Order {order} has been in customs for nine days. What can I do?"),
        ("Wrong item delivered", "I ordered the blue model but order {order} contained the red one."),
        ("Delivery address change", "Can I still change the delivery address of order {order}?"),
    ],
    "feature_request": [
        ("Dark mode please", "Our team works nights; a dark mode for the web app would help a lot."),
        ("API rate limits too low", "The {plan} plan allows too few API calls per minute for our sync job."),
        ("SSO with Okta", "We would like single sign-on with Okta for the {plan} plan."),
    ],
}
_TIERS = ("free", "pro", "enterprise")
_PLANS = ("Starter", "Team", "Business")
_PRODUCT_KINDS = {
    "kitchen": ("kettle", "chef's knife", "cast-iron pan", "espresso grinder", "cutting board"),
    "outdoor": ("tent", "sleeping bag", "headlamp", "trail shoes", "water filter"),
    "office": ("standing desk", "ergonomic chair", "monitor arm", "desk lamp", "notebook"),
    "audio": ("headphones", "bookshelf speaker", "turntable", "microphone", "DAC"),
}
_ADJECTIVES = ("compact", "lightweight", "durable", "premium", "quiet", "foldable", "classic", "modern")
_MATERIALS = ("stainless steel", "recycled aluminium", "oak", "canvas", "carbon fibre", "ceramic")


def sample_tickets(count: int = DEFAULT_TICKETS, seed: int = 7) -> Iterator[tuple[Any, ...]]:
    """Rows ``(ticket_id, subject, body, customer_tier, created_at)``, the same for the same seed."""
    rng = random.Random(seed)
    start = datetime(2026, 1, 5, 8, 0, tzinfo=timezone.utc)
    topics = sorted(_TOPICS)
    for ticket_id in range(1, count + 1):
        topic = topics[rng.randrange(len(topics))]
        subject, body = _TOPICS[topic][rng.randrange(len(_TOPICS[topic]))]
        created = start + timedelta(minutes=37 * ticket_id + rng.randrange(30))
        text: str | None = body.format(
            plan=rng.choice(_PLANS),
            day=created.strftime("%d %B"),
            order=f"A{100000 + rng.randrange(900000)}",
            code=rng.randrange(100, 999),
        )
        if ticket_id % EMPTY_BODY_EVERY == 0:
            text = None
        # Naive UTC timestamps: every warehouse stores them the same way.
        yield ticket_id, subject, text, rng.choice(_TIERS), created.replace(tzinfo=None)


def sample_products(count: int = DEFAULT_PRODUCTS, seed: int = 11) -> Iterator[tuple[Any, ...]]:
    """Rows ``(product_id, name, category, description, price)``, the same for the same seed."""
    rng = random.Random(seed)
    categories = sorted(_PRODUCT_KINDS)
    for product_id in range(1, count + 1):
        category = categories[rng.randrange(len(categories))]
        kind = rng.choice(_PRODUCT_KINDS[category])
        adjective, material = rng.choice(_ADJECTIVES), rng.choice(_MATERIALS)
        name = f"{adjective.title()} {kind} {product_id:03d}"
        description = (
            f"A {adjective} {kind} made of {material}, for everyday {category} use. "
            f"Ships in {rng.randrange(1, 6)} days; {rng.randrange(1, 4)}-year warranty."
        )
        yield product_id, name, category, description, round(rng.uniform(9, 499), 2)


_DDL = {
    TICKETS_TABLE: (
        "ticket_id INTEGER PRIMARY KEY, subject TEXT NOT NULL, body TEXT, "
        "customer_tier TEXT NOT NULL, created_at TIMESTAMP NOT NULL"
    ),
    PRODUCTS_TABLE: (
        "product_id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, "
        "description TEXT NOT NULL, price DOUBLE PRECISION NOT NULL"
    ),
}
_COLUMNS = {
    TICKETS_TABLE: ("ticket_id", "subject", "body", "customer_tier", "created_at"),
    PRODUCTS_TABLE: ("product_id", "name", "category", "description", "price"),
}


def _warehouse_hook(conn_id: str) -> Any:
    from airflow.providers.common.sql.hooks.sql import DbApiHook
    from airflow.sdk import BaseHook

    hook = BaseHook.get_connection(conn_id).get_hook()
    if not isinstance(hook, DbApiHook):
        raise TypeError(f"connection {conn_id!r} gives a {type(hook).__name__}, not a common-sql DbApiHook")
    return hook


def _placeholder(hook: Any) -> str:
    # DbApiHook.placeholder is "%s" by default; DuckDB and SQLite hooks say "?".
    return str(getattr(hook, "placeholder", "%s") or "%s")


def seed_warehouse(
    conn_id: str, *, tickets: int = DEFAULT_TICKETS, products: int = DEFAULT_PRODUCTS, chunk: int = 500
) -> dict[str, int]:
    """Create (replacing any earlier copy) and fill the sample tables; returns rows per table.

    :param conn_id: a warehouse connection whose hook is a common-sql ``DbApiHook``.
    :param tickets: how many support tickets to write.
    :param products: how many products to write.
    :param chunk: rows per ``executemany`` call (memory stays flat for any count).
    """
    hook = _warehouse_hook(conn_id)
    mark = _placeholder(hook)
    sources = {
        TICKETS_TABLE: sample_tickets(tickets),
        PRODUCTS_TABLE: sample_products(products),
    }
    written: dict[str, int] = {}
    conn = hook.get_conn()
    try:
        cur = conn.cursor()
        try:
            for table, rows in sources.items():
                cur.execute(f"DROP TABLE IF EXISTS {table}")
                cur.execute(f"CREATE TABLE {table} ({_DDL[table]})")
                columns = _COLUMNS[table]
                insert = (
                    f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join([mark] * len(columns))})"
                )
                count = 0
                batch: list[tuple[Any, ...]] = []
                for row in rows:
                    batch.append(row)
                    if len(batch) >= chunk:
                        cur.executemany(insert, batch)
                        count += len(batch)
                        batch = []
                if batch:
                    cur.executemany(insert, batch)
                    count += len(batch)
                written[table] = count
        finally:
            cur.close()
        conn.commit()
    finally:
        conn.close()
    return written


def _query(hook: Any, sql: str) -> Iterator[tuple[Any, ...]]:
    conn = hook.get_conn()
    try:
        cur = conn.cursor()
        try:
            cur.execute(sql)
            while True:
                rows = cur.fetchmany(100)
                if not rows:
                    break
                yield from (tuple(r) for r in rows)
        finally:
            cur.close()
    finally:
        conn.close()


class DuckDBFile:
    """A DuckDB database file opened read-only, in the shape of a hook (``get_conn()``), without Airflow."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def get_conn(self) -> Any:
        import duckdb

        if not self.path.is_file():
            raise FileNotFoundError(2, "No such file", str(self.path))
        return duckdb.connect(str(self.path), read_only=True)


def results_summary(conn_id: str | None, table: str, *, sample: int = 5, hook: Any = None) -> dict[str, Any]:
    """Rows per status, token totals and a few rows of a results table written by the merge.

    :param conn_id: the warehouse connection (ignored when ``hook`` is given).
    :param table: the results table.
    :param sample: how many rows to show.
    :param hook: anything with ``get_conn()`` returning a DB-API connection, e.g. :class:`DuckDBFile`.
    """
    if hook is None:
        if not conn_id:
            raise ValueError("results_summary needs a connection id or a hook")
        hook = _warehouse_hook(conn_id)
    counts = {
        str(s): int(n) for s, n in _query(hook, f"SELECT status, COUNT(*) FROM {table} GROUP BY status")
    }
    tokens = next(
        _query(
            hook,
            f"SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
            f"COALESCE(SUM(total_tokens), 0) FROM {table}",
        )
    )
    conn = hook.get_conn()
    try:
        cur = conn.cursor()
        try:
            cur.execute(f"SELECT * FROM {table} ORDER BY 1 LIMIT {int(sample)}")
            columns = [d[0] for d in cur.description]
            rows = [dict(zip(columns, r, strict=True)) for r in cur.fetchmany(sample)]
        finally:
            cur.close()
    finally:
        conn.close()
    return {
        "table": table,
        "rows": sum(counts.values()),
        "counts": dict(sorted(counts.items())),
        "prompt_tokens": int(tokens[0]),
        "completion_tokens": int(tokens[1]),
        "total_tokens": int(tokens[2]),
        "sample": rows,
    }


def format_summary(summary: dict[str, Any], columns: Sequence[str] = ()) -> str:
    """The summary as text for a terminal."""
    lines = [f"Results table {summary['table']}: {summary['rows']} row(s)"]
    width = max((len(s) for s in summary["counts"]), default=0)
    for status, count in summary["counts"].items():
        lines.append(f"  {status:<{width}}  {count:>6}")
    lines.append(
        f"Tokens: prompt {summary['prompt_tokens']}, completion {summary['completion_tokens']}, "
        f"total {summary['total_tokens']}"
    )
    if summary["sample"]:
        shown = list(columns) or [c for c in summary["sample"][0] if c not in ("merged_at", "batch_id")]
        lines.append(f"First {len(summary['sample'])} row(s):")
        for row in summary["sample"]:
            parts = []
            for column in shown:
                value = row.get(column)
                text = "" if value is None else str(value).replace("\n", " ")
                parts.append(f"{column}={text[:60] + '...' if len(text) > 60 else text}")
            lines.append("  " + " | ".join(parts))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------
def _dags_folder() -> Path:
    return Path(__file__).resolve().parents[1] / "dags_examples"


def run_demo(workdir: Path, *, tickets: int = DEFAULT_TICKETS, keep: bool = False) -> int:
    """Run example 1 end to end in ``workdir`` (see the module docstring); returns an exit code."""
    from airflow_batch_provider.server.background import BackgroundServer
    from airflow_batch_provider.server.config import ServerConfig

    workdir.mkdir(parents=True, exist_ok=True)
    home = workdir / "airflow-home"
    home.mkdir(exist_ok=True)
    warehouse = workdir / "warehouse.duckdb"
    if warehouse.exists():
        warehouse.unlink()
    real_vendor = os.environ.get("BATCH_DEMO_CONNECTION")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    root = str(Path(__file__).resolve().parents[1])
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(_dags_folder()),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW_CONN_WAREHOUSE": f'{{"conn_type": "duckdb", "host": "{warehouse}"}}',
            "AIRFLOW_BATCH_STAGING_ROOT": f"file://{workdir / 'staging'}",
            "BATCH_EXAMPLES_POLL_INTERVAL": "2",
            "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
        }
    )
    os.environ.update({k: env[k] for k in ("AIRFLOW_HOME", "AIRFLOW_CONN_WAREHOUSE")})

    def step(message: str) -> None:
        print(f"==> {message}", flush=True)

    step(f"Airflow metadata database in {home}")
    migrate = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if migrate.returncode != 0:
        print(migrate.stdout[-4000:], file=sys.stderr)
        return migrate.returncode

    step(f"Seeding DuckDB warehouse {warehouse}")
    counts = seed_warehouse("warehouse", tickets=tickets)
    print(f"    {counts[TICKETS_TABLE]} tickets, {counts[PRODUCTS_TABLE]} products")

    server: BackgroundServer | None = None
    try:
        if real_vendor:
            step("Using the batch API from BATCH_DEMO_CONNECTION (a real vendor: this costs money)")
            env[BATCH_CONN_ENV] = real_vendor
            env["BATCH_EXAMPLES_POLL_INTERVAL"] = "30"
        else:
            # time_scale 0.05: a batch validates, runs and finalizes in well under a second.
            config = ServerConfig(
                port=0, data_dir=workdir / "batch-server", backend="echo", dialect="openai", time_scale=0.05
            )
            server = BackgroundServer(config).start()
            step(f"Local batch server (echo backend, offline) at {server.base_url}")
            env[BATCH_CONN_ENV] = (
                f'{{"conn_type": "{CONN_TYPE}", "host": "{server.base_url}", "password": "sk-demo", '
                '"extra": {"dialect": "openai"}}'
            )
        step(f"airflow dags test {DEMO_DAG_ID}")
        started = time.monotonic()
        log_file = workdir / "dags-test.log"
        command = [sys.executable, "-m", "airflow", "dags", "test", DEMO_DAG_ID]
        if os.environ.get("BATCH_DEMO_MODEL"):
            command += ["-c", json.dumps({"model": os.environ["BATCH_DEMO_MODEL"]})]
        with log_file.open("w") as log:
            proc = subprocess.run(  # noqa: S603 - our own interpreter and a fixed argument list
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
                cwd=workdir,
            )
        elapsed = time.monotonic() - started
        if proc.returncode != 0:
            print(_tail_text(log_file), file=sys.stderr)
            print(f"DAG run failed (exit code {proc.returncode}); full log: {log_file}", file=sys.stderr)
            return proc.returncode
        print(f"    DAG run succeeded in {elapsed:.0f}s")
    finally:
        if server is not None:
            server.stop()
            step("Local batch server stopped")

    summary = results_summary("warehouse", DEMO_RESULTS_TABLE)
    print()
    print(
        format_summary(
            summary,
            columns=(
                "ticket_id",
                "status",
                "category",
                "urgency",
                "summary",
                "prompt_tokens",
                "completion_tokens",
            ),
        )
    )
    print()
    print(summary_hint(warehouse, kept=keep))
    return 0


def _cli_command() -> str:
    """How to call ``airflow-batch`` from the user's shell (the venv's script when it is not on PATH)."""
    script = Path(sys.executable).with_name("airflow-batch")
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m airflow_batch_provider.cli"
    on_path = shutil.which("airflow-batch")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "airflow-batch"
    try:
        return shlex.quote(str(script.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(script))


def summary_command(warehouse: Path, table: str = DEMO_RESULTS_TABLE) -> str:
    """The shell command that prints the summary of ``table`` in the DuckDB file ``warehouse`` again."""
    return f"{_cli_command()} summary --duckdb {shlex.quote(str(warehouse))} --table {shlex.quote(table)}"


def summary_hint(warehouse: Path, *, kept: bool) -> str:
    """What the demo prints last: how to look at the results table again."""
    if kept:
        return (
            f"Working files (warehouse, staging, logs) kept in {warehouse.parent}\n"
            f"Look at the results again with:\n  {summary_command(warehouse)}\n"
            f"(or open the file with the duckdb Python package: duckdb.connect({str(warehouse)!r}))"
        )
    return (
        "The temporary working files are removed now. To keep the warehouse and look at the results "
        "again, run the demo with --keep (or --workdir DIR), then:\n"
        f"  {summary_command(Path('DIR') / warehouse.name)}"
    )


def add_summary_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``airflow-batch summary`` (also ``python -m airflow_batch_provider.demo summary``)."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--duckdb", metavar="FILE", help="a DuckDB database file (opened read-only; no Airflow needed)"
    )
    where.add_argument("--conn-id", help="an Airflow warehouse connection id (any common-sql hook)")
    parser.add_argument(
        "--table", default=DEMO_RESULTS_TABLE, help=f"the results table (default {DEMO_RESULTS_TABLE})"
    )
    parser.add_argument("--rows", type=int, default=5, help="how many rows to show (default 5)")
    parser.set_defaults(func=run_summary)


def run_summary(args: argparse.Namespace) -> int:
    """Print the summary of a results table; exit 1 with one line when it cannot be read."""
    # A command line on an Airflow host, like ``airflow connections get``: the Task SDK reads
    # connections from the metadata database only in a process it knows as a server one; left
    # undetected, it would see environment variables and secrets backends alone. Inside a task
    # (a supervisor present) the SDK's own client chain still wins.
    os.environ.setdefault("_AIRFLOW_PROCESS_CONTEXT", "server")
    hook = DuckDBFile(args.duckdb) if args.duckdb else None
    source = args.duckdb or f"connection {args.conn_id!r}"
    try:
        summary = results_summary(args.conn_id, args.table, sample=args.rows, hook=hook)
    except OSError as exc:
        print(f"airflow-batch summary: {exc.filename or source}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"airflow-batch summary: cannot read table {args.table!r} from {source}: {first}", file=sys.stderr
        )
        return 1
    print(format_summary(summary))
    return 0


def _tail_text(path: Path, chars: int = 6000) -> str:
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(handle.tell() - chars, 0))
        return handle.read().decode("utf-8", "replace")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_batch_provider.demo", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    seed = sub.add_parser("seed", help="create and fill the sample tables in a warehouse connection")
    seed.add_argument("--conn-id", required=True, help="warehouse connection id (any common-sql hook)")
    seed.add_argument("--tickets", type=int, default=DEFAULT_TICKETS)
    seed.add_argument("--products", type=int, default=DEFAULT_PRODUCTS)
    add_summary_arguments(
        sub.add_parser("summary", help="print a results table: rows per status, tokens, a few rows")
    )
    run = sub.add_parser(
        "run", help="the demo: local batch server + DuckDB + example 1 with airflow dags test"
    )
    run.add_argument("--workdir", help="where to keep the demo's files (default: a new temporary directory)")
    run.add_argument("--tickets", type=int, default=DEFAULT_TICKETS)
    run.add_argument("--keep", action="store_true", help="keep the temporary working directory afterwards")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "seed":
        counts = seed_warehouse(args.conn_id, tickets=args.tickets, products=args.products)
        print(", ".join(f"{table}: {n} rows" for table, n in counts.items()))
        return 0
    if args.command == "summary":
        return run_summary(args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="airflow-batch-demo-"))
    # A directory the user named is always kept; a temporary one only with --keep.
    keep = bool(args.keep or args.workdir)
    code = 1
    try:
        code = run_demo(workdir, tickets=args.tickets, keep=keep)
        return code
    finally:
        if not keep and code == 0:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
