"""``dobb-bench controlled``: least-squares problems with a chosen input covariance and a known optimum.

Why: on a language model, rankings flip with the learning rate, the horizon and the seed (see
docs/microbatch.md). Here the loss is an exact quadratic, so the suboptimality after N steps is
measured without noise, each optimizer gets its best lr from a grid, and the covariance is chosen
to say *when* block-diagonal bases cost.

Problem: ``y = W* x + sigma * eps`` with ``x ~ N(0, S)``; one ``nn.Linear(n, m, bias=False)`` from
zero, trained on fresh minibatches with loss ``1/2 mean ||W x - y||^2``. The population loss is
``L(W) = 1/2 tr((W - W*) S (W - W*)^T) + m sigma^2 / 2`` and its minimum ``L* = m sigma^2 / 2``
(at ``W*``), so the suboptimality ``L(W) - L*`` is computed exactly in float64.

Covariances (``n`` inputs, ``G`` correlated groups):
- ``rotated``: power-law spectrum ``lambda_i = i^-alpha`` under a random rotation: every input is
  correlated with every other one, so every block partition cuts correlations;
- ``aligned``: block-diagonal, ``G`` groups of ``n/G`` contiguous inputs, each a rotated power law
  (scaled so the groups' spectra interleave): block bases with ``B`` dividing ``G`` are exact;
- ``misaligned``: the same covariance with its inputs rolled by half a group: every partition with
  ``B > 1`` cuts every group;
- ``diagonal``: power law on the diagonal plus weak random correlations (correlation 0.05):
  block bases are nearly exact for every ``B``;
- ``lowrank``: ``rotated`` with a rank-``n/16`` target ``W*``.

The column ``off-block`` of the table is the covariance's share outside the ``B``-block diagonal
after whitening the diagonal, ``||offblock(C)||_F / ||C||_F`` with ``C`` the correlation matrix:
the part of the curvature a block-diagonal basis cannot see.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import dobb
from dobb_bench.specs import recorded_adamw_part

KINDS = ("rotated", "aligned", "misaligned", "diagonal", "lowrank")


@dataclass
class Problem:
    kind: str
    sigma_x: torch.Tensor  # n x n input covariance (float64)
    w_star: torch.Tensor  # m x n optimum (float64)
    noise: float

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w_star.shape)

    def optimum_loss(self) -> float:
        return 0.5 * self.w_star.shape[0] * self.noise**2

    def suboptimality(self, w: torch.Tensor) -> float:
        """``L(W) - L*`` in float64 (inf when ``W`` is not finite)."""
        d = w.double() - self.w_star
        if not bool(torch.isfinite(d).all()):
            return math.inf
        return 0.5 * torch.trace(d @ self.sigma_x @ d.T).item()


def _rotation(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def _power_law(n: int, alpha: float, offset: int = 0, stride: int = 1) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * stride + offset + 1.0) ** -alpha


def make_problem(kind: str, n: int = 64, m: int = 32, groups: int = 4, alpha: float = 2.0,
                 noise: float = 0.1, seed: int = 0) -> Problem:
    if kind not in KINDS:
        raise ValueError(f"unknown problem {kind!r}; choose from {', '.join(KINDS)}")
    if n % groups or n < 2 * groups:
        raise ValueError(f"n={n} must be a multiple of groups={groups} with at least 2 inputs per group")
    gen = torch.Generator().manual_seed(1000 + seed)
    if kind in ("rotated", "lowrank"):
        rot = _rotation(n, gen)
        sigma = rot @ torch.diag(_power_law(n, alpha)) @ rot.T
    elif kind in ("aligned", "misaligned"):
        s = n // groups
        sigma = torch.zeros(n, n, dtype=torch.float64)
        for g in range(groups):
            rot = _rotation(s, gen)
            sigma[g * s:(g + 1) * s, g * s:(g + 1) * s] = rot @ torch.diag(_power_law(s, alpha, g, groups)) @ rot.T
        if kind == "misaligned":
            sigma = torch.roll(sigma, shifts=(s // 2, s // 2), dims=(0, 1))
    else:  # diagonal: weak correlations on a power-law diagonal
        z = torch.randn(n, n, generator=gen, dtype=torch.float64)
        corr = 0.8 * torch.eye(n, dtype=torch.float64) + 0.2 * z @ z.T / n  # correlations ~0.025
        dinv = torch.diag(corr).rsqrt()
        corr = dinv[:, None] * corr * dinv[None, :]
        scale = _power_law(n, alpha).sqrt()[torch.randperm(n, generator=gen)]
        sigma = scale[:, None] * corr * scale[None, :]
    w = torch.randn(m, n, generator=gen, dtype=torch.float64)
    if kind == "lowrank":
        r = max(1, n // 16)
        w = torch.randn(m, r, generator=gen, dtype=torch.float64) @ torch.randn(r, n, generator=gen, dtype=torch.float64) / math.sqrt(r)
    # scale so that the loss of W = 0 is 1/2 * m (unit signal per output): comparable across kinds
    w = w * math.sqrt(m / torch.trace(w @ sigma @ w.T).item())
    return Problem(kind, 0.5 * (sigma + sigma.T), w, noise)


def off_block_share(sigma: torch.Tensor, blocks: int) -> float:
    """``||offblock(C)|| / ||C||`` for the correlation matrix ``C`` and ``blocks`` contiguous nearly
    equal blocks (``dobb.functional.block_sizes``): 0 when the blocks see every correlation."""
    d = torch.diag(sigma).rsqrt()
    c = d[:, None] * sigma * d[None, :]
    mask = torch.zeros_like(c, dtype=torch.bool)
    start = 0
    for s in dobb.functional.block_sizes(c.shape[0], blocks):
        mask[start:start + s, start:start + s] = True
        start += s
    return c[~mask].norm().item() / c.norm().item()


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to zero on the last step (so the noise floor shrinks)."""
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))


def train(problem: Problem, optimizer: str, hparams: dict, lr: float, *, steps: int = 200, batch: int = 128,
          seed: int = 0, warmup: int = 10) -> tuple[float, torch.Tensor]:
    """Trains from zero; returns ``(suboptimality after `steps`, final W)``. Data are fresh Gaussian
    minibatches drawn from ``seed``; the optimizer comes from ``dobb.build_optimizer`` only."""
    m, n = problem.shape
    torch.manual_seed(seed)
    model = nn.Linear(n, m, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = dobb.build_optimizer(optimizer, model, lr=lr, weight_decay=0.0, **hparams,
                               **recorded_adamw_part(optimizer, model, hparams))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
    gen = torch.Generator().manual_seed(seed)
    chol = torch.linalg.cholesky(problem.sigma_x).float()
    w_star = problem.w_star.float()
    for _ in range(steps):
        x = torch.randn(batch, n, generator=gen) @ chol.T
        y = x @ w_star.T + problem.noise * torch.randn(batch, m, generator=gen)
        loss = 0.5 * (model(x) - y).square().sum(dim=1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not bool(torch.isfinite(loss)):
            break
        opt.step()
        sched.step()
    getattr(opt, "remove_hooks", lambda: None)()
    w = model.weight.detach().clone()
    return problem.suboptimality(w), w


def default_optimizers(n: int) -> list[tuple[str, str, dict]]:
    """(label, name, hparams): AdamW, Muon, Dion 1/4, block Muon and Dobb across block widths, and
    Dobb-l2 at the widest and narrowest blocks."""
    rows = [("AdamW", "adamw", {}), ("Muon", "muon", {}), ("Dion 1/4", "dion", {"rank_fraction": 0.25})]
    for b in (4, 16):
        rows.append((f"Block Muon B={b} ({n // b} wide)", "block-muon", {"blocks": b}))
    for b in (1, 2, 4, 8, 16):
        rows.append((f"Dobb B={b} ({n // b} wide)", "dobb", {"blocks": b}))
    for b in (1, 16):  # unit-norm coefficient columns instead of signs: is the gap to Muon the sign?
        rows.append((f"Dobb-l2 B={b} ({n // b} wide)", "dobb-l2", {"blocks": b}))
    return rows


LR_GRIDS = {"adamw": (0.1, 0.3, 1.0, 3.0)}  # per-parameter steps: AdamW's optimum sits higher
DEFAULT_GRID = (0.03, 0.1, 0.3, 1.0)


def run_grid(kinds, optimizers, *, n: int = 64, m: int = 32, alpha: float = 2.0, noise: float = 0.1,
             steps: int = 200, batch: int = 128, seeds=(0, 1), grids: dict | None = None, log=print) -> dict:
    """Every (problem, optimizer): lr chosen on ``seeds[0]`` from its grid, then every seed at that
    lr. Returns the JSON-ready results (settings, per-problem off-block shares, one row per pair)."""
    grids = {**LR_GRIDS, **(grids or {})}
    rows, problems = [], {}
    for kind in kinds:
        prob = make_problem(kind, n=n, m=m, alpha=alpha, noise=noise)
        problems[kind] = {"off_block": {str(b): round(off_block_share(prob.sigma_x, b), 4) for b in (2, 4, 8, 16)
                                        if b <= n // 2},
                          "initial_suboptimality": prob.suboptimality(torch.zeros(m, n)),
                          "optimum_loss": prob.optimum_loss()}
        for label, name, hp in optimizers:
            grid = tuple(grids.get(name, grids.get("default", DEFAULT_GRID)))
            tuning = {lr: train(prob, name, hp, lr, steps=steps, batch=batch, seed=seeds[0])[0] for lr in grid}
            finite = {lr: v for lr, v in tuning.items() if math.isfinite(v)}
            best = min(finite, key=finite.get) if finite else grid[0]
            subs = [tuning[best]] + [train(prob, name, hp, best, steps=steps, batch=batch, seed=s)[0] for s in seeds[1:]]
            rows.append({"problem": kind, "label": label, "optimizer": name, "hparams": hp, "lr": best,
                         "lr_at_grid_edge": best in (grid[0], grid[-1]) and len(grid) > 1,
                         "grid": {str(lr): _r(v) for lr, v in tuning.items()},
                         "seeds": list(seeds), "suboptimality": [_r(v) for v in subs],
                         "mean": _r(sum(subs) / len(subs))})
            log(f"{kind:10s} {label:26s} lr={best:<5g} suboptimality {rows[-1]['mean']:.4g}")
    return {"settings": {"n": n, "m": m, "alpha": alpha, "noise": noise, "steps": steps, "batch": batch,
                         "seeds": list(seeds), "lr_selection_seed": seeds[0], "grids": {k: list(v) for k, v in grids.items()},
                         "default_grid": list(DEFAULT_GRID), "schedule": "linear warmup 10 steps, cosine to 0",
                         "weight_decay": 0.0, "init": "zeros", "library_defaults": "every other hyperparameter"},
            "problems": problems, "rows": rows}


def _r(v: float) -> float | None:
    return float(f"{v:.5g}") if math.isfinite(v) else None


def table(result: dict) -> str:
    """Markdown: suboptimality per optimizer (rows) and problem (columns), then off-block shares."""
    kinds = list(result["problems"])
    by = {(r["label"], r["problem"]): r for r in result["rows"]}
    labels = list(dict.fromkeys(r["label"] for r in result["rows"]))
    ref = {k: by.get(("Dobb B=1 (%d wide)" % result["settings"]["n"], k)) for k in kinds}
    lines = ["| optimizer | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for label in labels:
        cells = []
        for k in kinds:
            r = by.get((label, k))
            if r is None or r["mean"] is None:
                cells.append("diverged" if r else "—")
                continue
            cell = f"{r['mean'] * 1e3:.2f}{'*' if r['lr_at_grid_edge'] else ''} (lr {r['lr']:g})"
            if label.startswith("Dobb B=") and ref[k] and ref[k]["mean"] and r is not ref[k]:
                cell += f" ×{r['mean'] / ref[k]['mean']:.2f}"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    widths = sorted({int(b) for p in result["problems"].values() for b in p["off_block"]})
    lines += ["", "| off-block share of the correlation | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for b in widths:
        lines.append(f"| B={b} | " + " | ".join(f"{result['problems'][k]['off_block'][str(b)]:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


def header(record: dict) -> str:
    """The table with the line that says how to read it (what docs/controlled.md shows)."""
    first = next(iter(record["problems"].values()))
    return (f"Suboptimality L(W_N) - L* after {record['settings']['steps']} steps, x1e-3, mean over seeds "
            f"{record['settings']['seeds']} (L(0) - L* = {first['initial_suboptimality']:g}, L* = "
            f"{first['optimum_loss']:g}); lr chosen per optimizer and problem on seed {record['settings']['lr_selection_seed']}; "
            f"* = that lr is at the grid's edge; xk = ratio to Dobb B=1.\n\n" + table(record))


def cmd_controlled(args) -> int:
    from dobb_bench.errors import CliError
    from dobb_bench.provenance import provenance

    if args.render:
        print(header(json.loads(Path(args.render).read_text())))
        return 0
    kinds = [k.strip() for k in args.problems.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise CliError(f"unknown problem(s) {bad}; choose from {', '.join(KINDS)}")
    if args.steps < 1 or args.batch < 1 or args.n < 2 or args.m < 1:
        raise CliError("--steps, --batch, --m must be positive and --n at least 2")
    try:
        seeds = tuple(int(s) for s in args.seeds.split(","))
    except ValueError:
        raise CliError(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    torch.set_num_threads(args.threads)
    optimizers = [o for o in default_optimizers(args.n) if o[2].get("blocks", 1) in (1, *range(2, args.n // 2 + 1))]
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_grid(kinds, optimizers, n=args.n, m=args.m, alpha=args.alpha, noise=args.noise, steps=args.steps,
                      batch=args.batch, seeds=seeds)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # CPU time is what the run costs on one free core; wall time also counts other jobs' share
    record = {"kind": "controlled", "provenance": provenance(), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "load_avg_1min": round(os.getloadavg()[0], 2), **result}
    print("\n" + header(record))
    print(f"\n{wall:.0f} s wall, {cpu:.0f} s CPU")
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("controlled", help="least-squares problems with chosen covariance and known optimum")
    p.add_argument("--problems", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    p.add_argument("--batch", type=int, default=128, help="samples per step (default 128)")
    p.add_argument("--n", type=int, default=64, help="inputs (the blocked axis)")
    p.add_argument("--m", type=int, default=32, help="outputs")
    p.add_argument("--alpha", type=float, default=2.0, help="power-law exponent of the spectrum")
    p.add_argument("--noise", type=float, default=0.1, help="label noise std (sets L*)")
    p.add_argument("--seeds", default="0,1", help="data seeds; the lr is chosen on the first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--record", help="write the JSON record here (e.g. docs/results/controlled/default.json)")
    p.add_argument("--render", metavar="RECORD", help="only print the tables of an existing record")
    p.set_defaults(func=cmd_controlled)
