"""Dobb's update kernels as ``compile=True`` runs them: pure functions of plain tensors and static
structure (block runs as tuples of ints, dtypes, option values), each compiled by
``dobb._compiled.compiled`` and called once per param group (one-sided: ``one_sided_``; Dobb-Muon:
``muon_directions``) or per matrix (two-sided); also the pure kernels ``core.update`` runs eagerly
beside them (``rotated_adam``, ``rotated_adam_group``: Dobb-Muon's preconditioning, per matrix and
stacked; ``two_sided_group``: the stacked two-sided step off a CPU). No import of ``core.update`` (it
imports this module): the orientation of the tensors is done there.

The step's per-step numbers enter as tensors, never as Python floats (``dynamic=False`` would compile
one graph per value): the update factors ``-lr * s`` (``factors``, a float64 vector: each entry the
Python float the eager step uses) and the step count of the bias corrections (a float64 0-d
tensor, so ``1 - beta2**t`` is the same float64 number as eager's). Compiled, the products are the
same ``bmm``s of the same blocks; the element-wise passes around them are fused, so results match
eager to float32 rounding, not bit for bit (tests/core/test_compiled_kernels.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

import math

from .. import functional as F
from .._compiled import compiled
from ..functional import BlockBasis
from ..newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalize

__all__ = ["one_sided_", "rotated_adam", "rotated_adam_group", "rotated_adam_all", "compiled_one_sided", "equal_groups", "muon_directions", "compiled_muon_directions", "two_sided_group"]


def one_sided_(ws: list[Tensor], us: list[Tensor], bases: list[Tensor], runs: tuple, factors: Tensor,
               betas: Tensor | None = None, *, norm: str, dtype: torch.dtype) -> None:
    """``W <- beta W + factor * normalize(U_b Q_b) Q_b^T`` for every matrix of a one-sided group:
    ``ws[i]``, ``us[i]`` stacks ``(E, r, k)`` with the blocked axis last (views of the weight and the
    update), ``bases[i]`` their row-stacked bases ``(E, k, s_max)``, ``runs[i]`` their ``(start, count,
    size)`` runs of equal blocks (together every column once), ``factors[i]`` the matrix's ``-lr * s``
    (sign's ``1/sqrt(rows)`` included), ``betas[i]`` its weight decay ``1 - lr * wd`` (None: decayed
    before): the decay and the add are one pass over ``W``, as eager's ``baddbmm`` with ``beta``."""
    for i, (w, u, b) in enumerate(zip(ws, us, bases)):
        E, r = u.shape[0], u.shape[1]
        for start, count, size in runs[i]:
            cols = slice(start, start + count * size)
            ub = u[:, :, cols].to(dtype).reshape(E, r, count, size).transpose(1, 2).reshape(E * count, r, size)
            q = b[:, start : start + count * size, :size].reshape(E * count, size, size).to(dtype)
            o = torch.bmm(F.block_coefficients(ub, q, norm), q.transpose(1, 2))
            wv = w[:, :, cols].view(E, r, count, size)
            if betas is not None:
                wv.mul_(betas[i])
            wv.add_(o.view(E, count, r, size).transpose(1, 2) * factors[i])


def rotated_adam(ut: Tensor, gt: Tensor, basis: Tensor, v: Tensor, sizes, step, *, dtype: torch.dtype,
                 momentum: float, beta2: float, eps: float) -> Tensor:
    """``P = R Q^T`` of ``precondition`` on plain tensors oriented ``(out, in)``, advancing ``v``; ``step``
    (1-based) an int, or a float64 0-d tensor in a compiled kernel (the same float64 bias corrections)."""
    c, gq = F.blockwise(torch.stack([ut, gt]).to(dtype), basis, sizes).unbind(0)
    gq = gq.to(v.dtype)
    v.mul_(beta2).addcmul_(gq, gq, value=1.0 - beta2)
    r = F.adam_direction(c.to(v.dtype), v, step=step, momentum=momentum, beta2=beta2, eps=eps)
    return F.blockwise(r.to(dtype), basis, sizes, transpose=True)


def rotated_adam_group(us: list[Tensor], gs: list[Tensor], bases: list[Tensor], vs: list[Tensor], sizes, step: int, *,
                       dtype: torch.dtype, momentum: float, beta2: float, eps: float) -> list[Tensor]:
    """``rotated_adam`` of equal matrices (same shape, block ``sizes``, dtypes and ``step``) as one stack,
    bit for bit: the products one ``bmm`` per run of equal blocks for all of them, each element-wise
    pass once, the second moments ``vs`` advanced in place by ``_foreach`` ops. Returns each ``P``."""
    if len(us) == 1:
        return [rotated_adam(us[0], gs[0], bases[0], vs[0], sizes, step, dtype=dtype, momentum=momentum,
                             beta2=beta2, eps=eps)]
    basis = torch.stack(bases)
    c, gq = F.blockwise(torch.stack(us + gs).to(dtype).unflatten(0, (2, len(us))), basis, sizes).unbind(0)
    gq = list(gq.to(vs[0].dtype).unbind(0))
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gq, gq, value=1.0 - beta2)
    r = F.adam_direction(c.to(vs[0].dtype), torch.stack(vs), step=step, momentum=momentum, beta2=beta2, eps=eps)
    return list(F.blockwise(r.to(dtype), basis, sizes, transpose=True).unbind(0))


def equal_groups(items: list[tuple]) -> list[list[int]]:
    """The indices of ``items`` ``(u, g, basis, v, dtype, sizes, step)`` grouped by equal matrices
    (shapes, dtypes, block sizes, device and step count), in first-seen order."""
    # the step count is compared, never hashed: hashing it made a compiled step specialise on its value
    # (a new graph every step); compared, the two counts stay symbolic with one equality guard
    groups: list[tuple[tuple, object, list[int]]] = []
    for i, (u, g, basis, v, dtype, sizes, step) in enumerate(items):
        key = (tuple(u.shape), u.dtype, g.dtype, tuple(basis.shape), basis.dtype, v.dtype, dtype, sizes, u.device)
        entry = next((e for e in groups if e[0] == key and e[1] == step), None)
        if entry is None:
            entry = (key, step, [])
            groups.append(entry)
        entry[2].append(i)
    return [idx for _, _, idx in groups]


def _rotated_by_group(us: list[Tensor], gs: list[Tensor], bases: list[Tensor], vs: list[Tensor], groups, steps, *,
                      momentum: float, beta2: float, eps: float) -> list[Tensor]:
    """``rotated_adam_group`` of each group ``(indices, product dtype, block sizes)`` at its step count
    ``steps[k]``: each ``P`` in the matrices' order."""
    out: list = [None] * len(us)
    for k, (idx, dtype, sizes) in enumerate(groups):
        ps = rotated_adam_group([us[i] for i in idx], [gs[i] for i in idx], [bases[i] for i in idx],
                                [vs[i] for i in idx], sizes, steps[k], dtype=dtype, momentum=momentum, beta2=beta2,
                                eps=eps)
        for i, x in zip(idx, ps):
            out[i] = x
    return out


def _grouped(items: list[tuple]) -> tuple[list, list]:
    """``items``' equal groups as ``(indices, product dtype, block sizes)`` and their step counts."""
    groups = equal_groups(items)
    return [(tuple(idx), items[idx[0]][4], items[idx[0]][5]) for idx in groups], [items[idx[0]][6] for idx in groups]


def rotated_adam_all(items: list[tuple], *, momentum: float, beta2: float, eps: float) -> list[Tensor]:
    """``rotated_adam`` of every matrix ``(u, g, basis, v, dtype, sizes, step)`` (oriented ``(out, in)``),
    one ``rotated_adam_group`` per group of equal matrices: each ``P`` in ``items``' order."""
    groups, steps = _grouped(items)
    return _rotated_by_group(*([it[j] for it in items] for j in range(4)), groups, steps, momentum=momentum,
                             beta2=beta2, eps=eps)


def muon_directions(us: list[Tensor], gs: list[Tensor], bases: list[Tensor], vs: list[Tensor], steps: Tensor,
                    groups: tuple, rows: tuple, *, momentum: float, beta2: float, eps: float, ns_dtype: torch.dtype,
                    out_dtype: torch.dtype | None) -> list[Tensor]:
    """``core.update.apply_preconditioned_muon``'s directions of every matrix, as ``compile=True`` runs
    them: one kernel (one graph) for the whole group, so a step pays one compiled call, not one per
    group of equal matrices and per Newton-Schulz shape. ``groups``: ``(indices, product dtype, block
    sizes)`` of each group of equal matrices (``equal_groups``), ``steps[k]`` its 1-based step count
    (float64: the same bias corrections as eager); ``rows[i]``: matrix ``i``'s Newton-Schulz row
    blocks. The same calls as eager, in the same order: ``rotated_adam_group`` per group, then
    ``orthogonalize`` of all row blocks (one batch per shape)."""
    pre = _rotated_by_group(us, gs, bases, vs, groups, steps, momentum=momentum, beta2=beta2, eps=eps)
    blocks = [b for x, r in zip(pre, rows) for b in x.split(list(r), dim=0)]
    return orthogonalize(blocks, NS_COEFFICIENTS, NS_STEPS, NS_EPS, dtype=ns_dtype, compile=True, out_dtype=out_dtype)


def compiled_muon_directions(items: list[tuple], rows: list, *, momentum: float, beta2: float, eps: float,
                             ns_dtype: torch.dtype, out_dtype: torch.dtype | None) -> list[Tensor]:
    """``muon_directions`` compiled, from ``rotated_adam_all``'s ``items`` and each matrix's row blocks."""
    groups, steps = _grouped(items)
    return compiled(muon_directions)(*([it[j] for it in items] for j in range(4)),
                                     torch.tensor([float(t) for t in steps], dtype=torch.float64), tuple(groups),
                                     tuple(tuple(r) for r in rows), momentum=momentum, beta2=beta2, eps=eps,
                                     ns_dtype=ns_dtype, out_dtype=out_dtype)


# ----------------------------------------------------------------------------- the calls (core.update)
def compiled_one_sided(mats: list, ws: list[Tensor], us: list[Tensor], *, norm: str, lr, tau: float,
                       product_dtype) -> None:
    """``core.update.apply_directions`` of a group (its ``OneSided`` items ``mats``, their weights and
    updates ``ws``, ``us`` oriented with the blocked axis last) as one ``one_sided_`` call, each
    matrix's ``decay`` (None: decayed before) folded into its pass over the weight."""
    dtypes = [F.matmul_dtype(m.basis.dtype, m.basis.device, product_dtype) for m in mats]
    for dtype in set(dtypes):  # one call per product dtype (one in practice)
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        group = [mats[i] for i in idx]
        factors = [-lr * F.update_scale(*m.layout.shape, tau) / (math.sqrt(m.layout.rows) if norm == "sign" else 1.0)
                   for m in group]
        device = group[0].w.device
        betas = (None if all(m.decay is None for m in group) else
                 torch.tensor([1.0 if m.decay is None else m.decay for m in group], dtype=torch.float64, device=device))
        compiled(one_sided_)(
            [ws[i] for i in idx], [us[i] for i in idx], [m.layout.stacked(m.basis) for m in group],
            tuple(tuple((r.start, r.count, r.size) for r in F.block_runs(m.layout.local_sizes)) for m in group),
            torch.tensor(factors, dtype=torch.float64, device=device), betas, norm=norm, dtype=dtype)


def two_sided_group(items: list, sizes: tuple, *, norm: str, step: int, momentum: float, beta2: float,
                     eps: float) -> None:
    """``two_sided_update_`` of equal matrices ``(w, u, g, rows basis, cols basis, v, factor, dtype)`` (the
    bases' block ``sizes``) as one stack, bit for bit: each element-wise pass and each product once."""
    *_, factor, dtype = items[0]
    x = items[0][1].new_empty((2 if norm == "adam" else 1, len(items), *items[0][1].shape), dtype=dtype)
    torch._foreach_copy_(list(x.flatten(0, 1).unbind(0)), [it[1] for it in items] + [it[2] for it in items][: len(x) // 2 * len(items)])
    rows, cols = (BlockBasis(torch.stack([it[i] for it in items]), s) for i, s in ((3, sizes[0]), (4, sizes[1])))
    if norm == "sign":
        d = F.rotate(x[0], rows, cols).sign_()
    else:  # the second moments updated as one stack, written back by one foreach copy
        c, gr = F.rotate(x, rows, cols).unbind(0)
        v = torch.stack([it[5] for it in items])
        gr = gr.to(v.dtype)
        v.mul_(beta2).addcmul_(gr, gr, value=1.0 - beta2)
        torch._foreach_copy_([it[5] for it in items], list(v.unbind(0)))
        d = F.adam_direction(c.to(v.dtype), v, step=step, momentum=momentum, beta2=beta2, eps=eps)
        d = F.block_pair_rms_(d, rows.sizes, cols.sizes).to(dtype)
    o = F.unrotate(d, rows, cols)
    o.mul_(factor)
    torch._foreach_add_([it[0] for it in items], list(o.to(items[0][0].dtype).unbind(0)))
