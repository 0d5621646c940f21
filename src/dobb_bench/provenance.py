"""Where a run record comes from: code revision, tree state, software, machine and command line.

Why: a figure in docs/ is only trustworthy if a reader can find the exact code and command that
produced it. Every final run record carries ``provenance()``; ``records.py`` refuses (in its test)
any docs table resting on a record whose tree was dirty, because a dirty tree names no revision.

The revision is that of the checkout holding *this* source file (so a run launched with
``PYTHONPATH=/tmp/exp-<rev>/src`` names the worktree's clean revision, not the caller's tree).
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

from dobb.functional import cpu_native

_SRC = Path(__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_SRC), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@lru_cache(maxsize=1)
def git_state() -> dict:
    """``{"git_rev": sha or None, "git_dirty": bool or None}``; dirty counts tracked-file edits only.

    Untracked files (run outputs, caches) do not change what the code computes; a modified or
    staged tracked file does.
    """
    rev = _git("rev-parse", "HEAD")
    if rev is None:
        return {"git_rev": None, "git_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_rev": rev.strip(), "git_dirty": None if status is None else bool(status.strip())}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16_flags() -> list[str]:
    """The CPU's bf16/AMX feature flags from /proc/cpuinfo (empty on AMD EPYC hosts here)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if "bf16" in f or f.startswith("amx"))
    except OSError:
        pass
    return []


def native_bf16() -> bool:
    """Whether oneDNN has native bf16 products on this CPU (AVX512-BF16/AMX): what torch's bf16
    products, and so Dobb's and Muon's bf16 paths, run on: the library's own answer
    (``dobb.functional.cpu_native``), so records name what ``product_dtype="auto"`` saw."""
    return cpu_native(torch.bfloat16)


def machine() -> dict:
    """Host description for records; ``native_bf16`` is oneDNN's answer (``native_bf16()``),
    ``bf16_flags`` the CPU flags behind it, since Dobb's and Muon's bf16 paths differ by host."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": gpu, "host_os": platform.platform(terse=True),
            "native_bf16": native_bf16(), "bf16_flags": cpu_bf16_flags()}


def command_line(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    prog = "dobb-bench" if argv and (argv[0].endswith(("dobb-bench", "cli.py")) or argv[0] == "-m") else argv[0]
    return shlex.join([prog, *argv[1:]]) if argv else ""


def provenance(argv: list[str] | None = None) -> dict:
    """The provenance block stored in every final record (JSON-ready)."""
    return {**git_state(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": machine(), "command": command_line(argv),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
