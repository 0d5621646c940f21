"""``dobb-bench project``: the optimizer step at scale, from a model that can be checked.

Per rank and per ``optimizer.step()``, a method's time is the sum of six terms (no overlap):

- **HBM**: the element-wise bytes of the step on this rank's shard (``roofline.step_cost``'s
  counts: AdamW 28 bytes an entry, the Muon family and Dobb 20, plus Dobb's bf16 basis) over
  the HBM bandwidth;
- **matmul**: the FLOPs of the products (``roofline.step_cost``: Newton-Schulz quintic
  ``steps (4 a^2 b + 2 a^3)``, Dobb's projections ``4 rows k s`` and its refresh ``2 k s^2 +
  B (4/3) s^3``) over a stated fraction of the dense peak of the dtype they run in (bf16:
  Newton-Schulz and Dobb's projections with a bf16 basis; fp32: Dobb's refresh, Dion);
- **link**: each method's step collectives (logical entries from ``dobb_bench.cost.payload``)
  as bytes on the wire per rank over the link the group crosses (NVLink inside a node, the
  per-GPU network link across nodes; ring collectives run at the slower link, an all-to-all
  sends to its on-node and off-node peers at once);
- **latency**: a fixed time per collective;
- **launch**: a per-kernel cost times the kernels the step launches. The counts per matrix, per
  group and per extra shape are the library's own, from a profiler trace
  (``dobb_bench.cost.kernels``; in the inputs under ``kernels``); the AdamW part of every method
  (embeddings, norms, biases) is charged torch's single-tensor path (the one DTensor parameters take);
- **QR**: a cost per Householder QR factorization (cuSOLVER runs each as a sequence of panel
  kernels; a batched call of ``b`` blocks is ``b`` of them): Dobb's refresh blocks, Dion's factor.

The per-kernel and per-QR costs are the model's only fitted constants, each fitted on one named
published point (``fit`` in the inputs; ``fit_constants``); every other calibration point is a
check the model was not fitted to.

Layouts: FSDP2 shards dim 0 over ``fs`` ranks; TP column-parallel shards the output axis, row-
parallel the input axis (``dobb_bench.cost.matrices``' split); ``dp`` replicas repeat the step.
Owner compute spreads whole matrices over the ``fs x tp`` ranks of one replica by the library's
greedy plan (``dobb.collectives.plan_owners`` on NS5 FLOPs); the busiest owner sets the step.
Dobb's blocks are cut at shard boundaries (the library's rule), so its block width is
``min(n / B, local width)``. Parameters that are not hidden matrices are AdamW's in every method.

Every input (peak rates, efficiencies, bandwidths, latencies, shapes, hyperparameters, kernel
counts, the published figures it is compared with) is in ``projection_inputs.json`` beside this
file, each with its source.
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
from dobb.collectives import plan_owners
from dobb_bench.cost.shapes import gpt2_param_count, matrix_shapes, preset

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
    bf16_eff: float = 1.0  # fraction of the dense peak a product reaches
    fp32_eff: float = 1.0
    kernel_s: float = 0.0  # per kernel launched (host dispatch and launch)
    qr_s: float = 0.0  # per Householder QR factorization

    @classmethod
    def from_inputs(cls, d: dict, fitted: dict | None = None) -> "Hardware":
        fitted = fitted or {}
        return cls(_v(d["bf16_flops"]), _v(d["fp32_flops"]), _v(d["hbm_bytes_per_s"]), _v(d["nvlink_bytes_per_s"]),
                   _v(d["internode_bytes_per_s"]), int(_v(d["gpus_per_node"])), _v(d["latency_intra_s"]),
                   _v(d["latency_inter_s"]), _v(d.get("bf16_efficiency", 1.0)), _v(d.get("fp32_efficiency", 1.0)),
                   fitted.get("kernel_s", 0.0), fitted.get("qr_s", 0.0))

    def with_(self, **kw) -> "Hardware":
        from dataclasses import replace

        return replace(self, **kw)


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
    if spec["kind"] == "gpt2" and "preset" in spec:
        shapes = matrix_shapes(spec["preset"])
        mats = [Matrix(nm, m, n, nm.rsplit(".", 1)[-1] in _COLWISE) for nm, (m, n) in shapes]
        return mats, gpt2_param_count(spec["preset"]) - sum(x.m * x.n for x in mats)
    if spec["kind"] == "gpt2":  # from a config.json: q, k, v, o d x d, fc f x d, proj d x f
        d, f, L = spec["width"], spec["ffn"], spec["layers"]
        layer = [("q", d, d, True), ("k", d, d, True), ("v", d, d, True), ("o", d, d, False),
                 ("fc", f, d, True), ("proj", d, f, False)]
        mats = [Matrix(f"h{i}.{nm}", m, n, c) for i in range(L) for nm, m, n, c in layer]
        other = (spec["vocab"] + spec["context"]) * d + L * (4 * d + f + 4 * d) + 2 * d  # biases, LayerNorms
        return mats, other
    if spec["kind"] == "llama":
        d, f, L = spec["width"], spec["ffn"], spec["layers"]
        hd = spec.get("head_dim") or d // spec["heads"]
        q, kv = hd * spec["heads"], hd * spec["kv_heads"]
        gated = spec.get("gated", True)
        layer = [("q", q, d, True), ("k", kv, d, True), ("v", kv, d, True), ("o", d, q, False)]
        layer += ([("gate", f, d, True), ("up", f, d, True)] if gated else [("fc", f, d, True)])
        layer += [("down", d, f, False)]
        mats = [Matrix(f"h{i}.{nm}", m, n, c) for i in range(L) for nm, m, n, c in layer]
        other = spec["vocab"] * d * (1 if spec.get("tied") else 2) + d * (2 * L + 1)  # embeddings, RMSNorms
        other += 2 * hd * L * bool(spec.get("qk_norm"))  # Qwen3's per-head q and k RMSNorms
        return mats, other
    raise ValueError(f"unknown model kind {spec['kind']!r} (gpt2 or llama)")


def other_tensors(spec: dict) -> int:
    """How many parameter tensors of a model are not hidden matrices (AdamW's, one kernel chain each)."""
    if spec["kind"] == "gpt2":
        return 10 * (preset(spec["preset"]).layers if "preset" in spec else spec["layers"]) + 4  # 6 biases + 2 LayerNorms a layer; wte, wpe, ln_f
    L = spec["layers"]
    return (2 + 2 * bool(spec.get("qk_norm"))) * L + (2 if spec.get("tied") else 3)  # norms; embeddings, head, final norm


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
    other ranks: on-node peers over NVLink and off-node peers over the network at the same time."""
    if size <= 1:
        return 0.0, 0.0
    on_node = max(1, min(size, hw.gpus_per_node // stride))
    intra = wire_bytes * (on_node - 1) / (size - 1)
    inter = wire_bytes * (size - on_node) / (size - 1)
    lat = hw.lat_inter if size > on_node else hw.lat_intra
    return max(intra / hw.nvlink, inter / hw.internode), count * lat


# ----------------------------------------------------------------------------- cost terms
TERMS = ("hbm_bytes", "bf16_flops", "fp32_flops", "link_s", "latency_s", "kernels", "qr")


def _zero() -> dict:
    return {k: 0.0 for k in TERMS}


def _add(a: dict, b: dict, scale: float = 1.0) -> dict:
    return {k: a[k] + scale * b[k] for k in a}


def seconds(c: dict, hw: Hardware) -> dict:
    """The six terms of a cost in seconds, and their sum."""
    t = {"hbm_s": c["hbm_bytes"] / hw.hbm,
         "matmul_s": c["bf16_flops"] / (hw.bf16_eff * hw.bf16_flops) + c["fp32_flops"] / (hw.fp32_eff * hw.fp32_flops),
         "link_s": c["link_s"], "latency_s": c["latency_s"], "launch_s": c["kernels"] * hw.kernel_s,
         "qr_s": c["qr"] * hw.qr_s}
    t["total_s"] = sum(t.values())
    return t


def kernel_count(counts: dict, label: str, part: str, mats: list) -> float:
    """Kernels of ``label``'s ``part`` step over ``mats`` (local shapes): ``per_group + per_matrix
    N + per_shape (S - 1)`` with ``S`` distinct shapes (``dobb_bench.cost.kernels``)."""
    if not mats:
        return 0.0
    c = counts[label][part]
    shapes = len({(round(r, 6), round(k, 6)) for r, k in mats})
    return c["per_group"] + c["per_matrix"] * len(mats) + c["per_shape"] * (shapes - 1)


def _adamw_other(other: int, tensors: int, lay: Layout, counts: dict) -> dict:
    c = _zero()
    c["hbm_bytes"] = 28.0 * other / (lay.fs * lay.tp)  # roofline: read W, G, M, V, write W, M, V (fp32)
    c["kernels"] = counts["adamw"]["steady"]["per_matrix"] * tensors  # torch's single-tensor path
    return c


def _locals(mats, lay) -> list[tuple[float, float]]:
    return [local_shape(x, lay) for x in mats]


def _elementwise(name: str, mats, lay) -> dict:
    c = _zero()
    for x in mats:
        r, k = local_shape(x, lay)
        c["hbm_bytes"] += step_cost(name, 1, 1)["bytes"] * r * k  # bytes an entry (28 AdamW, 20 Muon) x entries
    return c


def _ns_flops(m: float, n: float) -> float:
    """Newton-Schulz quintic FLOPs on an ``m x n`` matrix (``roofline``'s count)."""
    return step_cost("muon", m, n)["flops"]


def owner_plan(mats, ranks: int) -> tuple[list[int], int]:
    """The library's owner plan (NS5 FLOPs, longest first to the least loaded rank): the matrices
    of the busiest owner (indices) and how many owners hold at least one matrix."""
    flops = [_ns_flops(x.m, x.n) for x in mats]
    owner = plan_owners(flops, ranks)
    load = [0.0] * ranks
    for i, r in enumerate(owner):
        load[r] += flops[i]
    busiest = max(range(ranks), key=lambda r: (load[r], -r))
    return [i for i, r in enumerate(owner) if r == busiest], len(set(owner))


def cost_adamw(mats, lay, hw, hp, counts) -> dict:
    c = _elementwise("adamw", mats, lay)
    c["kernels"] = counts["adamw"]["steady"]["per_matrix"] * len(mats)
    return {"steady": c}


def cost_owner_muon(mats, lay, hw, hp, counts) -> dict:
    """Whole matrices to owners among the ``fs x tp`` ranks (all-to-all, ``ns_bytes`` an entry),
    NS5 there, results back: ``payload``'s ``2 mn`` per matrix. The busiest owner (the library's
    plan) sets the NS5 FLOPs and the kernels: momentum on every local shard, NS5 per shape it owns."""
    c = _elementwise("muon", mats, lay)
    G = lay.fs * lay.tp
    mine, _ = owner_plan(mats, G)
    c["bf16_flops"] = sum(_ns_flops(mats[i].m, mats[i].n) for i in mine)
    ck = counts["muon"]["steady"]
    owned_shapes = len({(mats[i].m, mats[i].n) for i in mine})
    c["kernels"] = ck["per_group"] + ck["per_matrix"] * len(mats) + ck["per_shape"] * max(owned_shapes - 1, 0)
    logical = sum(P.payload_entries("owner-muon", x.m, x.n, sharded="output", shards=G) for x in mats)
    wire = logical / G * (G - 1) / G * hp.get("ns_bytes", 2)
    c["link_s"], c["latency_s"] = all_to_all_time(wire, G, 1, hw, count=2)
    return {"steady": c}


def cost_gather_muon(mats, lay, hw, hp, counts) -> dict:
    """Every rank all-gathers every matrix (``payload``'s dense ``mn``) and runs NS5 on all of them."""
    c = _elementwise("muon", mats, lay)
    G = lay.fs * lay.tp
    c["bf16_flops"] = sum(_ns_flops(x.m, x.n) for x in mats)
    c["kernels"] = kernel_count(counts, "muon", "steady", [(x.m, x.n) for x in mats])
    logical = sum(P.payload_entries("muon", x.m, x.n, sharded="output", shards=G) for x in mats)
    c["link_s"], c["latency_s"] = ring_time(logical * (G - 1) / G * hp.get("grad_bytes", 4), G, 1, hw, count=len(mats))
    return {"steady": c}


def cost_placement_muon(mats, lay, hw, hp, counts) -> dict:
    """Owner placement (MatrixFSDP, DMuon): whole matrices live on owners; no step collective."""
    G = lay.fs * lay.tp
    mine, _ = owner_plan(mats, G)
    c = _zero()
    c["hbm_bytes"] = sum(step_cost("muon", mats[i].m, mats[i].n)["bytes"] for i in mine)
    c["bf16_flops"] = sum(_ns_flops(mats[i].m, mats[i].n) for i in mine)
    c["kernels"] = kernel_count(counts, "muon", "steady", [(mats[i].m, mats[i].n) for i in mine])
    return {"steady": c}


def _row_blocks(x: Matrix, lay: Layout, blocks: int) -> tuple[float, float, float]:
    """(block rows, columns, blocks on this rank) of row blocks cut at shard boundaries."""
    r, k = local_shape(x, lay)
    rows = min(x.m / blocks, r)
    return rows, k, r / rows


def cost_row_block_muon(mats, lay, hw, hp, counts) -> dict:
    """Row-block Muon: NS5 on each of ``blocks`` row blocks, cut at shard boundaries; no collective."""
    c = _elementwise("muon", mats, lay)
    for x in mats:
        rows, k, nb = _row_blocks(x, lay, int(hp["blocks"]))
        c["bf16_flops"] += nb * _ns_flops(rows, k)
    c["kernels"] = kernel_count(counts, "row-block-muon", "steady", _locals(mats, lay))
    return {"steady": c}


def cost_muonbp(mats, lay, hw, hp, counts) -> dict:
    """NS5 on this rank's shard every step; owner-compute Muon's full step every ``period``."""
    block = _elementwise("muon", mats, lay)
    block["bf16_flops"] = sum(_ns_flops(*local_shape(x, lay)) for x in mats)
    block["kernels"] = kernel_count(counts, "muonbp", "steady", _locals(mats, lay))
    full = cost_owner_muon(mats, lay, hw, hp, counts)["steady"]
    p = int(hp["period"])
    return {"steady": block, "periodic": _add(_zero(), _add(full, block, -1.0)), "every": p}


def cost_dion2_shard(mats, lay, hw, hp, counts) -> dict:
    """Dion2's row selection inside each shard: NS5 on the ``round(fraction r)`` heaviest local rows."""
    c = _elementwise("muon", mats, lay)
    for x in mats:
        r, k = local_shape(x, lay)
        c["bf16_flops"] += _ns_flops(max(1, round(hp["fraction"] * r)), k)
    c["kernels"] = kernel_count(counts, "dion2", "steady", _locals(mats, lay))
    return {"steady": c}


def cost_dion(mats, lay, hw, hp, counts) -> dict:
    """Dion (calibration only) on row shards: ``8 r_loc n r + 4 (r_loc + n) r^2`` fp32 FLOPs
    (``roofline``'s count with the local rows), ``payload``'s ``r (m + n)`` all-reduced, one QR a matrix."""
    G = lay.fs * lay.tp
    c = _elementwise("muon", mats, lay)
    logical = 0.0
    for x in mats:
        r_loc, k = local_shape(x, lay)
        frac = hp["rank"] / min(x.m, x.n) if "rank" in hp else hp["rank_fraction"]  # a fixed rank (r = 400)
        r = dion_rank(x.m, x.n, frac)
        c["fp32_flops"] += 8 * r_loc * k * r + 4 * (r_loc + k) * r * r
        c["hbm_bytes"] += 8 * max(x.m, x.n) * r  # Q (fp32) read and written
        logical += P.payload_entries("dion", x.m, x.n, {"rank_fraction": frac}, shards=G)
    c["kernels"] = kernel_count(counts, "dion", "steady", _locals(mats, lay))
    c["qr"] = counts["dion"]["steady"]["qr_per_matrix"] * len(mats)
    c["link_s"], c["latency_s"] = ring_time(2 * logical * (G - 1) / G * 4, G, 1, hw, count=2 * len(mats))
    return {"steady": c}


def _dobb_side(r: float, k: float, blocks: float, side: str) -> tuple[dict, dict]:
    """(steady, refresh) of one Dobb side on an ``r x k`` local shard from ``roofline.step_cost``."""
    hp = {"blocks": blocks, "side": side}
    steady = step_cost("dobb", r, k, {**hp, "refresh_every": math.inf})
    once = step_cost("dobb", r, k, {**hp, "refresh_every": 1})
    return steady, {key: once[key] - steady[key] for key in ("bytes", "flops")}


def cost_dobb(mats, lay, hw, hp, counts, stat_sync: bool = True) -> dict:
    """One- (``kind="dobb"``, input side) or two-sided Dobb (``kind="dobb-both"``): projections
    in bf16 (the basis dtype), refresh (``A Q`` and Householder QR of every local block, on every
    rank holding it) in fp32, statistic all-reduce (``payload.dp_stat_entries``, fp32) over the
    data-parallel ``fs x dp`` ranks once per refresh; all three per step, the refresh divided by T."""
    both = hp.get("kind") == "dobb-both"
    label = hp.get("kernels", "dobb-both" if both else "dobb-b4")
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
        refresh["qr"] += k / s_in
        stat_hp = {"blocks": max(1, round(k / s_in))}
        if both:
            s_out = min(x.m / hp["out_blocks"], r)
            st2, rf2 = _dobb_side(r, k, r / s_out, "output")
            steady["hbm_bytes"] += st2["bytes"] - step_cost("muon", 1, 1)["bytes"] * r * k  # one momentum pass
            steady["bf16_flops"] += st2["flops"]
            refresh["hbm_bytes"] += rf2["bytes"]
            refresh["fp32_flops"] += rf2["flops"]
            refresh["qr"] += r / s_out
            stat_hp = {**stat_hp, "side": "both", "out_blocks": max(1, round(r / s_out))}
            stat_entries += P.dp_stat_entries("dobb", round(r), round(k), stat_hp)
        else:
            stat_entries += P.dp_stat_entries("dobb", round(r), round(k), stat_hp)
    local = _locals(mats, lay)
    steady["kernels"] = kernel_count(counts, label, "steady", local)
    refresh["kernels"] = kernel_count(counts, label, "refresh", local) - steady["kernels"]
    G = lay.fs * lay.dp
    if stat_sync:
        refresh["link_s"], refresh["latency_s"] = ring_time(2 * stat_entries * (G - 1) / G * 4, G, lay.tp, hw)
    return {"steady": steady, "periodic": refresh, "every": int(hp["refresh_every"])}


COSTS = {"adamw": cost_adamw, "owner-muon": cost_owner_muon, "gather-muon": cost_gather_muon,
         "placement-muon": cost_placement_muon, "row-block-muon": cost_row_block_muon, "muonbp": cost_muonbp,
         "dion2-shard": cost_dion2_shard, "dion": cost_dion, "dobb": cost_dobb, "dobb-both": cost_dobb}


def project(method: dict, mats, other: int, lay: Layout, hw: Hardware, stat_sync: bool = True,
            counts: dict | None = None, tensors: int = 0) -> dict:
    """Per-rank times (ms) of one method: the steady step, the periodic step (refresh or full
    step) where there is one, the amortized step, and the six terms of the amortized step.
    ``counts``: kernel counts (``dobb_bench.cost.kernels``; default the committed inputs');
    ``tensors``: the non-matrix parameter tensors (AdamW's, one kernel chain each)."""
    kind = method["kind"]
    if kind not in COSTS:
        raise ValueError(f"unknown method kind {kind!r}; choose one of {', '.join(COSTS)}")
    counts = counts if counts is not None else load_inputs()["kernels"]["methods"]
    extra = {"stat_sync": stat_sync} if kind.startswith("dobb") else {}
    parts = COSTS[kind](mats, lay, hw, method, counts, **extra)
    steady = _add(parts["steady"], _adamw_other(other, tensors, lay, counts))
    every = parts.get("every", 1)
    periodic = _add(steady, parts["periodic"]) if "periodic" in parts else None
    amort = _add(steady, parts["periodic"], 1.0 / every) if periodic is not None else steady
    t = seconds(amort, hw)
    out = {"steady_ms": 1e3 * seconds(steady, hw)["total_s"],
           "periodic_ms": None if periodic is None else 1e3 * seconds(periodic, hw)["total_s"],
           "every": every, "amortized_ms": 1e3 * t["total_s"], "kernels": amort["kernels"], "qr": amort["qr"]}
    out.update({k.replace("_s", "_ms"): 1e3 * v for k, v in t.items() if k != "total_s"})
    return out


# ----------------------------------------------------------------------------- the record
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
                          "source": pt.get("source", case.get("source", "")), "terms": res})
    checks = [c for c in calib if not c["fitted"]]
    within = sum(0.5 <= c["ratio"] <= 2 for c in checks)
    return {"kind": "projection", "fitted": fitted, "rows": rows, "calibration": calib,
            "summary": {"unfitted": len(checks), "within_2x": within,
                        "median_ratio": sorted(c["ratio"] for c in checks)[len(checks) // 2] if checks else None},
            "not_calibrated": inputs.get("not_calibrated", [])}


def _fmt(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


TERM_KEYS = ("hbm_ms", "matmul_ms", "link_ms", "latency_ms", "launch_ms", "qr_ms")


def _pct(rec: dict, key: str) -> str:
    hw = (rec.get("inputs") or load_inputs())["hardware"]["h100-sxm"]
    return f"{100 * _v(hw.get(key, 1.0)):.0f}%"


def projection_markdown(rec: dict) -> str:
    layouts = list(dict.fromkeys(r["layout"] for r in rec["rows"]))
    out = ["| model | method | " + " | ".join(f"{x} ms" for x in layouts) + " | terms at " + layouts[0]
           + ": HBM / matmul / link / latency / launch / QR ms |", "|---|---|" + "---|" * (len(layouts) + 1)]
    by = {(r["model"], r["method"], r["layout"]): r for r in rec["rows"]}
    for model in dict.fromkeys(r["model"] for r in rec["rows"]):
        for method in dict.fromkeys(r["method"] for r in rec["rows"]):
            cells = [_fmt(by[model, method, x]["amortized_ms"]) for x in layouts]
            r0 = by[model, method, layouts[0]]
            terms = " / ".join(_fmt(r0[k]) for k in TERM_KEYS)
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
        out.append(f"| {c['published']} (model: {c['model']}) | {c.get('source', '')} | {fitted} | {_fmt(c['model_ms'])} | "
                   f"{c['published_ms']:g} | {c['ratio']:.2f}{miss} |")
    for nc in rec.get("not_calibrated", []):
        out.append(f"| {nc['label']}: {nc['published']} | — | not modelled: {nc['why']} | — | — | — |")
    s = rec.get("summary") or {}
    fit = rec.get("fitted", {})
    out += ["", f"Fitted: {1e6 * fit.get('kernel_s', 0):.3g} us a kernel, {1e6 * fit.get('qr_s', 0):.3g} us a QR "
            f"factorization, each solved from the one point marked fitted. Of the {s.get('unfitted')} points not fitted, "
            f"{s.get('within_2x')} are within 2x; median projected / published {s.get('median_ratio', 0):.2f}."]
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


# ----------------------------------------------------------------------------- the user's model
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "granite")


def config_spec(config: str, inputs: dict) -> dict:
    """A model spec from a named shape (the inputs' ``models``) or a Hugging Face ``config.json``."""
    if config in inputs["models"]:
        return inputs["models"][config]
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"--config {config!r} is neither a file nor a named shape ({', '.join(inputs['models'])})")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {config}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {config}: a JSON object is expected")
    kind = cfg.get("model_type")
    try:
        if kind == "gpt2":
            d = int(cfg["n_embd"])
            return {"kind": "gpt2", "width": d, "layers": int(cfg["n_layer"]), "ffn": int(cfg.get("n_inner") or 4 * d),
                    "vocab": int(cfg["vocab_size"]), "context": int(cfg.get("n_positions", 1024))}
        if kind in LLAMA_LIKE:
            heads = int(cfg["num_attention_heads"])
            spec = {"kind": "llama", "width": int(cfg["hidden_size"]), "layers": int(cfg["num_hidden_layers"]),
                    "heads": heads, "kv_heads": int(cfg.get("num_key_value_heads") or heads),
                    "ffn": int(cfg["intermediate_size"]), "vocab": int(cfg["vocab_size"]),
                    "tied": bool(cfg.get("tie_word_embeddings", False)), "qk_norm": kind == "qwen3"}
            if cfg.get("head_dim"):
                spec["head_dim"] = int(cfg["head_dim"])
            return spec
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--config {config}: a {kind} config needs {exc} (an integer)") from None
    raise ValueError(f"--config {config}: model_type {kind!r} is not supported (gpt2, {', '.join(LLAMA_LIKE)})")


def user_projection(spec: dict, gpus: int, tp: int, dtype: str, mfu: float, tokens: int, inputs: dict,
                    hardware: str = "h100-sxm") -> dict:
    """Every method's projected step on ``gpus`` ranks (FSDP ``gpus / tp`` x TP ``tp``), and its share
    of a training step whose forward and backward take ``6 params tokens / (gpus peak mfu)``."""
    if gpus < 1 or tp < 1 or gpus % tp:
        raise ValueError(f"--gpus {gpus} must be a positive multiple of --tp {tp}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu} must be in (0, 1]")
    if tokens < 1:
        raise ValueError(f"--tokens {tokens} must be positive")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"--dtype {dtype!r}: bf16 or fp32")
    if hardware not in inputs["hardware"]:
        raise ValueError(f"--hardware {hardware!r}: one of {', '.join(inputs['hardware'])}")
    bad = [k for k in ("width", "layers", "heads", "kv_heads", "ffn", "vocab", "head_dim")
           if k in spec and not (isinstance(spec[k], int) and spec[k] >= 1)]
    if bad:
        raise ValueError(f"the model's {', '.join(bad)} must be positive integers")
    if spec["kind"] == "llama" and (spec["width"] % spec["heads"] and not spec.get("head_dim")):
        raise ValueError("hidden_size must be a multiple of num_attention_heads (or give head_dim)")
    mats, other = model_matrices(spec)
    tensors = other_tensors(spec)
    fitted = fit_constants(inputs)
    hw = Hardware.from_inputs(inputs["hardware"][hardware], fitted)
    if dtype == "fp32":  # products in fp32 at its peak; NS5 operands move as 4 bytes
        hw = hw.with_(bf16_flops=hw.fp32_flops, bf16_eff=hw.fp32_eff)
    lay = Layout(gpus // tp, tp, 1)
    params = sum(x.m * x.n for x in mats) + other
    fwd_bwd_ms = 1e3 * 6 * params * tokens / (gpus * _v(inputs["hardware"][hardware]["bf16_flops"]) * mfu)
    rows = []
    for label, method in inputs["methods"].items():
        m = dict(method, ns_bytes=4) if dtype == "fp32" and "ns_bytes" in method else method
        res = project(m, mats, other, lay, hw, True, inputs["kernels"]["methods"], tensors)
        rows.append({"method": label, **res, "share": res["amortized_ms"] / (fwd_bwd_ms + res["amortized_ms"])})
    return {"params": params, "matrices": len(mats), "other_tensors": tensors, "layout": {"fs": lay.fs, "tp": tp},
            "fwd_bwd_ms": fwd_bwd_ms, "fitted": fitted, "hardware": hardware, "rows": rows,
            "efficiency": {"bf16": hw.bf16_eff, "fp32": hw.fp32_eff}}


def inputs_fit(args) -> list[dict]:
    return load_inputs(args.inputs).get("fit", []) or [{"case": "the inputs", "published": "fixed"}]


def user_text(res: dict, args) -> str:
    hw = res["hardware"]
    fit = res["fitted"]
    out = [f"{args.config}: {res['params'] / 1e9:.3g}B parameters, {res['matrices']} hidden matrices, "
           f"{res['other_tensors']} other tensors (AdamW); {args.gpus} x {hw}, FSDP {res['layout']['fs']} x TP {args.tp}",
           "", "| method | steady ms | periodic ms | amortized ms | HBM / matmul / link / latency / launch / QR ms "
           f"| share of a training step at MFU {args.mfu:g} |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        per = "—" if r["periodic_ms"] is None else _fmt(r["periodic_ms"])
        terms = " / ".join(_fmt(r[k]) for k in TERM_KEYS)
        out.append(f"| {r['method']} | {_fmt(r['steady_ms'])} | {per} | {_fmt(r['amortized_ms'])} | {terms} | "
                   f"{100 * r['share']:.2g}% |")
    out += ["", "Assumptions:",
            f"- per rank, per optimizer.step(); the six terms add (no overlap); Dobb amortized over T = 9 "
            f"(refresh = the periodic step), MuonBP over P = 5 (owner-compute full step = the periodic step);",
            f"- {hw}: the datasheet rates in src/dobb_bench/cost/projection_inputs.json; products in {args.dtype} at "
            f"{100 * res['efficiency'][args.dtype]:.0f}% of peak (Dobb's refresh and Dion in fp32 at "
            f"{100 * res['efficiency']['fp32']:.0f}%);",
            f"- {1e6 * fit.get('kernel_s', 0):.3g} us a kernel and {1e6 * fit.get('qr_s', 0):.3g} us a QR "
            f"factorization, fitted on {'; '.join(f['case'] + ': ' + f['published'] for f in inputs_fit(args))}; "
            f"kernel counts per matrix from "
            f"the library's own step (dobb_bench.cost.kernels), eager, no torch.compile;",
            f"- FSDP2 over {res['layout']['fs']} ranks (dim 0), TP {args.tp} inside a node; owner-compute Muon on the "
            f"library's greedy owner plan (the busiest owner sets the time); Dobb's statistic all-reduce in the "
            f"refresh step; non-matrix parameters are AdamW's in every method;",
            f"- training step: forward + backward = 6 x {res['params'] / 1e9:.3g}B x {args.tokens} tokens / "
            f"({args.gpus} GPUs x bf16 peak x MFU {args.mfu:g}) = {_fmt(res['fwd_bwd_ms'])} ms; share = step / "
            f"(forward-backward + step);",
            "- the model's error on published steps: docs/results.md, table:projected-calibration."]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- command
def cmd_project(args) -> int:
    from dobb_bench.provenance import provenance

    inputs = load_inputs(args.inputs)
    if args.config is not None:
        if args.gpus is None:
            raise ValueError("--config needs --gpus N (the ranks to project on)")
        res = user_projection(config_spec(args.config, inputs), args.gpus, args.tp, args.dtype, args.mfu,
                              args.tokens, inputs, args.hardware)
        print(user_text(res, args), end="")
        return 0
    if args.gpus is not None:
        raise ValueError("--gpus goes with --config (a Hugging Face config.json or a named shape)")
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
    p = sub.add_parser("project", help="model the optimizer step at scale (H100; GPT-2 XL, Llama-3-8B, or --config)")
    p.add_argument("--inputs", default=str(INPUTS), help="inputs JSON (default: the committed one beside the module)")
    p.add_argument("--out", default=str(RECORD.parent), help="folder for projection.json/.md and the plot")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--config", default=None,
                   help="a Hugging Face config.json or a named shape (gpt2-xl, llama3-8b, ...): print every method's "
                        "projected step for that model instead of writing the record")
    p.add_argument("--gpus", type=int, default=None, help="ranks (with --config; FSDP over gpus / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with --config)")
    p.add_argument("--dtype", default="bf16", help="dtype of the products: bf16 (default) or fp32")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilization of forward and backward (0.4)")
    p.add_argument("--tokens", type=int, default=2 ** 21, help="tokens a training step, all ranks (2^21)")
    p.add_argument("--hardware", default="h100-sxm", help="hardware entry of the inputs (h100-sxm)")
    p.set_defaults(func=cmd_project)
