"""The projection's record: the fitted constants, the calibration against published points, the
docs tables and the plot (``dobb_bench.cost.projection`` re-exports every public name here)."""
from __future__ import annotations

import json
from pathlib import Path

from dobb_bench.cost.projection_costs import project
from dobb_bench.cost.projection_model import (RECORD, ROOT, Hardware, Layout, value_of, load_inputs,
                                              model_matrices, other_tensors)

def _point_ms(case: dict, pt: dict, models: dict, hw: Hardware, counts: dict) -> tuple[float, dict]:
    mats, other, tensors = models[case["model"]]
    res = project(pt["method"], mats, other, Layout(**case["layout"]), hw, case.get("stat_sync_in_step", True),
                  counts, tensors)
    part = pt.get("part", "amortized")
    return {"steady": res["steady_ms"], "refresh": res["periodic_ms"], "amortized": res["amortized_ms"]}[part], res


FITTABLE = ("kernel_s", "qr_s")


def fit_constants(inputs: dict) -> dict:
    """The per-kernel and per-QR costs, solved exactly from the points ``inputs["fit"]`` names
    (one point per constant; the model is linear in both: ``ms = base + K kernel_s + Q qr_s``)."""
    fits = inputs.get("fit", [])
    fixed = {k: v for k, v in inputs.get("fixed", {}).items() if k in FITTABLE}  # tests: constants given
    if len(fits) > 2 or {f["constant"] for f in fits} - set(FITTABLE) or len({f["constant"] for f in fits}) != len(fits):
        raise ValueError(f"fit: at most one point for each of {', '.join(FITTABLE)}")
    models = {k: (*model_matrices(v), other_tensors(v)) for k, v in inputs["models"].items()}
    counts = inputs["kernels"]["methods"]
    rows, rhs = [], []
    for f in fits:
        case = next(c for c in inputs["calibration"] if c["label"] == f["case"])
        pt = next(p for p in case["points"] if p["published"] == f["published"])
        hw0 = Hardware.from_inputs(inputs["hardware"][case["hardware"]])
        base = _point_ms(case, pt, models, hw0, counts)[0]
        coef = [_point_ms(case, pt, models, hw0.with_(**{c: 1e-3}), counts)[0] - base for c in FITTABLE]
        rows.append([coef[FITTABLE.index(f2["constant"])] for f2 in fits])
        rhs.append(pt["ms"] - base)
    if len(fits) == 1:
        sol = [rhs[0] / rows[0][0]]
    elif len(fits) == 2:
        det = rows[0][0] * rows[1][1] - rows[0][1] * rows[1][0]
        if det == 0:
            raise ValueError("fit: the two points do not determine the two constants")
        sol = [(rhs[0] * rows[1][1] - rows[0][1] * rhs[1]) / det, (rows[0][0] * rhs[1] - rows[1][0] * rhs[0]) / det]
    else:
        sol = []
    return {**fixed, **{f["constant"]: 1e-3 * v for f, v in zip(fits, sol)}}


def _per_fs(method: dict, case: dict) -> dict:
    """A method whose rank is stated per FSDP degree (``rank_per_fs``, ``rank_fraction_per_fs``: the
    value over the case's ``fs``), as one reading of the paper's Dion on Qwen3."""
    m = {k: v for k, v in method.items() if not k.endswith("_per_fs")}
    fs = case["layout"]["fs"]
    if "rank_per_fs" in method:
        m["rank"] = method["rank_per_fs"] / fs
    if "rank_fraction_per_fs" in method:
        m["rank_fraction"] = method["rank_fraction_per_fs"] / fs
    return m


def _is_fitted(inputs: dict, case: dict, pt: dict) -> str | None:
    for f in inputs.get("fit", []):
        if f["case"] == case["label"] and f["published"] == pt["published"]:
            return f["constant"]
    return None


def build(inputs: dict) -> dict:
    """Projection rows and calibration rows from the inputs (deterministic, no machine state)."""
    fitted = fit_constants(inputs)
    hw_all = {k: Hardware.from_inputs(v, fitted) for k, v in inputs["hardware"].items()}
    models = {k: (*model_matrices(v), other_tensors(v)) for k, v in inputs["models"].items()}
    counts = inputs["kernels"]["methods"]
    pj = inputs["projection"]
    rows = []
    for model in pj["models"]:
        mats, other, tensors = models[model]
        for label, method in inputs["methods"].items():
            for lay in pj["layouts"]:
                L = Layout(lay["fs"], lay["tp"], lay["dp"])
                rows.append({"model": model, "method": label, "layout": lay["label"], "ranks": L.fs * L.tp * L.dp,
                             **project(method, mats, other, L, hw_all[pj["hardware"]], True, counts, tensors)})
    calib = []
    for case in inputs["calibration"]:
        for pt in case["points"]:
            ms, res = _point_ms(case, pt, models, hw_all[case["hardware"]], counts)
            calib.append({"case": case["label"], "published": pt["published"], "published_ms": pt["ms"],
                          "model": pt.get("model_label", pt["method"]["kind"]), "model_ms": ms,
                          "ratio": ms / pt["ms"], "fitted": _is_fitted(inputs, case, pt),
                          "source": pt.get("source", case.get("source", "")), "terms": res,
                          **({"reading": pt["reading"]} if pt.get("reading") else {})})
    cases = {c["label"]: c for c in inputs["calibration"]}
    not_cal = []
    for nc in inputs.get("not_calibrated", []):
        nc = dict(nc)
        if nc.get("readings"):  # published points left out of the count: the model under each reading
            nc["reading_ratios"] = [
                {"label": rd["label"], "ratios": [_point_ms(cases[pt["label"]], {"method": _per_fs(rd["method"], cases[pt["label"]])},
                                                            models, hw_all[cases[pt["label"]]["hardware"]], counts)[0] / pt["ms"]
                                                  for pt in nc["cases"]]} for rd in nc["readings"]]
        not_cal.append(nc)
    return {"kind": "projection", "fitted": fitted, "rows": rows, "calibration": calib,
            "summary": {**_count(c for c in calib if not c["fitted"]),
                        "without_readings": _count(c for c in calib if not c["fitted"] and not c.get("reading"))},
            "not_calibrated": not_cal}


def _count(checks) -> dict:
    """Points, points within 2x and the median projected / published of ``checks``."""
    ratios = sorted(c["ratio"] for c in checks)
    return {"unfitted": len(ratios), "within_2x": sum(0.5 <= r <= 2 for r in ratios),
            "median_ratio": ratios[len(ratios) // 2] if ratios else None}


def short_ms(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


TERM_KEYS = ("hbm_ms", "matmul_ms", "link_ms", "latency_ms", "launch_ms", "qr_ms")


def _pct(rec: dict, key: str) -> str:
    hw = (rec.get("inputs") or load_inputs())["hardware"]["h100-sxm"]
    return f"{100 * value_of(hw.get(key, 1.0)):.0f}%"


def projection_markdown(rec: dict) -> str:
    layouts = list(dict.fromkeys(r["layout"] for r in rec["rows"]))
    out = ["| model | method | " + " | ".join(f"{x} ms" for x in layouts) + " | terms at " + layouts[0]
           + ": HBM / matmul / link / latency / launch / QR ms |", "|---|---|" + "---|" * (len(layouts) + 1)]
    by = {(r["model"], r["method"], r["layout"]): r for r in rec["rows"]}
    for model in dict.fromkeys(r["model"] for r in rec["rows"]):
        for method in dict.fromkeys(r["method"] for r in rec["rows"]):
            cells = [short_ms(by[model, method, x]["amortized_ms"]) for x in layouts]
            r0 = by[model, method, layouts[0]]
            terms = " / ".join(short_ms(r0[k]) for k in TERM_KEYS)
            out.append(f"| {model} | {method} | " + " | ".join(cells) + f" | {terms} |")
    prov = rec.get("provenance") or {}
    fit = rec.get("fitted", {})
    out += ["", f"Per rank, amortized over the refresh (Dobb, T = 9) or full-step (MuonBP, P = 5) period; "
            f"H100 SXM, 8 GPUs a node, products at {_pct(rec, 'bf16_efficiency')} (bf16) / "
            f"{_pct(rec, 'fp32_efficiency')} (fp32) of peak, "
            f"{1e6 * fit.get('kernel_s', 0):.2f} us a kernel and {1e6 * fit.get('qr_s', 0):.2f} us a QR factorization "
            f"(fitted, see the calibration). Record `{RECORD.relative_to(ROOT)}` (revision {str(prov.get('git_rev'))[:7]}, "
            f"dirty {prov.get('git_dirty')}); command `{prov.get('command')}`; inputs "
            f"`src/dobb_bench/cost/projection_inputs.json`."]
    return "\n".join(out) + "\n"


def calibration_markdown(rec: dict) -> str:
    out = ["| published point | source | fitted? | projected ms | published ms | projected / published |",
           "|---|---|---|---|---|---|"]
    case = None
    for c in rec["calibration"]:
        if c["case"] != case:
            case = c["case"]
            out.append(f"| **{case}** | | | | | |")
        fitted = f"**fitted** ({c['fitted']})" if c.get("fitted") else "no"
        miss = "" if c.get("fitted") or 0.5 <= c["ratio"] <= 2 else " (> 2x off)"
        out.append(f"| {c['published']} (model: {c['model']}) | {c.get('source', '')} | {fitted} | {short_ms(c['model_ms'])} | "
                   f"{c['published_ms']:g} | {c['ratio']:.2f}{miss} |")
    for nc in rec.get("not_calibrated", []):
        readings = "".join(f"; {rd['label']}: " + " / ".join(f"{r:.2f}" for r in rd["ratios"])
                           for rd in nc.get("reading_ratios", []))
        verb = "not counted" if readings else "not modelled"
        out.append(f"| {nc['label']}: {nc['published']} | — | {verb}: {nc['why']}{readings} | — | — | — |")
    s = rec.get("summary") or {}
    fit = rec.get("fitted", {})
    wo = s.get("without_readings") or {}
    out += ["", f"Fitted: {1e6 * fit.get('kernel_s', 0):.3g} us a kernel, {1e6 * fit.get('qr_s', 0):.3g} us a QR "
            f"factorization, each solved from the one point marked fitted. Of the {s.get('unfitted')} points not fitted, "
            f"{s.get('within_2x')} are within 2x; median projected / published {s.get('median_ratio', 0):.2f}."
            + (f" Without the points that rest on a chosen reading (Dion on Qwen3): {wo['within_2x']} of "
               f"{wo['unfitted']}, median {wo['median_ratio']:.2f}." if wo and wo.get("unfitted") != s.get("unfitted") else "")]
    return "\n".join(out) + "\n"


def committed_record() -> dict:
    if not RECORD.exists():
        raise ValueError(f"no projection record at {RECORD}: run `dobb-bench project`")
    return json.loads(RECORD.read_text())


def table_projected() -> tuple[str, list[dict]]:
    rec = committed_record()
    return projection_markdown(rec), [rec]


def table_calibration() -> tuple[str, list[dict]]:
    rec = committed_record()
    return calibration_markdown(rec), [rec]


TABLES = {"projected-step": table_projected, "projected-calibration": table_calibration}


def plot(rec: dict, path: Path) -> Path:
    from dobb_bench.reports.report import pyplot

    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in rec["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in rec["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), sharey=True)
    for ax, model in zip(axes, models):
        for i, method in enumerate(methods):
            pts = sorted((r["ranks"], r["amortized_ms"]) for r in rec["rows"]
                         if r["model"] == model and r["method"] == method and "TP" not in r["layout"])
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            tp = [r for r in rec["rows"] if r["model"] == model and r["method"] == method and "TP" in r["layout"]]
            for r in tp:
                ax.plot([r["ranks"] * (1.08 + 0.02 * i)], [r["amortized_ms"]], marker="x", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model}: FSDP2 (o), FSDP 32 x TP 8 (x, at 256)", fontsize=9)
        ax.set_xlabel("ranks (H100)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("projected optimizer step, ms per rank (amortized)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


