"""``dobb-bench project``: the optimizer step at the paper's scale, from a model that can be checked.

Per rank and per ``optimizer.step()``, a method's time is the sum of four terms (no overlap):

- **HBM**: the element-wise bytes of the step on this rank's shard (``roofline.step_cost``'s
  counts: AdamW 28 bytes an entry, the Muon family and Dobb 20, plus Dobb's bf16 basis) over
  the HBM bandwidth;
- **matmul**: the FLOPs of the products (``roofline.step_cost``: Newton-Schulz quintic
  ``steps (4 a^2 b + 2 a^3)``, Dobb's projections ``4 rows k s`` and its refresh ``2 k s^2 +
  B (4/3) s^3``) over the dense peak of the dtype they run in (bf16: Newton-Schulz and Dobb's
  projections with a bf16 basis on a GPU; fp32: Dobb's refresh, Dion);
- **link**: each method's step collectives (logical entries from ``dobb_bench.cost.payload``)
  as bytes on the wire per rank over the link the group crosses (NVLink inside a node, the
  per-GPU InfiniBand link across nodes; ring collectives run at the slower link, an all-to-all
  sends to its on-node and off-node peers at once);
- **latency**: a fixed time per collective.

Layouts: FSDP2 shards dim 0 over ``fs`` ranks; TP column-parallel shards the output axis, row-
parallel the input axis (``dobb_bench.cost.matrices``' split); ``dp`` replicas repeat the step.
Owner compute spreads whole matrices over the ``fs x tp`` ranks of one replica (the busiest rank
bounds the step: ``max(total / ranks, largest matrix)``). Dobb's blocks are cut at shard
boundaries (the library's rule), so its block width is ``min(n / B, local width)``. Parameters
that are not hidden matrices (embeddings, norms, biases) are AdamW's in every method.

Every input (peak rates, bandwidths, latencies, shapes, hyperparameters, the published figures it
is compared with) is in ``projection_inputs.json`` beside this file, each with its source. The
model has no free parameter; nothing is fitted to the calibration points. It is a lower bound on
an implementation: kernels at peak, no launch or host overhead, no overlap lost.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dobb.baselines.dion import dion_rank
from dobb_bench.cost import payload as P
from dobb_bench.cost.matrices import _COLWISE
from dobb_bench.cost.roofline import _traffic as step_cost  # bytes and FLOPs only (no state bytes)
from dobb_bench.cost.shapes import gpt2_param_count, matrix_shapes

INPUTS = Path(__file__).with_name("projection_inputs.json")
ROOT = Path(__file__).resolve().parents[3]
RECORD = ROOT / "docs" / "results" / "cost" / "projection" / "projection.json"


# ----------------------------------------------------------------------------- inputs
def load_inputs(path: Path | str = INPUTS) -> dict:
    return json.loads(Path(path).read_text())


def _v(x):
    return x["value"] if isinstance(x, dict) else x


@dataclass(frozen=True)
class Hardware:
    bf16_flops: float
    fp32_flops: float
    hbm: float
    nvlink: float
    internode: float
    gpus_per_node: int
    lat_intra: float
    lat_inter: float

    @classmethod
    def from_inputs(cls, d: dict) -> "Hardware":
        return cls(_v(d["bf16_flops"]), _v(d["fp32_flops"]), _v(d["hbm_bytes_per_s"]), _v(d["nvlink_bytes_per_s"]),
                   _v(d["internode_bytes_per_s"]), int(_v(d["gpus_per_node"])), _v(d["latency_intra_s"]),
                   _v(d["latency_inter_s"]))


@dataclass(frozen=True)
class Layout:
    fs: int
    tp: int = 1
    dp: int = 1

    def __post_init__(self):
        for k in ("fs", "tp", "dp"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"layout {k} must be >= 1, got {getattr(self, k)}")


@dataclass(frozen=True)
class Matrix:
    name: str
    m: int
    n: int
    colwise: bool  # TP column-parallel (output axis split); else row-parallel (input axis split)


def model_matrices(spec: dict) -> tuple[list[Matrix], int]:
    """The hidden matrices of a model and the count of its other (AdamW) parameters."""
    if spec["kind"] == "gpt2":
        shapes = matrix_shapes(spec["preset"])
        mats = [Matrix(nm, m, n, nm.rsplit(".", 1)[-1] in _COLWISE) for nm, (m, n) in shapes]
        return mats, gpt2_param_count(spec["preset"]) - sum(x.m * x.n for x in mats)
    if spec["kind"] == "llama":
        d, f, L = spec["width"], spec["ffn"], spec["layers"]
        kv = d // spec["heads"] * spec["kv_heads"]
        gated = spec.get("gated", True)
        layer = [("q", d, d, True), ("k", kv, d, True), ("v", kv, d, True), ("o", d, d, False)]
        layer += ([("gate", f, d, True), ("up", f, d, True)] if gated else [("fc", f, d, True)])
        layer += [("down", d, f, False)]
        mats = [Matrix(f"h{i}.{nm}", m, n, c) for i in range(L) for nm, m, n, c in layer]
        other = spec["vocab"] * d * (1 if spec.get("tied") else 2) + d * (2 * L + 1)  # embeddings, RMSNorms
        return mats, other
    raise ValueError(f"unknown model kind {spec['kind']!r} (gpt2 or llama)")


def local_shape(x: Matrix, lay: Layout) -> tuple[float, float]:
    """This rank's ``rows x cols`` of ``x`` (TP first, then FSDP2's dim-0 shard)."""
    return x.m / (lay.fs * (lay.tp if x.colwise else 1)), x.n / (1 if x.colwise else lay.tp)


# ----------------------------------------------------------------------------- collectives
def _spans(size: int, stride: int, hw: Hardware) -> bool:
    return size * stride > hw.gpus_per_node


def ring_time(wire_bytes: float, size: int, stride: int, hw: Hardware, count: int = 1) -> tuple[float, float]:
    """(link s, latency s) of ring collectives (all-gather, all-reduce) moving ``wire_bytes`` per
    rank over a group of ``size`` ranks ``stride`` apart: the slowest link the ring crosses."""
    if size <= 1:
        return 0.0, 0.0
    inter = _spans(size, stride, hw)
    return wire_bytes / (hw.internode if inter else hw.nvlink), count * (hw.lat_inter if inter else hw.lat_intra)


def all_to_all_time(wire_bytes: float, size: int, stride: int, hw: Hardware, count: int = 1) -> tuple[float, float]:
    """(link s, latency s) of all-to-alls sending ``wire_bytes`` per rank spread evenly over the
    other ranks: on-node peers over NVLink and off-node peers over InfiniBand at the same time."""
    if size <= 1:
        return 0.0, 0.0
    on_node = max(1, min(size, hw.gpus_per_node // stride))
    intra = wire_bytes * (on_node - 1) / (size - 1)
    inter = wire_bytes * (size - on_node) / (size - 1)
    lat = hw.lat_inter if size > on_node else hw.lat_intra
    return max(intra / hw.nvlink, inter / hw.internode), count * lat


# ----------------------------------------------------------------------------- cost terms
def _zero() -> dict:
    return {"hbm_bytes": 0.0, "bf16_flops": 0.0, "fp32_flops": 0.0, "link_s": 0.0, "latency_s": 0.0}


def _add(a: dict, b: dict, scale: float = 1.0) -> dict:
    return {k: a[k] + scale * b[k] for k in a}


def seconds(c: dict, hw: Hardware) -> dict:
    """The four terms of a cost in seconds, and their sum."""
    t = {"hbm_s": c["hbm_bytes"] / hw.hbm, "matmul_s": c["bf16_flops"] / hw.bf16_flops + c["fp32_flops"] / hw.fp32_flops,
         "link_s": c["link_s"], "latency_s": c["latency_s"]}
    t["total_s"] = sum(t.values())
    return t


def _adamw_other(other: int, lay: Layout) -> dict:
    c = _zero()
    c["hbm_bytes"] = 28.0 * other / (lay.fs * lay.tp)  # roofline: read W, G, M, V, write W, M, V (fp32)
    return c


def _elementwise(name: str, mats, lay) -> dict:
    c = _zero()
    for x in mats:
        r, k = local_shape(x, lay)
        c["hbm_bytes"] += step_cost(name, 1, 1)["bytes"] * r * k  # bytes an entry (28 AdamW, 20 Muon) x entries
    return c


def _ns_flops(m: float, n: float) -> float:
    """Newton-Schulz quintic FLOPs on an ``m x n`` matrix (``roofline``'s count)."""
    return step_cost("muon", m, n)["flops"]


def cost_adamw(mats, lay, hw, hp) -> dict:
    return {"steady": _elementwise("adamw", mats, lay)}


def cost_owner_muon(mats, lay, hw, hp) -> dict:
    """Whole matrices to owners among the ``fs x tp`` ranks (all-to-all, ``ns_bytes`` an entry),
    NS5 there, results back: ``payload``'s ``2 mn`` per matrix."""
    c = _elementwise("muon", mats, lay)
    G = lay.fs * lay.tp
    flops = [_ns_flops(x.m, x.n) for x in mats]
    c["bf16_flops"] = max(sum(flops) / G, max(flops))
    logical = sum(P.payload_entries("owner-muon", x.m, x.n, sharded="output", shards=G) for x in mats)
    wire = logical / G * (G - 1) / G * hp.get("ns_bytes", 2)
    c["link_s"], c["latency_s"] = all_to_all_time(wire, G, 1, hw, count=2 * math.ceil(len(mats) / G))
    return {"steady": c}


def cost_gather_muon(mats, lay, hw, hp) -> dict:
    """Every rank all-gathers every matrix (``payload``'s dense ``mn``) and runs NS5 on all of them."""
    c = _elementwise("muon", mats, lay)
    G = lay.fs * lay.tp
    c["bf16_flops"] = sum(_ns_flops(x.m, x.n) for x in mats)
    logical = sum(P.payload_entries("muon", x.m, x.n, sharded="output", shards=G) for x in mats)
    c["link_s"], c["latency_s"] = ring_time(logical * (G - 1) / G * hp.get("grad_bytes", 4), G, 1, hw, count=len(mats))
    return {"steady": c}


def cost_placement_muon(mats, lay, hw, hp) -> dict:
    """Owner placement (MatrixFSDP, DMuon): whole matrices live on owners; no step collective."""
    G = lay.fs * lay.tp
    c = _zero()
    c["hbm_bytes"] = sum(step_cost("muon", x.m, x.n)["bytes"] for x in mats) / G
    flops = [_ns_flops(x.m, x.n) for x in mats]
    c["bf16_flops"] = max(sum(flops) / G, max(flops))
    return {"steady": c}


def cost_muonbp(mats, lay, hw, hp) -> dict:
    """NS5 on this rank's shard every step; owner-compute Muon's full step every ``period``."""
    block = _elementwise("muon", mats, lay)
    block["bf16_flops"] = sum(_ns_flops(*local_shape(x, lay)) for x in mats)
    full = cost_owner_muon(mats, lay, hw, hp)["steady"]
    p = int(hp["period"])
    return {"steady": block, "periodic": _add(_zero(), _add(full, block, -1.0)), "every": p}


def cost_dion2_shard(mats, lay, hw, hp) -> dict:
    """Dion2's row selection inside each shard: NS5 on the ``round(fraction r)`` heaviest local rows."""
    c = _elementwise("muon", mats, lay)
    for x in mats:
        r, k = local_shape(x, lay)
        c["bf16_flops"] += _ns_flops(max(1, round(hp["fraction"] * r)), k)
    return {"steady": c}


def cost_dion(mats, lay, hw, hp) -> dict:
    """Dion (calibration only) on row shards: ``8 r_loc n r + 4 (r_loc + n) r^2`` fp32 FLOPs
    (``roofline``'s count with the local rows), ``payload``'s ``r (m + n)`` all-reduced."""
    G = lay.fs * lay.tp
    c = _elementwise("muon", mats, lay)
    logical = 0.0
    for x in mats:
        r_loc, k = local_shape(x, lay)
        r = dion_rank(x.m, x.n, hp["rank_fraction"])
        c["fp32_flops"] += 8 * r_loc * k * r + 4 * (r_loc + k) * r * r
        c["hbm_bytes"] += 8 * max(x.m, x.n) * r  # Q (fp32) read and written
        logical += P.payload_entries("dion", x.m, x.n, {"rank_fraction": hp["rank_fraction"]}, shards=G)
    c["link_s"], c["latency_s"] = ring_time(2 * logical * (G - 1) / G * 4, G, 1, hw, count=2 * len(mats))
    return {"steady": c}


def _dobb_side(r: float, k: float, blocks: float, side: str) -> tuple[dict, dict]:
    """(steady, refresh) of one Dobb side on an ``r x k`` local shard from ``roofline.step_cost``."""
    hp = {"blocks": blocks, "side": side}
    steady = step_cost("dobb", r, k, {**hp, "refresh_every": math.inf})
    once = step_cost("dobb", r, k, {**hp, "refresh_every": 1})
    return steady, {key: once[key] - steady[key] for key in ("bytes", "flops")}


def cost_dobb(mats, lay, hw, hp, stat_sync: bool = True) -> dict:
    """One- (``kind="dobb"``, input side) or two-sided Dobb (``kind="dobb-both"``): projections
    in bf16 (the basis dtype), refresh (``A Q`` and Householder QR of every local block, on every
    rank holding it) in fp32, statistic all-reduce (``payload.dp_stat_entries``, fp32) over the
    data-parallel ``fs x dp`` ranks once per refresh; all three per step, the refresh divided by T."""
    both = hp.get("kind") == "dobb-both"
    steady, refresh = _zero(), _zero()
    stat_entries = 0.0
    for x in mats:
        r, k = local_shape(x, lay)
        s_in = min(x.n / hp["blocks"], k)
        st, rf = _dobb_side(r, k, k / s_in, "input")
        steady["hbm_bytes"] += st["bytes"]
        steady["bf16_flops"] += st["flops"]
        refresh["hbm_bytes"] += rf["bytes"]
        refresh["fp32_flops"] += rf["flops"]
        stat_hp = {"blocks": max(1, round(k / s_in))}
        if both:
            s_out = min(x.m / hp["out_blocks"], r)
            st2, rf2 = _dobb_side(r, k, r / s_out, "output")
            steady["hbm_bytes"] += st2["bytes"] - step_cost("muon", 1, 1)["bytes"] * r * k  # one momentum pass
            steady["bf16_flops"] += st2["flops"]
            refresh["hbm_bytes"] += rf2["bytes"]
            refresh["fp32_flops"] += rf2["flops"]
            stat_hp = {**stat_hp, "side": "both", "out_blocks": max(1, round(r / s_out))}
            stat_entries += P.dp_stat_entries("dobb", round(r), round(k), stat_hp)
        else:
            stat_entries += P.dp_stat_entries("dobb", round(r), round(k), stat_hp)
    G = lay.fs * lay.dp
    if stat_sync:
        refresh["link_s"], refresh["latency_s"] = ring_time(2 * stat_entries * (G - 1) / G * 4, G, lay.tp, hw)
    return {"steady": steady, "periodic": refresh, "every": int(hp["refresh_every"])}


COSTS = {"adamw": cost_adamw, "owner-muon": cost_owner_muon, "gather-muon": cost_gather_muon,
         "placement-muon": cost_placement_muon, "muonbp": cost_muonbp, "dion2-shard": cost_dion2_shard,
         "dion": cost_dion, "dobb": cost_dobb, "dobb-both": cost_dobb}


def project(method: dict, mats, other: int, lay: Layout, hw: Hardware, stat_sync: bool = True) -> dict:
    """Per-rank times (ms) of one method: the steady step, the periodic step (refresh or full
    step) where there is one, the amortized step, and the four terms of the amortized step."""
    kind = method["kind"]
    if kind not in COSTS:
        raise ValueError(f"unknown method kind {kind!r}; choose one of {', '.join(COSTS)}")
    extra = {"stat_sync": stat_sync} if kind.startswith("dobb") else {}
    parts = COSTS[kind](mats, lay, hw, method, **extra)
    steady = _add(parts["steady"], _adamw_other(other, lay))
    every = parts.get("every", 1)
    periodic = _add(steady, parts["periodic"]) if "periodic" in parts else None
    amort = _add(steady, parts["periodic"], 1.0 / every) if periodic is not None else steady
    t = seconds(amort, hw)
    out = {"steady_ms": 1e3 * seconds(steady, hw)["total_s"],
           "periodic_ms": None if periodic is None else 1e3 * seconds(periodic, hw)["total_s"],
           "every": every, "amortized_ms": 1e3 * t["total_s"]}
    out.update({k.replace("_s", "_ms"): 1e3 * v for k, v in t.items() if k != "total_s"})
    return out


# ----------------------------------------------------------------------------- the record
def build(inputs: dict) -> dict:
    """Projection rows and calibration rows from the inputs (deterministic, no machine state)."""
    hw_all = {k: Hardware.from_inputs(v) for k, v in inputs["hardware"].items()}
    models = {k: model_matrices(v) for k, v in inputs["models"].items()}
    pj = inputs["projection"]
    rows = []
    for model in pj["models"]:
        mats, other = models[model]
        for label, method in inputs["methods"].items():
            for lay in pj["layouts"]:
                L = Layout(lay["fs"], lay["tp"], lay["dp"])
                rows.append({"model": model, "method": label, "layout": lay["label"], "ranks": L.fs * L.tp * L.dp,
                             **project(method, mats, other, L, hw_all[pj["hardware"]])})
    calib = []
    for case in inputs["calibration"]:
        mats, other = models[case["model"]]
        L = Layout(**case["layout"])
        for pt in case["points"]:
            res = project(pt["method"], mats, other, L, hw_all[case["hardware"]], case.get("stat_sync_in_step", True))
            part = pt.get("part", "amortized")
            ms = {"steady": res["steady_ms"], "refresh": res["periodic_ms"], "amortized": res["amortized_ms"]}[part]
            calib.append({"case": case["label"], "published": pt["published"], "published_ms": pt["ms"],
                          "model": pt.get("model_label", pt["method"]["kind"]), "model_ms": ms,
                          "ratio": ms / pt["ms"], "terms": res})
    return {"kind": "projection", "rows": rows, "calibration": calib, "not_calibrated": inputs.get("not_calibrated", [])}


def _fmt(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def projection_markdown(rec: dict) -> str:
    layouts = list(dict.fromkeys(r["layout"] for r in rec["rows"]))
    out = ["| model | method | " + " | ".join(f"{x} ms" for x in layouts) + " | terms at " + layouts[0]
           + ": HBM / matmul / link / latency ms |", "|---|---|" + "---|" * (len(layouts) + 1)]
    by = {(r["model"], r["method"], r["layout"]): r for r in rec["rows"]}
    for model in dict.fromkeys(r["model"] for r in rec["rows"]):
        for method in dict.fromkeys(r["method"] for r in rec["rows"]):
            cells = [_fmt(by[model, method, x]["amortized_ms"]) for x in layouts]
            r0 = by[model, method, layouts[0]]
            terms = " / ".join(_fmt(r0[k]) for k in ("hbm_ms", "matmul_ms", "link_ms", "latency_ms"))
            out.append(f"| {model} | {method} | " + " | ".join(cells) + f" | {terms} |")
    prov = rec.get("provenance") or {}
    out += ["", f"Per rank, amortized over the refresh (Dobb, T = 9) or full-step (MuonBP, P = 5) period; "
            f"H100 SXM, 8 GPUs a node. Record `{RECORD.relative_to(ROOT)}` (revision {str(prov.get('git_rev'))[:7]}, "
            f"dirty {prov.get('git_dirty')}); command `{prov.get('command')}`; inputs "
            f"`src/dobb_bench/cost/projection_inputs.json`."]
    return "\n".join(out) + "\n"


def calibration_markdown(rec: dict) -> str:
    out = ["| published figure | ms | modelled as | model ms | model / published |", "|---|---|---|---|---|"]
    case = None
    for c in rec["calibration"]:
        if c["case"] != case:
            case = c["case"]
            out.append(f"| **{case}** | | | | |")
        out.append(f"| {c['published']} | {c['published_ms']:g} | {c['model']} | {_fmt(c['model_ms'])} | "
                   f"{c['ratio']:.2f}{' (> 2x off)' if not 0.5 <= c['ratio'] <= 2 else ''} |")
    for nc in rec.get("not_calibrated", []):
        out.append(f"| {nc['label']}: {nc['published']} | — | not modelled: {nc['why']} | — | — |")
    return "\n".join(out) + "\n"


def _record() -> dict:
    if not RECORD.exists():
        raise ValueError(f"no projection record at {RECORD}: run `dobb-bench project`")
    return json.loads(RECORD.read_text())


def table_projected() -> tuple[str, list[dict]]:
    rec = _record()
    return projection_markdown(rec), [rec]


def table_calibration() -> tuple[str, list[dict]]:
    rec = _record()
    return calibration_markdown(rec), [rec]


TABLES = {"projected-step": table_projected, "projected-calibration": table_calibration}


def plot(rec: dict, path: Path) -> Path:
    from dobb_bench.reports.report import _pyplot

    plt = _pyplot()
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


# ----------------------------------------------------------------------------- command
def cmd_project(args) -> int:
    from dobb_bench.provenance import provenance

    inputs = load_inputs(args.inputs)
    rec = build(inputs)
    rec["inputs"] = inputs
    rec["inputs_path"] = str(Path(args.inputs).resolve().relative_to(ROOT)) if Path(args.inputs).resolve().is_relative_to(ROOT) else str(args.inputs)
    rec["provenance"] = provenance(getattr(args, "argv", None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "projection.json").write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    if not args.no_plot:
        plot(rec, out / "projected_step.png")
    text = projection_markdown(rec) + "\n" + calibration_markdown(rec)
    (out / "projection.md").write_text(text)
    print(text, end="")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("project", help="model the optimizer step at the paper's scale (H100, GPT-2 XL, Llama-3-8B)")
    p.add_argument("--inputs", default=str(INPUTS), help="inputs JSON (default: the committed one beside the module)")
    p.add_argument("--out", default=str(RECORD.parent), help="folder for projection.json/.md and the plot")
    p.add_argument("--no-plot", action="store_true")
    p.set_defaults(func=cmd_project)
