"""`dobb-bench`: one entry point; each subcommand lives in its own module.

Every module listed in ``_COMMAND_MODULES`` exposes ``add_parsers(subparsers)``, which registers its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns an exit code. User errors are
raised as ``CliError`` and printed as one line with exit code 2 (no traceback).
"""
from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = [
    "commands_train",
    "ablations",
    "spectral",
    "timing",
    "payload_command",
    "diagnostics",
    "controlled",
    "roofline",
]


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def build_parser(modules=None) -> argparse.ArgumentParser:
    """``modules``: a subset of ``_COMMAND_MODULES`` (``python -m dobb_bench.timing`` imports only its own)."""
    parser = argparse.ArgumentParser(prog="dobb-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules or _COMMAND_MODULES:
        importlib.import_module(f"dobb_bench.{name}").add_parsers(sub)
    return parser


def main(argv: list[str] | None = None, modules=None) -> int:
    parser = build_parser(modules)
    args = parser.parse_args(argv)
    args.argv = ["dobb-bench", *(sys.argv[1:] if argv is None else argv)]  # for run records' provenance
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"dobb-bench {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
