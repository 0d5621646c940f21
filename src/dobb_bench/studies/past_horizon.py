"""Muon's family and Nesterov Dobb-Muon at twice the 20-tokens horizon (study ``past-horizon``,
``table:past-horizon``; issue 55).

Why: at 20 tokens per parameter row-block Muon's largest top singular value grows faster than
Muon's (``table:frontier-20``, as the MuonBP paper reports for block-wise orthogonalisation). This
study asks whether that growth keeps going when training runs twice as long (16,600 steps, the lr
schedule stretched over them), and whether a row behind or level with Muon at 8,300 steps stays
there. One seed per row at its chosen 20-tokens lr: a loss difference under about 0.025 at one
seed is noise in this setting (issue 55's probes), so the table gives gaps and calls none of them.

Columns: the loss at the last checkpoint on the 2,048 common windows (its own re-evaluation
record), the same row, lr and seed at 8,300 steps (``table:one-revision``'s runs where the row is
there, else ``table:frontier-20``'s), and the largest top singular value over the hidden matrices
at the run's middle eval (8,250, the 20-tokens horizon) and at its end, with the peak.
"""
from __future__ import annotations

from pathlib import Path

from dobb_bench.reports import records as R
from dobb_bench.studies import one_revision
from dobb_bench.studies.long_horizon_runs import ONE_REVISION, PAST, PAST_HORIZON, STUDIES
from dobb_bench.studies.define import grid_lr
from dobb_bench.studies.lr_rule import bf16

STUDY = "past-horizon"
REF = "Muon"
REEVAL = ("results", "checks", "reeval-windows", "past-horizon.jsonl")
SHORT_STEPS = 8300


def _lr(x: float) -> float:
    return float(f"{x:.4g}")


def reeval_records() -> list[dict]:
    return one_revision.jsonl(Path(R.DOCS).joinpath(*REEVAL))


def collect_reevals(runs_root: str) -> int:
    """Appends the re-evaluations of this study's finished runs (``{runs_root}/reeval-scratch.jsonl``)
    to the committed record, each run once; returns how many."""
    return one_revision.append_reevals(runs_root, PAST_HORIZON.kind, REEVAL)


def _short_loss(label: str, lr: float, seed: int = 0) -> tuple[float | None, str]:
    """The common-windows loss of ``label`` at ``lr`` and ``seed`` at 8,300 steps, fp32 products,
    and the table it comes from: table:one-revision first, table:frontier-20 else."""
    for r in one_revision.reeval_records():
        if (r["run"] == label and _lr(r["lr"]) == lr and r["seed"] == seed and r["steps"] == SHORT_STEPS
                and str(r.get("run_dir", "")).startswith(f"{ONE_REVISION.kind}-") and not bf16(r)):
            return r["common_val_loss"], "one-revision"
    found = [r for r in R.reeval_records() if r["run"] == label and _lr(r["lr"]) == lr and r["seed"] == seed
             and r["steps"] == SHORT_STEPS and r["model"]["width"] == 128 and not bf16(r)]
    return (found[-1]["common_val_loss"], "frontier-20") if found else (None, "")


def norm_path(rec: dict) -> tuple[float, float, float, int] | None:
    """The largest top singular value over the hidden matrices at the eval nearest the 20-tokens
    horizon, at the end, and its peak with the peak's step."""
    curve = [(s, v) for s, _, v in rec.get("norm_curve") or [] if v is not None]
    if not curve:
        return None
    mid = min(curve, key=lambda p: abs(p[0] - SHORT_STEPS))[1]
    peak = max(curve, key=lambda p: p[1])
    return mid, curve[-1][1], peak[1], peak[0]


def past_horizon() -> tuple[str, list[dict]]:
    common = {(r["run"], _lr(r["lr"]), r["seed"]): r for r in reeval_records()
              if str(r.get("run_dir", "")).startswith(f"{PAST_HORIZON.kind}-") and r["steps"] == PAST_HORIZON.steps}
    path = Path(R.RECORDS) / f"{STUDY}.jsonl"
    runs = {(r["run"], _lr(r["lr"]), r["seed"]): r for r in (R.load(STUDY) if path.exists() else [])
            if r.get("steps") == PAST_HORIZON.steps}
    ref = next((common[k] for k in common if k[0] == REF), None)
    lines = ["| row | spec | lr | loss at 16,600 steps, common windows | gap to Muon (seed 0) | "
             "same lr and seed at 8,300 steps | largest top singular value: at 8,250 / end (end / 8,250) | peak (step) |",
             "|" + "---|" * 8]
    used: list[dict] = []
    for row in PAST:
        lr = _lr(grid_lr(row.lrs[0]))
        got, rec = common.get((row.label, lr, 0)), runs.get((row.label, lr, 0))
        if got is None:
            lines.append(f"| {row.label} | `{row.spec}` | {lr:.3g} | not run yet | | | | |")
            continue
        used += [got] + ([rec] if rec else [])
        loss = got["common_val_loss"]
        gap = "" if row.label == REF else ("—" if ref is None else f"{loss - ref['common_val_loss']:+.3f}")
        short, where = _short_loss(row.label, lr)
        short_txt = "—" if short is None else f"{short:.3f} (`table:{where}`; {loss - short:+.3f} here)"
        np_ = norm_path(rec) if rec else None
        norms = "— | —" if np_ is None else (f"{np_[0]:.2f} / {np_[1]:.2f} ({np_[1] / np_[0]:.2f}x) | "
                                              f"{np_[2]:.2f} ({np_[3]:,})")
        lines.append(f"| {row.label} | `{row.spec}` | {lr:.3g} | {loss:.3f} | {gap} | {short_txt} | {norms} |")
    revs, cpus = one_revision.where(used)
    text = "\n".join(lines) + "\n\n"
    text += (f"Study `{STUDY}`: {PAST_HORIZON.steps} steps (the schedule stretched over them), width 128, 2 layers, "
             f"fp32 products, seed 0, each row at its chosen 20-tokens lr; revision {', '.join(revs) or '—'}; host "
             f"{', '.join(cpus) or '—'}. Losses: the last checkpoint (step 16,500) on 2,048 common windows (record "
             f"`docs/results/{'/'.join(REEVAL[1:])}`); norms: `docs/results/records/{STUDY}.jsonl`. One seed: a gap "
             "under about 0.025 is within seed noise here, so no gap is called.\n")
    return text, used


assert STUDIES[STUDY].setting == PAST_HORIZON
TABLES = {"past-horizon": past_horizon}
