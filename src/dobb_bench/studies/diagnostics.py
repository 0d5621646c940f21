"""Per-step and per-refresh diagnostics of a matrix optimizer, read from outside its code.

``StepDiagnostics.attach(optimizer, model)`` registers ``torch.optim`` step pre/post hooks (public
API), so any training loop gets the diagnostics without a hook point of its own. Everything is read
from ``optimizer.state[p]`` and the weights, never from private attributes:

- every step, every hidden matrix (``dobb.split_parameters``), any optimizer: the cosine between
  the step's update ``W_pre (1 - lr wd) - W_post`` and the gradient;
- every step, Dobb matrices: the fraction of coefficient signs that flip because the momentum
  moved, ``sign(U_t Q_t) != sign(U_{t-1} Q_t)`` (same basis on both sides);
- refresh steps (``state["captures"]`` went up), Dobb matrices: the statistic's relative change
  ``||A_new - A_old|| / ||A_old||`` of the EMA (the capture's own deviation from the previous EMA is
  this divided by ``1 - stat_decay``); the angle between consecutive bases (per column, the
  angle to its best-matching old column, averaged); and the fraction of coefficient signs that
  flip because the basis moved, ``sign(U_t Q_new) != sign(U_t Q_old)``.

Why these: the sign update is discontinuous. A coefficient near zero flips with any perturbation
and then moves its weight entry by the full step size, so how often signs flip (from the momentum
and from the basis) tells how strongly a tiny change of the statistic or the gradient is amplified.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

import dobb
from dobb import functional as F
from dobb_bench.specs import recorded_adamw_part


# ----------------------------------------------------------------------------- pure measures
def relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    """``||new - old||_F / ||old||_F`` in float64 (inf when ``old`` is zero and ``new`` is not)."""
    new, old = new.double(), old.double()
    den = old.norm().item()
    num = (new - old).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def basis_angle(q_old: torch.Tensor, q_new: torch.Tensor) -> torch.Tensor:
    """Per block ``(..., s, s)``: mean over new columns of the angle (degrees) to the closest old
    column, ``arccos(max_i |q_old_i . q_new_j|)``. Zero when the bases agree up to column order and
    signs (which leave the sign update unchanged); 90 degrees is the most two bases can differ."""
    cos = (q_old.double().transpose(-1, -2) @ q_new.double()).abs().amax(dim=-2).clamp(max=1.0)
    return torch.rad2deg(torch.arccos(cos)).mean(dim=-1)


def sign_flip_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of entries whose sign differs (a zero counts as its own sign)."""
    return (torch.sign(a) != torch.sign(b)).double().mean().item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    den = (a.norm() * b.norm()).item()
    return (a @ b).item() / den if den > 0 else 0.0


def coefficients(u: torch.Tensor, basis: torch.Tensor, sizes: list[int], side: str) -> torch.Tensor:
    """All blocks' projected coefficients ``U[:, b] Q_b`` (input side) or ``Q_b^T U[b, :]`` (output),
    concatenated and flattened, in float64."""
    u = (u if side == "input" else u.transpose(0, 1)).double()
    out = []
    for run in F.block_runs(sizes):
        ub = u[:, run.start : run.stop].reshape(u.shape[0], run.count, run.size).transpose(0, 1)
        out.append(torch.bmm(ub, F.block_view(basis, run).double()).flatten())
    return torch.cat(out)


def _blocks(stacked: torch.Tensor, sizes: list[int]):
    for run in F.block_runs(sizes):
        yield F.block_view(stacked, run)


# ----------------------------------------------------------------------------- the callback
class StepDiagnostics:
    """Collects the diagnostics above; ``records`` holds one dict per optimizer step.

    ``attach`` returns the instance; ``summary()`` averages over steps (and over refresh steps for
    the refresh measures). Costs one extra projection per Dobb matrix per step (about one more
    optimizer step's worth of work) and clones of the weights and optimizer state.
    """

    def __init__(self):
        self.records: list[dict] = []
        self._handles = []
        self._pre: dict = {}

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> "StepDiagnostics":
        self = cls()
        self.optimizer = optimizer
        matrices = {id(p) for _, p in dobb.split_parameters(model)[0]}
        self._tracked = []  # (param, group) for hidden matrices the optimizer owns
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in matrices:
                    self._tracked.append((p, group))
        self._handles = [optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after)]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @staticmethod
    def _dobb_view(p, group, state):
        if "basis" not in state or "stat" not in state:
            return None
        side = group.get("side", "input")
        k = p.shape[1] if side == "input" else p.shape[0]
        return side, F.block_sizes(k, 1 if group["blocks"] is None else group["blocks"])  # None: plain default

    @torch.no_grad()
    def _before(self, optimizer, args, kwargs) -> None:
        self._pre = {}
        for p, group in self._tracked:
            if p.grad is None:
                continue
            st = optimizer.state.get(p, {})
            snap = {"w": p.detach().clone(), "g": p.grad.detach().clone(),
                    "shrink": 1.0 - float(group["lr"]) * float(group["weight_decay"])}
            if self._dobb_view(p, group, st) is not None:
                snap.update(u=st["momentum"].clone(), stat=st["stat"].clone(), basis=st["basis"].clone(),
                            captures=_captured(st))
            self._pre[p] = snap

    @torch.no_grad()
    def _after(self, optimizer, args, kwargs) -> None:
        rec = defaultdict(list)
        for p, group in self._tracked:
            snap = self._pre.get(p)
            if snap is None:
                continue
            update = snap["w"] * snap["shrink"] - p.detach()
            rec["update_grad_cos"].append(cosine(update, snap["g"]))
            st = optimizer.state[p]
            view = self._dobb_view(p, group, st)
            if view is None or "u" not in snap:
                continue
            side, sizes = view
            u_new, basis = st["momentum"], st["basis"]
            c_new = coefficients(u_new, basis, sizes, side)
            if snap["captures"] > 0:  # the previous momentum is all zeros on the first step
                rec["momentum_flips"].append(sign_flip_fraction(c_new, coefficients(snap["u"], basis, sizes, side)))
            if _captured(st) > snap["captures"] and snap["captures"] > 0:
                rec["stat_change"].append(relative_change(st["stat"], snap["stat"]))
                angles = torch.cat([basis_angle(qo, qn) for qo, qn in
                                    zip(_blocks(snap["basis"], sizes), _blocks(basis, sizes))])
                rec["basis_angle_deg"].append(angles.mean().item())
                rec["basis_flips"].append(sign_flip_fraction(c_new, coefficients(u_new, snap["basis"], sizes, side)))
        self._pre = {}
        out = {k: sum(v) / len(v) for k, v in rec.items() if v}
        out["refresh"] = "stat_change" in out
        self.records.append(out)

    def summary(self, skip: int = 0) -> dict:
        """Means over steps ``>= skip`` of every measure (refresh measures over refresh steps)."""
        sums, counts = defaultdict(float), defaultdict(int)
        for rec in self.records[skip:]:
            for k, v in rec.items():
                if k != "refresh" and v is not None and math.isfinite(v):
                    sums[k] += v
                    counts[k] += 1
        out = {k: sums[k] / counts[k] for k in sums}
        out["refreshes"] = sum(1 for r in self.records[skip:] if r.get("refresh"))
        return out

    def series(self, key: str, every: int = 1) -> list:
        """``(step, value)`` pairs of one measure (1-based step after which it was measured)."""
        return [(i + 1, round(r[key], 5)) for i, r in enumerate(self.records)
                if key in r and (i + 1) % every == 0]


# ----------------------------------------------------------------------------- the grid command
# The diagnostics' setting (default preset of the 200-step main job) and the quick one; stated here so
# the record stays comparable if the main job's defaults change.
SETTINGS = {
    "default": dict(preset="small-cpu", steps=200, batch_size=16, eval_every=25, eval_seqs=64),
    "quick": dict(preset="tiny", steps=100, batch_size=8, eval_every=20, eval_seqs=32),
}
LR = 5e-3 * 2 ** -0.5


def _cells(specs, micro, captures, seeds):
    for spec in specs:
        for m in micro:
            # the capture grid applies to optimizers that take a capture option (dobb.valid_hparams)
            takes = "capture" in dobb.valid_hparams(spec.name)
            caps = captures if takes and m > 1 else ["first" if takes else None]
            for cap in caps:
                for seed in seeds:
                    yield spec, m, cap, seed


def _cell_key(spec, m, cap, seed) -> str:
    import re
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", f"{spec.label}_M{m}_{cap or 'na'}_s{seed}")


def _run_cell(job: dict) -> dict:
    """One training run with diagnostics attached (executed in a fresh process)."""
    import json
    import time
    from dataclasses import asdict
    from pathlib import Path

    from dobb_bench.training.data import load_corpus
    from dobb_bench.training.model import config_from_preset
    from dobb_bench.training.train import TrainConfig, run_training

    torch.set_num_threads(1)
    path = Path(job["path"])
    if path.exists():
        return json.loads(path.read_text())
    s = SETTINGS[job["setting"]]
    corpus = load_corpus(job["data"])
    model_cfg = config_from_preset(s["preset"], vocab_size=corpus.vocab_size)
    cfg = TrainConfig(steps=job["steps"] or s["steps"], batch_size=s["batch_size"], micro_batches=job["micro"],
                      lr=LR, weight_decay=0.1, eval_every=s["eval_every"], eval_seqs=s["eval_seqs"], seed=job["seed"])
    hp = dict(job["hparams"])
    if job["capture"] is not None:
        hp["capture"] = job["capture"]
    box = {}

    def factory(model):
        opt = dobb.build_optimizer(job["optimizer"], model, lr=cfg.lr, weight_decay=cfg.weight_decay, **hp,
                                   **recorded_adamw_part(job["optimizer"], model, hp))
        box["diag"] = StepDiagnostics.attach(opt, model)
        return opt

    t0 = time.perf_counter()
    final = run_training(model_cfg, cfg, corpus, factory, out_dir=None, progress=False)
    diag = box["diag"]
    refresh = [i for i, r in enumerate(diag.records) if r.get("refresh")]
    out = {"label": job["label"], "optimizer": job["optimizer"], "hparams": {k: str(v) for k, v in hp.items()},
           "micro_batches": job["micro"], "capture": job["capture"], "seed": job["seed"],
           "final_val_loss": final["final_val_loss"],
           "val_curve": [[e["step"], round(e["val_loss"], 4)] for e in final["evals"]],
           "train_losses": [round(x, 4) for x in final["train_losses"]],
           "diagnostics": {k: round(v, 5) for k, v in diag.summary(skip=1).items()},
           "refresh_series": {k: [round(diag.records[i].get(k, float("nan")), 4) for i in refresh]
                              for k in ("stat_change", "basis_angle_deg", "basis_flips")},
           "refresh_steps": [i + 1 for i in refresh],
           "update_grad_cos_every_10": [round(v, 4) for _, v in diag.series("update_grad_cos", 10)],
           "momentum_flips_every_10": [round(v, 4) for _, v in diag.series("momentum_flips", 10)],
           "model": model_cfg.to_dict(), "train": asdict(cfg), "corpus": corpus.name,
           "wall_s": round(time.perf_counter() - t0, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def cmd_microbatch(args) -> int:
    import json
    import multiprocessing as mp
    from pathlib import Path

    from dobb_bench.errors import CliError
    from dobb_bench.provenance import provenance
    from dobb_bench.specs import parse_spec
    from dobb_bench.training.model import GPT, ModelConfig

    specs = [parse_spec(t) for t in (args.optimizer or ["dobb:blocks=16"])]
    probe = GPT(ModelConfig(layers=1, width=32, heads=2, seq_len=8))
    for spec in specs:  # fail in a second, not after the runs before it
        getattr(dobb.build_optimizer(spec.name, probe, lr=1e-3, **spec.hparams), "remove_hooks", lambda: None)()
    try:
        micro = [int(x) for x in args.micro_batches.split(",")]
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise CliError("--micro-batches and --seeds take comma-separated integers") from None
    captures = [c.strip() for c in args.capture.split(",")]
    bad = [c for c in captures if c not in ("first", "all")]
    if bad or any(m < 1 for m in micro) or (args.steps is not None and args.steps < 1) or args.jobs < 1:
        raise CliError("--capture takes first,all; --micro-batches, --steps and --jobs must be positive")
    setting = "quick" if args.quick else "default"
    if any(SETTINGS[setting]["batch_size"] % m for m in micro):
        raise CliError(f"every --micro-batches value must divide the batch size {SETTINGS[setting]['batch_size']}")
    out = Path(args.out)
    jobs = [dict(path=str(out / "runs" / (_cell_key(spec, m, cap, seed) + f"_{setting}_{args.steps or 0}.json")),
                 setting=setting, steps=args.steps, data=args.data, label=spec.label, optimizer=spec.name,
                 hparams=spec.hparams, micro=m, capture=cap, seed=seed)
            for spec, m, cap, seed in _cells(specs, micro, captures, seeds)]
    print(f"{len(jobs)} runs, {args.jobs} at a time", flush=True)
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        runs = []
        for r in pool.imap(_run_cell, jobs):
            runs.append(r)
            print(f"{r['label']} M={r['micro_batches']} capture={r['capture']} seed={r['seed']}: "
                  f"{r['final_val_loss']:.4f} ({r['wall_s']} s)", flush=True)
    record = {"kind": "microbatch", "provenance": {**provenance(), "seeds": seeds},
              "setting": {"name": setting, **SETTINGS[setting], "steps": args.steps or SETTINGS[setting]["steps"],
                          "lr": LR, "weight_decay": 0.1, "schedule": "cosine", "warmup": "5% of steps",
                          "min_lr_ratio": 0.1, "data": args.data or "stdlib (byte)"},
              "runs": runs}
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(microbatch_table(runs) + "\n\n" + twin_table(runs))
    return 0


def microbatch_table(runs: list[dict]) -> str:
    """Mean +- std of the final loss and of the diagnostics per cell (label, M, capture)."""
    import statistics as st

    cells = defaultdict(list)
    for r in runs:
        cells[(r["label"], r["micro_batches"], r["capture"] or "-")].append(r)
    keys = ("update_grad_cos", "momentum_flips", "basis_flips", "basis_angle_deg", "stat_change")
    lines = ["| optimizer | M | capture | seeds | final val loss (mean ± std) | " + " | ".join(keys) + " |",
             "|---|---|---|---|---|" + "---|" * len(keys)]
    for (label, m, cap), rs in cells.items():
        losses = [r["final_val_loss"] for r in rs]
        sd = st.stdev(losses) if len(losses) > 1 else 0.0
        diag = [[r["diagnostics"].get(k) for r in rs] for k in keys]
        cols = [f"{st.mean(v):.3f}" if all(x is not None for x in v) else "—" for v in diag]
        lines.append(f"| {label} | {m} | {cap} | {len(rs)} | {st.mean(losses):.3f} ± {sd:.3f} "
                     f"({', '.join(f'{x:.3f}' for x in losses)}) | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def twin_table(runs: list[dict], thresholds=(1e-3, 1e-2, 1e-1)) -> str:
    """Each split run against the one-micro-batch run of the same optimizer and seed: the first step
    at which their training losses (same batches) differ by more than each threshold, and the
    final validation-loss difference. ``capture="all"`` twins differ only by rounding."""
    by = {(r["label"], r["micro_batches"], r["capture"], r["seed"]): r for r in runs}
    head = " | ".join(f"first step with abs(Δ train loss) > {t:g}" for t in thresholds)
    lines = [f"| optimizer | M | capture | seed | {head} | Δ final val loss |", "|---|---|---|---|" + "---|" * (len(thresholds) + 1)]
    for (label, m, cap, seed), r in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]), kv[0][3])):
        base = by.get((label, 1, "first" if cap else None, seed))
        if m == 1 or base is None:
            continue
        diffs = [abs(a - b) for a, b in zip(base["train_losses"], r["train_losses"])]
        firsts = [next((str(i + 1) for i, d in enumerate(diffs) if d > t), "never") for t in thresholds]
        lines.append(f"| {label} | {m} | {cap or '-'} | {seed} | " + " | ".join(firsts)
                     + f" | {r['final_val_loss'] - base['final_val_loss']:+.4f} |")
    return "\n".join(lines)


def cmd_render(args) -> int:
    import json
    from pathlib import Path

    record = json.loads(Path(args.record).read_text())
    print(microbatch_table(record["runs"]) + "\n\n" + twin_table(record["runs"]))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("microbatch", help="micro-batch split x capture grid with per-refresh diagnostics")
    p.add_argument("--optimizer", action="append", help="NAME[:k=v...] spec, repeatable (default dobb:blocks=16)")
    p.add_argument("--micro-batches", default="1,2,4", help="comma-separated micro-batch counts M (default 1,2,4)")
    p.add_argument("--capture", default="first,all", help="Dobb capture modes tried when M > 1")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--quick", action="store_true", help="tiny model, 100 steps")
    p.add_argument("--steps", type=int, help="override the setting's step count")
    p.add_argument("--data", help="corpus (default: stdlib sources, bytes)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    p.add_argument("--out", default="bench-out/microbatch", help="folder for the runs (default bench-out/microbatch)")
    p.add_argument("--record", help="write the compact JSON record here")
    p.set_defaults(func=cmd_microbatch)
    p = sub.add_parser("microbatch-table", help="the tables of a microbatch record (docs/microbatch.md)")
    p.add_argument("record", help="a microbatch JSON record (written by microbatch --record)")
    p.set_defaults(func=cmd_render)


def _captured(st: dict) -> int:
    """Statistics a Dobb matrix has captured, all sides and matrices together (``state["captures"]``)."""
    return sum(sum(side) for side in st["captures"])
