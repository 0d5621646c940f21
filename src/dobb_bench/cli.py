"""`dobb-bench`: one entry point; each subcommand lives in its own module.

Every module listed in ``_COMMAND_MODULES`` exposes ``add_parsers(subparsers)``, which registers its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns an exit code. User errors are
raised as ``CliError`` (or ``ValueError``/``OSError``) and printed as one line with exit code 2, no
traceback; Ctrl-C prints one line and exits 130. Under ``torchrun`` only rank 0 prints (every rank
meets the same user error; one message, not one per rank).

``python -m dobb_bench.cli`` (the entry ``torchrun`` needs) runs this file as ``__main__``; the
error classes live in ``dobb_bench.errors``, so they are the same classes whichever way the CLI is
started.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from dobb_bench.errors import CliError, Interrupted  # noqa: F401 (re-exported: dobb_bench.cli.CliError)
from dobb_bench.errors import one_line as _one_line

_COMMAND_MODULES = [  # dotted under dobb_bench; the order is the help's
    "studies.docs_tables",      # report
    "training.commands_train",  # train, compare, sweep
    "studies.ablations",        # ablate
    "spectral.commands",        # orthogonality, spectrum
    "cost.timing",              # timing
    "cost.payload_command",     # payload
    "studies.diagnostics",      # microbatch, microbatch-table
    "studies.controlled",       # controlled
    "cost.looptime",            # looptime
    "cost.roofline",            # roofline
    "cost.projection",          # project
    "studies.study_command",    # study
]


def build_parser(modules=None) -> argparse.ArgumentParser:
    """``modules``: a subset of ``_COMMAND_MODULES`` (``python -m dobb_bench.timing`` imports only its own)."""
    parser = argparse.ArgumentParser(prog="dobb-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules or _COMMAND_MODULES:
        importlib.import_module(f"dobb_bench.{name}").add_parsers(sub)
    return parser


def _os_error(exc: OSError) -> str:
    """An OSError as one line naming the file and the way out (``str(exc)`` names the file)."""
    what = exc.strerror or _one_line(exc)
    where = f": {exc.filename}" if exc.filename else ""
    return f"{what}{where} (check the path and its permissions, or choose another --out)"


def _say(command: str, text: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # torchrun: every rank meets the same error; rank 0 says it
        print(f"dobb-bench {command}: {text}", file=sys.stderr, flush=True)
    else:
        # torchrun SIGTERMs the other ranks as soon as one exits: give rank 0 time to print first.
        time.sleep(2.0)


def _leave_torchrun(code: int) -> int:
    """Under torchrun (several ranks), end this rank with ``os._exit(code)`` once its process group
    is gone and its output flushed. The commands have written their records by now; what is left
    is interpreter teardown, where gloo's threads can abort the process on a loaded host (SIGABRT,
    "terminate called without an active exception") and turn a completed run into a failed launch.
    A single process (and any in-process call, as the tests make) returns ``code`` as before."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1") or 1) < 2:
        return code
    import logging

    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():  # an error path that did not leave the group
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, modules=None) -> int:
    return _leave_torchrun(_main(argv, modules))


def _main(argv: list[str] | None = None, modules=None) -> int:
    parser = build_parser(modules)
    args = parser.parse_args(argv)
    args.argv = ["dobb-bench", *(sys.argv[1:] if argv is None else argv)]  # for run records' provenance
    try:
        return int(args.func(args) or 0)
    except Interrupted as exc:
        _say(args.command, _one_line(exc))
        return 130
    except KeyboardInterrupt:
        _say(args.command, "interrupted (Ctrl-C); finished runs and checkpoints in --out are kept: "
                           "rerun the same command to resume")
        return 130
    except (CliError, ValueError) as exc:
        _say(args.command, f"error: {_one_line(exc)}")
        return 2
    except OSError as exc:  # FileNotFoundError, PermissionError, NotADirectoryError, ...
        _say(args.command, f"error: {_os_error(exc)}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
