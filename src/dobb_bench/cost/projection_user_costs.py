"""The cost forms of the library's newer optimizers, beside ``projection_costs`` (moved here from it
to keep each file under 500 lines; ``projection_costs`` and ``dobb_bench.cost.projection`` re-export
every public name): Dobb-Muon (``cost_dobb_muon``), SOAP owner-computed (``cost_soap``,
``soap_sides``), ``split_refresh``'s owner-split basis solve (``split_refresh_cost``), and the helpers
``cost_dobb`` shares with them (``dobb_side``, ``NotProjected``). This module does not import
``projection_costs`` (which imports it)."""
from __future__ import annotations

import math

from dobb.collectives import plan_owners
from dobb_bench.cost import payload as P
from dobb_bench.cost.projection_model import (Hardware, Matrix, all_to_all_time,
                                              kernel_count, local_shape, local_shapes, ns_flops, ring_time, step_cost, traced_step_terms,
                                              zero_cost)


def dobb_side(r: float, k: float, blocks: float, side: str) -> tuple[dict, dict]:
    """(steady, refresh) FLOPs of one Dobb side on an ``r x k`` local shard from ``roofline.step_cost``
    (its bytes are the minimum; the projection charges the traced ones, ``cost_dobb``)."""
    hp = {"blocks": blocks, "side": side}
    steady = step_cost("dobb", r, k, {**hp, "refresh_every": math.inf})
    once = step_cost("dobb", r, k, {**hp, "refresh_every": 1})
    return steady, {key: once[key] - steady[key] for key in ("bytes", "flops")}


def splits(hp: dict) -> bool:
    """Whether a Dobb form's refresh is priced split over its statistic group: where the row sets
    ``split_refresh``. The rows of the library's defaults set it as the library decides
    (``dobb.core.statistics.split_by_default``: a hook statistic, on any device); the paper's rows and
    the calibration points (every rank solving every block) leave it out."""
    return bool(hp.get("split_refresh", False))


class NotProjected(ValueError):
    """A form the model cannot price (or the library refuses) at this layout: the row says why."""


def split_refresh_cost(refresh: dict, blocks: list[tuple[float, float]], basis_entries: float, G: int,
                   tp: int, hw: Hardware) -> None:
    """``split_refresh=True`` (``dobb.core.statistics``): each even-sized block's basis solve (``A Q``
    and its Householder QR; ``blocks``: (fp32 FLOPs, QRs, even-sized) each) runs on one owner of the ``G`` ranks
    that hold the same statistic (the library's plan, ``collectives.plan_owners``, longest first); the
    busiest owner sets the solve's FLOPs and QRs, and the new bases (``basis_entries``, bf16) are
    broadcast to the group: each rank receives the others' ``(G - 1) / G`` of them, one broadcast per
    owner. Odd-sized blocks stay replicated (every rank solves them), and the refresh's element-wise
    passes and kernels (the statistic's EMA, every rank) are left as they were."""
    even = [b for b in blocks if b[2]]
    odd = [b for b in blocks if not b[2]]
    owner = plan_owners([f for f, _, _ in even], G) if even else []
    load = [0.0] * G
    for (f, _, _), r in zip(even, owner):
        load[r] += f
    busiest = max(range(G), key=lambda r: (load[r], -r))
    mine = [b for b, r in zip(even, owner) if r == busiest]
    refresh["fp32_flops"] = sum(f for f, _, _ in mine + odd)
    refresh["qr"] = sum(q for _, q, _ in mine + odd)
    link, lat = ring_time(basis_entries * 2 * (G - 1) / G, G, tp, hw, count=len(set(owner)))
    refresh["link_s"] += link
    refresh["latency_s"] += lat


def _role(x: Matrix) -> str | None:
    """``heads``'s attention roles by matrix name (``dobb.core.heads``): q, k, v (or a fused qkv /
    c_attn) are ``"qkv"``, the attention output ``o`` is ``"out"``; the MLP None."""
    leaf = x.name.rsplit(".", 1)[-1]
    return "qkv" if leaf in ("q", "k", "v", "qkv", "c_attn") else ("out" if leaf == "o" else None)


def cost_dobb_muon(mats, lay, hw, hp, counts, stat_sync: bool = True) -> dict:
    """Dobb-Muon (``"dobb-muon"``, ``norm="muon"``; ``dobb.core.update.apply_preconditioned_muon``) on
    each rank's rows: three products with the block-diagonal input-side basis (``U Q``, ``G Q`` and
    ``R Q^T``: ``6 r k s``, in the bf16 products of a GPU), then NS5 on each of the ``out_blocks``
    row blocks, cut at shard boundaries (``min(m / Bo, local rows)`` rows, whole columns); the
    refresh, its QRs and the statistic all-reduce are Dobb's input side (``cost_dobb``). ``heads``
    (its per-head form, ``dobb.core.heads``): q, k and v take one Newton-Schulz row block per head
    (``n / heads`` rows, cut at shard boundaries), the attention output ``heads`` input blocks;
    the MLP keeps ``blocks`` and ``out_blocks``. The library needs whole rows on each rank (the
    input axis unsharded): a row-parallel matrix under TP is not projected. Element-wise bytes and
    kernels: the traced ``dobb-muon`` step (B=4, Bo=4; its per-head form is the same ops on other
    block sizes)."""
    label = hp.get("kernels", "dobb-muon")
    heads = hp.get("heads")
    steady, refresh = zero_cost(), zero_cost()
    stat_entries = entries = stats = 0.0
    solves = []
    for x in mats:
        r, k = local_shape(x, lay)
        if k != x.n:
            raise NotProjected(f"dobb-muon orthogonalizes whole rows on the rank that holds them; TP splits the "
                               f"input axis of the row-parallel {x.name.rsplit('.', 1)[-1]} ({x.m} x {x.n}), "
                               "which the library refuses")
        role = _role(x) if heads else None
        if heads and x.n % heads:
            raise NotProjected(f"heads={heads} does not divide the width {x.n} ({x.name.rsplit('.', 1)[-1]})")
        s_in = min(x.n / (heads if role == "out" else hp["blocks"]), k)
        rows = min(x.n / heads if role == "qkv" else x.m / hp["out_blocks"], r)
        steady["bf16_flops"] += 6 * r * k * s_in + (r / rows) * ns_flops(rows, k)
        _, rf = dobb_side(r, k, k / s_in, "input")
        refresh["fp32_flops"] += rf["flops"]
        refresh["qr"] += k / s_in
        solves += [(rf["flops"] * s_in / k, 1.0, round(s_in) % 2 == 0)] * max(1, round(k / s_in))
        stats += k * s_in
        stat_entries += P.dp_stat_entries("dobb", round(r), round(k), {"blocks": max(1, round(k / s_in))})
        entries += r * k
    traced_step_terms(steady, refresh, counts, label, entries, stats, local_shapes(mats, lay))
    G = lay.fs * lay.dp
    if stat_sync:
        refresh["link_s"], refresh["latency_s"] = ring_time(2 * stat_entries * (G - 1) / G * 4, G, lay.tp, hw)
    if splits(hp) and G > 1:
        split_refresh_cost(refresh, solves, stats, G, lay.tp, hw)
    return {"steady": steady, "periodic": refresh, "every": int(hp["refresh_every"])}


def soap_sides(x: Matrix, hp: dict) -> tuple[bool, bool]:
    """SOAP's preconditioned sides of a whole matrix: a side longer than ``max_precondition_dim``
    keeps the identity (``SOAP._sides``; ``blocks=1``, ``sides="both"``: the library's defaults)."""
    limit = hp["max_precondition_dim"]
    return x.m <= limit, x.n <= limit


def cost_soap(mats, lay, hw, hp, counts) -> dict:
    """SOAP owner-computed (``dobb.baselines.shampoo_family.soap``): gradient shards to each matrix's
    owner (one all-to-all, fp32, the state dtype), the step there on the whole matrix, update shards
    back (a second all-to-all): ``payload``'s ``2 mn`` an entry of 4 bytes. Owners by the library's
    plan on ``soap_cost`` (``collectives.plan_owners``, longest first); the busiest owner sets the step.
    Its fp32 products a step, per preconditioned side of size ``s`` (``m``: left, ``n``: right):
    ``QL^T G QR``, ``QL^T M QR``, ``QL O QR^T`` and the factor ``G G^T`` (or ``G^T G``): four
    products of ``2 m n s``; every ``precondition_frequency`` steps one power step per side,
    ``stat Q`` (``2 s^3``) and its Householder QR. Element-wise bytes and kernels: the traced ``soap``
    step on the owner's whole matrices (bytes an entry of the weight and of ``L, QL, R, QR``), the
    refresh's extra from the trace that refreshes on the traced step (``soap-refresh``); a rank's
    apply of the returned update shards is inside that trace's bytes of the owned entries."""
    from dobb.baselines.shampoo_family.soap import soap_cost

    if lay.tp > 1 and lay.fs > 1:
        raise NotProjected("the library's SOAP owner-computes on a 1-D mesh only and refuses FSDP x TP (a 2-D mesh)")
    G = lay.fs * lay.tp
    sides = [soap_sides(x, hp) for x in mats]
    costs = [soap_cost(x.m, x.n, 1, *s) for x, s in zip(mats, sides)]
    owner = plan_owners(costs, G)
    load = [0.0] * G
    for i, r in enumerate(owner):
        load[r] += costs[i]
    busiest = max(range(G), key=lambda r: (load[r], -r))
    mine = [i for i, r in enumerate(owner) if r == busiest]
    steady, refresh = zero_cost(), zero_cost()
    entries = stats = 0.0
    for i in mine:
        x, (left, right) = mats[i], sides[i]
        for s, on in ((x.m, left), (x.n, right)):
            if on:
                steady["fp32_flops"] += 4 * 2 * x.m * x.n * s
                refresh["fp32_flops"] += 2 * s ** 3
                refresh["qr"] += 1
                stats += s * s  # the factor (and its basis: the trace's bytes a statistic entry hold both)
        entries += x.m * x.n
    k, kr = counts["soap"]["steady"], counts["soap-refresh"]["steady"]
    steady["hbm_bytes"] = k["bytes_per_entry"] * entries + k["bytes_per_stat_entry"] * stats
    refresh["hbm_bytes"] = ((kr["bytes_per_entry"] - k["bytes_per_entry"]) * entries
                            + (kr["bytes_per_stat_entry"] - k["bytes_per_stat_entry"]) * stats)
    shapes = [(mats[i].m, mats[i].n) for i in mine]
    steady["kernels"] = kernel_count(counts, "soap", "steady", shapes)
    refresh["kernels"] = kernel_count(counts, "soap-refresh", "steady", shapes) - steady["kernels"]
    logical = sum(P.payload_entries("soap", x.m, x.n, sharded="output", shards=G) for x in mats)
    wire = logical / G * (G - 1) / G * 4
    steady["link_s"], steady["latency_s"] = all_to_all_time(wire, G, 1, hw, count=2)
    return {"steady": steady, "periodic": refresh, "every": int(hp["precondition_frequency"])}
