"""``airflow-batch``: the command line of the provider (serve, validate, prepare)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit 2), pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="airflow-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from airflow_batch_provider.server import cli as server_cli

    serve = sub.add_parser("serve", help="run the local OpenAI-compatible Files + Batches server")
    server_cli.add_arguments(serve)
    serve.set_defaults(func=server_cli.run)

    from airflow_batch_provider import commands

    commands.add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; usage errors exit 2, invalid input (a missing file, a bad option value) 1.

    Invalid input is reported as one line on stderr, never as a traceback.
    """
    from airflow_batch_provider.exceptions import BatchProviderError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"{parser.prog} {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
    except BatchProviderError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
