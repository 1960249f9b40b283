"""``airflow-batch``: the command line of the provider (serve, validate, prepare)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airflow-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from airflow_batch_provider.server import cli as server_cli

    serve = sub.add_parser("serve", help="run the local OpenAI-compatible Files + Batches server")
    server_cli.add_arguments(serve)
    serve.set_defaults(func=server_cli.run)

    from airflow_batch_provider import commands

    commands.add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
