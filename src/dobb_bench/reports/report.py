"""Reports for benchmark runs: a markdown table and PNG plots (matplotlib, Agg backend).

Why: ``compare`` is read by people, so its results must be a table they can paste (final val
loss, throughput, optimizer time, memory) plus the two pictures the paper leads with: validation
loss against step, and final loss against the optimizer-specific cross-shard payload relative to
Muon (Fig. 1). The payload ratios come from the caller (``payload``: a function of the optimizer,
its hparams and the shapes, ``dobb_bench.cost.payload.relative_payload`` in ``dobb-bench compare``):
this module presents what the layers above it compute and imports none of them.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import dobb.registry

from dobb_bench.bench_entries import BENCH_ENTRIES
from dobb_bench.specs import parse_value


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, spec)


def final_loss(f: dict) -> float:
    v = f.get("final_val_loss")
    return math.inf if v is None or f.get("diverged") or not math.isfinite(v) else v


def results_markdown(finals: list[dict], *, grid: bool, shared_lr: float | None,
                     row_lrs: dict[str, float] | None = None) -> str:
    """One row per optimizer label. With ``grid``: shared-lr loss and best-of-grid (lr, loss).
    ``row_lrs``: each label's own lr (compare's rows), which then takes the shared lr's place."""
    by_label: dict[str, list[dict]] = defaultdict(list)
    for f in finals:
        by_label[f["run"]].append(f)

    def at_own_lr(label, runs):
        lr = (row_lrs or {}).get(label, shared_lr)
        return next((r for r in runs if lr is not None and abs(r["lr"] - lr) < 1e-12), None)

    head = ["optimizer"]
    if grid and row_lrs:
        head += ["row lr", "val loss @ row lr", "best lr", "best val loss"]
    elif grid and shared_lr is not None:
        head += [f"val loss @ lr {shared_lr:.3g}", "best lr", "best val loss"]
    elif grid:
        head += ["best lr", "best val loss"]
    else:
        head += ["lr", "final val loss"]
    head += ["gap closure", "block widths", "bits/byte", "tokens/s", "opt ms/step", "peak mem MB", "opt state MB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ref_loss(label):
        runs = by_label.get(label)
        if not runs:
            return None
        v = final_loss(at_own_lr(label, runs) or min(runs, key=final_loss))
        return None if v == math.inf else v

    adamw, muon = ref_loss("AdamW"), ref_loss("Muon")
    one_seed = len({(f.get("train") or {}).get("seed") for f in finals}) == 1
    for label, runs in by_label.items():
        best = min(runs, key=final_loss)
        shared = at_own_lr(label, runs)
        ref = shared or best
        cells = [label]
        if grid and row_lrs:
            cells += [_fmt(row_lrs.get(label), ".3g"), _cell_loss(shared), _fmt(best["lr"], ".3g"), _cell_loss(best)]
        elif grid and shared_lr is not None:
            cells += [_cell_loss(shared), _fmt(best["lr"], ".3g"), _cell_loss(best)]
        elif grid:
            cells += [_fmt(best["lr"], ".3g"), _cell_loss(best)]
        else:
            cells += [_fmt(ref["lr"], ".3g"), _cell_loss(ref)]
        gc = gap_closure(final_loss(ref), adamw, muon) if final_loss(ref) < math.inf else None
        near = gc is not None and one_seed and min(abs(final_loss(ref) - adamw), abs(final_loss(ref) - muon)) <= ONE_SEED_NOISE
        cells += ["—" if gc is None or label in ("AdamW", "Muon") else f"{100 * gc:.0f}%"
                  + (" (within noise)" if near else ""),
                  block_widths(ref["optimizer"], ref.get("hparams", {}), ref.get("model", {})) or "—"]
        cells += [_fmt(ref.get("final_val_bpb"), ".4f"), _fmt(ref.get("tokens_per_s"), ".0f"),
                  _fmt(ref.get("opt_ms_per_step"), ".2f"), _fmt(ref.get("peak_mem_mb"), ".0f"),
                  _fmt(ref.get("opt_state_mb"), ".2f")]
        rows.append("| " + " | ".join(cells) + " |")
    f0 = finals[0]
    m, t = f0.get("model", {}), f0.get("train", {})
    rows.append("")
    rows.append(f"Model {m.get('layers')}/{m.get('width')}/{m.get('heads')} (layers/width/heads), "
                f"{f0.get('n_params')} parameters; {t.get('steps')} steps x {t.get('batch_size')} sequences "
                f"x {t.get('seq_len') or m.get('seq_len')} tokens; seed {t.get('seed')}; device {f0.get('device')}"
                f" ({f0.get('world')} process(es), dist {f0.get('dist')}, {f0.get('threads')} thread(s)). Loss in nats/token on fixed "
                "held-out sequences; opt ms/step times optimizer.step() only, first step excluded; "
                "peak mem is the max RSS of the run's process on CPU (with --no-isolate, a high-water "
                "mark shared by the runs before it) or max allocated CUDA memory. Gap closure = "
                f"(AdamW - x) / (AdamW - Muon) at {'each row' + chr(39) + 's own lr' if row_lrs else 'the shared lr'}"
                f"{'' if len({(f.get('train') or {}).get('seed') for f in finals}) > 1 else _ONE_SEED}; block widths: attention and MLP-in / "
                "MLP-out input (input side), or attention-out and MLP-out / MLP-in / fused qkv output "
                "(output side).")
    return "\n".join(rows) + "\n"


# The Findings' noise rule for one seed (dobb_bench.reports.tables.noise with no spread known)
ONE_SEED_NOISE = 0.1
_ONE_SEED = (f" (one seed: a loss difference under {ONE_SEED_NOISE:g} nats, and the gap closure it moves, "
             "is within noise)")


def _cell_loss(f: dict | None) -> str:
    if f is None:
        return "n/a"
    return "diverged" if f.get("diverged") else _fmt(f.get("final_val_loss"), ".4f")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(records: list[dict], path: Path) -> str:
    """Validation loss vs step, one line per run (label, plus lr when a label has several)."""
    plt = pyplot()
    curves: dict[tuple, list] = defaultdict(list)
    for r in records:
        if r.get("type") == "eval" and r.get("val_loss") is not None:
            curves[(r["run"], r["lr"])].append((r["step"], r["val_loss"]))
    labels = defaultdict(int)
    for run, _ in curves:
        labels[run] += 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, ((run, lr), pts) in enumerate(curves.items()):  # color x line style: 40 distinct lines
        pts.sort()
        name = f"{run} (lr {lr:.3g})" if labels[run] > 1 else run
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[(2 * i) % 20 + (i // 10) % 2],
                linestyle=("-", "--")[(i // 20) % 2], marker=".", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    finals = [pts[-1][1] for pts in curves.values() if pts]
    if finals:  # zoom on the end of training, where optimizers differ
        lo, hi = min(finals), max(finals)
        everything = max(v for pts in curves.values() for _, v in pts)
        top = min(everything, lo + max(1.0, 4 * (hi - lo)))
        ax.set_ylim(lo - 0.05 * (top - lo), top + 0.02 * (top - lo))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"validation curves: {path.name}"


def plot_payload(finals: list[dict], shapes: list[tuple[int, int]], path: Path, *, payload: Callable) -> str:
    """Fig. 1-style scatter: final loss vs cross-shard payload relative to Muon (``payload(optimizer,
    hparams, shapes)``, e.g. ``dobb_bench.cost.payload.relative_payload``)."""
    relative_payload = payload
    points = []
    for f in finals:
        if final_loss(f) == math.inf:
            continue
        try:
            ratio = relative_payload(f["optimizer"], typed_hparams(f.get("hparams", {})), shapes)
        except (ValueError, KeyError, TypeError) as exc:
            return f"payload scatter skipped: {exc}"
        points.append((f["run"], ratio, final_loss(f)))
    best = {}
    for label, ratio, loss in points:  # one point per label: its best lr
        if label not in best or loss < best[label][1]:
            best[label] = (ratio, loss)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, (ratio, loss) in best.items():
        ax.scatter([ratio], [loss])
        ax.annotate(label, (ratio, loss), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("optimizer-specific cross-shard payload / Muon's")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"payload scatter: {path.name}"


def typed_hparams(hparams: dict) -> dict:
    """Hyperparameters come back from JSON as strings: typed again by the spec grammar's one rule
    (``dobb_bench.specs.parse_value``: ``"4"`` -> 4, ``"True"`` -> True, ``"torch.float32"`` -> dtype)."""
    return {k: parse_value(k, v) if isinstance(v, str) else v for k, v in hparams.items()}


# ----- normalised reading of a loss table ----------------------------------------------------------
# The axis each optimizer blocks by default (dobb_bench.bench_entries' blocks_side; absent: it does not block)
_BLOCKED = {name: e.blocks_side for name, e in BENCH_ENTRIES.items() if e.blocks_side}


def block_widths(optimizer: str, hparams: dict, model: dict) -> str | None:
    """Block widths per matrix kind, e.g. ``"32 / 128 (attn+MLP-in / MLP-out input)"``; None if unblocked.

    Dobb's input side blocks each matrix's input axis: width ``d`` for q/k/v, attention-out and
    MLP-in, ``4d`` for MLP-out. The output side (Dobb-G; block Muon axis=0) blocks the output
    axis: ``3d`` (fused qkv), ``d``, ``4d``, ``d``. ``side``/``axis`` in ``hparams`` override.
    """
    side = _BLOCKED.get(optimizer)
    if side is None:
        return None
    hp = typed_hparams(hparams)
    if "side" in hp:
        side = hp["side"]
    if optimizer == "block-muon" and str(hp.get("axis", 1)) == "0":
        side = "output"
    if optimizer == "muonbp" and str(hp.get("axis", 0)) == "1":  # its block steps' axis (default rows)
        side = "input"
    blocks = int(hp.get("blocks", 4 if optimizer in ("block-muon", "muonbp") else 1))
    d = int(model.get("width", 0))
    if not d:
        return None

    def w(n, b=blocks):
        return str(math.ceil(n / b))

    if side == "input":
        return f"{w(d)} / {w(4 * d)}"
    if side == "both":  # two-sided: the input side's blocks, then the output side's (out_blocks)
        bo = int(hp.get("out_blocks", 1))
        return f"{w(d)} / {w(4 * d)} in, {w(d, bo)} / {w(4 * d, bo)} / {w(3 * d, bo)} out"
    return f"{w(d)} / {w(4 * d)} / {w(3 * d)}"


def block_width_note(optimizer: str, hparams: dict | None = None) -> str:
    side = _BLOCKED.get(optimizer)
    side = typed_hparams(hparams or {}).get("side", side)
    if side == "both":
        return ("input axis: attention and MLP-in / MLP-out; output axis: attention-out and MLP-out / "
                "MLP-in / fused qkv")
    return ("input axis: attention and MLP-in / MLP-out" if side == "input"
            else "output axis: attention-out and MLP-out / MLP-in / fused qkv")


def gap_closure(x: float, adamw: float, muon: float) -> float | None:
    """(AdamW - x) / (AdamW - Muon): 0 = AdamW, 1 = Muon; None when the gap is not positive."""
    if None in (x, adamw, muon) or not adamw > muon:
        return None
    return (adamw - x) / (adamw - muon)


def plain_summary(finals: list[dict], shapes: list[tuple[int, int]], noise: float | None = None, *,
                  payload: Callable) -> str:
    """Where each Dobb row lands against AdamW, Muon and Dion (nearest payload), in plain words.

    One row per label (its first run: compare's row at its own lr). Verdicts follow the Findings'
    noise rule (``dobb_bench.reports.tables.noise``, whose floor ``ONE_SEED_NOISE`` is defined
    here): with one seed no spread is known, so a
    difference under ``noise`` (0.1 nats) is within noise, and neither a lead nor a gap closure is
    claimed from it. That bar is a floor, not a bound: a run that leaves the loss plateau late can
    differ from its other seeds by more (docs/results.md). ``payload(optimizer, hparams, shapes)``:
    a row's payload relative to Muon's (``dobb_bench.cost.payload.relative_payload``).
    """
    relative_payload = payload  # payload(optimizer, hparams, shapes): relative to Muon's
    noise = ONE_SEED_NOISE if noise is None else noise  # tables.noise(None, None): one seed, no spread known
    rows = {}
    for f in finals:
        rows.setdefault(f["run"], f)
    loss = {k: final_loss(f) for k, f in rows.items()}
    adamw, muon = loss.get("AdamW"), loss.get("Muon")
    pay = {}
    for k, f in rows.items():
        try:
            pay[k] = relative_payload(f["optimizer"], typed_hparams(f.get("hparams", {})), shapes)
        except (ValueError, KeyError, TypeError):
            pay[k] = None
    dions = [k for k, f in rows.items() if f["optimizer"] == "dion" and loss[k] < math.inf]

    def versus(x, other, name):
        if other is None:
            return f"{name}: not in this run"
        if other == math.inf:
            return f"{name}: no finite result"
        d = x - other
        if abs(d) <= noise:
            return f"within noise of {name} ({d:+.3f}; one seed cannot tell apart less than {noise:g} nats)"
        return f"{abs(d):.3f} {'ahead of' if d < 0 else 'behind'} {name} (beyond one-seed noise)"

    lines = [f"Summary (one seed, each row at its lr above; by the Findings' noise rule a difference under "
             f"{noise:g} nats is within noise):"]
    for k, f in rows.items():
        entry = dobb.registry.OPTIMIZERS.get(f["optimizer"])
        if entry is None or not entry.refreshes:  # the summary reads the Dobb family's rows
            continue
        x = loss[k]
        if x == math.inf:
            lines.append(f"- {k}: diverged.")
            continue
        bw = block_widths(f["optimizer"], f.get("hparams", {}), f.get("model", {}))
        gc = gap_closure(x, adamw, muon) if adamw not in (None, math.inf) and muon not in (None, math.inf) else None
        parts = [versus(x, adamw, "AdamW"), versus(x, muon, "Muon")]
        if dions and pay.get(k) is not None:
            near = min(dions, key=lambda d: abs((pay[d] or 0) - pay[k]))
            parts.append(versus(x, loss[near], f"{near} (the Dion row nearest in payload: "
                                               f"{pay[near]:.3f} of Muon's vs {pay[k]:.3f})"))
        lines.append(f"- {k} (lr {f.get('lr', math.nan):.3g}; blocks {bw} wide, "
                     f"{block_width_note(f['optimizer'], f.get('hparams'))}): loss {x:.3f}; "
                     + "; ".join(parts) + _closure_text(gc, x, adamw, muon, noise)
                     + f"; cost: {_cost(k, rows, pay)}.")
    ran = {k: d for k, f in rows.items() for d in [product_dtype(f)] if d}
    if ran:
        kinds = sorted(set(ran.values()))
        same = (f"every matrix row's products ran in {kinds[0]}, so the optimizer step costs above compare "
                "like with like" if len(kinds) == 1 else
                "the products ran in different dtypes (" + ", ".join(f"{k} {d}" for k, d in ran.items())
                + "), so the optimizer step costs above do not compare like with like")
        lines.append(f"- Product dtype: {same} (a bf16 row on a CPU without native bf16 would be emulated and slow).")
    return "\n".join(lines) + "\n"


def _closure_text(gc: float | None, x: float, adamw, muon, noise: float) -> str:
    """The gap closure, only where one seed can resolve it: the row is beyond noise of both ends."""
    if gc is None:
        return ""
    if abs(x - muon) <= noise or abs(x - adamw) <= noise:
        return (f"; gap closure {100 * gc:.0f}% is not resolved by one seed (within {noise:g} nats of "
                f"{'Muon' if abs(x - muon) <= noise else 'AdamW'})")
    return f"; closes {100 * gc:.0f}% of the AdamW-Muon gap (one seed; beyond noise of both)"


def product_dtype(final: dict) -> str | None:
    """The dtype a run's matrix products ran in, as its record names it (Newton-Schulz for the Muon
    family, projections for Dobb); ``None`` for rows without either (AdamW) or older records."""
    for g in final.get("optimizer_groups") or []:
        for key in ("ns_dtype_resolved", "product_dtype_resolved"):
            if g.get(key) and g.get("algorithm") != "adamw":
                return str(g[key]).replace("torch.", "")
    return None


def _cost(k: str, rows: dict[str, dict], pay: dict[str, float | None]) -> str:
    """A row's cost beside its loss: optimizer ms/step as measured in this run (and as a ratio to
    AdamW's and Muon's rows of the same run, the only comparison a shared machine supports), and
    its FSDP payload relative to Muon's (``relative_payload``'s default layout)."""
    ms = rows[k].get("opt_ms_per_step")
    bits = []
    if isinstance(ms, (int, float)) and math.isfinite(ms):
        ratios = [f"{ms / ref:.2f}x {name}'s" for name in ("AdamW", "Muon") if name in rows
                  for ref in [rows[name].get("opt_ms_per_step")] if isinstance(ref, (int, float)) and ref > 0]
        bits.append(f"optimizer step {ms:.1f} ms" + (f" ({', '.join(ratios)} in this run)" if ratios else ""))
    else:
        bits.append("optimizer step not timed")
    if pay.get(k) is not None:
        bits.append(f"FSDP payload {pay[k]:.3f} of Muon's")
    return ", ".join(bits)
