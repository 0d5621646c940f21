"""How a multi-process test's ranks end, and how the test tells a platform abort at exit from a failure.

On a loaded 2-core host, gloo ranks sometimes die *after* their work, while the interpreter tears
down gloo's threads: SIGABRT, "terminate called without an active exception". torchrun then exits
non-zero although every result was written. Two parts:

- ``finish_rank(done_dir)``, the last call of a torchrun worker: a ``barrier`` (every rank's work is
  done), a marker file per rank (written only after that barrier), ``destroy_process_group``, then
  ``os._exit`` once the output streams are flushed, so no interpreter teardown runs after the
  result;
- ``run_ranks(cmd, done_dir, world)`` runs the command and classifies a non-zero exit: when every
  rank wrote its marker, the run completed and the non-zero status came at exit (a
  ``PlatformExitAbort`` warning says so, with the status, and the test goes on to verify the
  results itself); otherwise it is a real failure (``AssertionError`` with stderr's tail).
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

MARKER = ".rank{rank}.done"


class PlatformExitAbort(UserWarning):
    """Every rank completed its work (markers written), and the launch still exited non-zero."""


def completed_ranks(done_dir, world: int) -> list[int]:
    return [r for r in range(world) if (Path(done_dir) / MARKER.format(rank=r)).exists()]


def finish_rank(done_dir) -> None:
    """End this rank: barrier, marker, ``destroy_process_group``, flush, ``os._exit(0)``."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        rank = dist.get_rank()
        (Path(done_dir) / MARKER.format(rank=rank)).write_text("done\n")
        dist.destroy_process_group()
    else:
        (Path(done_dir) / MARKER.format(rank=0)).write_text("done\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def classify(returncode: int, done_dir, world: int) -> str:
    """``"ok"``, ``"platform abort at exit"`` (every rank done, non-zero exit) or ``"failure"``."""
    if returncode == 0:
        return "ok"
    return "platform abort at exit" if len(completed_ranks(done_dir, world)) == world else "failure"


def run_ranks(cmd: list[str], done_dir, world: int, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` of a torchrun launch whose workers end with ``finish_rank(done_dir)``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    kind = classify(proc.returncode, done_dir, world)
    if kind == "platform abort at exit":
        warnings.warn(PlatformExitAbort(
            f"exit status {proc.returncode} after all {world} ranks completed and wrote their results: a "
            f"platform abort at exit, not a failure; stderr tail: {proc.stderr[-500:]}"), stacklevel=2)
    elif kind == "failure":
        done = completed_ranks(done_dir, world)
        raise AssertionError(f"real failure: exit status {proc.returncode}, ranks that completed: {done} of "
                             f"{world}\n{proc.stderr[-3000:]}")
    return proc
