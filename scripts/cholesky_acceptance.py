"""How often Cholesky QR's acceptance test passes on the statistics of a real training run
(issue 23 item 5: is ``qr="cholesky"`` a cheaper refresh?).

Runs one ``dobb-bench compare`` training in this process (``--no-isolate``) with Dobb at
``qr=cholesky`` and wraps ``dobb.functional.qr_cholesky`` to count, per block width, the blocks
whose factorization it accepts (``ok``: R's smallest diagonal above ``rtol=1e-3`` of its largest;
the rest are redone by Householder, see ``orthogonal_iteration``). Also recorded per call: the
smallest ratio ``min diag(R) / max diag(R)`` over the batch (``log10``), and whether the same test
would pass after scaling every column of ``P = A Q`` to unit norm (``P D^{-1}`` has the same
orthonormal factor up to column signs, and a warm-started ``P`` has nearly orthogonal columns whose
norms carry the statistic's eigenvalues, so the scaled matrix is well conditioned).

The wrapper only observes: the returned ``(Q, ok)`` are the library's own, so the training is the
one ``compare`` runs. Output: one JSON record with the counts and the provenance of run records.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/cholesky_acceptance.py --steps 300 \
        --out docs/results/cost/cholesky_acceptance.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

import dobb.functional as F
from dobb_bench import cli
from dobb_bench.provenance import provenance


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    counts = defaultdict(lambda: {"calls": 0, "blocks": 0, "accepted": 0, "accepted_if_columns_scaled": 0,
                                  "log10_min_diag_ratio": []})
    original = F.qr_cholesky

    def observed(p, rtol=1e-3):
        q, ok = original(p, rtol)
        with torch.no_grad():
            c = counts[int(p.shape[-1])]
            c["calls"] += 1
            c["blocks"] += int(ok.numel())
            c["accepted"] += int(ok.sum())
            r = torch.linalg.cholesky_ex(p.transpose(-1, -2) @ p, upper=True)[0].diagonal(dim1=-2, dim2=-1)
            c["log10_min_diag_ratio"].append(float(torch.log10((r.amin(-1) / r.amax(-1)).clamp_min(1e-30)).min()))
            scaled = p / p.norm(dim=-2, keepdim=True).clamp_min(1e-30)
            c["accepted_if_columns_scaled"] += int(original(scaled, rtol)[1].sum())
        return q, ok

    F.qr_cholesky = observed  # orthogonal_iteration looks the name up in the module at call time
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["compare", "--no-isolate", "--no-progress", "--optimizers", f"dobb:blocks={args.blocks}:qr=cholesky",
               "--seed", str(args.seed), "--layers", "2", "--context", "64", "--steps", str(args.steps),
               "--eval-every", str(args.steps), "--out", tmp]
        rc = cli.main(cmd)
    F.qr_cholesky = original
    widths = {}
    for size, c in sorted(counts.items()):
        ratios = sorted(c.pop("log10_min_diag_ratio"))
        widths[str(size)] = {**c, "log10_min_diag_ratio_median": ratios[len(ratios) // 2],
                             "log10_min_diag_ratio_max": ratios[-1]}
    record = {"kind": "cholesky_acceptance", "compare_args": cmd[:-2], "rc": rc, "rtol": 1e-3, "widths": widths,
              "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(widths, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
