"""How far a host moves a 20-tokens loss (study ``host-check``, ``table:host-check``; issue 55).

Why: ``table:one-revision`` ran every run at one revision on one host kind (an Intel Xeon with AMX).
Sessions land on other host kinds (AMD EPYC with and without native bf16), and the same revision's
numerics digest differs between them (fp32 BLAS kernels round differently;
``docs/results/checks/numerics-digest/57db80f-amd-epyc.json``): a run there does not compute the
same numbers. This study reruns some of ``table:one-revision``'s runs at the same revision, with the
same command, on another host kind, and pairs each with its original by row, lr and seed.

The table gives each pair's two common-windows losses and their difference, then per row the
differences' mean and largest size against the row's seed spread on the original host, and a paired
t-test over every pair (is there a systematic host offset?). Its reading decides whether a row run on
one host kind may be paired with a reference run on the other: where the host moves a loss by much
less than the seeds do, a host is one more source of the noise the seeds already measure.
"""
from __future__ import annotations

import functools
import statistics
from pathlib import Path

from dobb_bench.reports import records as R
from dobb_bench.studies import one_revision
from dobb_bench.studies.define import beyond_noise, grid_lr
from dobb_bench.studies.long_horizon_runs import HOST, HOST_CHECK, ONE_REVISION, STUDIES
from dobb_bench.studies.lr_rule import bf16

STUDY = "host-check"
REEVAL = one_revision.HK_REEVAL


_lr = one_revision.lr_key
# the re-evaluations of this study's finished runs appended to its committed record, each run once
collect_reevals = functools.partial(one_revision.append_reevals, kind=HOST_CHECK.kind, rel=REEVAL)


def reeval_records() -> list[dict]:
    return one_revision.jsonl(Path(R.DOCS).joinpath(*REEVAL))


def _by_key(recs: list[dict], kind: str, steps: int) -> dict[tuple, dict]:
    return {(r["run"], _lr(r["lr"]), r["seed"]): r for r in recs
            if str(r.get("run_dir", "")).startswith(f"{kind}-") and r["steps"] == steps and not bf16(r)}


def host_check() -> tuple[str, list[dict]]:
    here = _by_key(reeval_records(), HOST_CHECK.kind, HOST_CHECK.steps)
    there = _by_key(one_revision.reeval_records(), ONE_REVISION.kind, ONE_REVISION.steps)
    study = STUDIES[STUDY]
    lines = ["| row | lr | seed | loss, `table:one-revision`'s run | loss, this host | difference (this - that) |",
             "|" + "---|" * 6]
    used: list[dict] = []
    diffs: dict[str, list[float]] = {}
    for row in HOST:
        lr = _lr(grid_lr(row.lrs[0]))
        for sd in study.seeds:
            a, b = there.get((row.label, lr, sd)), here.get((row.label, lr, sd))
            if b is None:
                lines.append(f"| {row.label} | {lr:.3g} | {sd} | "
                             f"{'—' if a is None else format(a['common_val_loss'], '.4f')} | not run yet | |")
                continue
            used.append(b)
            if a is None:
                lines.append(f"| {row.label} | {lr:.3g} | {sd} | no run | {b['common_val_loss']:.4f} | |")
                continue
            used.append(a)
            d = b["common_val_loss"] - a["common_val_loss"]
            diffs.setdefault(row.label, []).append(d)
            lines.append(f"| {row.label} | {lr:.3g} | {sd} | {a['common_val_loss']:.4f} | "
                         f"{b['common_val_loss']:.4f} | {d:+.4f} |")
    lines += ["", "| row | pairs | mean difference | largest size | seed spread there (std over its seeds) |",
              "|" + "---|" * 5]
    for row in HOST:
        ds = diffs.get(row.label, [])
        lr = _lr(grid_lr(row.lrs[0]))
        seeds = [r["common_val_loss"] for (run, x, _), r in there.items() if run == row.label and x == lr]
        spread = f"{statistics.stdev(seeds):.4f} ({len(seeds)} seeds)" if len(seeds) > 1 else "—"
        if ds:
            lines.append(f"| {row.label} | {len(ds)} | {statistics.fmean(ds):+.4f} | {max(map(abs, ds)):.4f} | {spread} |")
        else:
            lines.append(f"| {row.label} | 0 | | | {spread} |")
    ref = study.reference
    others = [row for row in HOST if row.label != ref]
    if ref is not None and others:
        lines += ["", f"| row | seed | gap to {ref}, `table:one-revision`'s host | gap to {ref}, this host | change |",
                  "|" + "---|" * 5]
        rlr = _lr(grid_lr(next(r for r in HOST if r.label == ref).lrs[0]))
        for row in others:
            lr = _lr(grid_lr(row.lrs[0]))
            for sd in study.seeds:
                keys = (row.label, lr, sd), (ref, rlr, sd)
                if not all(k in d for d in (here, there) for k in keys):
                    continue
                g_there = there[keys[0]]["common_val_loss"] - there[keys[1]]["common_val_loss"]
                g_here = here[keys[0]]["common_val_loss"] - here[keys[1]]["common_val_loss"]
                lines.append(f"| {row.label} | {sd} | {g_there:+.4f} | {g_here:+.4f} | {g_here - g_there:+.4f} |")
    every = [d for ds in diffs.values() for d in ds]
    revs, cpus = one_revision.where(used)
    text = "\n".join(lines) + "\n\n"
    if len(every) > 1:
        mean, se = statistics.fmean(every), statistics.stdev(every) / len(every) ** 0.5
        text += (f"Over every pair ({len(every)}): mean {mean:+.4f}, std {statistics.stdev(every):.4f}, "
                 f"largest size {max(map(abs, every)):.4f}; "
                 + ("a host offset beyond noise" if beyond_noise(mean, se, len(every)) else "no host offset beyond noise")
                 + f" (paired t = {mean / se if se else float('inf'):.1f}).\n\n")
    text += (f"Study `{STUDY}`: the runs of `table:one-revision` ({ONE_REVISION.steps} steps, width 128, 2 layers, fp32 "
             f"products, the same command) repeated at revision {', '.join(revs) or '—'} on another host; hosts "
             f"{', '.join(cpus) or '—'}. Losses: the last checkpoint (step 8,000) on 2,048 common windows (records "
             f"`docs/results/{'/'.join(REEVAL[1:])}` and `docs/results/{'/'.join(one_revision.REEVAL[1:])}`). "
             "A difference is each pair's loss here less the original's; the t-test is paired over every pair.\n")
    return text, used


assert STUDIES[STUDY].setting.steps == ONE_REVISION.steps
TABLES = {"host-check": host_check}
