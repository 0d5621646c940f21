"""Table helpers shared by every study's docs tables, each computed only from committed records
(``dobb_bench.reports.records``).

Every generator returns ``(markdown, records_used)``. Conventions for every table:
- losses are final validation loss (nats/token), mean ± sample standard deviation over seeds,
  with the seed count given;
- gap closure is (AdamW - x) / (AdamW - Muon) on the seed means of the same study and setting,
  AdamW being its seeds ``GAP_ADAMW_SEEDS`` (0, 1, 2) at the shared lr, Muon torch-equivalent Muon
  (bf16 Newton-Schulz) or, where a study has no such row, Muon-fp32 (``MUON_REFS``); the robust
  tables (``dobb_bench.studies.operating_point``) apply the same formula to medians;
- a difference is called beyond noise only when it exceeds 2 standard deviations (the larger of
  the two rows' seed spreads; a one-seed row borrows the other row's), never below 0.1 nats
  when a row has one seed.

The studies' generators are in ``dobb_bench.studies`` (the registry of every docs table by name,
and ``dobb-bench report``, in ``dobb_bench.studies.docs_tables``).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

from dobb_bench.reports import records as R
from dobb_bench.reports.report import ONE_SEED_NOISE, block_widths, gap_closure  # noqa: F401 (ONE_SEED_NOISE re-exported)

# the AdamW seeds every gap closure divides by (the headline's; every study at another setting ran these)
GAP_ADAMW_SEEDS = (0, 1, 2)


def final_loss(r):
    v = r.get("final_val_loss")
    return None if v is None or r.get("diverged") else v


def stats(values: list[float]) -> tuple[float, float | None, int]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, None, 0
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else None, len(vals)


def fmt_ms(mean: float, std: float | None, n: int) -> str:
    if n == 0:
        return "diverged"
    return f"{mean:.3f} ± {std:.3f}" if std is not None else f"{mean:.3f}"


def paired(a: list, b: list) -> tuple[float, float, list[float]] | None:
    """``a - b`` element by element where both are known (paired by seed, or by window group): the
    mean, its standard error and the differences; None with fewer than two pairs."""
    d = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    if len(d) < 2:
        return None
    return statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5, d


def noise(std_a: float | None, std_b: float | None) -> float:
    """2 std of the noisier row; a one-seed row borrows the other's spread, with 0.1 as the floor."""
    known = [x for x in (std_a, std_b) if x is not None]
    if len(known) == 2:
        return 2 * max(known)
    return max([ONE_SEED_NOISE] + [2 * x for x in known])


def group_by(recs, key):
    out = defaultdict(list)
    for r in recs:
        out[key(r)].append(r)
    return out


def _find(groups: dict, name: str):
    return next((v for k, v in groups.items() if k == name), None)


# The Muon reference of a study: torch-equivalent Muon (bf16 Newton-Schulz), or the same iteration in
# fp32 where bf16 is emulated (7x cheaper on this CPU; equal to 1e-3 nats at 800 steps, 3 seeds).
MUON_REFS = ("Muon", "Muon-fp32")


def muon_ref(table: dict, steps=None):
    for name in MUON_REFS:
        v = table.get(name if steps is None else (name, steps))
        if v is not None and v[2]:
            return v
    return None


def seeds_table(recs: list[dict], label_order: list[str] | None = None) -> str:
    """One row per run label: lr, block widths, seeds, loss, gap closure, difference vs AdamW."""
    by = group_by(recs, lambda r: r["run"])
    st = {k: stats([final_loss(r) for r in v]) for k, v in by.items()}
    adamw, muon = st.get("AdamW"), muon_ref(st)
    rows = ["| optimizer | lr | block widths | seeds | final val loss | gap closure | vs AdamW |",
            "|---|---|---|---|---|---|---|"]
    labels = [k for k in (label_order or []) if k in by] + [k for k in by if k not in (label_order or [])]
    for label in labels:
        runs = by[label]
        m, s, n = st[label]
        r0 = runs[0]
        bw = block_widths(r0["optimizer"], r0.get("hparams", {}), r0.get("model", {})) or "—"
        gc = gap_closure(m, adamw[0], muon[0]) if adamw and muon and n else None
        if label == "AdamW" or adamw is None or not n or not adamw[2]:
            vs = "—"
        else:
            d = m - adamw[0]
            beyond = abs(d) > noise(s, adamw[1])
            vs = f"{d:+.3f} ({'beyond' if beyond else 'within'} noise)"
        lrs = sorted({r["lr"] for r in runs})
        rows.append(f"| {label} | {', '.join(f'{x:.3g}' for x in lrs)} | {bw} | "
                    f"{','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} | "
                    f"{fmt_ms(m, s, n)} | {'—' if gc is None else f'{100 * gc:.0f}%'} | {vs} |")
    return "\n".join(rows) + "\n" + setting_line(recs)


def setting_line(recs: list[dict]) -> str:
    r = recs[0]
    m, t, c, p = r.get("model", {}), r.get("train", {}), r.get("corpus", {}), r.get("provenance", {})
    revs = sorted({(x.get("provenance") or {}).get("git_rev", "?")[:7] for x in recs})
    steps = sorted({x.get("steps") for x in recs})
    widths = "/".join(str(w) for w in sorted({(x.get("model") or {}).get("width") for x in recs} - {None}))
    return (f"\nSetting: {m.get('layers')} layers, width {widths}, context {m.get('seq_len')}, "
            f"corpus `{c.get('name')}`; {'/'.join(map(str, steps))} steps x {t.get('batch_size')} sequences x "
            f"{t.get('seq_len') or m.get('seq_len')} tokens, "
            f"{t.get('micro_batches')} micro-batch(es), weight decay {t.get('weight_decay')}, "
            f"{t.get('schedule')} schedule; {len(recs)} runs at revision(s) {', '.join(revs)} "
            f"on {(p.get('machine') or {}).get('cpu')}, torch {p.get('torch')}.\n")


def lr_grid_table(recs: list[dict], label_order: list[str] | None = None, grid_seed: int | None = None) -> str:
    """Loss per (optimizer, lr) and each row's best lr. ``grid_seed``: the grid cells and the best lr
    come from that seed alone (a seed-0 grid with more seeds run only at the best point, whose
    mean would otherwise be compared with single seeds); a last column gives every seed at the best lr."""
    by = group_by(recs, lambda r: r["run"])
    first = [k for k in (label_order or []) if k in by]
    by = {k: by[k] for k in first + [k for k in by if k not in first]}
    lrs = sorted({r["lr"] for r in recs if grid_seed is None or r["seed"] == grid_seed})
    tail = " | best | all seeds at best |" if grid_seed is not None else " | best |"
    rows = ["| optimizer | " + " | ".join(f"lr {x:.3g}" for x in lrs) + tail,
            "|---|" + "---|" * (len(lrs) + 1 + (grid_seed is not None))]
    for label, runs in by.items():
        cell = {}
        on_grid = [r for r in runs if grid_seed is None or r["seed"] == grid_seed]
        for lr in lrs:
            cell[lr] = stats([final_loss(r) for r in on_grid if abs(r["lr"] - lr) < 1e-12])
        done = {lr: v for lr, v in cell.items() if v[2]}
        best = min(done, key=lambda k: done[k][0]) if done else None
        cells = [("**" + fmt_ms(*cell[lr]) + "**" if lr == best else fmt_ms(*cell[lr])) if cell[lr][2]
                 else "" for lr in lrs]
        line = f"| {label} | " + " | ".join(cells) + f" | {'' if best is None else f'{best:.3g}'} |"
        if grid_seed is not None:
            at = [r for r in runs if best is not None and abs(r["lr"] - best) < 1e-12]
            m, sd, n = stats([final_loss(r) for r in at])
            line += f" {fmt_ms(m, sd, n)} ({n} seed{'s' if n != 1 else ''}) |" if n else " |"
        rows.append(line)
    return "\n".join(rows) + "\n" + setting_line(recs)


def pairs_table(recs: list[dict], pairs, per_seed: bool = False) -> tuple[str, list[dict]]:
    """Paired rows ``(a, b)`` over the seeds both have (same data order and initial weights): each
    row's mean, the difference and the project's noise verdict, optionally the per-seed differences."""
    head = "| row | against | seeds | row's loss | against's loss | difference | verdict |"
    rows = [head + (" per seed (same data, same init) |" if per_seed else ""),
            "|---|---|---|---|---|---|---|" + ("---|" if per_seed else "")]
    used = []
    for a, b in pairs:
        ra = {r["seed"]: r for r in recs if r["run"] == a}
        rb = {r["seed"]: r for r in recs if r["run"] == b}
        common = sorted(set(ra) & set(rb))
        if not common:
            continue
        sa, sb = stats([final_loss(ra[s]) for s in common]), stats([final_loss(rb[s]) for s in common])
        d = sa[0] - sb[0]
        verdict = "beyond noise" if abs(d) > noise(sa[1], sb[1]) else "within noise"
        row = f"| {a} | {b} | {','.join(map(str, common))} | {fmt_ms(*sa)} | {fmt_ms(*sb)} | {d:+.3f} | {verdict} |"
        if per_seed:
            row += " " + ", ".join(f"{final_loss(ra[s]) - final_loss(rb[s]):+.3f}" for s in common
                                   if final_loss(ra[s]) is not None and final_loss(rb[s]) is not None) + " |"
        rows.append(row)
        used += [ra[s] for s in common] + [rb[s] for s in common]
    uniq = list({id(r): r for r in used}.values())
    return "\n".join(rows) + "\n" + (setting_line(uniq) if uniq else ""), uniq


def study_tables(name, fn, where=None):
    def gen():
        recs = R.load(name)
        if where is not None:
            recs = [r for r in recs if where(r)]
        return fn(recs), recs
    return gen


SHARED_LR = 5e-3 * 2 ** -0.5  # AdamW's best point of its own grid (table lr-grid)
