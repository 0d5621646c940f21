"""Generators of the docs tables, each computed only from committed records (``records.py``).

Every generator returns ``(markdown, records_used)``. Conventions for every table:
- losses are final validation loss (nats/token), mean ± sample standard deviation over seeds,
  with the seed count given;
- gap closure is (AdamW - x) / (AdamW - Muon) on the seed means of the same study and setting;
- a difference is called beyond noise only when it exceeds 2 standard deviations (the larger of
  the two rows' seed spreads; a one-seed row borrows the other row's), never below 0.1 nats
  when a row has one seed.

``dobb-bench report`` (in ``add_report_parser``) rewrites the tables in docs/*.md and collects
run folders into records.
"""
from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict

from . import records as R
from .report import block_widths, gap_closure

ONE_SEED_NOISE = 0.1


def _loss(r):
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


def noise(std_a: float | None, std_b: float | None) -> float:
    """2 std of the noisier row; a one-seed row borrows the other's spread, with 0.1 as the floor."""
    known = [x for x in (std_a, std_b) if x is not None]
    if len(known) == 2:
        return 2 * max(known)
    return max([ONE_SEED_NOISE] + [2 * x for x in known])


def _group(recs, key):
    out = defaultdict(list)
    for r in recs:
        out[key(r)].append(r)
    return out


def _find(groups: dict, name: str):
    return next((v for k, v in groups.items() if k == name), None)


# The Muon reference of a study: torch-equivalent Muon (bf16 Newton-Schulz), or the same iteration in
# fp32 where bf16 is emulated (7x cheaper on this CPU; equal to 1e-3 nats at 800 steps, 3 seeds).
MUON_REFS = ("Muon", "Muon-fp32")


def _muon(table: dict, steps=None):
    for name in MUON_REFS:
        v = table.get(name if steps is None else (name, steps))
        if v is not None and v[2]:
            return v
    return None


def seeds_table(recs: list[dict], label_order: list[str] | None = None) -> str:
    """One row per run label: lr, block widths, seeds, loss, gap closure, difference vs AdamW."""
    by = _group(recs, lambda r: r["run"])
    st = {k: stats([_loss(r) for r in v]) for k, v in by.items()}
    adamw, muon = st.get("AdamW"), _muon(st)
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


def lr_grid_table(recs: list[dict], label_order: list[str] | None = None) -> str:
    by = _group(recs, lambda r: r["run"])
    first = [k for k in (label_order or []) if k in by]
    by = {k: by[k] for k in first + [k for k in by if k not in first]}
    lrs = sorted({r["lr"] for r in recs})
    rows = ["| optimizer | " + " | ".join(f"lr {x:.3g}" for x in lrs) + " | best |",
            "|---|" + "---|" * (len(lrs) + 1)]
    for label, runs in by.items():
        cell = {}
        for lr in lrs:
            cell[lr] = stats([_loss(r) for r in runs if abs(r["lr"] - lr) < 1e-12])
        done = {lr: v for lr, v in cell.items() if v[2]}
        best = min(done, key=lambda k: done[k][0]) if done else None
        cells = [("**" + fmt_ms(*cell[lr]) + "**" if lr == best else fmt_ms(*cell[lr])) if cell[lr][2]
                 else "" for lr in lrs]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {'' if best is None else f'{best:.3g}'} |")
    return "\n".join(rows) + "\n" + setting_line(recs)


def horizon_table(recs: list[dict]) -> str:
    steps = sorted({r["steps"] for r in recs})
    by = _group(recs, lambda r: r["run"])
    first = [k for k in ("AdamW",) + MUON_REFS if k in by]
    by = {k: by[k] for k in first + [k for k in by if k not in first]}
    st = {(k, s): stats([_loss(r) for r in v if r["steps"] == s]) for k, v in by.items() for s in steps}
    rows = ["| optimizer | " + " | ".join(f"{s} steps" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for label in by:
        cells = []
        for s in steps:
            m, sd, n = st[(label, s)]
            a, mu = st.get(("AdamW", s)), _muon(st, s)
            gc = gap_closure(m, a[0], mu[0]) if n and a and mu and a[2] and mu[2] else None
            cells.append("" if not n else fmt_ms(m, sd, n) + ("" if gc is None or label in ("AdamW",) + MUON_REFS
                                                               else f" ({100 * gc:.0f}%)"))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n" + setting_line(recs)


PAPER_PENALTY = {192: 0.18, 48: 0.23, 12: 0.50}  # block penalty / AdamW-Muon gap, paper Small


def width_points(recs: list[dict]) -> dict[int, list[tuple[int, int, float | None, float, float | None, int]]]:
    """Per model width: (B, narrowest block width, penalty / gap, Dobb mean, std, seeds) per Dobb row."""
    out = {}
    by_w = _group(recs, lambda r: r["model"]["width"])
    for width in sorted(by_w):
        g = _group(by_w[width], lambda r: r["run"])
        ref = {k: stats([_loss(r) for r in v]) for k, v in g.items()}
        a, mu, one = ref.get("AdamW"), _muon(ref), ref.get("Dobb B=1")
        rows = []
        for k in (k for k in g if g[k][0]["optimizer"] == "dobb"):
            m, s, n = ref[k]
            b = int(g[k][0]["hparams"].get("blocks", 1))
            pen = (m - one[0]) / (a[0] - mu[0]) if one and a and mu and a[0] > mu[0] and n else None
            rows.append((b, width // b, pen, m, s, n))
        out[width] = sorted(rows)
    return out


def width_table(recs: list[dict]) -> str:
    """Block penalty (Dobb B - Dobb B=1) over the AdamW-Muon gap, per model width and block width."""
    rows = ["| model width | B | block width (attn+MLP-in / MLP-out) | seeds | Dobb loss | penalty / gap |",
            "|---|---|---|---|---|---|"]
    by_w = _group(recs, lambda r: r["model"]["width"])
    for width in sorted(by_w):
        g = _group(by_w[width], lambda r: r["run"])
        ref = {k: stats([_loss(r) for r in v]) for k, v in g.items()}
        a, mu, one = ref.get("AdamW"), _muon(ref), ref.get("Dobb B=1")
        dobb = sorted((k for k in g if g[k][0]["optimizer"] == "dobb"),
                      key=lambda k: int(g[k][0]["hparams"].get("blocks", 1)))
        for k in dobb:
            r0 = g[k][0]
            m, s, n = ref[k]
            pen = (m - one[0]) / (a[0] - mu[0]) if one and a and mu and a[0] > mu[0] and n else None
            rows.append(f"| {width} | {r0['hparams'].get('blocks', 1)} | "
                        f"{block_widths('dobb', r0['hparams'], r0['model'])} | {n} | {fmt_ms(m, s, n)} | "
                        f"{'—' if pen is None else f'{pen:.2f}'} |")
        rows.append(f"| {width} | AdamW / Muon | — | {a[2] if a else 0} / {mu[2] if mu else 0} | "
                    f"{fmt_ms(*a) if a else ''} / {fmt_ms(*mu) if mu else ''} | gap "
                    f"{'' if not (a and mu) else f'{a[0] - mu[0]:.3f}'} |")
    rows.append("")
    rows.append("Paper (Small, width 768, Table 11): penalty / gap " +
                ", ".join(f"{v:.2f} at {k}-wide blocks" for k, v in PAPER_PENALTY.items()) + ".")
    return "\n".join(rows) + "\n" + setting_line(recs)


VARIANT_ORDER = ["Muon-fp32", "NorMuon-fp32", "CMuon-fp32", "SAMuon-fp32", "SAMuon-lite-fp32"]


def _variant_records() -> list[dict]:
    """Study ``muon-variants`` plus the Muon-fp32 / NorMuon-fp32 runs of the same setting on the
    grid up to 5e-3 (studies muon-fp32, own-lr, headline; the points above it that this table shows
    are its own runs), one record per (label, lr, seed)."""
    recs = {}
    for study in ("muon-fp32", "own-lr", "headline", "muon-variants"):
        for r in R.load(study):
            if study == "muon-variants" or (r["run"] in VARIANT_ORDER[:2] and r["lr"] <= 5e-3 + 1e-12):
                recs[(r["run"], round(r["lr"], 12), r["seed"])] = r
    return list(recs.values())


def variants_table(recs: list[dict], ref: str = "Muon-fp32") -> str:
    """Seed-0 loss per lr, the best seed-0 lr, every seed there, and the difference from ``ref`` at
    its own best lr (beyond noise: over 2 std of the noisier row, 0.1 nats for a one-seed row)."""
    by = _group(recs, lambda r: r["run"])
    labels = [k for k in VARIANT_ORDER if k in by] + [k for k in by if k not in VARIANT_ORDER]
    lrs = sorted({round(r["lr"], 12) for r in recs if r["seed"] == 0})
    best, at_best = {}, {}
    for label in labels:
        s0 = {lr: _loss(r) for r in by[label] if r["seed"] == 0 for lr in [round(r["lr"], 12)]}
        done = {lr: v for lr, v in s0.items() if v is not None}
        best[label] = min(done, key=done.get) if done else None
        at_best[label] = stats([_loss(r) for r in by[label] if round(r["lr"], 12) == best[label]])
    rows = ["| optimizer | " + " | ".join(f"lr {x:.3g}" for x in lrs) + f" | best lr | seeds | loss at best | vs {ref} |",
            "|---|" + "---|" * (len(lrs) + 4)]
    for label in labels:
        s0 = {round(r["lr"], 12): _loss(r) for r in by[label] if r["seed"] == 0}
        cells = [("diverged" if s0[lr] is None else (f"**{s0[lr]:.3f}**" if lr == best[label] else f"{s0[lr]:.3f}"))
                 if lr in s0 else "" for lr in lrs]
        m, sd, n = at_best[label]
        seeds = ",".join(str(r["seed"]) for r in sorted(by[label], key=lambda r: r["seed"])
                         if round(r["lr"], 12) == best[label])
        vs = "—"
        if label != ref and ref in at_best and at_best[ref][2] and n:
            d = m - at_best[ref][0]
            vs = f"{d:+.3f} ({'beyond' if abs(d) > noise(sd, at_best[ref][1]) else 'within'} noise)"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {'' if best[label] is None else f'{best[label]:.3g}'} | "
                    f"{seeds} | {fmt_ms(m, sd, n)} | {vs} |")
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
        sa, sb = stats([_loss(ra[s]) for s in common]), stats([_loss(rb[s]) for s in common])
        d = sa[0] - sb[0]
        verdict = "beyond noise" if abs(d) > noise(sa[1], sb[1]) else "within noise"
        row = f"| {a} | {b} | {','.join(map(str, common))} | {fmt_ms(*sa)} | {fmt_ms(*sb)} | {d:+.3f} | {verdict} |"
        if per_seed:
            row += " " + ", ".join(f"{_loss(ra[s]) - _loss(rb[s]):+.3f}" for s in common
                                   if _loss(ra[s]) is not None and _loss(rb[s]) is not None) + " |"
        rows.append(row)
        used += [ra[s] for s in common] + [rb[s] for s in common]
    uniq = list({id(r): r for r in used}.values())
    return "\n".join(rows) + "\n" + (setting_line(uniq) if uniq else ""), uniq


def _study(name, fn, where=None):
    def gen():
        recs = R.load(name)
        if where is not None:
            recs = [r for r in recs if where(r)]
        return fn(recs), recs
    return gen


SHARED_LR = 5e-3 * 2 ** -0.5  # AdamW's best point of its own grid (table lr-grid)
HEADLINE_ORDER = ["AdamW", "Muon", "Dobb B=1", "Dobb B=4", "Dobb B=16", "Block Muon B=16", "Dion rho=1/16"]


# the unstaggered rows are the headline records from before stagger became the default (4f58df5)
STAGGER_ORDER = [f"Dobb B={b}{s}" for b in (1, 4, 16) for s in ("", " stagger=True")]
NESTEROV_ORDER = ["Muon-fp32", "Muon-fp32-nesterov", "Dobb B=4", "Dobb B=4 nesterov=True"]


def _headline():
    """Headline rows; AdamW's seed-0 run at the shared lr is the lr grid's (same setting)."""
    recs = R.load("headline") + [r for r in R.load("lr-grid") if abs(r["lr"] - SHARED_LR) < 1e-12]
    from .family_soap import headline_rows  # issue 24: SOAP and Newton-Muon, 3 seeds at the shared lr

    recs += headline_rows()
    return seeds_table(recs, HEADLINE_ORDER), recs


# The bf16-products study (issue 20): Dobb with its projection products forced to bf16 beside the
# headline's fp32-product rows of the same block count. Paired by seed (same data order and initial
# weights), so the per-seed difference isolates the product dtype; the noise rule is the project's.
BF16_BLOCKS = (1, 4, 16)


def _bf16_records() -> list[dict]:
    """Study ``bf16-products`` plus the headline's Dobb B=1/4/16 runs (fp32 products on CPU)."""
    fp32 = {f"Dobb B={b}" for b in BF16_BLOCKS}
    return R.load("bf16-products") + [r for r in R.load("headline") if r["run"] in fp32]


def bf16_table(recs: list[dict]) -> str:
    rows = ["| blocks | fp32 products | bf16 products | bf16 - fp32 per seed | mean difference |",
            "|---|---|---|---|---|"]
    for b in BF16_BLOCKS:
        f32 = {r["seed"]: _loss(r) for r in recs if r["run"] == f"Dobb B={b}"}
        b16 = {r["seed"]: _loss(r) for r in recs if r["run"] == f"Dobb B={b} bf16"}
        if not b16:
            continue
        sf, sb = stats(list(f32.values())), stats(list(b16.values()))
        pairs = sorted(s for s in b16 if s in f32 and b16[s] is not None and f32[s] is not None)
        diffs = [b16[s] - f32[s] for s in pairs]
        d = sb[0] - sf[0]
        verdict = "beyond" if abs(d) > noise(sb[1], sf[1]) else "within"
        per_seed = ", ".join(f"{x:+.4f} (seed {s})" for s, x in zip(pairs, diffs))
        rows.append(f"| B={b} | {fmt_ms(*sf)} | {fmt_ms(*sb)} | {per_seed} | {d:+.3f} ({verdict} noise) |")
    return "\n".join(rows) + "\n" + setting_line(recs)


TABLES = {
    "headline": lambda: _headline(),
    "lr-grid": _study("lr-grid", lr_grid_table),
    "block-width": _study("block-width", width_table),
    "horizon": _study("horizon", horizon_table),
    "corpus2": _study("corpus2", lambda recs: seeds_table(recs, ["AdamW", "Muon-fp32", "Dobb B=1", "Dobb B=4",
                                                                  "Dobb B=16", "Dion rho=1/16"])),
    "main-job": _study("main-job", seeds_table),
    "muon-fp32": _study("muon-fp32", seeds_table),
    "own-lr": _study("own-lr", lambda recs: lr_grid_table(recs, ["AdamW", "Muon-fp32", "NorMuon-fp32", "Dobb B=1",
                                                                  "Dobb B=4", "Dobb B=16", "Block Muon B=16"])),
    "stagger": _study("stagger", lambda recs: seeds_table(recs, STAGGER_ORDER)),
    "nesterov": _study("nesterov", lambda recs: seeds_table(recs, NESTEROV_ORDER)),
    "muon-variants": lambda: (variants_table(recs := _variant_records()), recs),
    "bf16-products": lambda: (bf16_table(recs := _bf16_records()), recs),
}


def _operating_point_tables():
    """Issue 23's tables (operating points, robust statistics): generators in ``operating_point``."""
    from . import operating_point

    return operating_point.TABLES


TABLES.update({name: (lambda name=name: _operating_point_tables()[name]())
               for name in ("operating-point", "robust-headline", "block-width-robust")})


def _family_dash_tables():
    """Issue 24's DASH tables: generators in ``family_dash``."""
    from . import family_dash

    return family_dash.TABLES


TABLES.update({name: (lambda name=name: _family_dash_tables()[name]())
               for name in ("family-dash", "family-dash-lr", "family-dash-pairs")})


def _family_soap_tables():
    """Issue 24's SOAP / Newton-Muon tables: generators in ``family_soap``."""
    from . import family_soap

    return family_soap.TABLES


TABLES.update({name: (lambda name=name: _family_soap_tables()[name]())
               for name in ("family-soap", "family-soap-lr", "family-soap-pairs")})


def _two_sided_tables():
    """Issue 25's tables (two-sided Dobb): generators in ``two_sided``."""
    from . import two_sided

    return two_sided.TABLES


TABLES.update({name: (lambda name=name: _two_sided_tables()[name]()) for name in ("two-sided", "two-sided-lr")})


# ----- plots from records ---------------------------------------------------------------------------
LAYOUTS = (("output", "FSDP: output axis (rows) sharded over 4 ranks"),
           ("input", "input axis (columns) sharded over 4 ranks, B a multiple of 4"))


def plot_block_width(recs: list[dict], out_dir) -> str:
    """Penalty / gap against the narrowest block width (log scale), per model width, paper beside."""
    from .report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for width, rows in width_points(recs).items():
        pts = [(bw, pen) for _, bw, pen, *_ in rows if pen is not None]
        seeds = "/".join(str(n) for n in sorted({r[5] for r in rows}))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"ours, model width {width} ({seeds} seeds)")
    ax.plot(list(PAPER_PENALTY), list(PAPER_PENALTY.values()), marker="s", linestyle="--",
            label="paper, Small (width 768), Table 11")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block width at the attention / MLP-in input")
    ax.set_ylabel("(Dobb B - Dobb B=1) / (AdamW - Muon)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "block_width_penalty.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_study(study: str, out_dir=None) -> list[str]:
    """Mean validation curves and loss vs payload (one panel per layout) for a study's records."""
    from .payload import relative_payload
    from .report import _pyplot, _typed

    recs = _headline()[1] if study == "headline" else [] if study == "operating-point" else R.load(study)
    out_dir = R.RECORDS.parent if out_dir is None else out_dir
    if study == "block-width":
        return [plot_block_width(recs, out_dir)]
    if study == "operating-point":
        from .operating_point import plot

        return [plot(out_dir)]
    plt = _pyplot()
    by = _group(recs, lambda r: r["run"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in by.items():
        steps = sorted({p[0] for r in runs for p in r["curve"]})
        mean = [statistics.fmean([v for r in runs for s2, v in r["curve"] if s2 == s and v is not None] or [math.nan])
                for s in steps]
        ax.plot(steps, mean, marker=".", label=f"{label} ({len(runs)} seed(s))")
    ax.set_ylim(None, 3.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss, mean over seeds (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    curves = out_dir / f"{study}_val_loss.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, (sharded, title) in zip(axes, LAYOUTS):
        for label, runs in by.items():
            r0 = runs[0]
            d = r0["model"]["width"]
            shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * r0["model"]["layers"]
            x = relative_payload(r0["optimizer"], _typed(r0.get("hparams", {})), shapes, sharded=sharded, shards=4)
            m, sd, n = stats([_loss(r) for r in runs])
            ax.errorbar([x], [m], yerr=[sd or 0], fmt="o", capsize=3)
            ax.annotate(label, (x, m), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer-specific cross-shard payload / Muon's")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss, mean ± std over seeds")
    fig.tight_layout()
    payload = out_dir / f"{study}_payload_vs_loss.png"
    fig.savefig(payload, dpi=110)
    plt.close(fig)
    return [str(curves), str(payload)]


# ----- the `report` subcommand --------------------------------------------------------------------
def cmd_report(args) -> int:
    if args.docs:  # another docs folder: its *.md and results/records (the default edits this checkout)
        R.use_docs(args.docs)
    if args.plots:
        for study in args.plots.split(","):
            print("report: wrote " + ", ".join(plot_study(study)))
        return 0
    if args.collect:
        new = R.collect(args.collect, args.study, runs=args.runs.split(",") if args.runs else None)
        print(f"report: {len(new)} record(s) from {args.collect} -> {R.RECORDS / (args.study + '.jsonl')}")
        return 0
    changed = R.regenerate_docs(write=not args.check)
    for name, tabs in changed.items():
        print(f"{'differs' if args.check else 'rewrote'}: docs/{name}: {', '.join(tabs)}")
    if args.check:  # figures outside the marked tables (README.md, docs/**/*.md): listed (issue 23 item 7)
        from .figure_check import scan

        figures = scan()
        for path, hits in figures.items():
            for line, text in hits:
                print(f"unsourced figure: {path}:{line}: {text[:100]}")
        if figures:
            print(f"report: {sum(map(len, figures.values()))} figure(s) name no record and are not marked "
                  "'not measured here'" + ("" if args.strict_figures else " (listed; --strict-figures fails on them)"))
        if changed or (figures and args.strict_figures):
            return 1
    if not changed:
        print("report: every docs table matches its records")
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="regenerate the docs tables from docs/results/records")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a table differs; also list "
                   "figures in README.md and docs/**/*.md that name no record")
    p.add_argument("--strict-figures", action="store_true", help="with --check: exit 1 on unsourced figures too")
    p.add_argument("--collect", metavar="RUN_DIR", help="add a compare/sweep output folder's runs to the records")
    p.add_argument("--study", help="records file to collect into (docs/results/records/STUDY.jsonl)")
    p.add_argument("--runs", metavar="LABEL[,LABEL]", help="with --collect: only the runs with these labels")
    p.add_argument("--plots", metavar="STUDY[,STUDY]", help="write curves and payload plots to docs/results/")
    p.add_argument("--docs", metavar="DIR", help="the docs folder to read records from and write tables to "
                   "(its *.md and results/records; default: this repository's docs/)")
    p.set_defaults(func=lambda a: (_need_study(a), cmd_report(a))[1])


def _need_study(args):
    if args.collect and not args.study:
        print("dobb-bench report: error: --collect needs --study NAME", file=sys.stderr)
        raise SystemExit(2)
