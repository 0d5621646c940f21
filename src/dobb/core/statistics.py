"""Dobb's statistics path: what the ranks agree on, the statistic fold and the basis solve.

In the step's order (``core.optimizer.Dobb._prepare_step`` says what is due, then the refresh):

1. **Agreement** (``agree``): one pass of collectives, issued identically on every rank whatever its
   data: the captured statistics of every matrix due for a refresh (token-weighted sums, ``SumBucket``;
   zero with zero weight where a layer did not run on this rank), each as one ``layout.ReducedStat``,
   and the finiteness flags of all gradients, folded into a statistic reduction over the same ranks
   when there is one. A non-finite gradient is reported before any statistic is used, so raising on
   it leaves every weight and state untouched on every rank. The flags, and the row counts where the
   host must see them, come back in one host read (``agree`` says why it cannot go); with
   ``check_finite=False`` and every due matrix holding a statistic, none.
2. **The statistic** of one side of one stack (a 2-D matrix is a stack of one, see ``layout``):
   the agreed capture, or with ``source="grad_gram"`` the gradient's block Gram (``gram_statistic``).
   ``fold_side`` applies the rules once for every matrix: a matrix of the captured span counts a
   capture when it is due (``core.schedule.due``) and some rank saw a row for it; each such local
   matrix folds the new statistic (a copy on its first capture, else the EMA) and queues its blocks
   for a new basis, exact (``eigh``) with ``basis="eigh"`` or on a first capture with
   ``init_basis="eigh"``, else by warm-started orthogonal iteration. On a capture-only step
   (``capture_every``, ``core.schedule.captured``) a matrix is agreed and folded (the EMA) alike but
   neither counts a capture nor queues a basis.
3. **The basis solve** (``solve``): ``functional.refresh_bases``, one batched call per param group,
   and the split of it across the ranks that hold the same statistic: with ``split_refresh=True``,
   and by default (``None``) where it is bitwise the unsplit refresh by construction (``split_by_default``).

The split: under FSDP2 (input-side blocks over the unsharded axis), DDP and HSDP every rank of a
statistic group holds the same reduced statistic and the same bases. Each even-sized block's refresh
is then computed by one owner rank of the group and the new bases are broadcast in the basis dtype
(``distribution.solve_on_owners``, the owner compute of replicated work), so the ranks' refresh work
divides by the group size. It is bitwise the unsplit refresh by construction: the owner solves the
same statistic and basis (identical on every rank), every rank stores the owner's result rounded to
the basis dtype, and the unsplit refresh of a shared request (``split_refresh=False``, the ``mirror``
of ``RefreshBatch``) solves every block on every rank in the very batches the owners solve
(``distribution.solve_as_owners``), so a device whose batched solve rounds a block by its batch
(CUDA's batched ``eigh`` of small blocks is Jacobi, a lone block's ``syevd``) gives both the same
bits. Odd-sized blocks stay replicated (solved by every rank in one batch per request), as before. Collectives: per
statistic group and basis dtype, one broadcast per owner rank that owns a block, in group-rank order,
with sizes derived from the block sizes; the plan reads only rank-invariant facts (which blocks are
due, their sizes, the order of the requests), so every rank issues the same broadcasts in the same order.

Every sum here is issued inside ``collectives.collective_kind`` (``"stat"``, ``"finite"``,
``"norm"``, ``"basis"``) so that a meter can tell them apart.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import functional as F
from ..capture import PendingStat
from .. import collectives
from ..collectives import group_ranks
from ..distribution import solve_as_owners, solve_on_owners
from ..layout import MatrixLayout, ReducedStat, local_nonfinite
from .options import HOOK_SOURCES

__all__ = ["SumBucket", "all_reduce_sum_", "DueStat", "Agreement", "agree", "local_nonfinite", "gram_statistic",
           "fold_side", "store_bases", "EIGH_COST", "RefreshBatch", "shared_group", "split_by_default",
           "solve"]


# ----------------------------------------------------------------------------- sums over ranks
class SumBucket:
    """Tensors summed over one process group by a single all-reduce, returned in the order added.

    Why one flat buffer: every rank adds the same segments (same shapes, same order) whatever its
    data, so the ranks always issue the same collective, and one call replaces many small ones.
    """

    def __init__(self, group, dtype: torch.dtype, device: torch.device):
        self.group, self.dtype, self.device = group, dtype, device
        self.parts: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> int:
        self.parts.append(t)
        return len(self.parts) - 1

    def reduce(self, kind: str) -> list[torch.Tensor]:
        """The segments summed over the group, in the bucket's dtype and device. Without a group the
        sum is each segment itself: no flat buffer is written (a segment already in the bucket's
        dtype and device comes back as it is, not a copy)."""
        if self.group is None:
            return [t.to(device=self.device, dtype=self.dtype) for t in self.parts]
        flat = torch.cat([t.reshape(-1).to(device=self.device, dtype=self.dtype) for t in self.parts])
        collectives.all_reduce_sum_(flat, self.group, kind)
        sizes = [t.numel() for t in self.parts]
        return [v.view(t.shape) for v, t in zip(flat.split(sizes), self.parts)]


def all_reduce_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` (ell2 column norms, gradient-Gram partial sums); no-op without a group."""
    if group is not None:
        collectives.all_reduce_sum_(tensor, group, "norm")
    return tensor


# ----------------------------------------------------------------------------- agreement
@dataclass
class DueStat:
    """One side (0: the input side or the one side, 1: the output side of ``side="both"``) of one
    matrix due for a refresh, with what this rank captured for it (``capture.PendingStat``, or None)."""

    param: torch.Tensor
    side: int
    layout: MatrixLayout
    pending: PendingStat | None
    dtype: torch.dtype
    unseen: bool  # no statistic yet: the row counts must be read on the host (first capture, exact eigh)


@dataclass
class Agreement:
    """``stats[side][param]``: the agreed statistic of each due matrix side; ``nonfinite``: (index
    into the step's parameters, number of ranks) of the first gradient with a NaN/Inf, else None
    (then ``stats`` is empty: nothing may be used)."""

    stats: tuple[dict[torch.Tensor, ReducedStat], dict[torch.Tensor, ReducedStat]] = field(
        default_factory=lambda: ({}, {}))
    nonfinite: tuple[int, int] | None = None


def agree(due: list[DueStat], params: list[torch.Tensor], step_group, check_finite: bool) -> Agreement:
    """Reduce the statistics of ``due`` over their statistic groups and, with ``check_finite``, the
    finiteness flags of ``params``' gradients over ``step_group``, in one pass of collectives."""
    buckets: dict[tuple, SumBucket] = {}
    slots = []  # (due, bucket, index of sums, index of counts, local row counts)
    for d in due:
        lay = d.layout
        device = lay.local(d.param).device
        if d.pending is not None:
            count = d.pending.count  # rows: an int for a matrix, a list per expert for a stack
            sums, n = d.pending.sums, count if isinstance(count, list) else [count]
        else:
            sums, n = torch.zeros(lay.capture_shape, dtype=d.dtype, device=device), [0] * lay.stack_span
        key = (id(lay.stat_group), d.dtype, device)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = SumBucket(lay.stat_group, d.dtype, device)
        slots.append((d, bucket, bucket.add(sums), bucket.add(torch.tensor(n, dtype=d.dtype, device=device)), n))
    flags = local_nonfinite(params) if check_finite else None
    flag_slot = None
    if flags is not None and step_group is not None:
        ranks = group_ranks(step_group)
        shared = next((b for b in buckets.values() if b.group is not None and group_ranks(b.group) == ranks), None)
        if shared is None:
            shared = buckets[("finite",)] = SumBucket(step_group, flags.dtype, flags.device)
        flag_slot = (shared, shared.add(flags))
    reduced = {id(b): b.reduce("finite" if k == ("finite",) else "stat") for k, b in buckets.items()}
    counts = [reduced[id(b)][c] for _, b, _, c, _ in slots]
    if all(b.group is None for _, b, _, _, _ in slots):
        # no statistic group (one process): the totals are this rank's row counts, known on the
        # host, so a step with check_finite=False reads no tensor value
        host = [n for *_, n in slots]
    elif check_finite or any(d.unseen for d, *_ in slots):
        host = None  # read with the flags: a first statistic needs them (schedule, exact eigh); with the
        # flags read anyway, exact captures (a capture counts only where some rank saw a row)
    else:  # every due matrix has a statistic: keep-or-update is decided on the device
        host = [None] * len(slots)
    if flags is not None or host is None:
        # The one host read of a step. Raising on a non-finite gradient (check_finite) is a decision
        # on the host by nature, before any state changes, so its flags are read every step; the row
        # counts ride on the same read. They cannot stay on the device where a statistic is new (its
        # first capture picks the copy and the exact eigh, and with split_refresh the owners and sizes
        # of the basis broadcasts, which every rank must issue alike) or where the counts decide
        # whether a capture counts (state). check_finite=False and no new statistic: no read at all.
        if flags is not None and flag_slot is not None:
            flags = reduced[id(flag_slot[0])][flag_slot[1]]
        parts = ([] if flags is None else [flags]) + (counts if host is None else [])
        flat = (torch.cat(parts).tolist() if len(parts) > 1 and len({t.device for t in parts}) == 1
                else [v for t in parts for v in t.tolist()])
        if flags is not None:
            bad = [i for i, v in enumerate(flat[: len(flags)]) if v > 0]
            if bad:
                return Agreement(nonfinite=(bad[0], int(flat[bad[0]])))
            flat = flat[len(flags):]
        if host is None:
            ends = [0, *itertools.accumulate(c.numel() for c in counts)]
            host = [flat[a:z] for a, z in zip(ends, ends[1:])]
    out = Agreement()
    for (d, b, i, _, _), total, count in zip(slots, host, counts):
        sums = reduced[id(b)][i]
        out.stats[d.side][d.param] = (d.layout.mean_on_device(sums, count) if total is None
                                      else d.layout.mean(sums, total))
    return out


# ----------------------------------------------------------------------------- the statistic
def gram_statistic(grad_local: torch.Tensor, layout: MatrixLayout, dtype=torch.float32) -> ReducedStat:
    """Gradient-Gram source: diagonal blocks of ``G^T G / m`` (input side) or ``G G^T / n`` (output)
    of every local matrix of the stack, as the statistic of a refresh (every matrix has its rows).

    Rows of the Gram sum may be sharded (the other axis split across ranks): partial sums are
    added over ``layout.l2_group`` (the same ranks that share column norms).
    """
    g = layout.stacked(grad_local)
    g = g if layout.blocked_axis == 1 else g.transpose(1, 2)
    if not layout.local_sizes:  # empty shard: so are the other ranks of its l2 group
        sums = g.new_zeros(g.shape[0], 0, layout.state_cols, dtype=dtype)
    else:
        sums = all_reduce_sum_(F.gram_blocks(g, layout.local_sizes, dtype), layout.l2_group)
    return ReducedStat(layout.pad_state_cols(sums.div_(layout.rows)), [True] * layout.stack_span)


def fold_side(new: ReducedStat, *, layout: MatrixLayout, stat: torch.Tensor, basis: torch.Tensor,
              counts: list[int], due: list[bool], stat_decay: float, eigh: bool, init_eigh: bool,
              requests: list, eigh_every: int = 0, lerps: list | None = None,
              refresh: list[bool] | None = None) -> None:
    """One side of one stack (its ``stat`` and ``basis`` state tensors): the matrices of the captured
    span that are ``due`` (capture and fold: ``schedule.captured``) and have seen a row
    (``new.seen``) fold ``new`` into their statistic where local (``functional.fold_statistic_``: a
    copy on the first capture, else the EMA with ``stat_decay``); those among them also ``refresh``
    (``schedule.due``; None: all of ``due``) count a capture (``counts``, in place) and queue their
    blocks for the basis refresh as ``(A, Q0, exact, put)`` on ``requests``: exact (``eigh``) with
    ``eigh``, or on a first capture with ``init_eigh``, else warm-started orthogonal iteration. The
    others keep statistic and basis (a capture-only step: the fold alone, no count, no request). With
    ``eigh_every = k > 0`` a matrix's every ``k``-th refresh (its capture count, before this one, a
    multiple of ``k``) is exact too, resetting the warm-started basis. ``lerps`` (optional): where a
    2-D matrix takes the plain EMA, ``(stat, new)`` is put there for the caller's one
    ``_foreach_lerp_`` of a group (before the solve reads the statistic) instead."""
    lo, E = layout.stack_offset, layout.stack_local
    refresh = due if refresh is None else refresh
    first = [counts[lo + i] == 0 for i in range(E)]
    periodic = [bool(eigh_every) and counts[lo + i] % eigh_every == 0 for i in range(E)]
    chosen = [i for i in range(E) if due[lo + i] and new.seen[lo + i]]
    for j in range(len(counts)):
        if refresh[j] and new.seen[j]:
            counts[j] += 1
    if not chosen:
        return
    stat, basis = layout.stacked(stat), layout.stacked(basis)
    keep = None if new.keep is None else new.keep[lo : lo + E]
    if lerps is not None and E == 1 and keep is None and chosen == [0] and not first[0]:
        lerps.append((stat, new.mean.to(stat.dtype)))  # fold_statistic_'s stat.lerp_, for a foreach
    else:
        F.fold_statistic_(stat, new.mean, [first[i] for i in range(E)], chosen, stat_decay, keep)
    chosen = [i for i in chosen if refresh[lo + i]]  # the fold done: the new bases
    exact_of = {i: eigh or (first[i] and init_eigh) or periodic[i] for i in chosen}
    for exact in (True, False):
        # truth tests, not ``== exact``: under torch.compile a count, and so ``first``, is symbolic
        sel = [i for i in chosen if (exact_of[i] if exact else not exact_of[i])]
        if not sel:
            continue
        idx = None if len(sel) == E else torch.tensor(sel, device=stat.device)
        k4 = None if keep is None else (keep if idx is None else keep.index_select(0, idx)).view(-1, 1, 1, 1)
        for run in F.block_runs(layout.local_sizes):
            sv, bv = F.stack_block_view(stat, run), F.stack_block_view(basis, run)
            if idx is not None:
                sv, bv_sel = sv.index_select(0, idx), bv.index_select(0, idx)
            else:
                bv_sel = bv
            requests.append((sv.reshape(-1, run.size, run.size), bv_sel.reshape(-1, run.size, run.size), exact,
                             lambda q, copies=None, bv=bv, idx=idx, k4=k4: _put_bases(bv, q, idx, k4, copies)))


def store_bases(puts: list[list], bases: list[list[torch.Tensor]]) -> None:
    """Every new basis into its state (the ``put`` of each request, ``fold_side``); off a CPU the plain
    copies of all requests run as one ``_foreach_copy_`` (the same values as one ``copy_`` each)."""
    copies: list = []
    for put_list, qs in zip(puts, bases):
        for put, q in zip(put_list, qs):
            put(q, copies)
    if copies:
        torch._foreach_copy_(*map(list, zip(*copies)))


def _put_bases(bv: torch.Tensor, q: torch.Tensor, idx: torch.Tensor | None, keep: torch.Tensor | None,
               copies: list | None = None) -> None:
    """Store new bases ``q`` into a stack's run view ``bv`` (``(E, count, s, s)``): all matrices, or
    those of ``idx``; where ``keep`` (device flags) is False the old basis stays. ``q`` is rounded to
    the basis dtype first, in its own layout (``_rounded``), so the store is a same-dtype copy.
    ``copies`` (optional): a plain store off a CPU is put there as ``(bv, q)`` (``store_bases``)."""
    if idx is None:
        q = _rounded(q.view(bv.shape), bv.dtype)
        if copies is not None and keep is None and q.device.type != "cpu":
            copies.append((bv, q))
            return
        _store(bv, q if keep is None else torch.where(keep, q, bv))
    else:
        q = q.reshape(len(idx), *bv.shape[1:]).to(bv.dtype)
        bv.index_copy_(0, idx, q if keep is None else torch.where(keep, q, bv.index_select(0, idx)))


# blocks from this size on are stored one 2-D block at a time (see ``_store``)
STORE_2D_MIN_SIZE = 256


def _rounded(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` in ``dtype``, in ``q``'s own memory layout, on a CPU: a QR or ``eigh`` result is
    column-major per block (LAPACK's layout), and rounding it while it is copied into a row-major
    basis makes one strided pass that converts and transposes at once, missing the cache; rounding
    is element-wise, so converting first (one contiguous pass) and transposing after gives the same
    bits. Elsewhere ``q`` as it is: the store's one copy converts (one kernel, not two)."""
    if q.dtype == dtype or q.device.type != "cpu":
        return q
    return q.to(dtype, memory_format=torch.preserve_format)


def _store(bv: torch.Tensor, q: torch.Tensor) -> None:
    """``bv.copy_(q)``; on a CPU a large same-dtype column-major block is copied as 2-D blocks, which
    take torch's blocked transpose copy (a 4-D transposed copy walks the source with a stride of a
    row and misses the cache on every element); the same values either way. Elsewhere one copy
    (one kernel)."""
    s = bv.shape[-1]
    if (s >= STORE_2D_MIN_SIZE and q.device.type == "cpu" and q.dtype == bv.dtype and q.dim() == 4
            and not q.is_contiguous()):
        for e in range(bv.shape[0]):
            for c in range(bv.shape[1]):
                bv[e, c].copy_(q[e, c])
    else:
        bv.copy_(q)


# ----------------------------------------------------------------------------- the basis solve
# cost of an exact eigh block relative to one round of Q <- qr(A Q), for the owner plan's balance:
# a round figure, so that a plan does not move with one host's timings (the measured ratios:
# scripts/refresh_kernels.py, docs/timing.md)
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


# Why the device does not enter: a batched solve need not be batch-invariant (CUDA's ``linalg.eigh``
# solves a batch of small blocks by Jacobi, ``syevjBatched``, and a lone block by ``syevd``; cuBLAS may
# pick another kernel for another batch count), so the unsplit refresh of a shared request solves in
# the owners' batches (``RefreshBatch.mirror``) and the split is bitwise it on every device.
def split_by_default(source: str) -> bool:
    """Whether ``Dobb(split_refresh=None)`` (the default) splits a shared request (``shared_group`` not
    None) of a param group with statistic ``source``: where the split is bitwise the unsplit refresh
    by construction on any device. The statistic must be the one the statistic all-reduce gave every
    rank (``"activation"``, ``"output_grad"``: ``agree``), not a gradient Gram each rank forms from
    its own gradient (``"grad_gram"``: equal on every rank only as far as the gradient and its Gram
    reduction are). The device does not enter: the unsplit refresh of a shared request solves its
    blocks in the owners' batches (``solve``'s ``mirror``), so a device whose batched solve rounds a
    block by its batch gives the split's bits too. Odd block sizes stay local in ``solve`` whatever
    the option; expert stacks and blocked axes sharded over the statistic group have no shared group.
    Reads only rank-invariant facts, so every rank of a group decides alike."""
    return source in HOOK_SOURCES


@dataclass
class RefreshBatch:
    """The refresh requests of one param group: ``blocks`` ``(A, Q0, exact)`` (``(b, s, s)`` each),
    the ``groups`` sharing each request (``shared_group``, or None) whose blocks the split solves, and
    the ``mirror`` groups (one per request, or None; empty: none) of the shared requests it does not
    split, solved on every rank in the batches the split's owners would solve: the unsplit refresh of
    a shared request, bitwise the split's on any device. Also the group's solve settings."""

    ortho_steps: int
    qr: str
    basis_dtype: torch.dtype
    blocks: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    mirror: list = field(default_factory=list)


def solve(batches: list[RefreshBatch]) -> list[list[torch.Tensor]]:
    """New bases for every request of every batch, in order: ``functional.refresh_bases`` for the
    local requests, the split (owner solve and broadcast) for the shared even-sized blocks."""
    out = [[None] * len(b.blocks) for b in batches]
    # (split?, ranks, dtype) -> [(batch, request, block)]: the split's units, and the mirror's (the same
    # owners' batches, every one solved here)
    units: dict[tuple, list[tuple[int, int, int]]] = {}
    handles = {}
    for bi, b in enumerate(batches):
        local = []
        mirror = b.mirror or [None] * len(b.blocks)
        for ri, ((a, _, _), g, m) in enumerate(zip(b.blocks, b.groups, mirror)):
            if (g is None and m is None) or a.shape[-1] % 2:
                local.append(ri)
                continue
            key = (g is not None, tuple(sorted(group_ranks(g if g is not None else m))), str(b.basis_dtype))
            handles[key] = (g if g is not None else m, b.basis_dtype)
            units.setdefault(key, []).extend((bi, ri, j) for j in range(a.shape[0]))
        for ri, q in zip(local, refresh_local([b.blocks[ri] for ri in local], b.ortho_steps, b.qr)):
            out[bi][ri] = q
    parts: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for key in sorted(units):  # the same order on every rank
        group, dtype = handles[key]
        for (bi, ri, j), q in _split(batches, units[key], key[1], group, dtype, communicate=key[0]).items():
            parts.setdefault((bi, ri), {})[j] = q
    for (bi, ri), blocks in parts.items():
        out[bi][ri] = torch.stack([blocks[j] for j in range(len(blocks))])
    return out


def refresh_local(blocks: list[tuple[torch.Tensor, torch.Tensor, bool]], ortho_steps: int,
                  qr: str) -> list[torch.Tensor]:
    """``functional.refresh_bases`` of ``blocks``, bitwise, without its concatenation where a batch
    (block size and rule) holds one request whose statistic is contiguous: the solve then reads the
    request's own tensors (a concatenation of one tensor is a contiguous copy of it, so the products
    see the same values in the same layout)."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (a, _, exact) in enumerate(blocks):
        groups.setdefault((a.shape[-1], exact), []).append(i)
    if any(len(idx) > 1 or not blocks[idx[0]][0].is_contiguous() for idx in groups.values()):
        return F.refresh_bases(blocks, ortho_steps, qr)
    out: list[torch.Tensor] = [None] * len(blocks)  # type: ignore[list-item]
    for (_, exact), (i,) in groups.items():
        a, q0, _ = blocks[i]
        a = a.to(torch.promote_types(a.dtype, torch.float32))
        out[i] = F.eigh_basis(a) if exact else F.orthogonal_iteration(a, q0.contiguous(), ortho_steps, qr)
    return out


def _split(batches, units, ranks, group, dtype, communicate: bool = True) -> dict[tuple, torch.Tensor]:
    """The shared blocks ``units`` (``(batch, request, block)``) of one statistic group and basis
    dtype, each solved by its owner and broadcast (``distribution.solve_on_owners``); with
    ``communicate=False`` (the mirror) every owner's batches solved on this rank, owner by owner:
    the same calls on the same blocks, so the same bits, with no collective."""
    def block(u):
        bi, ri, j = u
        a, q0, exact = batches[bi].blocks[ri]
        return a[j : j + 1], q0[j : j + 1], exact

    def solve_mine(mine: list[int]) -> list[torch.Tensor]:
        sel_units = [units[i] for i in mine]
        result = {}
        for bi in sorted({u[0] for u in sel_units}):  # each param group with its own solve settings
            sel = [u for u in sel_units if u[0] == bi]
            for u, q in zip(sel, F.refresh_bases([block(u) for u in sel], batches[bi].ortho_steps, batches[bi].qr)):
                result[u] = q[0].to(dtype)  # what the unsplit refresh stores: the solve rounded to the basis dtype
        return [result[u] for u in sel_units]

    costs = [block(u)[0].shape[-1] ** 3 * (EIGH_COST if block(u)[2] else batches[u[0]].ortho_steps) for u in units]
    shapes = [(block(u)[0].shape[-1],) * 2 for u in units]
    device = batches[units[0][0]].blocks[units[0][1]][0].device
    if not communicate:
        return dict(zip(units, solve_as_owners(costs, len(ranks), solve_mine)))
    return dict(zip(units, solve_on_owners(costs, ranks, group, solve_mine, shapes, dtype, device, "basis")))
