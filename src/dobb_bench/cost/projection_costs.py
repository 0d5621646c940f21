"""Each method's per-rank step as counts of the six terms (``dobb_bench.cost.projection``
re-exports every public name here; see its docstring for the model). Dobb-Muon, SOAP, the
``split_refresh`` pricing, ``dobb_side`` and ``NotProjected`` moved to ``projection_user_costs``,
still importable from here."""
from __future__ import annotations

import math

from dobb.baselines.dion_family.dion import dion_rank
from dobb.collectives import plan_owners
from dobb_bench.cost import payload as P
from dobb_bench.cost.projection_model import (Hardware, Layout, Matrix, add_cost, adamw_other_cost, elementwise_cost, local_shapes,
                                              ns_flops, zero_cost, all_to_all_time, bytes_per_entry, bytes_per_stat_entry,
                                              kernel_count, load_inputs, local_shape, ring_time, seconds, traced_step_terms)
from dobb_bench.cost.projection_model import step_cost  # noqa: F401  (kept importable here)
from dobb_bench.cost.projection_user_costs import (NotProjected, cost_dobb_muon, cost_soap, dobb_side,  # noqa: F401
                                                   soap_sides, split_refresh_cost, splits)  # noqa: F401


def owner_plan(mats, ranks: int) -> tuple[list[int], int]:
    """The library's owner plan (NS5 FLOPs, longest first to the least loaded rank): the matrices
    of the busiest owner (indices) and how many owners hold at least one matrix. (The plan is the
    same for any step count: every matrix's FLOPs scale by it.)"""
    flops = [ns_flops(x.m, x.n) for x in mats]
    owner = plan_owners(flops, ranks)
    load = [0.0] * ranks
    for i, r in enumerate(owner):
        load[r] += flops[i]
    busiest = max(range(ranks), key=lambda r: (load[r], -r))
    return [i for i, r in enumerate(owner) if r == busiest], len(set(owner))


def dmuon_owners(mats, ranks: int, small: int = 5_000_000) -> list[int]:
    """DMuon's ownership plan (``compute_balanced_assignment`` in ``dmuon/partition.py``,
    github.com/X-Square-Robot/dmuon at cfa7703, the revision of its LLM benchmark): each matrix of at
    least ``small`` entries is a unit, and a layer's smaller matrices are merged into one; units go,
    largest first (by entries; a stable sort keeps the model's order among equals), to the
    least-loaded rank not yet used in their layer, else to the least-loaded rank. The owner of each
    matrix, by index (layer: the ``h{i}`` prefix of the matrix name)."""
    layers: dict[str, list[int]] = {}
    for i, x in enumerate(mats):
        layers.setdefault(x.name.split(".", 1)[0], []).append(i)
    units = []
    for layer, idx in layers.items():
        units += [(layer, [i], mats[i].m * mats[i].n) for i in idx if mats[i].m * mats[i].n >= small]
        rest = [i for i in idx if mats[i].m * mats[i].n < small]
        if rest:
            units.append((layer, rest, sum(mats[i].m * mats[i].n for i in rest)))
    units.sort(key=lambda u: u[2], reverse=True)
    load, used, owner = [0] * ranks, {}, [0] * len(mats)
    for layer, idx, numel in units:
        seen = used.setdefault(layer, set())
        r = min(range(ranks), key=lambda q: (q in seen, load[q]))
        for i in idx:
            owner[i] = r
        load[r] += numel
        seen.add(r)
    return owner


def gram_ns_flops(m: float, n: float, syrk: bool = True) -> float:
    """FLOPs of DMuon's Gram Newton-Schulz (``gram_newton_schulz_local`` in ``dmuon/optim/newton_schulz.py``
    at cfa7703: five POLAR_EXPRESS steps, a restart before step 2) on an ``m x n`` matrix, ``a = min``,
    ``b = max``: ``X X^T`` at the start and at the restart (``2 a^2 b`` each), ``Q X`` at the restart
    and at the end (``2 a^2 b`` each), and 14 ``a x a`` products (``2 a^3`` each: ``Z`` in every
    step, ``Q Z`` in steps 1, 3, 4, ``R Z`` and ``Z (R Z)`` in steps 0, 2, 3). With its SYRK kernel
    ("lower-triangle + mirror-write kernel (50% tile savings)") every symmetric product, all but the
    two ``Q X``, costs half: ``6 a^2 b + 14 a^3``; without, ``8 a^2 b + 28 a^3``."""
    a, b = min(m, n), max(m, n)
    half = 0.5 if syrk else 1.0
    return half * 2 * (2 * a * a * b) + 2 * (2 * a * a * b) + half * 14 * (2 * a ** 3)


def _ns(x, hp: dict) -> float:
    """The Newton-Schulz FLOPs of one whole matrix under ``hp``: NS5 (``ns_steps``) or ``ns="gram-syrk"``."""
    if hp.get("ns") == "gram-syrk":
        return gram_ns_flops(x.m, x.n)
    if hp.get("ns") not in (None, "standard"):
        raise ValueError(f"ns {hp['ns']!r}: 'standard' or 'gram-syrk'")
    return ns_flops(x.m, x.n, hp.get("ns_steps", 5))


def _selected(x, hp: dict) -> bool:
    """Whether a benchmark's Muon takes ``x`` (``hp["select"]``: ``min_entries`` and ``max_rows``);
    the others get the method's ``other_update``."""
    sel = hp.get("select") or {}
    return x.m * x.n >= sel.get("min_entries", 0) and x.m <= sel.get("max_rows", math.inf)


def _per_matrix_kernels(hp: dict, label: str, mats, counts) -> float:
    """``hp["kernels_per_matrix"]`` (a benchmark's own loop, counted from its source) times the
    matrices, else the library's traced counts for ``label`` over the whole shapes."""
    if "kernels_per_matrix" in hp:
        return hp["kernels_per_matrix"] * len(mats)
    return kernel_count(counts, label, "steady", [(x.m, x.n) for x in mats])


def other_update(hp: dict, entries: float, tensors: int, lay, counts) -> dict:
    """The update of the parameters a method does not orthogonalize: AdamW (its traced bytes an
    entry, 80 with weight decay, and torch's single-tensor kernel count) unless
    ``hp["other_update"]`` gives ``bytes_per_entry`` and ``kernels_per_tensor`` (a benchmark's own
    loop, counted from its source: DMuon's baselines add the gradient, one ``add_``; its AdamW loop
    is 9 kernels a tensor, 88 bytes an entry)."""
    if "other_update" not in hp:
        return adamw_other_cost(entries, tensors, lay, counts)
    o = hp["other_update"]
    c = zero_cost()
    c["hbm_bytes"] = o["bytes_per_entry"] * entries / (lay.fs * lay.tp)
    c["kernels"] = o["kernels_per_tensor"] * tensors
    return c


def cost_adamw(mats, lay, hw, hp, counts) -> dict:
    c = elementwise_cost("adamw", mats, lay, counts)
    c["kernels"] = counts["adamw"]["steady"]["per_matrix"] * len(mats)
    return {"steady": c}


def _muon_bytes(hp: dict, counts: dict) -> tuple[float, float]:
    """(bytes an entry of the update around Newton-Schulz, bytes an entry of the Newton-Schulz
    call) of the method's traced step: the library's Muon (``muon``) split at its
    ``orthogonalize`` call (traced alone, ``ns``), so that the momentum and the update are charged
    on every rank's shard and the NS call where it runs; another traced step (``hp["kernels"]``)
    is charged whole where its NS runs."""
    label = hp.get("kernels", "muon")
    total = bytes_per_entry(counts, label)
    if label != "muon":
        return 0.0, total
    ns = counts[label]["steady"].get("ns_bytes_per_entry", 0.0)
    return total - ns, ns


def _loop_bytes(hp: dict, mats, lay, whole: list, owned: list | None = None) -> float:
    """Element-wise bytes of a benchmark's own loop (``hp["loop_bytes"]``, counted op by op from its
    source): ``whole`` bytes an entry of every matrix the rank runs Newton-Schulz on whole,
    ``owned`` of every matrix it owns, ``gram`` an entry of their ``a x a`` Gram matrices, ``local``
    an entry of the rank's shard of every matrix."""
    lb = hp["loop_bytes"]
    mine = whole + (owned or [])
    out = lb.get("whole", 0.0) * sum(x.m * x.n for x in whole) + lb.get("owned", 0.0) * sum(x.m * x.n for x in owned or [])
    out += lb.get("gram", 0.0) * sum(min(x.m, x.n) ** 2 for x in mine)
    out += lb.get("local", 0.0) * sum(r * k for r, k in local_shapes(mats, lay))
    return out


def cost_owner_muon(mats, lay, hw, hp, counts) -> dict:
    """Whole matrices to owners among the ``fs x tp`` ranks (all-to-all, ``ns_bytes`` an entry),
    NS5 there, results back: ``payload``'s ``2 mn`` per matrix. The busiest owner (the library's
    plan) sets the NS5 FLOPs and the kernels: momentum on every local shard, NS5 per shape it owns."""
    upd, ns = _muon_bytes(hp, counts)
    G = lay.fs * lay.tp
    mine, _ = owner_plan(mats, G)
    c = elementwise_cost("muon", mats, lay, counts, upd)
    c["hbm_bytes"] += ns * sum(mats[i].m * mats[i].n for i in mine)
    c["bf16_flops"] = sum(ns_flops(mats[i].m, mats[i].n, hp.get("ns_steps", 5)) for i in mine)
    ck = counts["muon"]["steady"]
    owned_shapes = len({(mats[i].m, mats[i].n) for i in mine})
    c["kernels"] = ck["per_group"] + ck["per_matrix"] * len(mats) + ck["per_shape"] * max(owned_shapes - 1, 0)
    logical = sum(P.payload_entries("owner-muon", x.m, x.n, sharded="output", shards=G) for x in mats)
    wire = logical / G * (G - 1) / G * hp.get("ns_bytes", 2)
    c["link_s"], c["latency_s"] = all_to_all_time(wire, G, 1, hw, count=2)
    return {"steady": c}


def cost_gather_muon(mats, lay, hw, hp, counts) -> dict:
    """Every rank all-gathers every matrix (``payload``'s dense ``mn``) and runs NS5 on all of them
    (one gather a matrix; on ``fs = tp = 1``, DDP, there is nothing to gather). ``select``: the
    matrices a benchmark's Muon takes, the rest get ``other_update`` (DMuon's FSDP2+Muon baseline);
    ``kernels_per_matrix`` and ``loop_bytes``: the benchmark's own per-matrix loop."""
    ns = [x for x in mats if _selected(x, hp)]
    rest = [x for x in mats if not _selected(x, hp)]
    if "loop_bytes" in hp:
        c = zero_cost()
        c["hbm_bytes"] = _loop_bytes(hp, ns, lay, ns)
    else:
        upd, per = _muon_bytes(hp, counts)
        c = elementwise_cost("muon", ns, lay, counts, upd)
        c["hbm_bytes"] += per * sum(x.m * x.n for x in ns)  # NS on the gathered whole matrix, every rank
    G = lay.fs * lay.tp
    c["bf16_flops"] = sum(_ns(x, hp) for x in ns)
    c["kernels"] = _per_matrix_kernels(hp, "muon", ns, counts)
    logical = sum(P.payload_entries("muon", x.m, x.n, sharded="output", shards=G) for x in ns)
    c["link_s"], c["latency_s"] = ring_time(logical * (G - 1) / G * hp.get("grad_bytes", 4), G, 1, hw, count=len(ns))
    if rest:
        c = add_cost(c, other_update(hp, sum(x.m * x.n for x in rest), len(rest), lay, counts))
    return {"steady": c}


def cost_dtensor_muon(mats, lay, hw, hp, counts) -> dict:
    """``torch.optim.Muon`` stepping FSDP2's DTensors (MatrixFSDP's "stock FSDP2-Muon": its benchmark
    hands the sharded parameters to ``torch.optim.Muon``). Newton-Schulz runs as DTensor algebra on
    the row-sharded ``a x b`` (``a = min(m, n)``) iterate: each product keeps its left operand's
    rows and gathers its right operand whole (DTensor's ``Shard(0) @ Replicate -> Shard(0)``), so a
    step gathers ``X^T`` for ``A = X X^T``, ``A`` for ``A A`` and ``X`` for ``B X``: ``2 a b + a^2``
    entries in the bf16 the iteration runs in, three collectives; every rank computes ``1 / G`` of
    each product; the Frobenius norm is one all-reduce a matrix. Element-wise passes on each rank's
    shard (``hp["kernels"]``: the traced step, e.g. ``torch-muon-bf16``)."""
    label = hp.get("kernels", "muon")
    c = elementwise_cost(label, mats, lay, counts)
    G = lay.fs * lay.tp
    steps = hp.get("ns_steps", 5)
    c["bf16_flops"] = sum(ns_flops(x.m, x.n, steps) for x in mats) / G
    c["kernels"] = kernel_count(counts, label, "steady", [(x.m, x.n) for x in mats])
    gathered = sum(steps * (2 * min(x.m, x.n) * max(x.m, x.n) + min(x.m, x.n) ** 2) for x in mats)
    link, lat = ring_time(gathered * (G - 1) / G * 2, G, 1, hw, count=(3 * steps + 1) * len(mats))
    c["link_s"], c["latency_s"] = link, lat
    return {"steady": c}


def cost_placement_muon(mats, lay, hw, hp, counts) -> dict:
    """Owner placement (MatrixFSDP, DMuon): whole matrices live on owners; no step collective.
    ``partition="dmuon"``: DMuon's plan (``dmuon_owners``), the busiest owner by Newton-Schulz
    FLOPs; else the library's greedy plan. ``ns="gram-syrk"``: DMuon's Gram Newton-Schulz.
    Element-wise bytes: the traced step (``hp["kernels"]``) on the owned matrices, or the source's own
    loop (``loop_bytes``)."""
    G = lay.fs * lay.tp
    if hp.get("partition") == "dmuon":
        owner = dmuon_owners(mats, G)
        load = [0.0] * G
        for i, r in enumerate(owner):
            load[r] += _ns(mats[i], hp)
        busiest = max(range(G), key=lambda r: (load[r], -r))
        mine = [i for i, r in enumerate(owner) if r == busiest]
    elif hp.get("partition") not in (None, "library"):
        raise ValueError(f"partition {hp['partition']!r}: 'library' or 'dmuon'")
    else:
        mine, _ = owner_plan(mats, G)
    c = zero_cost()
    owned = [mats[i] for i in mine]
    if "loop_bytes" in hp:
        c["hbm_bytes"] = _loop_bytes(hp, [], lay, [], owned)
    else:  # the traced step on the owner's whole matrices
        c["hbm_bytes"] = bytes_per_entry(counts, hp.get("kernels", "muon")) * sum(x.m * x.n for x in owned)
    c["bf16_flops"] = sum(_ns(mats[i], hp) for i in mine)
    c["kernels"] = _per_matrix_kernels(hp, hp.get("kernels", "muon"), owned, counts)
    return {"steady": c}


def _row_blocks(x: Matrix, lay: Layout, blocks: int) -> tuple[float, float, float]:
    """(block rows, columns, blocks on this rank) of row blocks cut at shard boundaries."""
    r, k = local_shape(x, lay)
    rows = min(x.m / blocks, r)
    return rows, k, r / rows


def cost_row_block_muon(mats, lay, hw, hp, counts) -> dict:
    """Row-block Muon: NS5 on each of ``blocks`` row blocks, cut at shard boundaries; no collective."""
    c = elementwise_cost("row-block-muon", mats, lay, counts)
    for x in mats:
        rows, k, nb = _row_blocks(x, lay, int(hp["blocks"]))
        c["bf16_flops"] += nb * ns_flops(rows, k)
    c["kernels"] = kernel_count(counts, "row-block-muon", "steady", local_shapes(mats, lay))
    return {"steady": c}


def cost_muonbp(mats, lay, hw, hp, counts) -> dict:
    """NS5 on this rank's shard every step; owner-compute Muon's full step every ``period``."""
    block = elementwise_cost("muonbp", mats, lay, counts)
    block["bf16_flops"] = sum(ns_flops(*local_shape(x, lay)) for x in mats)
    block["kernels"] = kernel_count(counts, "muonbp", "steady", local_shapes(mats, lay))
    full = cost_owner_muon(mats, lay, hw, hp, counts)["steady"]
    p = int(hp["period"])
    return {"steady": block, "periodic": add_cost(zero_cost(), add_cost(full, block, -1.0)), "every": p}


def cost_dion2_shard(mats, lay, hw, hp, counts) -> dict:
    """Dion2's row selection inside each shard: NS5 on the ``round(fraction r)`` heaviest local rows."""
    c = elementwise_cost("dion2", mats, lay, counts)
    for x in mats:
        r, k = local_shape(x, lay)
        c["bf16_flops"] += ns_flops(max(1, round(hp["fraction"] * r)), k)
    c["kernels"] = kernel_count(counts, "dion2", "steady", local_shapes(mats, lay))
    return {"steady": c}


def cost_dion(mats, lay, hw, hp, counts) -> dict:
    """Dion (calibration only) on row shards: ``8 r_loc n r + 4 (r_loc + n) r^2`` fp32 FLOPs
    (``roofline``'s count with the local rows), ``payload``'s ``r (m + n)`` all-reduced, one QR a matrix;
    element-wise bytes traced: an entry of the local shard, and an entry of the ``max(m, n) x r`` factor."""
    G = lay.fs * lay.tp
    c = elementwise_cost("dion", mats, lay, counts)
    logical = 0.0
    for x in mats:
        r_loc, k = local_shape(x, lay)
        frac = hp["rank"] / min(x.m, x.n) if "rank" in hp else hp["rank_fraction"]  # a fixed rank (r = 400)
        r = dion_rank(x.m, x.n, frac)
        c["fp32_flops"] += 8 * r_loc * k * r + 4 * (r_loc + k) * r * r
        c["hbm_bytes"] += bytes_per_stat_entry(counts, "dion") * max(x.m, x.n) * r  # the factor's passes (traced)
        logical += P.payload_entries("dion", x.m, x.n, {"rank_fraction": frac}, shards=G)
    c["kernels"] = kernel_count(counts, "dion", "steady", local_shapes(mats, lay))
    c["qr"] = counts["dion"]["steady"]["qr_per_matrix"] * len(mats)
    c["link_s"], c["latency_s"] = ring_time(2 * logical * (G - 1) / G * 4, G, 1, hw, count=2 * len(mats))
    return {"steady": c}


def _output_span(x: Matrix, lay: Layout) -> float:
    """Rows of the output-side statistic a rank captures and all-reduces: FSDP's shards of the output
    axis sit on data-parallel ranks, so each rank reduces the statistic of the whole axis (``dobb.sharding``:
    ``span_sizes``), less TP's split of it (column-parallel), whose ranks see the same data."""
    return x.m / (lay.tp if x.colwise else 1)


def cost_dobb(mats, lay, hw, hp, counts, stat_sync: bool = True) -> dict:
    """One-sided Dobb (``kind="dobb"``: input side; ``kind="dobb-g"``: output side, Dobb-G, with
    ``norm="l2"`` Dobb-G-ell2) or two-sided Dobb (``kind="dobb-both"``): projections in
    ``hp["product_dtype"]`` (default bf16, the basis dtype: this library's products on a GPU,
    ``dobb.functional.matmul_dtype``; "fp32" where a published implementation multiplies in fp32),
    refresh (``A Q`` and Householder QR of every local block, on every rank holding it) in fp32,
    statistic all-reduce (fp32) over the data-parallel ``fs x dp`` ranks once per refresh; all three
    per step, the refresh divided by T. Input side: every rank holds all ``n / s`` blocks of its rows
    and reduces their ``n s`` entries (``payload.dp_stat_entries``). Output side: blocks of
    ``min(m / B, local rows)`` rows, cut at shard boundaries; a rank refreshes only its own blocks but
    reduces the statistic of the whole span (``_output_span``: ``span x s`` entries). Dobb-G-ell2 on a
    row-parallel matrix (its input axis split by TP) sums its coefficient norms over the TP ranks,
    one all-reduce of its local rows a matrix, every step (the paper's Table 7: ``O(m)``).

    Element-wise bytes and kernels: the traced step ``hp["kernels"]`` (default the library's step
    with the products in ``product_dtype``: ``dobb-b4``, ``dobb-g-l2``, ``dobb-both``, ``-fp32`` for
    fp32 products): its bytes an entry of the local shard, and an entry of the local block
    statistics and bases (input side ``k s``, output side the rank's own ``r s`` rows), steady and
    refresh."""
    if hp.get("product_dtype", "bf16") not in ("bf16", "fp32"):
        raise ValueError(f"dobb product_dtype {hp['product_dtype']!r}: bf16 or fp32")
    fp32 = hp.get("product_dtype") == "fp32"
    prod = "fp32_flops" if fp32 else "bf16_flops"
    kind = hp.get("kind", "dobb")
    both, out_only = kind == "dobb-both", kind == "dobb-g"
    label = hp.get("kernels", "dobb-both" if both else ("dobb-g-l2" if out_only else "dobb-b4") + ("-fp32" if fp32 else ""))
    steady, refresh = zero_cost(), zero_cost()
    stat_entries = 0.0
    entries = stats = 0.0  # this rank's weight entries, and its block statistic / basis entries
    l2_rows, l2_count = 0.0, 0
    solves, basis = [], 0.0  # each local block's solve (split_refresh), the bases' entries
    for x in mats:
        r, k = local_shape(x, lay)
        if not out_only:
            s_in = min(x.n / hp["blocks"], k)
            st, rf = dobb_side(r, k, k / s_in, "input")
            stats += k * s_in
            steady[prod] += st["flops"]
            refresh["fp32_flops"] += rf["flops"]
            refresh["qr"] += k / s_in
            solves += [(rf["flops"] * s_in / k, 1.0, round(s_in) % 2 == 0)] * max(1, round(k / s_in))
            basis += k * s_in
            stat_entries += P.dp_stat_entries("dobb", round(r), round(k), {"blocks": max(1, round(k / s_in))})
        if both or out_only:
            s_out = min(x.m / hp["out_blocks" if both else "blocks"], r)
            st2, rf2 = dobb_side(r, k, r / s_out, "output")
            stats += r * s_out
            steady[prod] += st2["flops"]
            refresh["fp32_flops"] += rf2["flops"]
            refresh["qr"] += r / s_out
            solves += [(rf2["flops"] * s_out / r, 1.0, round(s_out) % 2 == 0)] * max(1, round(r / s_out))
            basis += r * s_out
            stat_entries += _output_span(x, lay) * s_out
            if out_only and hp.get("norm") == "l2" and not x.colwise and lay.tp > 1:
                l2_rows += r
                l2_count += 1
        entries += r * k
    traced_step_terms(steady, refresh, counts, label, entries, stats, local_shapes(mats, lay))
    if l2_count:
        steady["link_s"], steady["latency_s"] = ring_time(2 * l2_rows * 4 * (lay.tp - 1) / lay.tp, lay.tp, 1, hw,
                                                          count=l2_count)
    G = lay.fs * lay.dp
    if stat_sync:
        refresh["link_s"], refresh["latency_s"] = ring_time(2 * stat_entries * (G - 1) / G * 4, G, lay.tp, hw)
    if splits(hp) and G > 1:
        if both or out_only:  # output-side blocks are a rank's own rows under FSDP2: not one statistic group's
            raise NotProjected("split_refresh is priced for the input side (its blocks shared by the statistic group) only")
        split_refresh_cost(refresh, solves, basis, G, lay.tp, hw)
    return {"steady": steady, "periodic": refresh, "every": int(hp["refresh_every"])}


COSTS = {"adamw": cost_adamw, "owner-muon": cost_owner_muon, "gather-muon": cost_gather_muon,
         "placement-muon": cost_placement_muon, "dtensor-muon": cost_dtensor_muon, "row-block-muon": cost_row_block_muon, "muonbp": cost_muonbp,
         "dion2-shard": cost_dion2_shard, "dion": cost_dion, "dobb": cost_dobb, "dobb-both": cost_dobb,
         "dobb-g": cost_dobb, "dobb-muon": cost_dobb_muon, "soap": cost_soap}


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
    steady = add_cost(parts["steady"], other_update(method, other, tensors, lay, counts))
    every = parts.get("every", 1)
    periodic = add_cost(steady, parts["periodic"]) if "periodic" in parts else None
    amort = add_cost(steady, parts["periodic"], 1.0 / every) if periodic is not None else steady
    t = seconds(amort, hw)
    out = {"steady_ms": 1e3 * seconds(steady, hw)["total_s"],
           "periodic_ms": None if periodic is None else 1e3 * seconds(periodic, hw)["total_s"],
           "every": every, "amortized_ms": 1e3 * t["total_s"], "kernels": amort["kernels"], "qr": amort["qr"]}
    out.update({k.replace("_s", "_ms"): 1e3 * v for k, v in t.items() if k != "total_s"})
    return out

