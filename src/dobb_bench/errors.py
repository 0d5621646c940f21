"""The bench's user-facing errors, below every command module (``cli`` imports the commands, so
the commands take their error classes from here, not from ``cli``: no import circle).

``CliError``: printed by ``dobb_bench.cli.main`` as one line, exit code 2. ``Interrupted``: a run
stopped by Ctrl-C/SIGTERM with its state saved, one line, exit code 130.
"""
from __future__ import annotations

__all__ = ["CliError", "Interrupted", "one_line"]


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class Interrupted(Exception):
    """A run stopped by Ctrl-C/SIGTERM with its state saved: the message (one line), exit code 130."""


def one_line(exc: BaseException) -> str:
    """The first non-empty line of an error's message (its class name when it has none)."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return lines[0] if lines else type(exc).__name__
