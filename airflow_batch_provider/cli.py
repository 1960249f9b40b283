"""airflow-batch: the command line of the provider (serve, validate, prepare, summary)."""

# The entry point only (the parser, exit codes, one-line errors; the docstring is the --help text).
# Each command lives with what it runs: file_commands (validate, prepare), server.options (serve),
# demo (summary).

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit 2), pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _serve(parser: argparse.ArgumentParser) -> None:
    from airflow_batch_provider.server import options

    options.add_arguments(parser)
    parser.set_defaults(func=options.run)


def _validate(parser: argparse.ArgumentParser) -> None:
    from airflow_batch_provider import file_commands

    file_commands.add_validate_arguments(parser)


def _prepare(parser: argparse.ArgumentParser) -> None:
    from airflow_batch_provider import file_commands

    file_commands.add_prepare_arguments(parser)


def _summary(parser: argparse.ArgumentParser) -> None:
    from airflow_batch_provider import demo

    demo.add_summary_arguments(parser)


# name -> (one-line help, adds the command's options). The options are added only for the command
# being run, so ``airflow-batch --help`` imports nothing beyond argparse.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "serve": ("run the local OpenAI-compatible Files + Batches server", _serve),
    "validate": ("check a batch JSONL file against every rule of a dialect", _validate),
    "prepare": ("set or override the model (and url) on every line of a batch JSONL file", _prepare),
    "summary": ("print a results table: rows per status, token totals, the first rows", _summary),
}


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the top-level parser has no option taking a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``airflow-batch`` parser; with ``command``, only that command gets its options."""
    parser = _Parser(prog="airflow-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, add_arguments) in COMMANDS.items():
        child = sub.add_parser(name, help=text, description=text)
        if command is None or command == name:
            add_arguments(child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; usage errors exit 2, invalid input (a missing file, a bad option value) 1.

    Invalid input is reported as one line on stderr, never as a traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv) or "")
    args = parser.parse_args(argv)
    from airflow_batch_provider.exceptions import BatchProviderError

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
