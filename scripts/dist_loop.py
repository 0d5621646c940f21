"""Loop the multi-process tests on a loaded host and keep the record (issue 41, item 4).

Runs ``pytest -n 2 --dist loadgroup tests/distributed tests/bench/training`` (the README's xdist
mode) ``--runs`` times in a row, and writes after every run a JSON record and a Markdown summary:
the command, the git revision (and whether the worktree was dirty), the CPU model (``lscpu``),
per run the exit status, wall seconds, pytest's summary counts, the platform aborts at exit the
harness reported (``PlatformExitAbort`` / "platform abort at exit"; ranks killed after a slow exit
are counted apart), the load average, and the
busiest other processes (the CPU-bound process beside the tests).

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/dist_loop.py --runs 5 --out docs/results/checks/dist_loop_loaded
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "--timeout", "900",
          "tests/distributed", "tests/bench/training"]


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _sh(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def busiest(exclude: int, n: int = 3) -> list[str]:
    """The ``n`` busiest processes not of this loop (pid, %CPU, command), from ``ps``."""
    out = _sh(["ps", "-eo", "pid,ppid,pcpu,args", "--sort=-pcpu"]).splitlines()[1:]
    rows = []
    for line in out:
        pid, ppid, pcpu, args = line.split(None, 3)
        if int(pid) == exclude or int(ppid) == exclude or "pytest" in args or "ps -eo" in args:
            continue
        rows.append(f"{pid} {pcpu}% {args[:100]}")
        if len(rows) == n:
            break
    return rows


def counts(summary: str) -> dict[str, int]:
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|warnings?|deselected)", summary)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="docs/results/checks/dist_loop_loaded", help="path stem (.json, .md)")
    args = ap.parse_args()
    out = ROOT / args.out
    cmd = [sys.executable, *PYTEST]
    record = {
        "command": "OMP_NUM_THREADS=1 PYTHONPATH=src python " + " ".join(PYTEST),
        "git_rev": _sh(["git", "rev-parse", "HEAD"]),
        "dirty_tracked_files": bool(_sh(["git", "status", "--porcelain", "--untracked-files=no"])),
        "cpu_model": cpu_model(), "nproc": os.cpu_count(),
        "start": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs": [],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for i in range(1, args.runs + 1):
        load0, beside = os.getloadavg()[0], busiest(os.getpid())
        exit_log = Path(tempfile.mkdtemp()) / "spawn-exit.log"  # reports of pools stopped at exit
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env={**env, "DOBB_SPAWN_EXIT_LOG": str(exit_log)},
                              capture_output=True, text=True)
        secs = time.monotonic() - t0
        text = proc.stdout + proc.stderr + (exit_log.read_text() if exit_log.exists() else "")
        summary = next((l for l in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed)", l)), "")
        run = {"run": i, "rc": proc.returncode, "seconds": round(secs), "summary": summary.strip("= "),
               "counts": counts(summary), "platform_aborts_at_exit": len(re.findall("platform abort at exit", text)),
               "slow_exits_killed": len(re.findall("slow exit", text)),
               "exit_reports": re.findall(r"^.*(?:platform abort at exit|slow exit).*$", text, re.M)[:10],
               "failures": re.findall(r"^FAILED .*$|^ERROR .*$", text, re.M)[:20],
               "load_avg_1min_start": round(load0, 2), "load_avg_1min_end": round(os.getloadavg()[0], 2),
               "busiest_other_processes_at_start": beside}
        record["runs"].append(run)
        record["end"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record["failed_runs"] = sum(r["rc"] != 0 for r in record["runs"])
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(record))
        print(f"run {i}: rc={proc.returncode} {secs:.0f}s {run['summary']}", flush=True)
    return 0 if record["failed_runs"] == 0 else 1


def markdown(r: dict) -> str:
    lines = [f"# {len(r['runs'])} loops of tests/distributed and tests/bench/training on a loaded host", "",
             f"Machine: {r['cpu_model']}, {r['nproc']} CPUs; rev `{r['git_rev']}` (tracked files dirty: "
             f"{r['dirty_tracked_files']}); {r['start']} .. {r.get('end', '')}.", "",
             "Command per run (`scripts/dist_loop.py`):", "", f"    {r['command']}", "",
             "| run | rc | s | pytest | aborts at exit | load (start/end) | busiest other process at start |",
             "|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        other = x["busiest_other_processes_at_start"][0] if x["busiest_other_processes_at_start"] else ""
        lines.append(f"| {x['run']} | {x['rc']} | {x['seconds']} | {x['summary']} | {x['platform_aborts_at_exit']} | "
                     f"{x['load_avg_1min_start']}/{x['load_avg_1min_end']} | `{other}` |")
    lines += ["", f"Failed runs: {r.get('failed_runs', 0)} of {len(r['runs'])}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
