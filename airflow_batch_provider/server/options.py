"""``airflow-batch serve``: command-line options of the local batch server."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from airflow_batch_provider.dialects import DIALECTS
from airflow_batch_provider.server.config import FaultConfig, ServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (default 8000; 0 = any free port)"
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        dest="allowed_hosts",
        metavar="NAME",
        help="answer requests whose Host header names NAME (repeatable; any port). localhost, "
        "127.0.0.1, [::1] and the --host address are always served; other names get a 421 "
        "(DNS-rebinding defence). '*' serves every name",
    )
    parser.add_argument(
        "--backend", choices=("echo", "upstream"), default="echo", help="what answers each line"
    )
    parser.add_argument(
        "--dialect", choices=sorted(DIALECTS), default="openai", help="vendor wire shape to speak"
    )
    parser.add_argument("--data-dir", default="./batch-server-data", help="where metadata and files are kept")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="real seconds per simulated second (0.01 = 100x faster)"
    )
    parser.add_argument(
        "--api-key-env", metavar="VAR", help="require the API key held in this environment variable"
    )
    parser.add_argument(
        "--bearer-token-env",
        metavar="VAR",
        help="also accept this environment variable's token as 'Authorization: Bearer' "
        "(dialect azure: stands in for a Microsoft Entra ID token)",
    )
    parser.add_argument(
        "--gcs-endpoint-url",
        metavar="URL",
        help="Cloud Storage JSON API the jobs read input from and write predictions to (dialect "
        "vertex; e.g. a gcp-storage-emulator at http://127.0.0.1:9023)",
    )
    parser.add_argument(
        "--bigquery-endpoint-url",
        metavar="URL",
        help="BigQuery REST endpoint the jobs read bq:// input tables from and write prediction "
        "tables to (dialect vertex; anonymous credentials, e.g. a bqemulator at http://127.0.0.1:9050)",
    )
    parser.add_argument(
        "--s3-endpoint-url",
        metavar="URL",
        help="S3 endpoint the jobs read input from and write results to (dialect bedrock; default: "
        "AWS's own; credentials from boto3's default chain)",
    )
    parser.add_argument(
        "--upstream", metavar="URL", help="OpenAI-compatible base URL (with /v1) for --backend upstream"
    )
    parser.add_argument(
        "--upstream-key-env", metavar="VAR", help="environment variable holding the upstream API key"
    )
    parser.add_argument("--upstream-concurrency", type=int, default=8, help="most upstream calls in flight")
    parser.add_argument("--upstream-retries", type=int, default=3, help="retries per line on 429/5xx")
    parser.add_argument("--embedding-dim", type=int, default=16, help="echo embedding size")
    parser.add_argument("--line-seconds", type=float, default=0.0, help="simulated seconds per line")
    parser.add_argument(
        "--validate-seconds", type=float, default=2.0, help="simulated seconds spent validating"
    )
    parser.add_argument(
        "--finalize-seconds", type=float, default=2.0, help="simulated seconds spent finalizing"
    )
    parser.add_argument("--max-lines", type=int, help="override the dialect's line limit")
    parser.add_argument("--max-file-bytes", type=int, help="override the dialect's file size limit")
    parser.add_argument("--max-line-bytes", type=int, help="override the dialect's line size limit")
    parser.add_argument(
        "--max-storage-bytes",
        type=int,
        help="cap on bytes kept in the data dir (uploads past it get a 507; a batch whose results "
        "would pass it fails with insufficient_storage)",
    )
    parser.add_argument(
        "--max-enqueued-tokens",
        type=int,
        help="enqueued-token limit per model: the input tokens of live batches (validating, in "
        "progress, finalizing) of one model may not pass it",
    )
    parser.add_argument(
        "--enqueued-limit-form",
        choices=("refuse", "fail"),
        help="a batch over --max-enqueued-tokens is refused at create (refuse) or created and failed "
        "with token_limit_exceeded (fail); default: the vendor's (azure refuse, else fail)",
    )
    faults = parser.add_argument_group("fault injection (rates are fractions 0..1)")
    faults.add_argument("--fault-429", type=float, default=0.0, help="fraction of calls answering 429")
    faults.add_argument("--fault-500", type=float, default=0.0, help="fraction of calls answering 500")
    faults.add_argument("--fault-503", type=float, default=0.0, help="fraction of calls answering 503")
    faults.add_argument(
        "--retry-after", type=float, default=1.0, help="Retry-After seconds on injected 429/503"
    )
    faults.add_argument("--fault-slow", type=float, default=0.0, help="fraction of calls delayed")
    faults.add_argument("--slow-seconds", type=float, default=0.5, help="delay of a slow call")
    faults.add_argument(
        "--fault-drop", type=float, default=0.0, help="fraction of downloads dropped half way"
    )
    faults.add_argument("--fault-line-failure", type=float, default=0.0, help="fraction of lines failing")
    faults.add_argument("--fail-validation", action="store_true", help="every batch fails validation")
    faults.add_argument("--expire-batches", action="store_true", help="every batch expires when it starts")
    faults.add_argument("--stall-batches", action="store_true", help="every batch stalls until resumed")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the server settings from parsed options (the API key is read from the environment)."""
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SystemExit(f"--api-key-env {args.api_key_env}: the variable is not set or empty")
    bearer_token = None
    if getattr(args, "bearer_token_env", None):
        bearer_token = os.environ.get(args.bearer_token_env)
        if not bearer_token:
            raise SystemExit(f"--bearer-token-env {args.bearer_token_env}: the variable is not set or empty")
    return ServerConfig(
        host=args.host,
        allowed_hosts=args.allowed_hosts,
        port=args.port,
        data_dir=Path(args.data_dir),
        backend=args.backend,
        dialect=args.dialect,
        gcs_endpoint_url=getattr(args, "gcs_endpoint_url", None),
        bigquery_endpoint_url=getattr(args, "bigquery_endpoint_url", None),
        api_key=api_key,
        bearer_token=bearer_token,
        s3_endpoint_url=getattr(args, "s3_endpoint_url", None),
        time_scale=args.time_scale,
        validate_seconds=args.validate_seconds,
        finalize_seconds=args.finalize_seconds,
        line_seconds=args.line_seconds,
        max_lines=args.max_lines,
        max_file_bytes=args.max_file_bytes,
        max_line_bytes=args.max_line_bytes,
        max_storage_bytes=args.max_storage_bytes,
        max_enqueued_tokens=getattr(args, "max_enqueued_tokens", None),
        enqueued_limit_form=getattr(args, "enqueued_limit_form", None),
        embedding_dim=args.embedding_dim,
        upstream_url=args.upstream,
        upstream_api_key_env=args.upstream_key_env,
        upstream_concurrency=args.upstream_concurrency,
        upstream_max_retries=args.upstream_retries,
        faults=FaultConfig(
            rate_429=args.fault_429,
            rate_500=args.fault_500,
            rate_503=args.fault_503,
            retry_after=args.retry_after,
            slow_rate=args.fault_slow,
            slow_seconds=args.slow_seconds,
            drop_rate=args.fault_drop,
            line_failure_rate=args.fault_line_failure,
            fail_validation=args.fail_validation,
            expire_batches=args.expire_batches,
            stall_batches=args.stall_batches,
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Start the server in the foreground until interrupted."""
    import socket

    import uvicorn

    from airflow_batch_provider.server.app import create_app

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"airflow-batch serve: {exc}", file=sys.stderr)
        return 2
    config.data_dir.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        print(f"airflow-batch serve: cannot bind {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    config = config.model_copy(update={"port": port})
    key_note = f" (API key from ${args.api_key_env})" if args.api_key_env else ""
    if getattr(args, "bearer_token_env", None):
        key_note += f" (bearer token from ${args.bearer_token_env})"
    # The API root in the mode's first path style; a vendor with more than one names the others.
    from airflow_batch_provider.server.wire import get_wire

    first, *others = get_wire(config.dialect).path_prefixes
    also = f" (also under {', '.join(others)})" if others else ""
    # Bound to every interface, the server is reached by a name it serves (0.0.0.0 is none of them).
    shown = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host  # noqa: S104
    print(
        f"Local batch server ({config.dialect} dialect, {config.backend} backend) at "
        f"http://{shown}:{port}{first}{also}{key_note}\n"
        f"  data: {config.data_dir.resolve()}  time scale: {config.time_scale:g}",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="info", access_log=False))
    server.run(sockets=[sock])
    return 0
