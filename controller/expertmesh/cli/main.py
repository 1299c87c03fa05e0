"""The ``expertmesh`` command line.

Every subcommand module exposes ``add_parser(subparsers)`` that registers its
parser with ``func=...``. Bad input raises :class:`UsageError` (or
``ValueError`` from the planner): one line on stderr, exit code 2, no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["UsageError", "main"]

# Subcommand modules, in the order `expertmesh --help` lists them. A module that
# is not there yet is skipped, so the CLI works while features land one by one.
_COMMANDS = ("trace", "plan", "sim", "demo", "serve", "certs")


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit code 2), like every other
    bad input; ``--help`` still prints the full usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="expertmesh",
        description="Expert placement, replication and migration for MoE across data centers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(f"expertmesh.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"expertmesh.cli.{name}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as err:
        print(f"expertmesh {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except RecursionError:  # e.g. JSON or YAML given on the command line, nested too deeply
        print(f"expertmesh {args.command}: error: input nested too deeply", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"expertmesh {args.command}: error: input too large for memory", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.strerror}: {err.filename}"
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
