"""Summaries and reports of ``dobb-bench timing``: per-optimizer statistics from the raw repeats,
the markdown tables, the plot and the JSON lines (``timing.jsonl``, ``timing.md``, ``timing.png``).

Pure functions of the measured numbers (no optimizer runs here), so they can be re-run on a saved
result.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from dobb_bench.cost import payload as P


def stats(values: list[float]) -> dict | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    if len(vals) == 1:
        q1 = q3 = vals[0]
    else:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": statistics.median(vals), "q25": q1, "q75": q3, "min": vals[0], "max": vals[-1], "n": len(vals)}


def _iqr(q: dict | None) -> str:
    """``median [q25, q75]`` of a stats dict; ``–`` without one (a record from before the field)."""
    return "–" if not q else f"{q['median']:.2f} [{q['q25']:.2f}, {q['q75']:.2f}]"


def summarize(entry, live, shapes, dtype: str, metered, dist_ctx=None) -> dict:
    """The summary record of one ``timing_run.Entry``: step-time statistics over its repeats,
    ratio to torch AdamW in the same repeats, measured and derived state sizes."""
    spec = entry.spec
    out = {"kind": "summary", "label": spec.label, "name": spec.name, "hparams": jsonable(spec.hparams)}
    if entry.skipped is not None:
        out["skipped"] = entry.skipped
        return out
    reps = entry.reps
    ref = next(e for e in live if e.spec.name == "torch-adamw")
    amort = [statistics.fmean(t for _, t in steps) for steps in reps]
    refresh = [statistics.fmean(t for r, t in steps if r) if any(r for r, _ in steps) else None for steps in reps]
    nonref = [statistics.fmean(t for r, t in steps if not r) if not all(r for r, _ in steps) else None for steps in reps]
    spread = [max(t for _, t in steps) / statistics.median(t for _, t in steps) for steps in reps if len(steps) > 1]
    ratio = [a / statistics.fmean(t for _, t in r) for a, r in zip(amort, ref.reps)]
    fused = next((e for e in live if e.spec.name == "torch-adamw-fused"), None)
    ratio_fused = (None if fused is None or fused.skipped is not None else
                   [a / statistics.fmean(t for _, t in r) for a, r in zip(amort, fused.reps)])
    name = P.canonical_name(spec.name)
    pbytes = torch.finfo(getattr(torch, dtype)).bits // 8
    derived = sum(P.derived_state_bytes(name, m, n, spec.hparams, pbytes) for _, (m, n) in shapes)
    per_rank = sum(P.derived_state_bytes(name, m, n, spec.hparams, pbytes, *(dist_ctx.shards(mat) if dist_ctx else (1, 1)))
                   for mat, (m, n) in shapes)
    out.update(
        cycle=entry.cycle, steps_per_repeat=entry.per_rep, has_refresh=entry.is_dobb,
        amortized_ms=stats(amort), refresh_ms=stats(refresh) if entry.is_dobb else None,
        nonrefresh_ms=stats(nonref) if entry.is_dobb else None,
        max_over_median=stats(spread), ratio_to_adamw=stats(ratio),
        ratio_to_fused_adamw=None if ratio_fused is None else stats(ratio_fused),
        state_bytes=entry.state_bytes, rss_delta_bytes=entry.rss_delta_bytes,
        derived_state_bytes=derived, derived_state_bytes_per_rank=per_rank,
        cuda_state_bytes=entry.cuda_state_bytes, cuda_peak_extra_bytes=entry.cuda_peak_extra_bytes,
        warmup_s=entry.warmup_s, metered=metered,
    )
    return out


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Headline numbers are the slowest rank's medians (a step ends when every rank is done)."""
    merged = []
    for i, s0 in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        out = dict(s0)
        if "skipped" not in s0:
            for key in ("amortized_ms", "refresh_ms", "nonrefresh_ms", "max_over_median", "ratio_to_adamw",
                        "ratio_to_fused_adamw"):
                vals = [r[key] for r in ranks if r.get(key)]
                out[key] = max(vals, key=lambda s: s["median"]) if vals else None
            out["per_rank"] = [{"rank": k, "amortized_ms": r["amortized_ms"], "refresh_ms": r["refresh_ms"],
                                "nonrefresh_ms": r["nonrefresh_ms"], "state_bytes": r["state_bytes"],
                                "metered": r.get("metered")} for k, r in enumerate(ranks)]
        merged.append(out)
    return merged


def jsonable(x):
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def _med(s, spec=".2f") -> str:
    return "–" if not s else format(s["median"], spec)


def timing_markdown(result: dict) -> str:
    run, sums = result["run"], [s for s in result["summaries"]]
    cfg = run["config"]
    ok = [s for s in sums if "skipped" not in s]
    model = f"GPT-2 {cfg['preset']}" + (f" layers {cfg['layers']}" if cfg.get("layers") else "")
    dev = run["machine"].get("gpu") or f"CPU ({run['machine'].get('cpu') or 'unknown'})"
    head = ["Model", "device", "DP", "FS", "TP", "procs"] + [s["label"] for s in ok]
    lines = ["Optimizer call, amortized over one cycle (ms, median over repeats; slowest rank):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| " + " | ".join([model, dev, str(cfg["dp"]), str(cfg["fs"]), str(cfg["tp"]), str(run["world"])]
                               + [_med(s["amortized_ms"]) for s in ok]) + " |", ""]
    head = ["method", "Non-refresh", "Refresh", "Amortized [IQR]", "x AdamW [IQR]", "x fused AdamW [IQR]",
            "max/median in cycle",
            "state MB (measured)", "state MB (derived)",
            "GPU alloc delta / peak MB" if cfg["device"] == "cuda" else "RSS delta MB", "reps x steps"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mb = 1 / 2**20
    for s in sums:
        if "skipped" in s:
            lines.append(f"| {s['label']} | skipped: {s['skipped']} |" + " |" * (len(head) - 2))
            continue
        a, r = s["amortized_ms"], s["ratio_to_adamw"]
        cells = [s["label"], _med(s["nonrefresh_ms"]), _med(s["refresh_ms"]),
                 f"{a['median']:.2f} [{a['q25']:.2f}, {a['q75']:.2f}]",
                 f"{r['median']:.2f} [{r['q25']:.2f}, {r['q75']:.2f}]", _iqr(s.get("ratio_to_fused_adamw")),
                 _med(s["max_over_median"]),
                 _fmt(s["state_bytes"] * mb, ".1f"), _fmt(s["derived_state_bytes_per_rank"] * mb, ".1f"),
                 _memory_cell(s, mb), f"{a['n']} x {s['steps_per_repeat']}"]
        lines.append("| " + " | ".join(cells) + " |")
    m = run["machine"]
    lines += ["", f"{run['matrices']} matrices ({run['entries'] / 1e6:.1f}M entries), dtype {cfg['dtype']}, "
              f"device {cfg['device']}, {m.get('threads')} thread(s), torch {m.get('torch')}. Optimizer call = "
              "optimizer.step() only (capture passes excluded); Dobb with check_finite=False. Repeats interleaved "
              "across optimizers; warm-up excluded. Derived state: AdamW 2mn, Muon mn, Dion mn + max(m,n) r (fp32), "
              "Dobb mn + 6 n^2/B bytes (fp32 statistic + bf16 basis, Table 18); per rank under FS x TP."]
    ratios = run.get("ratio_matrix") or {}
    if len(ratios) > 1:
        labels = list(ratios)
        lines += ["", "Time ratios row / column (median over repeats of the per-repeat ratio of cycle means"
                      + ("; rank 0" if run["world"] > 1 else "") + "):", "",
                  "| row / column | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        lines += ["| " + " | ".join([a] + [f"{ratios[a][b]:.3g}" for b in labels]) + " |" for a in labels]
    meters = [s for s in ok if s.get("metered")]
    if meters:
        lines += ["", "| method | step collectives | step bytes | next step collectives | next step bytes | "
                      "capture stat collectives | capture stat bytes |", "|---|---|---|---|---|---|---|"]
        for s in meters:
            mt = s["metered"]
            st, nx, cap = mt.get("step", {}), mt.get("next_step", {}), mt.get("capture_stat", {})
            lines.append(f"| {s['label']} | {st.get('collectives', '–')} | {st.get('bytes', '–')} | "
                         f"{nx.get('collectives', '–')} | {nx.get('bytes', '–')} | {cap.get('collectives', '–')} | "
                         f"{cap.get('bytes', '–')} |")
        lines.append("(payload meter on rank 0: one step not timed; 'step' is a refresh step for Dobb)")
    return "\n".join(lines) + "\n"


def _memory_cell(s: dict, mb: float) -> str:
    if s.get("cuda_state_bytes") is not None:
        return f"{s['cuda_state_bytes'] * mb:.1f} / {s['cuda_peak_extra_bytes'] * mb:.1f}"
    return _fmt(s["rss_delta_bytes"] * mb, ".1f")


def timing_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in result["summaries"] if "skipped" not in s]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(ok)), 4))
    xs = range(len(ok))
    med = [s["amortized_ms"]["median"] for s in ok]
    err = [[m - s["amortized_ms"]["q25"] for m, s in zip(med, ok)], [s["amortized_ms"]["q75"] - m for m, s in zip(med, ok)]]
    ax.bar(xs, med, yerr=err, capsize=3, color="#4c72b0", label="amortized (IQR)")
    for i, s in enumerate(ok):
        if s.get("refresh_ms"):
            ax.scatter([i], [s["refresh_ms"]["median"]], marker="^", color="#c44e52",
                       label="refresh step" if i == next(j for j, t in enumerate(ok) if t.get("refresh_ms")) else None)
        if s.get("nonrefresh_ms"):
            ax.scatter([i], [s["nonrefresh_ms"]["median"]], marker="v", color="#55a868",
                       label="non-refresh step" if i == next(j for j, t in enumerate(ok) if t.get("nonrefresh_ms")) else None)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([s["label"] for s in ok], rotation=20, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("optimizer.step() ms")
    cfg = result["run"]["config"]
    ax.set_title(f"GPT-2 {cfg['preset']} matrices, {cfg['device']}, DPxFSxTP {cfg['dp']}x{cfg['fs']}x{cfg['tp']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_timing(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timing.jsonl", out / "timing.md", out / "timing.png"]
    with open(paths[0], "w") as f:
        for rec in [result["run"], *result["summaries"], *result["reps"]]:
            f.write(json.dumps(jsonable(rec)) + "\n")
    paths[1].write_text(timing_markdown(result))
    if result.get("profiles"):
        prof = out / "profile.txt"
        prof.write_text("".join(f"=== {label}: {kind} step (torch.profiler, self time)\n{table}\n"
                                for label, tables in result["profiles"].items() for kind, table in tables.items()))
        paths.append(prof)
    try:
        timing_plot(result, out / "timing.png")
    except ImportError as exc:  # matplotlib is an optional (bench) dependency
        print(f"timing.png skipped: {exc}", file=sys.stderr)
        paths.remove(out / "timing.png")
    return paths
