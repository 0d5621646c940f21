"""The refresh of one side of one stack of matrices (a 2-D matrix is a stack of one, see ``layout``):
which matrices count a capture, the statistic fold and the queue of blocks for the basis solve.

The rules, once for every matrix: a matrix of the captured span counts a capture when it is due
(``_schedule.due``) and some rank saw a row for it; each such local matrix folds the new statistic
(a copy on its first capture, else the EMA) and refreshes its bases, exactly (``eigh``) with
``basis="eigh"`` or on a first capture with ``init_basis="eigh"``, else by warm-started orthogonal
iteration. The solve itself is
``functional.refresh_bases``, one call for the whole param group.
"""
from __future__ import annotations

import torch

from . import functional as F
from .layout import MatrixLayout, ReducedStat

__all__ = ["fold_side"]


def fold_side(new: ReducedStat, *, layout: MatrixLayout, stat: torch.Tensor, basis: torch.Tensor,
              counts: list[int], due: list[bool], stat_decay: float, eigh: bool, init_eigh: bool,
              requests: list) -> None:
    """One side of one stack (its ``stat`` and ``basis`` state tensors): the matrices of the captured
    span that are ``due`` and have seen a row (``new.seen``) count a capture (``counts``, in place);
    the local ones among them fold ``new`` into their statistic (``functional.fold_statistic_``: a
    copy on the first capture, else the EMA with ``stat_decay``) and queue their blocks for the basis
    refresh as ``(A, Q0, exact, put)`` on ``requests``: exact (``eigh``) with ``eigh``, or on a
    first capture with ``init_eigh``, else warm-started orthogonal iteration. The others keep
    statistic and basis."""
    lo, E = layout.stack_offset, layout.stack_local
    first = [counts[lo + i] == 0 for i in range(E)]
    chosen = [i for i in range(E) if due[lo + i] and new.seen[lo + i]]
    for j in range(len(counts)):
        if due[j] and new.seen[j]:
            counts[j] += 1
    if not chosen:
        return
    stat, basis = layout.stacked(stat), layout.stacked(basis)
    keep = None if new.keep is None else new.keep[lo : lo + E]
    F.fold_statistic_(stat, new.mean, [first[i] for i in range(E)], chosen, stat_decay, keep)
    exact_of = {i: eigh or (first[i] and init_eigh) for i in chosen}
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
                             lambda q, bv=bv, idx=idx, k4=k4: _put_bases(bv, q, idx, k4)))


def _put_bases(bv: torch.Tensor, q: torch.Tensor, idx: torch.Tensor | None, keep: torch.Tensor | None) -> None:
    """Store new bases ``q`` into a stack's run view ``bv`` (``(E, count, s, s)``): all matrices, or
    those of ``idx``; where ``keep`` (device flags) is False the old basis stays."""
    if idx is None:
        q = q.view(bv.shape)
        bv.copy_(q if keep is None else torch.where(keep, q, bv))
    else:
        q = q.reshape(len(idx), *bv.shape[1:]).to(bv.dtype)
        bv.index_copy_(0, idx, q if keep is None else torch.where(keep, q, bv.index_select(0, idx)))
