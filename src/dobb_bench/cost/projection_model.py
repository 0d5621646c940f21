"""The projection's inputs, shapes, collectives and cost terms (``dobb_bench.cost.projection``
re-exports every public name here; see its docstring for the model)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dobb_bench.cost.matrices import COLWISE
from dobb_bench.cost.roofline import traffic as step_cost  # bytes and FLOPs only (no state bytes)
from dobb_bench.cost.shapes import gpt2_param_count, matrix_shapes, preset

INPUTS = Path(__file__).with_name("projection_inputs.json")
ROOT = Path(__file__).resolve().parents[3]
RECORD = ROOT / "docs" / "results" / "cost" / "projection" / "projection.json"


# ----------------------------------------------------------------------------- inputs
def load_inputs(path: Path | str = INPUTS) -> dict:
    return json.loads(Path(path).read_text())


def value_of(x):
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
        return cls(value_of(d["bf16_flops"]), value_of(d["fp32_flops"]), value_of(d["hbm_bytes_per_s"]), value_of(d["nvlink_bytes_per_s"]),
                   value_of(d["internode_bytes_per_s"]), int(value_of(d["gpus_per_node"])), value_of(d["latency_intra_s"]),
                   value_of(d["latency_inter_s"]), value_of(d.get("bf16_efficiency", 1.0)), value_of(d.get("fp32_efficiency", 1.0)),
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
        # ``fused_qkv``: one ``3d x d`` attention projection (Hugging Face's and the paper's c_attn;
        # the paper's Figure 2 "separates the query, key, and value blocks of the fused attention
        # projection"): one matrix where the split form has three. Same entries, same count below.
        shapes = matrix_shapes(spec["preset"], fused_qkv=bool(spec.get("fused_qkv")))
        mats = [Matrix(nm, m, n, nm.rsplit(".", 1)[-1] in COLWISE) for nm, (m, n) in shapes]
        return mats, gpt2_param_count(spec["preset"]) - sum(x.m * x.n for x in mats)
    if spec["kind"] == "layers":  # explicit per-layer matrices (a benchmark's own model): [name, m, n, colwise]
        mats = [Matrix(f"h{i}.{nm}", int(m), int(n), bool(c)) for i in range(spec["layers"])
                for nm, m, n, c in spec["matrices"]]
        return mats, int(spec["other"])
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
        other += (q + 2 * kv) * L * bool(spec.get("qkv_bias"))  # Qwen2's q, k and v biases
        return mats, other
    raise ValueError(f"unknown model kind {spec['kind']!r} (gpt2, llama or layers)")


def other_tensors(spec: dict) -> int:
    """How many parameter tensors of a model are not hidden matrices (AdamW's, one kernel chain each)."""
    if spec["kind"] == "layers":
        return int(spec["other_tensors"])
    if spec["kind"] == "gpt2":
        biases = 4 if spec.get("fused_qkv") else 6  # one c_attn bias for the fused q, k, v
        return (biases + 4) * (preset(spec["preset"]).layers if "preset" in spec else spec["layers"]) + 4  # biases + 2 LayerNorms a layer; wte, wpe, ln_f
    L = spec["layers"]
    per_layer = 2 + 2 * bool(spec.get("qk_norm")) + 3 * bool(spec.get("qkv_bias"))  # norms (q, k norms), q, k, v biases
    return per_layer * L + (2 if spec.get("tied") else 3)  # embeddings, head, final norm


def local_shape(x: Matrix, lay: Layout) -> tuple[float, float]:
    """This rank's ``rows x cols`` of ``x`` (TP first, then FSDP2's dim-0 shard)."""
    return x.m / (lay.fs * (lay.tp if x.colwise else 1)), x.n / (1 if x.colwise else lay.tp)


# ----------------------------------------------------------------------------- collectives
def _spans(size: int, stride: int, hw: Hardware) -> bool:
    return size * stride > hw.gpus_per_node


def ring_time(wire_bytes: float, size: int, stride: int, hw: Hardware, count: int = 1) -> tuple[float, float]:
    """(link s, latency s) of ring collectives (all-gather, all-reduce) moving ``wire_bytes`` per
    rank over a group of ``size`` ranks ``stride`` apart.

    Inside a node: NVLink. Across nodes: NCCL runs one ring (channel) per network card, so each of
    the group's ``g`` ranks on a node is the node's exit in one ring in ``g``, and sends only that
    ring's ``1 / g`` of its bytes over its own card, at the same time as the others: the ring's
    bus bandwidth is ``g`` per-GPU links, never more than NVLink, which every ring still crosses
    inside the node. ``g = 1`` (a stride of a node or more) is one card: the per-GPU link."""
    if size <= 1:
        return 0.0, 0.0
    if not _spans(size, stride, hw):
        return wire_bytes / hw.nvlink, count * hw.lat_intra
    on_node = max(1, min(size, hw.gpus_per_node // stride))
    return wire_bytes / min(hw.nvlink, on_node * hw.internode), count * hw.lat_inter


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


def zero_cost() -> dict:
    return {k: 0.0 for k in TERMS}


def add_cost(a: dict, b: dict, scale: float = 1.0) -> dict:
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


def bytes_per_entry(counts: dict, label: str, part: str = "steady") -> float:
    """Element-wise bytes an entry of ``label``'s ``part`` step (``dobb_bench.cost.kernels``: traced)."""
    return counts[label][part]["bytes_per_entry"]


def bytes_per_stat_entry(counts: dict, label: str, part: str = "steady") -> float:
    """Element-wise bytes an entry of the statistic, basis or factor beside the weight (traced)."""
    return counts[label][part].get("bytes_per_stat_entry", 0.0)


def traced_step_terms(steady: dict, refresh: dict, counts: dict, label: str, entries: float, stats: float,
                      local: list) -> None:
    """Fills the traced terms of a Dobb form's ``steady`` and ``refresh`` costs: element-wise bytes over
    this rank's weight ``entries`` and statistic/basis ``stats`` (the refresh's beyond the steady
    step's), and kernels over the ``local`` shapes (the refresh's beyond the steady count)."""
    steady["hbm_bytes"] = bytes_per_entry(counts, label) * entries + bytes_per_stat_entry(counts, label) * stats
    refresh["hbm_bytes"] = ((bytes_per_entry(counts, label, "refresh") - bytes_per_entry(counts, label)) * entries
                            + (bytes_per_stat_entry(counts, label, "refresh") - bytes_per_stat_entry(counts, label)) * stats)
    steady["kernels"] = kernel_count(counts, label, "steady", local)
    refresh["kernels"] = kernel_count(counts, label, "refresh", local) - steady["kernels"]


def adamw_other_cost(other: int, tensors: int, lay: Layout, counts: dict) -> dict:
    c = zero_cost()
    c["hbm_bytes"] = bytes_per_entry(counts, "adamw") * other / (lay.fs * lay.tp)  # traced: 8 passes, weight decay on
    c["kernels"] = counts["adamw"]["steady"]["per_matrix"] * tensors  # torch's single-tensor count (see projection)
    return c


def local_shapes(mats, lay) -> list[tuple[float, float]]:
    return [local_shape(x, lay) for x in mats]


def elementwise_cost(label: str, mats, lay, counts: dict, per_entry: float | None = None) -> dict:
    """HBM bytes of the element-wise passes of ``label``'s step over this rank's entries of ``mats``:
    the traced bytes an entry (``per_entry`` where given) times the entries."""
    c = zero_cost()
    b = bytes_per_entry(counts, label) if per_entry is None else per_entry
    for x in mats:
        r, k = local_shape(x, lay)
        c["hbm_bytes"] += b * r * k
    return c


def ns_flops(m: float, n: float, steps: int = 5) -> float:
    """Newton-Schulz quintic FLOPs on an ``m x n`` matrix (``roofline``'s count): ``steps (4 a^2 b + 2 a^3)``."""
    return step_cost("muon", m, n, {"ns_steps": steps})["flops"]

