"""Optimizer step() time of every baseline next to Dobb (B = 1, 4, 16) and AdamW, side by side.

The matrices are GPT-2 Small's (per layer: q, k, v, o 768x768, fc 3072x768, proj 768x3072) for
``--layers`` layers, fp32, with fixed random gradients. All optimizers step in interleaved rounds
(round r times step r of each optimizer), so load from other processes hits them alike. Reported
per optimizer: median and mean (amortized) step time; for Dobb and PR-Muon also the median of
their expensive steps (basis refresh / full NS5) and of the others. Dobb uses
``source="grad_gram"`` (no hooks needed; same per-step math as the activation source).

    python scripts/step_time_baselines.py --layers 2 --rounds 9
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import dobb

SHAPES = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]


def make_params(layers: int, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(layers):
        for m, n in SHAPES:
            p = nn.Parameter(torch.randn(m, n, generator=g) * 0.02)
            p.grad = torch.randn(m, n, generator=g) * 1e-3
            params.append(p)
    return params


def optimizers(layers: int) -> dict[str, tuple[torch.optim.Optimizer, callable]]:
    """name -> (optimizer over its own copy of the matrices, is-expensive-step predicate or None)."""
    lr = 1e-4

    def group(cls, **kw):
        return [{"params": make_params(layers), "algorithm": cls.algorithm, **kw}]

    out = {"adamw": (torch.optim.AdamW(make_params(layers), lr=lr, betas=(0.9, 0.95)), None)}
    out["muon"] = (dobb.Muon(group(dobb.Muon), lr=lr), None)
    out["dion r=1/4"] = (dobb.Dion(group(dobb.Dion), lr=lr, rank_fraction=0.25), None)
    out["dion r=1/16"] = (dobb.Dion(group(dobb.Dion), lr=lr, rank_fraction=1 / 16), None)
    out["rmnp"] = (dobb.RMNP(group(dobb.RMNP), lr=lr), None)
    pr = dobb.PeriodicRowMuon(group(dobb.PeriodicRowMuon), lr=lr, period=3)
    first = pr.param_groups[0]["params"][0]
    out["pr-muon K=3"] = (pr, lambda o=pr, p=first: o.state[p]["step"] % 3 == 0)
    out["block-muon B=4"] = (dobb.BlockMuon(group(dobb.BlockMuon), lr=lr, blocks=4, axis=1), None)
    out["dion2 1/4"] = (dobb.Dion2(group(dobb.Dion2), lr=lr, fraction=0.25), None)
    for b in (1, 4, 16):
        opt = dobb.Dobb(group(dobb.Dobb), lr=lr, blocks=b, source="grad_gram", refresh_every=9)
        out[f"dobb B={b}"] = (opt, opt.is_refresh_step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="timed steps per optimizer (9 = one Dobb refresh cycle)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (Dobb's first refresh is exact eigh)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    opts = optimizers(args.layers)
    times = {name: [] for name in opts}
    heavy = {name: [] for name in opts}
    for _ in range(args.warmup):
        for opt, _ in opts.values():
            opt.step()
    for _ in range(args.rounds):
        for name, (opt, is_heavy) in opts.items():
            h = bool(is_heavy()) if is_heavy else False
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
            heavy[name].append(h)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.layers} GPT-2 Small layers "
          f"({len(SHAPES) * args.layers} matrices), {args.rounds} timed steps after {args.warmup} warm-up")
    print(f"{'optimizer':16s} {'median ms':>10s} {'mean ms':>10s} {'heavy ms':>10s} {'light ms':>10s}")
    result = {}
    for name, ts in times.items():
        hv = [t for t, h in zip(ts, heavy[name]) if h]
        lt = [t for t, h in zip(ts, heavy[name]) if not h]
        row = {"median_ms": 1e3 * statistics.median(ts), "mean_ms": 1e3 * statistics.fmean(ts),
               "heavy_median_ms": 1e3 * statistics.median(hv) if hv and lt else None,
               "light_median_ms": 1e3 * statistics.median(lt) if hv and lt else None}
        result[name] = row
        fmt = lambda v: f"{v:10.1f}" if v is not None else f"{'':>10s}"  # noqa: E731
        print(f"{name:16s} {fmt(row['median_ms'])} {fmt(row['mean_ms'])} {fmt(row['heavy_median_ms'])} "
              f"{fmt(row['light_median_ms'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "rounds": args.rounds, "threads": torch.get_num_threads(),
                       "results": result}, f, indent=2)


if __name__ == "__main__":
    main()
