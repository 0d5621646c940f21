"""The basis refresh split across the ranks that hold the same statistic (issue 23 item 5).

Why: under FSDP2 (input-side blocks over the unsharded axis), DDP and HSDP every rank of a
statistic group holds the same reduced statistic and the same bases, and each of them used to
compute the same refresh. Here each block's refresh is computed by one owner rank of the group and
the new bases are broadcast in the basis dtype, so the ranks' refresh work divides by the group
size, as owner-compute Muon divides its Newton-Schulz work (docs/timing.md, "A refresh that scales":
the refresh is two thirds of Dobb B=1's FSDP2 step on GPT-2 Small layer 0).

Exactness: the owner runs ``functional.refresh_bases`` on the same statistic and basis (identical
on every rank: the statistic comes from one all-reduce, the bases from the previous exchange), and
every rank stores the owner's result rounded to the basis dtype, which is what the unsplit refresh
stores. A block solved alone equals the same block solved inside a batch for every even block size
(checked on this CPU for fp32 and fp64); for odd sizes MKL's last bit depends on the block's place
in the batch, so odd-sized blocks stay replicated (solved by every rank, in the same batches as
before). The split is therefore bitwise the unsplit refresh (tests/distributed/test_refresh_split_sharded.py).

Collectives: per statistic group and basis dtype, one broadcast per owner rank that owns a block,
in group-rank order, with sizes derived from the block sizes. The plan reads only rank-invariant
facts (which blocks are due, their sizes, the order of the requests), so every rank issues the same
broadcasts in the same order whatever its data. Payload per refresh: each split block's ``s^2``
basis entries in the basis dtype, from its owner to the other ranks of the group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import functional as F
from .collectives import collective_kind, group_ranks

__all__ = ["RefreshBatch", "plan_owners", "shared_group", "solve"]

# cost of an exact eigh block relative to one round of Q <- qr(A Q) (scripts/refresh_kernels.py:
# 1.7x at n = 768 and 3072 on an AVX2 CPU)
EIGH_COST = 2.0


def shared_group(layout):
    """The process group whose ranks hold this layout's blocks identically (same statistic after the
    all-reduce, same bases), or None: a 2-D matrix whose statistic group captures its own blocks
    (``span_sizes`` None: the blocked axis is not sharded over the group). Expert stacks and blocked
    axes sharded over data-parallel ranks hold different blocks per rank and stay local."""
    group = layout.stat_group
    if group is None or layout.stack_size != 1 or layout.span_sizes is not None:
        return None
    return group if dist.get_world_size(group) > 1 else None


def plan_owners(costs: list[float], ranks: int) -> list[int]:
    """Owner (0 .. ranks-1) of each unit: longest first, each to the least loaded rank (ties: the
    lowest rank; equal costs keep their order). Pure: every rank computes the same plan."""
    load = [0.0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


@dataclass
class RefreshBatch:
    """The refresh requests of one param group: ``blocks`` ``(A, Q0, exact)`` (``(b, s, s)`` each),
    the ``groups`` sharing each request (``shared_group``, or None) and the group's solve settings."""

    ortho_steps: int
    qr: str
    basis_dtype: torch.dtype
    blocks: list = field(default_factory=list)
    groups: list = field(default_factory=list)


def solve(batches: list[RefreshBatch]) -> list[list[torch.Tensor]]:
    """New bases for every request of every batch, in order: ``functional.refresh_bases`` for the
    local requests, the split (owner solve and broadcast) for the shared even-sized blocks."""
    out = [[None] * len(b.blocks) for b in batches]
    units: dict[tuple, list[tuple[int, int, int]]] = {}  # (ranks, dtype) -> [(batch, request, block)]
    handles = {}
    for bi, b in enumerate(batches):
        local = []
        for ri, ((a, _, _), g) in enumerate(zip(b.blocks, b.groups)):
            if g is None or a.shape[-1] % 2:
                local.append(ri)
                continue
            key = (tuple(sorted(group_ranks(g))), str(b.basis_dtype))
            handles[key] = (g, b.basis_dtype)
            units.setdefault(key, []).extend((bi, ri, j) for j in range(a.shape[0]))
        for ri, q in zip(local, F.refresh_bases([b.blocks[ri] for ri in local], b.ortho_steps, b.qr)):
            out[bi][ri] = q
    parts: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for key in sorted(units):  # the same order on every rank
        group, dtype = handles[key]
        for (bi, ri, j), q in _split(batches, units[key], key[0], group, dtype).items():
            parts.setdefault((bi, ri), {})[j] = q
    for (bi, ri), blocks in parts.items():
        out[bi][ri] = torch.stack([blocks[j] for j in range(len(blocks))])
    return out


def _split(batches, units, ranks, group, dtype) -> dict[tuple, torch.Tensor]:
    def block(u):
        bi, ri, j = u
        a, q0, exact = batches[bi].blocks[ri]
        return a[j : j + 1], q0[j : j + 1], exact

    costs = [block(u)[0].shape[-1] ** 3 * (EIGH_COST if block(u)[2] else batches[u[0]].ortho_steps) for u in units]
    owner = plan_owners(costs, len(ranks))
    me = ranks.index(dist.get_rank())
    result = {}
    mine = [u for u, o in zip(units, owner) if o == me]
    for bi in sorted({u[0] for u in mine}):  # each param group with its own solve settings
        sel = [u for u in mine if u[0] == bi]
        for u, q in zip(sel, F.refresh_bases([block(u) for u in sel], batches[bi].ortho_steps, batches[bi].qr)):
            result[u] = q[0].to(dtype)  # what the unsplit refresh stores: the solve rounded to the basis dtype
    device = batches[units[0][0]].blocks[units[0][1]][0].device
    for r, src in enumerate(ranks):
        owned = [u for u, o in zip(units, owner) if o == r]
        if not owned:
            continue
        sizes = [block(u)[0].shape[-1] ** 2 for u in owned]
        buf = (torch.cat([result[u].reshape(-1) for u in owned]) if r == me
               else torch.empty(sum(sizes), dtype=dtype, device=device))
        with collective_kind("basis"):
            dist.broadcast(buf, src=src, group=group)
        if r != me:
            for u, flat, n in zip(owned, buf.split(sizes), sizes):
                s = int(round(n ** 0.5))
                result[u] = flat.view(s, s)
    return result
