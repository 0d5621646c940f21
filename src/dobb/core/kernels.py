"""Dobb's update kernels as ``compile=True`` runs them: pure functions of plain tensors and static
structure (block runs as tuples of ints, dtypes, option values), each compiled by
``dobb._compiled.compiled`` and called once per param group (one-sided) or per matrix (two-sided,
Dobb-Muon). ``core.update`` calls them only for a group with ``compile=True``; an eager step never
reads this file.

The step's per-step numbers enter as tensors, never as Python floats (``dynamic=False`` would compile
one graph per value): the update factors ``-lr * s`` (``factors``, a float64 vector: each entry the
Python float the eager step uses) and the step count of the bias corrections (a float64 0-d
tensor, so ``1 - beta2**t`` is the same float64 number as eager's). Compiled, the products are the
same ``bmm``s of the same blocks; the element-wise passes around them are fused, so results match
eager to float32 rounding, not bit for bit (tests/integrations/test_compiled_kernels.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

import math

from .. import functional as F
from .._compiled import compiled
from ..functional import BlockBasis
from .update import OneSided, _oriented, _oriented_muon, rotated_adam

__all__ = ["one_sided_", "preconditioned_muon", "compiled_one_sided", "compiled_muon", "two_sided_group"]


def one_sided_(ws: list[Tensor], us: list[Tensor], bases: list[Tensor], runs: tuple, factors: Tensor, *, norm: str,
               dtype: torch.dtype) -> None:
    """``W += factor * normalize(U_b Q_b) Q_b^T`` for every matrix of a one-sided group: ``ws[i]``,
    ``us[i]`` stacks ``(E, r, k)`` with the blocked axis last (views of the weight and the update),
    ``bases[i]`` their row-stacked bases ``(E, k, s_max)``, ``runs[i]`` their ``(start, count, size)``
    runs of equal blocks, ``factors[i]`` the matrix's ``-lr * s`` (sign's ``1/sqrt(rows)`` included)."""
    for i, (w, u, b) in enumerate(zip(ws, us, bases)):
        E, r = u.shape[0], u.shape[1]
        for start, count, size in runs[i]:
            cols = slice(start, start + count * size)
            ub = u[:, :, cols].to(dtype).reshape(E, r, count, size).transpose(1, 2).reshape(E * count, r, size)
            q = b[:, start : start + count * size, :size].reshape(E * count, size, size).to(dtype)
            o = torch.bmm(F.block_coefficients(ub, q, norm), q.transpose(1, 2))
            w[:, :, cols].view(E, r, count, size).add_(o.view(E, count, r, size).transpose(1, 2) * factors[i])


def preconditioned_muon(u: Tensor, g: Tensor, basis: Tensor, v: Tensor, step: Tensor, sizes: tuple, rows: tuple, *,
                        dtype: torch.dtype, momentum: float, beta2: float, eps: float,
                        ns_dtype: torch.dtype) -> list[Tensor]:
    """``norm="muon"``'s directions of one matrix: ``core.update.rotated_adam`` (advancing ``v``), then
    NS5 of each of its row blocks ``rows`` (``core.update.apply_preconditioned_muon``, steps 1-3 and
    the Newton-Schulz of step 4). Tensors oriented ``(out, in)``; ``step``: the 1-based step count."""
    from ..baselines.muon_family.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz

    p = rotated_adam(u, g, basis, v, sizes, step, dtype=dtype, momentum=momentum, beta2=beta2, eps=eps)
    parts = p.split(list(rows), dim=0)
    if len(set(rows)) == 1:  # equal row blocks: one batched iteration
        return list(newton_schulz(torch.stack(parts), NS_COEFFICIENTS, NS_STEPS, NS_EPS, ns_dtype).unbind(0))
    return [newton_schulz(x, NS_COEFFICIENTS, NS_STEPS, NS_EPS, ns_dtype) for x in parts]


# ----------------------------------------------------------------------------- the calls (core.update)
def compiled_one_sided(mats: list[OneSided], *, norm: str, lr, tau: float, product_dtype) -> None:
    """``apply_directions`` of a group as one ``core.kernels.one_sided_`` call (``compile=True``)."""
    dtypes = {F.matmul_dtype(m.basis.dtype, m.basis.device, product_dtype) for m in mats}
    for dtype in dtypes:  # one call per product dtype (one in practice)
        group = [m for m in mats if F.matmul_dtype(m.basis.dtype, m.basis.device, product_dtype) == dtype]
        factors = [-lr * F.update_scale(*m.layout.shape, tau) / (math.sqrt(m.layout.rows) if norm == "sign" else 1.0)
                   for m in group]
        compiled(one_sided_)(
            [_oriented(m.layout.stacked(m.w), m.layout) for m in group], [_oriented(m.layout.stacked(m.u), m.layout)
                                                                          for m in group],
            [m.layout.stacked(m.basis) for m in group],
            tuple(tuple((r.start, r.count, r.size) for r in F.block_runs(m.layout.local_sizes)) for m in group),
            torch.tensor(factors, dtype=torch.float64, device=group[0].w.device), norm=norm, dtype=dtype)


def compiled_muon(plan, state: dict, ut: Tensor, gt: Tensor, rows: tuple, *, basis_dtype, product_dtype,
                  momentum: float, beta2: float, eps: float, ns_dtype: torch.dtype) -> list[Tensor]:
    """``apply_preconditioned_muon``'s directions of one matrix as one ``preconditioned_muon`` call."""
    ut, gt, basis, v, dtype = _oriented_muon(plan, state, ut, gt, basis_dtype, product_dtype)
    step = torch.tensor(float(state["step"] + 1), dtype=torch.float64)  # the bias corrections' t, in float64
    return compiled(preconditioned_muon)(ut, gt, basis, v, step, tuple(plan.layout.local_sizes), rows, dtype=dtype,
                                         momentum=momentum, beta2=beta2, eps=eps, ns_dtype=ns_dtype)


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
