"""Operating points: loss and step cost of each optimizer at each block count, from records.

Rules fixed before the operating-point runs were read (an example fixed in advance, not tuned):

- **plateau-stuck**: a run whose validation loss at step ``PLATEAU_STEP`` (150; from the record's eval
  curve) is above ``PLATEAU_LOSS`` (2.8 nats) sat on the early loss plateau. Stuck runs are counted
  and named in every table; they are never dropped.
- **row statistic**: the median over seeds (one stuck seed of three or five cannot move it much);
  mean ± sample std is printed beside it.
- **gap closure** ``(AdamW - x) / (AdamW - Muon)``: on the rows' medians, and per seed on the seeds
  that x, AdamW and Muon share (the spread of those is the honest error bar). AdamW is its seeds
  ``GAP_ADAMW_SEEDS`` (0, 1, 2), the set every gap closure in the docs divides by; its further seeds
  (3 and 4, study ``operating-point``) are listed under the tables, in no closure.

Costs come from two timing records made at a clean revision (``docs/results/operating-point/``):
``looptime.json`` (``dobb-bench looptime``: ``optimizer.step()`` inside the training loop of the loss
runs' model, every optimizer interleaved step by step in one process; median amortized ms over
cycles and the per-cycle ratio to torch AdamW) and ``fsdp4/timing.jsonl`` (``dobb-bench timing
--fs 4`` under torchrun: FSDP2 on 4 gloo ranks, GPT-2 Small layer 0). A row is on the Pareto front
of a cost when no other row has both a lower (or equal) median loss and a lower (or equal) cost,
one of them strictly.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from dobb_bench.reports import records as R
from dobb_bench.reports.tables import GAP_ADAMW_SEEDS

PLATEAU_STEP = 150
PLATEAU_LOSS = 2.8
SHARED_LR = 5e-3 * 2 ** -0.5
OP_DIR = R.RECORDS.parent / "operating-point"
LOSS_STUDIES = ("headline", "lr-grid", "block-width", "operating-point")

# (row = loss-record run label, looptime spec, FSDP2 timing label). Muon-type rows are timed with
# fp32 Newton-Schulz: bf16 is emulated on these AMD hosts (docs/timing.md); the loss rows of Muon and
# Block Muon B=16 ran bf16 NS, equal to fp32 NS to 1e-3 nats at 800 steps (study muon-fp32).
ROWS = [("AdamW", "torch-adamw", "torch-adamw"),
        ("Muon", "muon:ns_dtype=float32", "owner-muon:ns_dtype=float32")]
ROWS += [(f"Dobb B={b}", f"dobb:blocks={b}", f"dobb:blocks={b}") for b in (1, 2, 4, 8, 16)]
ROWS += [(f"Block Muon-fp32 B={b}", f"block-muon:blocks={b}:ns_dtype=float32",
          f"block-muon:blocks={b}:ns_dtype=float32") for b in (2, 4, 8)]
ROWS += [("Block Muon B=16", "block-muon:blocks=16:ns_dtype=float32", "block-muon:blocks=16:ns_dtype=float32")]
# FSDP2-only rows: the same update as the Muon row, other layouts
EXTRA_FSDP = [("Muon, DTensor layout (gathers every matrix on every rank)", "Muon", "muon:ns_dtype=float32")]


# ----------------------------------------------------------------------------- robust statistics
def loss_at(rec: dict, step: int) -> float | None:
    for s, v in rec.get("curve") or []:
        if s == step:
            return v
    return None


def is_stuck(rec: dict) -> bool | None:
    """True when the run sat on the plateau (rule above); None when its curve has no step 150."""
    v = loss_at(rec, PLATEAU_STEP)
    return None if v is None else v > PLATEAU_LOSS


def final(rec: dict) -> float | None:
    v = rec.get("final_val_loss")
    return None if v is None or rec.get("diverged") or not math.isfinite(v) else v


def summarize(recs: list[dict]) -> dict:
    """Per-seed losses, median, mean, std, seed count and stuck seeds of one row's runs."""
    by_seed = {r["seed"]: final(r) for r in recs}
    vals = [v for v in by_seed.values() if v is not None]
    return {"by_seed": by_seed, "n": len(vals),
            "median": statistics.median(vals) if vals else math.nan,
            "mean": statistics.fmean(vals) if vals else math.nan,
            "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "stuck": sorted(r["seed"] for r in recs if is_stuck(r))}


def gap(x: float, adamw: float, muon: float) -> float | None:
    if any(v is None or not math.isfinite(v) for v in (x, adamw, muon)) or not adamw > muon:
        return None
    return (adamw - x) / (adamw - muon)


def per_seed_gaps(row: dict, adamw: dict, muon: dict) -> dict[int, float | None]:
    seeds = sorted(set(row["by_seed"]) & set(adamw["by_seed"]) & set(muon["by_seed"]))
    return {s: gap(row["by_seed"][s], adamw["by_seed"][s], muon["by_seed"][s]) for s in seeds}


def pareto(points: dict[str, tuple[float, float]]) -> set[str]:
    """Names of the (cost, loss) points no other point dominates (both <=, one <)."""
    front = set()
    for k, (c, lo) in points.items():
        if not any((c2 <= c and l2 <= lo and (c2 < c or l2 < lo)) for k2, (c2, l2) in points.items() if k2 != k):
            front.add(k)
    return front


# ----------------------------------------------------------------------------- records
def _setting_ok(r: dict) -> bool:
    m, t = r.get("model") or {}, r.get("train") or {}
    return (r.get("steps") == 800 and m.get("width") == 128 and m.get("layers") == 2
            and (r.get("corpus") or {}).get("name") == "stdlib" and t.get("micro_batches", 1) == 1
            and abs(r["lr"] - SHARED_LR) < 1e-12)


def loss_records(studies=LOSS_STUDIES, adamw_seeds=GAP_ADAMW_SEEDS) -> list[dict]:
    """Every 800-step, width-128 run at the shared lr in these studies, one record per run and seed;
    AdamW's only at ``adamw_seeds`` (None: every seed)."""
    seen = {}
    for s in studies:
        try:
            recs = R.load(s)
        except ValueError:
            continue
        for r in recs:
            if _setting_ok(r) and (adamw_seeds is None or r["run"] != "AdamW" or r["seed"] in adamw_seeds):
                seen.setdefault(R.record_key(r), r)
    return list(seen.values())


def other_adamw_seeds() -> tuple[str, list[dict]]:
    """A sentence on AdamW's seeds outside ``GAP_ADAMW_SEEDS`` (losses, stuck or not), and their records."""
    extra = sorted((r for r in loss_records(adamw_seeds=None) if r["run"] == "AdamW" and r["seed"] not in GAP_ADAMW_SEEDS),
                   key=lambda r: r["seed"])
    if not extra:
        return "", []
    cells = ", ".join(f"seed {r['seed']}: {_f(final(r))}{' (stuck)' if is_stuck(r) else ''}" for r in extra)
    seeds = ", ".join(map(str, GAP_ADAMW_SEEDS))
    return (f" AdamW's further seeds, in no closure (every gap closure divides by AdamW seeds {seeds}): "
            f"{cells}."), extra


def by_row(recs: list[dict]) -> dict[str, dict]:
    groups = defaultdict(list)
    for r in recs:
        groups[r["run"]].append(r)
    return {k: summarize(v) for k, v in groups.items()}


def _load_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def looptime_costs(path: Path | None = None) -> tuple[dict[str, dict], dict | None]:
    rec = _load_json(path or OP_DIR / "looptime.json")
    if rec is None:
        return {}, None
    return {s["spec"]: s for s in rec["summaries"]}, rec


def fsdp_costs(path: Path | None = None) -> tuple[dict[str, dict], dict | None]:
    path = path or OP_DIR / "fsdp4" / "timing.jsonl"
    if not path.exists():
        return {}, None
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    run = next((x for x in lines if x.get("kind") == "run"), None)
    return {x["label"]: x for x in lines if x.get("kind") == "summary" and x.get("amortized_ms")}, run


def _payload(summary: dict | None) -> str | None:
    """Rank 0's metered ``step()`` collectives / bytes (a refresh step for Dobb), as in the record."""
    step = ((summary or {}).get("metered") or {}).get("step")
    return None if step is None else f"{step['collectives']} / {step['bytes']:,}"


def _ms(summary: dict | None) -> float | None:
    if not summary:
        return None
    a = summary.get("amortized_ms")
    return a.get("median") if isinstance(a, dict) else a


# ----------------------------------------------------------------------------- tables
def _f(x, spec=".3f", none="—"):
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def operating_rows(loop=None, fsdp=None) -> list[dict]:
    st = by_row(loss_records())
    loop = looptime_costs()[0] if loop is None else loop
    fsdp = fsdp_costs()[0] if fsdp is None else fsdp
    adamw, muon = st.get("AdamW"), st.get("Muon")
    out = []
    for row, lspec, fspec in ROWS + [(n, None, f) for n, _, f in EXTRA_FSDP]:
        s = st.get(row) or st.get(next((src for n, src, _ in EXTRA_FSDP if n == row), ""), None)
        ls = loop.get(lspec) if lspec else None
        out.append({"row": row, "stats": s, "loop_ms": _ms(ls),
                    "loop_x": (ls or {}).get("ratio_to_adamw", {}).get("median") if ls else None,
                    "fsdp_ms": _ms(fsdp.get(fspec)), "fsdp_spec": fspec, "loop_spec": lspec,
                    "fsdp_payload": _payload(fsdp.get(fspec)),
                    "gap": gap(s["median"], adamw["median"], muon["median"]) if s and adamw and muon else None})
    for key, col in (("loop_ms", "front_loop"), ("fsdp_ms", "front_fsdp")):
        pts = {r["row"]: (r[key], r["stats"]["median"]) for r in out
               if r[key] is not None and r["stats"] and r["stats"]["n"]}
        front = pareto(pts)
        for r in out:
            r[col] = r["row"] in front if r["row"] in pts else None
    return out


def operating_table() -> tuple[str, list[dict]]:
    recs = loss_records()
    loop, lrec = looptime_costs()
    fsdp, frun = fsdp_costs()
    rows = operating_rows(loop, fsdp)
    head = ["| optimizer | seeds (stuck) | final val loss: median | mean ± std | gap closure (medians) | "
            "loop ms/step [x AdamW] | front (loop) | FSDP2 4 ranks ms/step | front (FSDP2) | "
            "FSDP2 step collectives / bytes (rank 0; Dobb: a refresh step) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["stats"]
        seeds = "—" if not s else f"{s['n']}" + (f" ({', '.join(map(str, s['stuck']))} stuck)" if s["stuck"] else "")
        loss = "—" if not s else _f(s["median"])
        ms = "—" if not s else (f"{s['mean']:.3f} ± {s['std']:.3f}" if s["std"] is not None else _f(s["mean"]))
        g = "—" if r["gap"] is None or r["row"].startswith(("AdamW", "Muon")) else f"{100 * r['gap']:.0f}%"
        lp = "not timed" if r["loop_ms"] is None else f"{r['loop_ms']:.2f} [{_f(r['loop_x'], '.2f')}]"
        fs = "not timed" if r["fsdp_ms"] is None else f"{r['fsdp_ms']:.1f}"
        mark = {True: "**yes**", False: "no", None: "—"}
        head.append(f"| {r['row']} | {seeds} | {loss} | {ms} | {g} | {lp} | {mark[r['front_loop']]} | {fs} | "
                    f"{mark[r['front_fsdp']]} | {r['fsdp_payload'] or '—'} |")
    used = [r for r in recs if r["run"] in {x["row"] for x in rows}]
    foot = [""]
    revs = sorted({(r.get("provenance") or {}).get("git_rev", "?")[:7] for r in used})
    foot.append(f"Loss: {len(used)} runs (2 layers, width 128, context 64, 800 steps, lr {SHARED_LR:.3g}, "
                f"stdlib corpus) at revision(s) {', '.join(revs)}; stuck = val loss > {PLATEAU_LOSS} at step "
                f"{PLATEAU_STEP}, counted, not dropped. Block Muon B=2/4/8 ran fp32 Newton-Schulz, Muon and "
                "Block Muon B=16 bf16 (equal to fp32 to 1e-3 nats, study muon-fp32); every Muon-type timing row "
                "is fp32 NS (bf16 is emulated on this CPU)." + other_adamw_seeds()[0])
    if lrec:
        p, c = lrec.get("provenance") or {}, lrec["config"]
        foot.append(f"Loop: `docs/results/operating-point/looptime.json` ({c.get('layers')} layers, width "
                    f"{c.get('width')}, vocab {c['vocab']}, {c['batch']} x {c['seq_len']} tokens; {c['cycles']} "
                    f"cycles of {c['cycle_len']} steps, interleaved; revision {p.get('git_rev', '?')[:7]}, dirty "
                    f"{p.get('git_dirty')}, {(p.get('machine') or {}).get('cpu')}); median amortized ms over "
                    "cycles, [median per-cycle ratio to torch AdamW].")
    if frun:
        p = frun.get("provenance") or {}
        foot.append(f"FSDP2: `docs/results/operating-point/fsdp4/timing.jsonl` (GPT-2 Small layer 0, "
                    f"{frun.get('world')} gloo ranks, `optimizer.step()` only, slowest rank; revision "
                    f"{p.get('git_rev', '?')[:7]}, dirty {p.get('git_dirty')}). Muon's FSDP2 cell is "
                    "owner-compute Muon; torchtitan's DistMuon cannot be built on CPU/gloo "
                    "(`tests/distributed/test_titan_muon.py`).")
    return "\n".join(head + foot) + "\n", used + other_adamw_seeds()[1]


def robust_table(order: list[str] | None = None) -> tuple[str, list[dict]]:
    """Per row: per-seed losses (stuck marked), median, mean ± std, gap closures (medians, per seed)."""
    recs = loss_records()
    st = by_row(recs)
    adamw, muon = st.get("AdamW"), st.get("Muon")
    names = [k for k in (order or []) if k in st] + sorted(k for k in st if k not in (order or []))
    stuck_of = {(r["run"], r["seed"]) for r in recs if is_stuck(r)}
    out = ["| optimizer | per-seed loss (seed: loss; * stuck) | median | mean ± std | gap closure: medians | "
           "per seed | mean (for comparison) |", "|---|---|---|---|---|---|---|"]
    for k in names:
        s = st[k]
        cells = ", ".join(f"{seed}: {_f(v)}{'*' if (k, seed) in stuck_of else ''}" for seed, v in sorted(s["by_seed"].items()))
        gm = gap(s["median"], adamw["median"], muon["median"]) if adamw and muon else None
        ga = gap(s["mean"], adamw["mean"], muon["mean"]) if adamw and muon else None
        ps = per_seed_gaps(s, adamw, muon) if adamw and muon else {}
        psc = ", ".join(f"{seed}: {'—' if g is None else f'{100 * g:.0f}%'}" for seed, g in ps.items()) or "—"
        ref = k in ("AdamW", "Muon")
        std = f"{s['mean']:.3f} ± {s['std']:.3f}" if s["std"] is not None else _f(s["mean"])
        out.append(f"| {k} | {cells} | {_f(s['median'])} | {std} | "
                   f"{'—' if ref or gm is None else f'{100 * gm:.0f}%'} | {'—' if ref else psc} | "
                   f"{'—' if ref or ga is None else f'{100 * ga:.0f}%'} |")
    out.append("")
    note, extra = other_adamw_seeds()
    out.append(f"Stuck: val loss above {PLATEAU_LOSS} at step {PLATEAU_STEP} (rule fixed before the new runs were "
               "read). Per-seed gap closure uses the same seed's AdamW and Muon." + note)
    return "\n".join(out) + "\n", recs + extra


def block_width_robust() -> tuple[str, list[dict]]:
    """The block-width penalty on medians: (median Dobb B - median Dobb B=1) / (median AdamW - median Muon)."""
    recs = [r for r in R.load("block-width") if r.get("steps") == 800
            and (r["run"] != "AdamW" or r["seed"] in GAP_ADAMW_SEEDS)]
    out = ["| model width | B | block width (attn+MLP-in) | Dobb median | penalty / gap (medians) | "
           "penalty / gap (means) | AdamW seeds (stuck) |", "|---|---|---|---|---|---|---|"]
    by_w = defaultdict(list)
    for r in recs:
        by_w[r["model"]["width"]].append(r)
    for w in sorted(by_w):
        st = by_row(by_w[w])
        a, mu, one = st.get("AdamW"), st.get("Muon") or st.get("Muon-fp32"), st.get("Dobb B=1")
        if not (a and mu and one):
            continue
        dobb = sorted((k for k in st if k.startswith("Dobb B=")), key=lambda k: int(k.split("=")[1]))
        for k in dobb:
            b = int(k.split("=")[1])
            pm = (st[k]["median"] - one["median"]) / (a["median"] - mu["median"])
            pa = (st[k]["mean"] - one["mean"]) / (a["mean"] - mu["mean"])
            out.append(f"| {w} | {b} | {math.ceil(w / b)} | {_f(st[k]['median'])} | {pm:.2f} | {pa:.2f} | "
                       f"{a['n']}" + (f" ({', '.join(map(str, a['stuck']))})" if a["stuck"] else "") + " |")
    return "\n".join(out) + "\n", recs


# ----------------------------------------------------------------------------- plot
def plot(out_dir: Path | None = None) -> str:
    """Median loss against step time (loop and FSDP2 panels), seed range as bars, Pareto front joined."""
    from dobb_bench.reports.report import pyplot

    plt = pyplot()
    rows = operating_rows()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, key, front, title in ((axes[0], "loop_ms", "front_loop", "training loop, 1 process (looptime)"),
                                  (axes[1], "fsdp_ms", "front_fsdp", "FSDP2, 4 gloo ranks, GPT-2 Small layer 0")):
        pts = [r for r in rows if r[key] is not None and r["stats"] and r["stats"]["n"]]
        for r in pts:
            vals = [v for v in r["stats"]["by_seed"].values() if v is not None]
            fam = "C0" if r["row"].startswith("Dobb") else "C1" if "Block" in r["row"] else "C2" if "Muon" in r["row"] else "C3"
            ax.errorbar([r[key]], [r["stats"]["median"]],
                        yerr=[[r["stats"]["median"] - min(vals)], [max(vals) - r["stats"]["median"]]],
                        fmt="o" if r[front] else "s", color=fam, mfc=fam if r[front] else "white", capsize=3)
            ax.annotate(r["row"].replace("Block Muon-fp32", "BlockMuon").replace("Block Muon", "BlockMuon")
                        .replace(", DTensor layout (gathers every matrix on every rank)", " DTensor"),
                        (r[key], r["stats"]["median"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        fr = sorted((r[key], r["stats"]["median"]) for r in pts if r[front])
        if fr:
            ax.plot([p[0] for p in fr], [p[1] for p in fr], "k--", lw=1, label="Pareto front (filled markers)")
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("optimizer.step() ms (median, log scale)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final val loss, median over seeds (bars: seed range)")
    fig.tight_layout()
    out_dir = OP_DIR.parent if out_dir is None else out_dir
    path = Path(out_dir) / "operating_point.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


TABLES = {
    "operating-point": operating_table,
    "robust-headline": lambda: robust_table(["AdamW", "Muon", "Dobb B=1", "Dobb B=2", "Dobb B=4", "Dobb B=8",
                                             "Dobb B=16"]),
    "block-width-robust": block_width_robust,
}
