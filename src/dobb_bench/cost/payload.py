"""Derived optimizer-specific cross-shard payload (paper Table 3, Table 7, Figure 1).

Definition (Figure 1's caption): for one ``m x n`` weight matrix, the *logical* number of scalar
entries exchanged between devices that hold different shards of that matrix during one optimizer
step. Collective factors (ring ``(S-1)/S`` etc.) and bytes per entry are omitted; forward/backward
communication and the data-parallel gradient reduction are not counted, and neither is Dobb's
data-parallel synchronization of its block statistics (``n^2 / B`` entries per matrix per refresh),
which ``dp_stat_entries`` reports separately.

Which axis is sharded matters (``sharded="output"``: rows ``m``, FSDP2's dim-0 sharding and
column-parallel TP; ``sharded="input"``: columns ``n``, row-parallel TP). The leading counts:

==================  ==================================  ==================================
optimizer           output axis ``m`` sharded           input axis ``n`` sharded
==================  ==================================  ==================================
adamw               0                                   0
muon                ``mn`` (dense exchange)             ``mn``
dion (rank r)       ``r (m + n)``                       ``r (m + n)``
dobb, dobb-g        0 (blocks within shards)            0 (blocks within shards)
dobb-l2             ``n`` (column norms)                0
dobb-g-l2           0                                   ``m`` (row norms)
rmnp                0 (rows local)                      ``m`` (row norms)
pr-muon (K)         ``mn / K``                          ``(mn + (K-1) m) / K``
block-muon, axis 0  0 (row blocks within shards)        ``mn`` (every block spans shards)
block-muon, axis 1  ``mn`` (every block spans shards)   0 (column blocks within shards)
dion2 (fraction a)  ``k n``, ``k = round(a m)`` rows    ``k n``
dion2, select=shard 0 (rows chosen within shards)       ``k n`` (rows span every shard)
muonbp (period P)   ``2 mn / P`` (owner full step)      ``2 mn / P`` (blocks follow the shards)
dion3 (fraction a)  ``k n`` (as dion2)                  ``k n``
normuon             ``mn`` (as muon)                    ``mn``
owner-muon          ``2 mn`` (shards to owner, back)    ``2 mn``
soap                ``2 mn`` (owner compute)            ``2 mn``
owner-placement     0 (whole matrix on its owner)       0
dash, shampoo       0 (tiles within shards)             0 (tiles within shards)
splus (Bi, Bo, T)   ``sum_c n_c^2 / T`` (G^T G blocks)  ``sum_b m_b^2 / T`` (G G^T blocks)
==================  ==================================  ==================================

SPlus's step is shard-local when its blocks of the sharded axis lie within shards (``out_blocks``
under a sharded ``m``, ``blocks`` under a sharded ``n``); the other side's Gram blocks sum over the
shards and are all-reduced on each refresh, every ``T = inverse_every`` steps (amortized per step;
a side of length ``>= max_dim`` has no statistic).

Owner compute (``owner-muon``, the ``dion`` package's megabatching) moves each matrix's shards to
one owner rank and the result back: twice Muon's logical count, but NS5 runs once per matrix
instead of on every rank. SOAP under sharding is owner-computed the same way (the owner also keeps
the matrix's statistics, bases and moments), so its count is owner-muon's. Owner *placement* (DMuon, MatrixFSDP) keeps each whole matrix on one
rank, so the step exchanges nothing; the matrix moves in forward and backward instead (weight
broadcast from the owner, gradient reduced to it), which ``forward_backward_entries`` reports:
``2 mn`` per step, the same leading count as FSDP2's own all-gather and reduce-scatter that every
sharded optimizer pays.

Rows adamw to dobb-g-l2 are the paper's (Table 3, Table 7); the others are derived the same way by us: the
minimum a method must exchange, whatever an implementation does (this package's reference
baselines gather whole matrices, which the payload meter would show). Amortized methods
(PR-Muon's full step every ``K``) are averaged per step. A Dobb block that straddles a shard
boundary (only possible when ``B`` is not a multiple of the shard count on the sharded axis; the
library refuses such layouts) is charged its dense slab ``s_b x`` (other axis).

Dion's rank is the library's ``dobb.baselines.dion_family.dion.dion_rank``: ``r = max(1, round(rank_fraction *
min(m, n)))``. Hyperparameters a spec leaves out are the optimizers' own defaults
(``optimizer_defaults``: the classes' ``matrix_defaults``), never repeated here. Over GPT-2 XL's
matrices (q, k, v, o: ``d x d``; fc ``4d x d``; proj ``d x 4d``) the aggregate Dion ratio
``sum r(m+n) / sum mn`` is exactly ``1.5 rho`` (Figure 1).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import dobb
from dobb import registry
from dobb.baselines.dion_family.dion import dion_rank
from dobb.functional import block_sizes
from dobb.sharding import chunk_sizes
from dobb_bench.bench_entries import bench_entry

__all__ = [
    "PAYLOAD_NAMES",
    "PAYLOAD_FORMULAS",
    "STATE_FORMULAS",
    "canonical_name",
    "optimizer_defaults",
    "payload_entries",
    "relative_payload",
    "dp_stat_entries",
    "dp_basis_entries",
    "derived_state_bytes",
    "forward_backward_entries",
]

# Names that are a placement of an optimizer, not an optimizer of their own (no build_optimizer
# name): the optimizer whose math and state they keep; the step exchanges nothing.
PLACEMENTS = {"owner-placement": "muon"}
PLACEMENT_NAMES = tuple(PLACEMENTS)
# Every optimizer of dobb.registry (declared there once), then the placements.
PAYLOAD_NAMES = (*registry.OPTIMIZER_NAMES, *PLACEMENT_NAMES)
_ALIASES = {"torch-adamw": "adamw", "torch-adamw-fused": "adamw", "torch-muon": "muon", "dobb-ell2": "dobb-l2", "dobb-g-ell2": "dobb-g-l2"}
_AXES = ("output", "input")


def canonical_name(name: str) -> str:
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PAYLOAD_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(PAYLOAD_NAMES)} "
                         f"(or {', '.join(_ALIASES)})")
    return key


def _entry(key: str) -> registry.Entry:
    return registry.get(PLACEMENTS.get(key, key))


def optimizer_defaults(name: str) -> dict:
    """The hyperparameters ``dobb.build_optimizer(name, ...)`` uses when a spec leaves them out:
    the class' ``matrix_defaults`` with the registry entry's preset on top (``{}`` for AdamW)."""
    entry = _entry(canonical_name(name))
    if not entry.is_matrix:
        return {}
    return {**entry.cls.matrix_defaults, **entry.defaults, **entry.preset}


def _with_defaults(name: str, hparams: dict | None) -> tuple[str, dict]:
    key = canonical_name(name)
    return key, {**optimizer_defaults(key), **(hparams or {})}


def _split(size: int, blocks: int) -> list[int]:
    """Dobb's (and block Muon's) block sizes: the library's own partition (``dobb.functional``)."""
    return block_sizes(size, min(blocks, size))


def _shard_bounds(size: int, shards: int) -> list[int]:
    """Interior boundaries of ``torch.chunk``-style shards (FSDP2, DTensor ``Shard``): the
    library's ``dobb.sharding.chunk_sizes``, imported here only (it loads torch.distributed.tensor)."""
    from dobb.sharding import chunk_sizes

    ends, out = 0, []
    for s in chunk_sizes(size, shards)[:-1]:
        ends += s
        if 0 < ends < size:
            out.append(ends)
    return out


def _straddling(size: int, blocks: int, shards: int) -> list[int]:
    """Sizes of the blocks (``blocks`` near-equal contiguous blocks) that cross a shard boundary."""
    if shards <= 1:
        return []
    bounds = _shard_bounds(size, shards)
    out, start = [], 0
    for s in _split(size, blocks):
        if any(start < b < start + s for b in bounds):
            out.append(s)
        start += s
    return out


def _check_axis(sharded: str) -> str:
    if sharded not in _AXES:
        raise ValueError(f"sharded must be 'output' (rows m) or 'input' (columns n), got {sharded!r}")
    return sharded


def _fraction(hparams: dict, key: str) -> float:
    frac = float(hparams[key])
    if not 0 < frac <= 1:
        raise ValueError(f"{key} must lie in (0, 1], got {frac}")
    return frac


def _blocks(hparams: dict) -> int:
    b = int(hparams["blocks"])
    if b < 1:
        raise ValueError(f"blocks must be >= 1, got {b}")
    return b


# ----- payload formulas: f(m, n, hparams, sharded, shards) -> entries; named by dobb_bench.bench_entries
def _pay_none(m, n, hp, sharded, shards):
    return 0.0


def _pay_dense(m, n, hp, sharded, shards):  # every rank needs the whole matrix (Muon, NorMuon)
    return float(m * n)


def _pay_owner(m, n, hp, sharded, shards):  # shards to the owner and the result back
    return float(2 * m * n)


def _pay_dion(m, n, hp, sharded, shards):
    return float(dion_rank(m, n, _fraction(hp, "rank_fraction")) * (m + n))


def _pay_rmnp(m, n, hp, sharded, shards):  # row norms cross shards only when columns are split
    return float(m) if sharded == "input" else 0.0


def _pay_pr_muon(m, n, hp, sharded, shards):
    period = int(hp["period"])
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    cheap = m if sharded == "input" else 0
    return (m * n + (period - 1) * cheap) / period


def _pay_selected_rows(m, n, hp, sharded, shards):  # k selected rows (dobb.baselines.dion_family.dion2)
    frac = _fraction(hp, "fraction")
    if hp.get("select", "global") != "shard":
        return float(max(1, round(frac * m)) * n)
    # select="shard": k_b rows within each row block; the blocks lie in the row shards (the library
    # cuts them at the boundaries, and refuses a count that cannot), so row sharding exchanges
    # nothing (a refused count: its straddling blocks' slabs); column sharding moves the selected rows
    if sharded == "output":
        try:
            block_sizes(m, _blocks(hp), chunk_sizes(m, shards))
            return 0.0
        except ValueError:
            return float(sum(_straddling(m, _blocks(hp), shards)) * n)
    return float(sum(max(1, round(frac * s)) for s in _split(m, _blocks(hp))) * n)


def _pay_muonbp(m, n, hp, sharded, shards):
    """Block steps: blocks run along the sharded axis, cut at the shard boundaries first (the
    library's partition), so nothing crosses; a block count the shards cannot take (which the library
    refuses) is charged its straddling blocks' slabs, as Dobb's are. Every ``P``-th step the whole
    matrix goes to its owner and back (``2 mn``, as owner-muon). Amortized over ``P``."""
    period = int(hp["period"])
    if period < 0:
        raise ValueError(f"period must be >= 0 (0: no full step), got {period}")
    size, other = (m, n) if sharded == "output" else (n, m)
    try:
        block_sizes(size, _blocks(hp), chunk_sizes(size, shards))
        block = 0
    except ValueError:
        block = sum(_straddling(size, _blocks(hp), shards)) * other
    return float(block if period == 0 else (2 * m * n + (period - 1) * block) / period)


def _pay_block_muon(m, n, hp, sharded, shards):
    axis = int(hp["axis"])  # 1: column blocks (input axis), 0: row blocks (output axis)
    blocked = "input" if axis == 1 else "output"
    if blocked != sharded:
        return float(m * n)
    size, other = (n, m) if blocked == "input" else (m, n)
    return float(sum(_straddling(size, _blocks(hp), shards)) * other)


def _pay_dobb(m, n, hp, sharded, shards):
    if hp["side"] == "both":  # each side as a one-sided Dobb-sign of its own axis
        total = 0.0
        for side, size, other, blocks in (("input", n, m, _blocks(hp)), ("output", m, n, int(hp["out_blocks"]))):
            if side == sharded:
                total += sum(_straddling(size, blocks, shards)) * other
            elif hp["source"] == "grad_gram":
                total += _stat_size(size, blocks) / int(hp["refresh_every"])
        return float(total)
    blocked, norm = hp["side"], hp["norm"]  # "input": blocks over n (columns); "output": blocks over m (rows)
    size, other = (n, m) if blocked == "input" else (m, n)
    total = 0.0
    if blocked == sharded:
        total += sum(_straddling(size, _blocks(hp), shards)) * other
    elif norm == "l2":
        total += size  # one partial squared norm per coefficient column (row) summed over shards
    if hp["source"] == "grad_gram" and blocked != sharded:
        # G^T G (G G^T) blocks sum over the sharded axis: the statistic itself crosses shards
        total += _stat_size(size, _blocks(hp)) / int(hp["refresh_every"])
    return float(total)


def _pay_splus(m, n, hp, sharded, shards):
    limit, every = int(hp["max_dim"]), int(hp["inverse_every"])
    total = 0.0
    for side, size, other, blocks in (("input", n, m, _blocks(hp)), ("output", m, n, int(hp["out_blocks"]))):
        if size >= limit:  # no statistic, identity basis
            continue
        if side == sharded:
            total += sum(_straddling(size, blocks, shards)) * other
        else:  # the Gram blocks of this side sum over the sharded axis: all-reduced per refresh
            total += _stat_size(size, blocks) / every
    return float(total)


PAYLOAD_FORMULAS: dict[str, Callable[..., float]] = {
    "none": _pay_none, "dense": _pay_dense, "owner": _pay_owner, "dion": _pay_dion, "rmnp": _pay_rmnp,
    "pr-muon": _pay_pr_muon, "selected-rows": _pay_selected_rows, "block-muon": _pay_block_muon,
    "dobb": _pay_dobb, "splus": _pay_splus, "muonbp": _pay_muonbp,
}


def payload_entries(name: str, m: int, n: int, hparams: dict | None = None, *, sharded: str = "output",
                    shards: int = 4) -> float:
    """Leading logical cross-shard entries per optimizer step for one ``m x n`` matrix."""
    key, hp = _with_defaults(name, hparams)
    _check_axis(sharded)
    if int(shards) < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if m < 1 or n < 1:
        raise ValueError(f"matrix shape must be positive, got {(m, n)}")
    if shards == 1 or key in PLACEMENTS:
        return 0.0
    return PAYLOAD_FORMULAS[bench_entry(_entry(key).name).payload](m, n, hp, sharded, int(shards))


def forward_backward_entries(name: str, m: int, n: int, *, shards: int = 4) -> float:
    """Leading entries one ``m x n`` weight moves in forward + backward under sharding: ``2 mn``
    (FSDP2's all-gather and reduce-scatter for every optimizer; owner placement's broadcast from
    and reduction to the owner), 0 on one device."""
    canonical_name(name)
    return 0.0 if int(shards) <= 1 else float(2 * m * n)


def _stat_size(size: int, blocks: int) -> int:
    return sum(s * s for s in _split(size, min(blocks, size)))


def dp_stat_entries(name: str, m: int, n: int, hparams: dict | None = None, per_step: bool = False) -> float:
    """Dobb's data-parallel statistic synchronization (``sum_b s_b^2 ~ k^2/B`` per refresh;
    ``/T`` per step with ``per_step``); 0 for every other optimizer and for ``source="grad_gram"``
    (the reduced gradient needs no extra data-parallel exchange)."""
    key, hp = _with_defaults(name, hparams)
    if not issubclass(_entry(key).cls, dobb.Dobb) or hp["source"] == "grad_gram":
        return 0.0
    if hp["side"] == "both":  # both sides' statistics are averaged over the data-parallel ranks
        entries = _stat_size(n, _blocks(hp)) + _stat_size(m, int(hp["out_blocks"]))
    else:
        entries = _stat_size(n if hp["side"] == "input" else m, _blocks(hp))
    return entries / int(hp["refresh_every"]) if per_step else float(entries)


def dp_basis_entries(name: str, m: int, n: int, hparams: dict | None = None) -> float:
    """``split_refresh=True``: the new bases each shared block's owner broadcasts to the other ranks
    of its statistic group per refresh, ``sum s_b^2`` over the blocks of even size (odd-sized ones
    are solved on every rank and not sent; ``dobb.core.statistics``). 0 without it, for every other
    optimizer, and for ``source="grad_gram"`` (no shared statistic group). Entries in the basis dtype."""
    key, hp = _with_defaults(name, hparams)
    if not issubclass(_entry(key).cls, dobb.Dobb) or hp["source"] == "grad_gram":
        return 0.0
    if str(hp.get("split_refresh", False)).lower() not in ("true", "1"):
        return 0.0
    if hp["side"] == "both":
        sizes = _split(n, min(_blocks(hp), n)) + _split(m, min(int(hp["out_blocks"]), m))
    else:
        k = n if hp["side"] == "input" else m
        sizes = _split(k, min(_blocks(hp), k))
    return float(sum(s * s for s in sizes if s % 2 == 0))


def _iter_shapes(shapes: Iterable) -> list[tuple[int, int]]:
    out = []
    for s in shapes:
        if isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[1], (tuple, list)):
            s = s[1]  # ("h0.q", (m, n)) pairs from dobb_bench.cost.shapes
        m, n = (int(v) for v in s)
        out.append((m, n))
    if not out:
        raise ValueError("no matrix shapes given")
    return out


def relative_payload(name: str, hparams: dict | None, shapes: Sequence, *, sharded: str = "output",
                     shards: int = 4) -> float:
    """Aggregate payload relative to Muon's dense count: ``sum payload / sum m n``.

    ``shapes``: ``(m, n)`` tuples or ``(name, (m, n))`` pairs. Defaults follow Figure 1 (FSDP,
    ``FS = 4``: the output axis of every matrix is sharded over 4 devices). Dion at rank fraction
    ``rho`` gives ``1.5 rho`` on GPT-2 XL's matrices; Dobb and AdamW give 0.
    """
    mats = _iter_shapes(shapes)
    num = sum(payload_entries(name, m, n, hparams, sharded=sharded, shards=shards) for m, n in mats)
    return num / sum(m * n for m, n in mats)


def derived_state_bytes(name: str, m: int, n: int, hparams: dict | None = None, param_bytes: int = 4,
                        out_shards: int = 1, in_shards: int = 1) -> float:
    """Optimizer state per matrix from buffer sizes (not measured), for the timing table.

    AdamW ``2 mn`` entries; Muon family and RMNP ``mn`` (momentum); Dion ``mn + max(m, n) r`` (fp32
    ``Q``); Dobb ``mn`` momentum plus the block statistic (fp32) and basis (bf16): ``6 k^2 / B``
    bytes for the blocked axis ``k`` (Table 18's ``6 n^2/B`` in the principal precision; the
    row-stacked buffers are ``k x ceil(k/B)``). Per rank under sharding (``out_shards`` ranks split
    the rows, ``in_shards`` the columns): weight-shaped buffers are split over both, Dobb's block
    state only over the shards of its blocked axis (replicated otherwise), Dion's ``Q`` replicated.
    """
    key, hp = _with_defaults(name, hparams)
    mn = m * n * param_bytes / (out_shards * in_shards)
    return float(STATE_FORMULAS[bench_entry(_entry(key).name).state](m, n, hp, mn, out_shards, in_shards))


# ----- state formulas: f(m, n, hparams, mn, out_shards, in_shards) -> bytes per rank; ``mn`` is the
# weight-shaped buffer's bytes on this rank; named by dobb_bench.bench_entries
def _state_adamw(m, n, hp, mn, out_shards, in_shards):  # exp_avg, exp_avg_sq
    return 2 * mn


def _state_momentum(m, n, hp, mn, out_shards, in_shards):
    return mn


def _state_momentum_rows(m, n, hp, mn, out_shards, in_shards):  # + the fp32 row second moments, whole on every rank
    return mn + m * 4


def _state_dion(m, n, hp, mn, out_shards, in_shards):  # + the fp32 Q, replicated
    return mn + max(m, n) * dion_rank(m, n, _fraction(hp, "rank_fraction")) * 4


def _state_dobb(m, n, hp, mn, out_shards, in_shards):
    side = hp["side"]
    stat_b = _dtype_bytes(hp["stat_dtype"])
    basis_b = _dtype_bytes(hp["basis_dtype"])

    def stored(k, blocks):  # row-stacked (k, s_max) buffers: k^2/B for equal blocks
        return k * -(-k // min(blocks, k))

    if side == "both":  # both sides' statistic and basis, each sharded with its own axis
        total = (mn + stored(n, _blocks(hp)) * (stat_b + basis_b) / in_shards
                 + stored(m, int(hp["out_blocks"])) * (stat_b + basis_b) / out_shards)
        if hp["norm"] == "adam":  # the rotated gradient's second moment, weight-shaped, in stat_dtype
            total += m * n * stat_b / (out_shards * in_shards)
        return total
    k = n if side == "input" else m
    total = mn + stored(k, _blocks(hp)) * (stat_b + basis_b) / (in_shards if side == "input" else out_shards)
    if hp["norm"] == "muon":  # Dobb-preconditioned Muon: the second moment in the basis, weight-shaped
        total += m * n * stat_b / (out_shards * in_shards)
    return total


def _state_dash(m, n, hp, mn, out_shards, in_shards):
    """Gradient EMA and Adam-graft second moment (weight-shaped), plus fp32 ``L``, ``R`` and their
    inverse roots for every tile of this rank's shard (``r^2 + c^2`` each: ``2 mn`` for full square tiles)."""
    from dobb.baselines.shampoo_family.dash import tile_specs

    ml, nl = chunk_sizes(m, out_shards)[0], chunk_sizes(n, in_shards)[0]  # the largest (first) shard
    block = hp.get("block_size") or max(ml, nl)  # shampoo: one tile per matrix
    return 2 * mn + 2 * 4 * sum(k * (r * r + c * c) for k, r, c in tile_specs(ml, nl, int(block)))


def _state_samuon(m, n, hp, mn, out_shards, in_shards):  # + the power iteration's warm start (fp32, length n)
    return mn + (n * 4 if hp["topk_method"] == "power" else 0)


STATE_FORMULAS: dict[str, Callable[..., float]] = {
    "adamw": _state_adamw, "momentum": _state_momentum, "momentum+rows": _state_momentum_rows,
    "dion": _state_dion, "dobb": _state_dobb, "samuon": _state_samuon, "dash": _state_dash,
}


def _state_soap(m, n, hp, mn, out_shards, in_shards):
    """fp32 first and (rotated) second moments, plus fp32 L, R and their bases for every column
    block on each preconditioned side, for the whole matrix (under sharding all of it on the
    matrix's owner rank and none on the others, so a rank holds the sum over the matrices it owns)."""
    blocks, limit = int(hp["blocks"]), int(hp["max_precondition_dim"])
    nb = n // blocks
    left = m if hp["sides"] in ("both", "output") and m <= limit else 0
    right = nb if hp["sides"] in ("both", "input") and nb <= limit else 0
    return 2 * 4 * m * n + blocks * 2 * 4 * (left * left + right * right)


def _state_newton_muon(m, n, hp, mn, out_shards, in_shards):  # + fp32 statistic and inverse per block
    nb = n // int(hp["blocks"])
    return mn + int(hp["blocks"]) * 2 * 4 * nb * nb


def _state_splus(m, n, hp, mn, out_shards, in_shards):
    """Momentum and iterate average (weight-shaped, the weight's dtype), plus fp32 statistic and
    basis per side of length ``< max_dim``, row-stacked ``(k, s_max)``: the blocked axis' buffers
    split over its shards, the other side's (a partial sum per rank) whole on every rank."""
    limit = int(hp["max_dim"])
    total = 2 * mn
    for size, blocks, shards in ((n, _blocks(hp), in_shards), (m, int(hp["out_blocks"]), out_shards)):
        if size < limit:
            total += size * -(-size // min(blocks, size)) * 2 * 4 / shards
    return total


STATE_FORMULAS.update({"soap": _state_soap, "newton-muon": _state_newton_muon, "splus": _state_splus})


def _dtype_bytes(dtype) -> int:
    text = str(dtype).replace("torch.", "")
    sizes = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2,
             "fp16": 2, "float64": 8, "double": 8}
    if text not in sizes:
        raise ValueError(f"unknown dtype {dtype!r}")
    return sizes[text]
