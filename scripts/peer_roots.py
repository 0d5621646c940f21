"""DASH's Newton-DB inverse fourth root: ours against pytorch-optimizer's kernel on the same inputs.

Inputs: ``--tiles`` SPD factors ``G G^T / n`` of ``--size`` (128, DASH's block in the peer table),
``G`` Gaussian ``n x 2n``, fp32, one thread. Timed, interleaved call by call over ``--rounds``
rounds (order rotated): ``dobb.baselines.shampoo_family._matrix_roots.inverse_root_newton_db`` (10 fixed steps per
square root, its default tile batch ``TILE_BATCH_BYTES``), the same in one batch of every tile
(``tile_batch=tiles``, the batching before issue 44), and pytorch-optimizer's
``compute_power_newton_db`` called as its DASH calls it for ``p = 4`` (square root, then inverse
square root, 10 iterations each, Frobenius scale). Reported: median and IQR of the per-round ratio
ours / peer, and the largest relative difference between the two roots.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/peer_roots.py --out docs/results/peers/peer_roots.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_speed import git_rev, machine, versions  # noqa: E402

from dobb.baselines.shampoo_family._matrix_roots import TILE_BATCH_BYTES, inverse_root_newton_db  # noqa: E402


def peer_root(x: torch.Tensor, steps: int) -> torch.Tensor:
    from pytorch_optimizer.optimizer.utils.matrix import compute_power_newton_db

    scale = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    root = compute_power_newton_db(x, scale, steps, inverse=False)
    return compute_power_newton_db(root, scale.sqrt(), steps, inverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", type=int, default=216, help="factors (216: the L and R of one 2304x768 qkv, B=128)")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.tiles < 1 or args.size < 1 or args.steps < 2 or args.rounds < 2:
        raise ValueError("--tiles and --size must be >= 1, --steps and --rounds >= 2")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(args.tiles, args.size, 2 * args.size, generator=gen)
    x = g @ g.mT / args.size
    calls = {
        "ours (tile batches)": lambda: inverse_root_newton_db(x, 4, 0.0, args.steps),
        "ours (one batch)": lambda: inverse_root_newton_db(x, 4, 0.0, args.steps, tile_batch=args.tiles),
        "pytorch-optimizer": lambda: peer_root(x, args.steps),
    }
    outs = {k: f() for k, f in calls.items()}  # warm-up, and the roots compared
    ref = outs["pytorch-optimizer"]
    diff = {k: ((o - ref).norm() / ref.norm()).item() for k, o in outs.items()}
    ms = {k: [] for k in calls}
    names = list(calls)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            calls[k]()
            ms[k].append(1e3 * (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(f"{k} {ms[k][-1]:.0f} ms" for k in names), flush=True)

    def q(v):
        v = sorted(v)
        qs = statistics.quantiles(v, n=4, method="inclusive")
        return {"median": statistics.median(v), "q25": qs[0], "q75": qs[2], "n": len(v)}

    res = {k: {"ms": q(ms[k]), "ratio_to_peer": q([a / b for a, b in zip(ms[k], ms["pytorch-optimizer"])]),
               "rel_diff_to_peer": diff[k], "all_ms": ms[k]} for k in names}
    rec = {"kind": "peer_roots", "command": " ".join([sys.executable, *sys.argv]),
           "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}, "provenance": git_rev(),
           "machine": {**machine(), "loadavg_end": os.getloadavg()}, "packages": versions(),
           "settings": {"tiles": args.tiles, "size": args.size, "steps": args.steps, "rounds": args.rounds,
                        "p": 4, "dtype": "float32", "threads": 1, "tile_batch_bytes": TILE_BATCH_BYTES},
           "results": res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    for k in names:
        print(f"{k}: {res[k]['ms']['median']:.0f} ms, x peer {res[k]['ratio_to_peer']['median']:.2f} "
              f"[{res[k]['ratio_to_peer']['q25']:.2f}, {res[k]['ratio_to_peer']['q75']:.2f}], rel diff {diff[k]:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
