"""Time Gram Newton-Schulz against NS5 on one matrix shape; write a JSON run record.

Run from a clean checkout (the record names its git revision and refuses nothing, but marks a
dirty tree), e.g.::

    git worktree add --detach /tmp/peers-$(git rev-parse --short HEAD) HEAD
    cd /tmp/peers-<rev> && OMP_NUM_THREADS=1 PYTHONPATH=src python docs/results/peers/time_gram_ns.py \
        --shape 3072 768 --out /work/main/docs/results/peers/gram_ns_3072x768.json

Each repeat times every variant once, in turn (interleaved, so a burst of load on a shared
machine hits all of them); the record keeps every sample, the median and the IQR.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dobb.baselines import orthogonalize

NS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def git(*args):
    root = Path(__file__).resolve().parents[3]
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[3072, 768])
    ap.add_argument("--batch", type=int, default=1, help="equal-shape matrices per call (stacked)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(NS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(*args.shape, generator=gen) for _ in range(args.batch)]
    variants = [(m, d) for d in args.dtypes for m in ("standard", "gram")]
    samples = {f"{m}/{d}": [] for m, d in variants}
    for m, d in variants:  # warm-up
        orthogonalize(mats, method=m, dtype=NS[d])
    for _ in range(args.repeats):
        for m, d in variants:
            t0 = time.perf_counter()
            orthogonalize(mats, method=m, dtype=NS[d])
            samples[f"{m}/{d}"].append(time.perf_counter() - t0)
    summary = {}
    for key, xs in samples.items():
        q = statistics.quantiles(xs, n=4)
        summary[key] = {"median_s": statistics.median(xs), "iqr_s": q[2] - q[0]}
    for d in args.dtypes:
        summary[f"speedup/{d}"] = summary[f"standard/{d}"]["median_s"] / summary[f"gram/{d}"]["median_s"]
    record = {
        "what": "orthogonalize() call time, NS5 (standard) vs Gram Newton-Schulz, 5 steps",
        "shape": args.shape, "batch": args.batch, "threads": args.threads, "repeats": args.repeats,
        "samples_s": samples, "summary": summary,
        "provenance": {"git_rev": git("rev-parse", "HEAD"),
                       "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
                       "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                       "torch": torch.__version__, "python": platform.python_version(),
                       "machine": f"{platform.machine()} {platform.processor() or ''} "
                                  f"{os.cpu_count()} cpus, shared with other jobs".strip(),
                       "cpu_model": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                          if ln.startswith("model name")), None) if os.path.exists("/proc/cpuinfo") else None,
                       "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
