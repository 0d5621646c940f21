"""The sharded frontier at 20 tokens per parameter (``table:frontier-20``), from committed records.

Every row trained 8,300 steps (about 20 tokens per parameter) on the width-128 bench model, and
every finished run was re-evaluated at its last checkpoint on 2,048 held-out windows common to
every run (``scripts/reeval_windows.py``, record ``docs/results/checks/reeval-windows/reeval.jsonl``).

The protocol, applied here to whatever has been run:
- a row's lr is chosen at seed 0 on the common windows; it is *bracketed* when a worse lr lies on
  each side of it;
- its loss is the mean over the seeds run at that lr (seeds 1 and 2 were run there);
- its gap to owner-compute Muon (each at its own best lr) is paired by seed: a seed gives both
  rows the same initial weights, data order and windows. A gap is *beyond noise* under a 95%
  paired t-test over the seeds; because seed 0 also chose the lr, the verdict is repeated on the
  seeds that did not (1 and 2) and a lead that holds only with seed 0 is said to rest on it;
- step cost, bytes and state come from ``table:shard-local``'s timing run and formulas (GPT-2
  Small layer 0 over 4 gloo ranks, each ratio against owner-compute Muon measured side by side);
- weight norms: each hidden matrix's top singular value and RMS at the first eval (the initial
  weights), halfway and at the end (``norms_by_matrix`` in the run records of study
  ``long-horizon``); "growth" is the largest final / initial ratio over the matrices.
"""
from __future__ import annotations

import math
import statistics

from dobb_bench.reports import records as R
from dobb_bench.reports.tables import paired
from dobb_bench.studies import long_horizon as LH
from dobb_bench.studies.define import beyond_noise, best_of
from dobb_bench.studies.shard_local import OWNER, fmt_bytes, timing_ratios, communication, state_per_param

STEPS, WIDTH = 8300, 128
# (row as labelled in the runs, spec whose step was timed in table:shard-local)
ROWS = (
    ("Dobb B=1", "dobb:blocks=1"),
    ("Dobb B=4", "dobb:blocks=4"),
    ("Two-sided B=1 Bo=4", "dobb:side=both:blocks=1:out_blocks=4"),
    ("Two-sided B=4 Bo=4", "dobb:side=both:blocks=4:out_blocks=4"),
    ("Row-block Muon R=4", "block-muon:axis=0:blocks=4:ns_dtype=float32"),
    ("MuonBP R=4 P=5", "muonbp:blocks=4:period=5:ns_dtype=float32"),
    ("MuonBP R=4 P=10", "muonbp:blocks=4:period=10:ns_dtype=float32"),
    # b2 and the AdamW part's lr do not change the step's cost: timed as splus:out_blocks=4
    ("SPlus Bo=4 authors", "splus:out_blocks=4"),
    ("Dion2 1/4 per shard R=4", "dion2:select=shard:blocks=4:ns_dtype=float32"),
    ("DASH 32", "dash:block_size=32"),
    # issue 40's Dobb forms that steps no slower than two-sided B=1 Bo=4's
    ("Dobb-Muon B=4 Bo=4", "dobb-muon:blocks=4:out_blocks=4"),
    # per-head row blocks: heads=4 in the bench model, timed at GPT-2 Small's 12
    ("Dobb-Muon B=4 Bo=4 heads", "dobb-muon:blocks=4:out_blocks=4:heads=12"),
)
REFS = (
    ("Muon", OWNER),
    ("SOAP", "soap"),
    ("AdamW", "adamw"),
    ("Two-sided B=1 Bo=1", "dobb:side=both"),
)
REF = "Muon"


def _lr(r: dict) -> float:
    return float(f"{r['lr']:.4g}")


def _bf16(r: dict) -> bool:
    """A run made with bf16 products: outside this table's protocol (fp32 products on every row)."""
    return "bfloat16" in str(r.get("hparams", {}))


def _common() -> dict[str, dict[float, dict[int, dict]]]:
    """``{row: {lr: {seed: reeval record}}}`` at this setting, fp32 products only."""
    out: dict = {}
    for r in LH.reeval_records():
        if r["steps"] == STEPS and r["model"]["width"] == WIDTH and not _bf16(r):
            out.setdefault(r["run"], {}).setdefault(_lr(r), {})[r["seed"]] = r
    return out


def choose(by_lr: dict[float, dict[int, dict]]) -> tuple[float | None, bool]:
    """The row's lr and whether the seed-0 grid brackets it: the seed-0 best on the common windows,
    or, where a neighbouring lr (one grid step, a factor sqrt 2) is worse than it by less than two
    standard errors of the window noise (paired over the window groups), the one of them with the
    lowest mean over seeds 0 and 1 once each has seed 1 (``define.chosen_j``, the driver's rule)."""
    best, bracketed = best_of((lr, s[0]["common_val_loss"]) for lr, s in by_lr.items() if 0 in s)
    if best is None or not bracketed:
        return best, bracketed
    ref = by_lr[best][0].get("common_groups")
    cands = [best]
    for lr in by_lr:
        if lr != best and 0 in by_lr[lr] and abs(math.log2(lr / best)) < 0.51 and ref:
            got = paired(by_lr[lr][0].get("common_groups") or [], ref)
            if got is not None and got[0] < 2 * got[1]:
                cands.append(lr)
    if len(cands) == 1 or any(1 not in by_lr[lr] for lr in cands):
        return best, bracketed
    means = [(by_lr[lr][0]["common_val_loss"] + by_lr[lr][1]["common_val_loss"]) / 2 for lr in cands]
    return cands[means.index(min(means))], bracketed


def verdict(gaps: dict[int, float]) -> tuple[float, str]:
    """The mean of per-seed gaps and the noise verdict: a 95% paired t-test over every seed, then
    over the seeds other than 0 (which chose the lr); with fewer than three seeds no verdict."""
    seeds = sorted(gaps)
    d = [gaps[s] for s in seeds]
    mean = statistics.fmean(d)
    if len(d) < 3:
        return mean, f"{len(d)} seed{'s' if len(d) > 1 else ''}: no verdict"

    def beyond(xs):
        se = statistics.stdev(xs) / len(xs) ** 0.5
        return beyond_noise(statistics.fmean(xs), se, len(xs)), statistics.fmean(xs) / se if se else math.inf

    all_ok, t_all = beyond(d)
    later = [gaps[s] for s in seeds if s != 0]
    later_ok, t_later = beyond(later) if len(later) >= 2 else (False, 0.0)
    if all_ok and later_ok:
        return mean, f"beyond noise (t = {t_all:.1f}; seeds 1+ alone t = {t_later:.1f})"
    if all_ok:
        return mean, f"beyond noise only with seed 0, which chose the lr (t = {t_all:.1f}; seeds 1+ alone t = {t_later:.1f})"
    return mean, f"within noise (t = {t_all:.1f})"


def norm_stats(recs: list[dict]) -> tuple[float, float, float] | None:
    """Over the records that carry norms: the mean final largest top singular value, the largest
    final / initial top-singular-value ratio over matrices (mean over seeds), and the largest
    final / halfway ratio (growth still going on at the end)."""
    have = [r["norms_by_matrix"] for r in recs if r.get("norms_by_matrix")]
    if not have:
        return None
    top = [max(v[-1][2] for v in m.values()) for m in have]
    grow = [max(v[-1][2] / v[0][2] for v in m.values()) for m in have]
    late = [max(v[-1][2] / v[1][2] for v in m.values()) for m in have]
    return statistics.fmean(top), statistics.fmean(grow), statistics.fmean(late)


NORMS_STUDY = "long-horizon-norms"  # reruns of runs made before norms were recorded, for their norms only


def _run_records(study: str = LH.STUDY) -> dict[tuple[str, float, int], dict]:
    out = {}
    for r in R.load(study):
        m = r.get("model") or {}
        if r.get("steps") == STEPS and m.get("width") == WIDTH and m.get("layers") == 2 and not _bf16(r):
            out[(r["run"], _lr(r), r["seed"])] = r
    return out


def pareto(points: dict[str, tuple[float, float]]) -> set[str]:
    """Rows on the loss / step-cost frontier: no other row is both cheaper (or as cheap) and lower
    in loss (or as low), one of them strictly."""
    on = set()
    for a, (la, ca) in points.items():
        dominated = any((lb <= la and cb <= ca) and (lb < la or cb < ca) for b, (lb, cb) in points.items() if b != a)
        if not dominated:
            on.add(a)
    return on


def frontier_20() -> tuple[str, list[dict]]:
    common, runs, reruns = _common(), _run_records(), _run_records(NORMS_STUDY)
    ratios, _ = timing_ratios()
    ref_lr, _ = choose(common.get(REF, {}))
    ref = common.get(REF, {}).get(ref_lr, {})
    head = ("| row | communication under `Shard(0)` | lrs run: seed-0 loss, common windows | best lr | "
            "seeds at best: loss | mean ± std (n) | gap to Muon, paired by seed | bytes per step | "
            "FSDP2 step / owner-compute Muon | state B/param | largest top singular value, end | growth: end / initial "
            "(end / halfway) |")
    lines = [head, "|" + "---|" * 12]
    used: list[dict] = []
    summary: dict[str, tuple] = {}
    compared = 0
    for group, rows in (("zero step communication", ROWS), ("references", REFS)):
        lines.append(f"| *{group}* |" + " |" * 11)
        for name, spec in rows:
            by_lr = common.get(name, {})
            nbytes, when = communication(spec)
            ratio = ratios.get("torch-adamw" if spec == "adamw" else spec)
            cost = (f" | {fmt_bytes(nbytes)} | {'—' if ratio is None else f'{ratio:.2f}'} | "
                    f"{state_per_param(spec):.1f}")
            lr, bracketed = choose(by_lr)
            if lr is None:
                lines.append(f"| {name} | {when} | not run yet | | | |{cost} | | |")
                continue
            grid = ", ".join(f"{x:.3g}: {s[0]['common_val_loss']:.3f}" for x, s in sorted(by_lr.items()) if 0 in s)
            at = by_lr[lr]
            used += [s[0] for s in by_lr.values() if 0 in s] + list(at.values())
            losses = {sd: at[sd]["common_val_loss"] for sd in sorted(at)}
            vals = list(losses.values())
            m = statistics.fmean(vals)
            sd_txt = f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else ""
            per_seed = ", ".join(f"{v:.3f} (s{sd})" for sd, v in losses.items())
            if name == REF:
                gap = ""
            else:
                gaps = {sd: losses[sd] - ref[sd]["common_val_loss"] for sd in losses if sd in ref}
                if gaps:
                    mean, text = verdict(gaps)
                    compared += len(gaps) >= 3
                    gap = f"{mean:+.3f} ({', '.join(f'{g:+.3f}' for g in gaps.values())}), {text}"
                else:
                    gap = "—"
            recs = [runs[(name, lr, sd)] for sd in at if (name, lr, sd) in runs]
            ns, mark = norm_stats(recs), ""
            if ns is None:  # a rerun of the same run, made for its norms (its loss is not used)
                ns, mark = norm_stats([reruns[(name, lr, sd)] for sd in at if (name, lr, sd) in reruns]), " (rerun)"
            norms = " | — | —" if ns is None else f" | {ns[0]:.2f}{mark} | {ns[1]:.2f}x ({ns[2]:.2f}x)"
            summary[name] = (m, ratio, losses, when)
            lines.append(f"| {name} | {when} | {grid} | {lr:.3g}{'' if bracketed else ' (edge)'} | {per_seed} | "
                         f"{m:.3f}{sd_txt} ({len(vals)}) | {gap}{cost}{norms} |")
    text = "\n".join(lines) + "\n"
    points = {k: (v[0], v[1]) for k, v in summary.items() if v[1] is not None and len(v[2]) >= 3}
    on = sorted(pareto(points), key=lambda k: points[k][1]) if points else []
    text += (f"\n{compared} rows were compared with Muon by a paired t-test over at least three seeds, each at 95% "
             "and not corrected for the number of comparisons. ")
    if on:
        text += ("On the loss / FSDP2-step frontier (rows with three seeds and a timed step; mean loss): "
                 + ", ".join(f"{k} ({points[k][0]:.3f}, {points[k][1]:.2f}x)" for k in on) + ".")
    text += "\n"
    revs = sorted({(r.get("provenance") or {}).get("git_rev", "")[:7] for r in used})
    text += (f"\nLosses: 2,048 common windows at the last checkpoint (record "
             f"`docs/results/checks/reeval-windows/reeval.jsonl`, re-evaluated at {', '.join(revs) or '—'}); "
             "norms: run records of study `long-horizon` (only runs made after norms were recorded have them); "
             f"\"(rerun)\": from a rerun of the seed-0 run at the same settings (study `{NORMS_STUDY}`), whose "
             "loss is not used.\n")
    return text, used + [runs[k] for k in runs if k[0] in summary]


TABLES = {"frontier-20": frontier_20}
