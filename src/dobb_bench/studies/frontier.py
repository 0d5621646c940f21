"""The sharded frontier at 20 tokens per parameter (``table:frontier-20``), from committed records.

Every row trained 8,300 steps (about 20 tokens per parameter) on the width-128 bench model, and
every finished run was re-evaluated at its last checkpoint on 2,048 held-out windows common to
every run (``scripts/reeval_windows.py``, record ``docs/results/checks/reeval-windows/reeval.jsonl``).

The protocol, applied here to whatever has been run:
- a row's lr is chosen on the common windows by the one rule of ``lr_rule.choose`` (the seed-0
  best, its close neighbours through seeds 0+1, a tie there through seed 2); a row the rule still
  waits on is marked "lr not settled: needs <lr> seed <n>", a chosen lr at an end of the lrs run
  "(edge)";
- its loss is the mean over the seeds run at that lr;
- its gap to owner-compute Muon (each at its own best lr) is paired by seed: a seed gives both
  rows the same initial weights, data order and windows. A gap is *beyond noise* under a 95%
  paired t-test over the seeds; because seed 0 also chose the lr, the verdict is repeated on the
  seeds that did not (1 and 2): a lead that holds only with seed 0 is said to rest on it, one that
  holds on the later seeds only is said so;
- the loss / step frontier keeps ties (``pareto``): a row leaves it only when another is cheaper
  beyond the spread of the step ratios between timing records and lower beyond paired noise;
- step cost, bytes and state come from ``table:shard-local``'s timing run and formulas (GPT-2
  Small layer 0 over 4 gloo ranks, each ratio against owner-compute Muon measured side by side);
- weight norms: each hidden matrix's top singular value and RMS at the first eval (the initial
  weights), halfway and at the end (``norms_by_matrix`` in the run records of study
  ``long-horizon``); "growth" is the largest final / initial ratio over the matrices.
"""
from __future__ import annotations

import json
import math
import statistics

from dobb_bench.reports import records as R
from dobb_bench.studies import long_horizon as LH
from dobb_bench.studies.define import beyond_noise
from dobb_bench.studies.lr_rule import Choice, bf16, choose  # noqa: F401 (the rule of this table)
from dobb_bench.studies.shard_local import (OWNER, TIMING, communication, fmt_bytes, state_per_param,
                                            timing_ratios)

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


_bf16 = bf16


def _common() -> dict[str, dict[float, dict[int, dict]]]:
    """``{row: {lr: {seed: reeval record}}}`` at this setting, fp32 products only."""
    out: dict = {}
    for r in LH.reeval_records() + LH.amd_rule_runs():
        if r["steps"] == STEPS and r["model"]["width"] == WIDTH and not _bf16(r):
            out.setdefault(r["run"], {}).setdefault(_lr(r), {})[r["seed"]] = r
    return out


def verdict(gaps: dict[int, float]) -> tuple[float, str]:
    """The mean of per-seed gaps and the noise verdict: a 95% paired t-test over every seed, then
    over the seeds other than 0 (which chose the lr); with fewer than three seeds no verdict.
    Four words: beyond noise (both tests), beyond noise only with seed 0 (every seed only), beyond
    noise on the seeds that did not choose the lr only (the later seeds only), within noise."""
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
    ts = f"t = {t_all:.1f}; seeds 1+ alone t = {t_later:.1f}"
    if all_ok and later_ok:
        return mean, f"beyond noise ({ts})"
    if all_ok:
        return mean, f"beyond noise only with seed 0, which chose the lr ({ts})"
    if later_ok:
        return mean, f"beyond noise on the seeds that did not choose the lr only ({ts})"
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


# timing records whose ratios are not repeats of one step's measure: fsdp4-splus times SPlus's whole
# 100-step cycle (fsdp4 one step)
NOT_REPEATS = ("cost/shard-local/fsdp4-splus/timing.jsonl",)
SMALL_STEP = 0.05  # ratios below this (AdamW's, 0.003-0.013) sit at the timer's resolution: no spread from them


# issue 55: every row's step from one timing run (one revision, one host, at least five repeats),
# with each ratio's range over the repeats; while it is absent the table takes the earlier records
# (``TIMING``: several runs, hosts and revisions) and their spread between runs
ONE_RUN = "cost/frontier-20/fsdp4/timing.jsonl"


def one_run() -> dict | None:
    """The one timing run's record: ``{"ratios": {spec: median ratio to owner-compute Muon},
    "ranges": {spec: (min, max)}, "repeats": n, "path": docs path}``; None when not committed."""
    path = R.DOCS / "results" / ONE_RUN
    if not path.exists():
        return None
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = next(r for r in recs if r.get("kind") == "run")
    ratios = {k: row[OWNER] for k, row in run["ratio_matrix"].items() if OWNER in row}
    ranges = {k: tuple(row[OWNER]) for k, row in run["ratio_range"].items() if OWNER in row}
    return {"ratios": ratios, "ranges": ranges, "repeats": run["config"]["repeats"], "path": f"docs/results/{ONE_RUN}"}


def one_run_spread(run: dict, specs=None) -> tuple[float, str]:
    """The spread of a step ratio within the one run: the largest ``max / min - 1`` of a row's
    per-repeat ratio over ``specs`` (default every spec timed) whose step is not at the timer's
    resolution, and that spec."""
    spans = [(hi / lo - 1, k) for k, (lo, hi) in run["ranges"].items()
             if k != OWNER and run["ratios"][k] >= SMALL_STEP and lo > 0 and (specs is None or k in specs)]
    return max(spans, default=(0.0, ""))


def timing_spread() -> tuple[float, list[tuple[str, list[float]]]]:
    """The spread of a step ratio between timing runs: the largest ``max / min - 1`` over the specs
    timed (against owner-compute Muon, one ratio per record: the median over its repeats) in more
    than one record, and those specs with their ratios. 0.0 when no spec was timed twice."""
    seen: dict[str, list[float]] = {}
    for rel in TIMING:
        path = R.DOCS / "results" / rel
        if rel in NOT_REPEATS or not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "run":
                for spec, row in rec["ratio_matrix"].items():
                    if spec != OWNER and OWNER in row and row[OWNER] >= SMALL_STEP:
                        seen.setdefault(spec, []).append(row[OWNER])
    twice = [(spec, v) for spec, v in seen.items() if len(v) > 1]
    return max((max(v) / min(v) - 1 for _, v in twice), default=0.0), twice


def _beyond_paired(a: dict[int, float], b: dict[int, float]) -> bool:
    """``a`` lower than ``b`` beyond paired noise: a 95% paired t-test over their common seeds (at
    least three)."""
    d = [a[sd] - b[sd] for sd in sorted(set(a) & set(b))]
    if len(d) < 3:
        return False
    m, se = statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5
    return m < 0 and beyond_noise(m, se, len(d))


def pareto(points: dict[str, tuple[dict[int, float], float]], spread: float = 0.0,
           ranges: dict[str, tuple[float, float]] | None = None) -> set[str]:
    """Rows on the loss / step-cost frontier, ties kept: a row leaves it only when another row is
    cheaper beyond the timing spread and lower in loss beyond paired noise (a 95% paired t-test over
    their common seeds). Cheaper beyond the spread: with ``ranges`` (each row's step ratio over the
    repeats of one timing run), the other row's slowest repeat is faster than this row's fastest;
    else its ratio times ``1 + spread`` is below this row's. ``points``: row -> ({seed: loss}, step ratio)."""
    on = set()
    for a, (la, ca) in points.items():
        if not any(cheaper(b, a, points, spread, ranges) and _beyond_paired(lb, la)
                   for b, (lb, cb) in points.items() if b != a):
            on.add(a)
    return on


def cheaper(b: str, a: str, points: dict, spread: float = 0.0, ranges: dict | None = None) -> bool:
    """``b``'s step cheaper than ``a``'s beyond the timing spread (see ``pareto``)."""
    if ranges is not None and a in ranges and b in ranges:
        return ranges[b][1] < ranges[a][0]
    return points[b][1] * (1 + spread) < points[a][1]


def level(points: dict[str, tuple[dict[int, float], float]], a: str, b: str) -> bool:
    """``a`` and ``b`` within paired noise of each other on loss (neither lower beyond it)."""
    return not _beyond_paired(points[a][0], points[b][0]) and not _beyond_paired(points[b][0], points[a][0])


def frontier_20() -> tuple[str, list[dict]]:
    common, runs, reruns = _common(), _run_records(), _run_records(NORMS_STUDY)
    timed = one_run()
    ratios = timing_ratios()[0] if timed is None else timed["ratios"]
    ref = common.get(REF, {}).get(choose(common.get(REF, {})).lr, {})
    head = ("| row | communication under `Shard(0)` | lrs run: seed-0 loss, common windows | best lr | "
            "seeds at best: loss | mean ± std (n) | gap to Muon, paired by seed | bytes per step | "
            "FSDP2 step / owner-compute Muon | state B/param | largest top singular value, end | growth: end / initial "
            "(end / halfway) |")
    lines = [head, "|" + "---|" * 12]
    used: list[dict] = []
    summary: dict[str, tuple] = {}
    compared, choices = 0, {}
    for group, rows in (("zero step communication", ROWS), ("references", REFS)):
        lines.append(f"| *{group}* |" + " |" * 11)
        for name, spec in rows:
            by_lr = common.get(name, {})
            nbytes, when = communication(spec)
            key = "torch-adamw" if spec == "adamw" else spec
            ratio = ratios.get(key)
            span = "" if timed is None or key not in timed["ranges"] or key == OWNER else \
                " [{:.2f}, {:.2f}]".format(*timed["ranges"][key])
            cost = (f" | {fmt_bytes(nbytes)} | {'—' if ratio is None else f'{ratio:.2f}{span}'} | "
                    f"{state_per_param(spec):.1f}")
            choice = choices[name] = choose(by_lr)
            lr = choice.lr
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
            summary[name] = (m, ratio, losses, when, key)
            lines.append(f"| {name} | {when} | {grid} | {choice.cell()} | {per_seed} | "
                         f"{m:.3f}{sd_txt} ({len(vals)}) | {gap}{cost}{norms} |")
    text = "\n".join(lines) + "\n"
    text += f"\n{compared} rows were compared with Muon by a paired t-test over at least three seeds, each at 95% " \
            "and not corrected for the number of comparisons. " + frontier_line(summary, choices, timed) + "\n"
    open_ = {k: c for k, c in choices.items() if c.lr is not None and not c.settled}
    if open_:
        text += ("\nThe lr rule (`lr_rule.choose`: the seed-0 best, its close neighbours through seeds 0+1, a tie "
                 "there through seed 2, the chosen lr bracketed) is not settled for "
                 + "; ".join(f"{k} (" + ", ".join(f"{x:.3g} seed {sd}" for x, sd in c.needs) + ")"
                             for k, c in open_.items())
                 + ": their rows show the lr the rule holds so far, and the runs named are the ones it needs.\n")
    revs = sorted({(r.get("provenance") or {}).get("git_rev", "")[:7] for r in used})
    text += (f"\nLosses: 2,048 common windows at the last checkpoint (record "
             f"`docs/results/checks/reeval-windows/reeval.jsonl`, re-evaluated at {', '.join(revs) or '—'}); "
             + ("steps: the timing records of `table:shard-local`; " if timed is None else
                f"steps: one timing run, `{timed['path']}` (median over {timed['repeats']} repeats [min, max]); ")
             + "norms: run records of study `long-horizon` (only runs made after norms were recorded have them); "
             f"\"(rerun)\": from a rerun of the seed-0 run at the same settings (study `{NORMS_STUDY}`), whose "
             "loss is not used.\n")
    return text, used + [runs[k] for k in runs if k[0] in summary]


def frontier_line(summary: dict[str, tuple], choices: dict[str, Choice], timed: dict | None = None) -> str:
    """The loss / step frontier in words, ties shown: rows with three seeds and a timed step; a row
    is off it only when another is cheaper beyond the timing spread and lower beyond paired noise
    (``pareto``); each row on it names the rows on it level with it on loss (within paired noise)
    and on step (ratios within the spread)."""
    points = {k: (v[2], v[1]) for k, v in summary.items() if v[1] is not None and len(v[2]) >= 3}
    if not points:
        return ""
    if timed is None:
        spread, twice = timing_spread()
        timed_txt = "; ".join(f"{spec} " + " and ".join(f"{v:.3f}" for v in vs) for spec, vs in twice)
        spread_txt = ("Timing spread: each timing record gives one ratio per spec (the median over its repeats), so "
                      f"the spread is the one measured between records, {100 * spread:.0f}% (the largest max / min "
                      f"over the specs timed in two or more: {timed_txt}).")
    else:  # over this table's rows only (the run also times rows of other tables)
        spread, widest = one_run_spread(timed, {v[4] for v in summary.values()})
        spread_txt = (f"Timing spread: every step ratio comes from one timing run; a row is cheaper than another beyond "
                      f"it when its slowest of {timed['repeats']} repeats is faster than the other's fastest (the widest "
                      f"range, max / min - 1: {100 * spread:.0f}%, {widest}).")
    ranges = None if timed is None else {k: timed["ranges"][v[4]] for k, v in summary.items()
                                         if k in points and v[4] in timed["ranges"]}
    on = sorted(pareto(points, spread, ranges), key=lambda k: points[k][1])
    mean = {k: summary[k][0] for k in points}

    def entry(k):
        cheaper_on = [x for x in on if points[x][1] < points[k][1] or (points[x][1] == points[k][1] and x < k)]
        loss = [x for x in cheaper_on if level(points, k, x)]
        step = [x for x in cheaper_on if not cheaper(x, k, points, spread, ranges)]
        marks = ([f"level on loss with {', '.join(loss)}"] if loss else []) + \
                ([f"on step with {', '.join(step)}"] if step else []) + \
                (["lr not settled"] if not choices[k].settled else [])
        return f"{k} ({mean[k]:.3f}, {points[k][1]:.2f}x" + (f"; {'; '.join(marks)}" if marks else "") + ")"

    return ("On the loss / FSDP2-step frontier (rows with three seeds and a timed step; mean loss, step ratio), a "
            "row is off only where another row is both cheaper beyond the timing spread and lower beyond paired "
            "noise (95% paired t-test over the seeds); each row names the cheaper rows on it that it is level "
            "with, within paired noise (loss) or within the spread (step): " + ", ".join(entry(k) for k in on) + ". "
            + spread_txt)


TABLES = {"frontier-20": frontier_20}
