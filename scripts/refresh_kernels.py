"""One Dobb basis refresh, kernel by kernel, at the block widths of GPT-2 Small (issue 23 item 5).

Times, in one process (``--threads``, default 1), fp32, for each width ``n`` (default 768 and 3072,
the widths of a B=1 block of ``q, k, v, o, fc`` and of ``proj``):

- ``capture``: the statistic of one capture, ``X^T X`` over ``--tokens`` rows (``second_moment_blocks``);
- ``matmul``: the orthogonal-iteration product ``P = A Q``;
- ``qr_householder`` / ``qr_cholesky``: the orthonormal factor of ``P`` (``dobb.functional``);
  ``qr_geqrf_orgqr``: the same Householder ``Q`` without forming ``R`` (checked bitwise equal);
- ``refresh_householder`` / ``refresh_cholesky``: one whole ``orthogonal_iteration(A, Q, 1, qr)``
  (the default refresh; Cholesky's includes its one host read and any Householder redo);
- ``eigh``: ``eigh_basis(A)`` (the first refresh, or ``basis="eigh"``);
- ``apply``: the two projection products of a non-refresh step for ``--rows`` rows
  (``U Q`` then ``C Q^T``), the work every step does, for scale.

The statistic is ``X^T X / N`` of ``N = --stat-tokens`` Gaussian rows with a decaying column scale
(condition number about 1e2: full rank and inside Cholesky QR's acceptance test ``rtol=1e-3``); the warm
start ``Q`` is the exact eigenbasis of a nearby statistic (a refresh's usual starting point). A
second statistic of rank ``n/2`` (``rank_deficient``) shows Cholesky QR's fallback, the case of
dead units or few captured rows. After one warm-up each, ``--repeats`` rounds run every kernel once
in a rotated order (the host is shared: kernels of one round see the same load); reported per
kernel: median and min ms, and ``x_refresh_householder``, the median over rounds of its time over
the default refresh's in the same round.

Output: one JSON record (``--out``) with the timings and the provenance of the run records (git
revision and dirty flag of this checkout, machine with its bf16 flags, command).

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/refresh_kernels.py --out docs/results/cost/refresh_kernels.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dobb import functional as F
from dobb_bench.provenance import provenance


def _interleaved(kernels: dict, repeats: int, ref: str) -> dict:
    """Each round runs every kernel once, in a rotated order, so that all see the same machine load
    (the host is shared); per kernel: median and min ms, and the median over rounds of its time
    divided by ``ref``'s in the same round (the figure to read on a loaded machine)."""
    for fn in kernels.values():
        fn()  # warm-up: allocation, LAPACK workspace queries
    names = list(kernels)
    ms = {k: [] for k in names}
    for rnd in range(repeats):
        for k in names[rnd % len(names):] + names[: rnd % len(names)]:
            t0 = time.perf_counter()
            kernels[k]()
            ms[k].append((time.perf_counter() - t0) * 1e3)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "ms": v,
                f"x_{ref}": statistics.median(a / b for a, b in zip(v, ms[ref]))} for k, v in ms.items()}


def _statistic(n: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    # column scales 1 .. 0.1: condition number about 1e2, inside Cholesky QR's acceptance
    # (qr_cholesky accepts R's diagonal down to 1e-3 of its largest, i.e. A's eigenvalue ratio)
    scale = torch.logspace(0, -1, n, dtype=torch.float64)
    x = torch.randn(tokens, n, generator=gen, dtype=torch.float64) * scale
    return (x.T @ x / tokens).float()


def bench_width(n: int, args, gen: torch.Generator) -> dict:
    a = _statistic(n, args.stat_tokens, gen)[None]
    q0 = F.eigh_basis(_statistic(n, args.stat_tokens, gen)[None].double()).float()  # a nearby eigenbasis
    p = a @ q0
    low = _statistic(n, n // 2, gen)[None]  # rank n/2
    x = torch.randn(args.tokens, n, generator=gen)
    u = torch.randn(1, args.rows, n, generator=gen)
    _, ok = F.qr_cholesky(p)
    _, ok_low = F.qr_cholesky(low @ q0)
    kernels = {
        "capture": lambda: F.second_moment_blocks(x, [n]),
        "matmul": lambda: a @ q0,
        "qr_householder": lambda: F.qr_householder(p),
        "qr_cholesky": lambda: F.qr_cholesky(p),
        # linalg.qr is geqrf + orgqr plus the triangular R (a triu of n^2): Q alone skips R
        "qr_geqrf_orgqr": lambda: torch.linalg.householder_product(*torch.geqrf(p)),
        "refresh_householder": lambda: F.orthogonal_iteration(a, q0, 1, "householder"),
        "refresh_cholesky": lambda: F.orthogonal_iteration(a, q0, 1, "cholesky"),
        "refresh_cholesky_rank_deficient": lambda: F.orthogonal_iteration(low, q0, 1, "cholesky"),
        "eigh": lambda: F.eigh_basis(a),
        "apply": lambda: torch.bmm(torch.bmm(u, q0).sign_(), q0.transpose(1, 2)),
    }
    out = {"n": n, "cholesky_ok_full_rank": bool(ok.all()), "cholesky_ok_rank_deficient": bool(ok_low.all()),
           **_interleaved(kernels, args.repeats, "refresh_householder")}
    # the two refreshes must agree (same subspace iteration, different factorization): sign-fixed columns
    qh = F.orthogonal_iteration(a.double(), q0.double(), 1, "householder")
    qc = F.orthogonal_iteration(a.double(), q0.double(), 1, "cholesky")
    sign = torch.sign((qh * qc).sum(-2, keepdim=True))
    out["geqrf_orgqr_equals_linalg_qr_bitwise"] = bool(
        torch.equal(F.qr_householder(p), torch.linalg.householder_product(*torch.geqrf(p))))
    out["householder_vs_cholesky_max_abs_diff_fp64"] = float((qh - qc * sign).abs().max())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[768, 3072])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1024, help="rows of one capture (default 1024)")
    ap.add_argument("--stat-tokens", type=int, default=None, help="rows behind the statistic (default 4n)")
    ap.add_argument("--rows", type=int, default=192, help="weight rows of the apply (default 192: 768/4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    widths = []
    for n in args.widths:
        a = argparse.Namespace(**{**vars(args), "stat_tokens": args.stat_tokens or 4 * n})
        widths.append(bench_width(n, a, gen))
        w = widths[-1]
        print(f"n={n}: " + ", ".join(f"{k} {v['median_ms']:.1f} ms ({v['x_refresh_householder']:.2f}x)"
                                     for k, v in w.items() if isinstance(v, dict)),
              flush=True)
    record = {"kind": "refresh_kernels", "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "dtype": "float32", "widths": widths, "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
