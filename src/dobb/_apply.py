"""Dobb's apply-direction kernels: ``W -= lr * s * normalize(U_b Q_b) Q_b^T`` for every block of a
param group, batched by block shape (a mixin of ``Dobb``; state and layouts stay in ``dobb``).

Expert stacks ``(E, out, in)`` go through ``experts.apply_stack`` (one ``bmm`` pair per run of
equal blocks over all experts); 2-D matrices through ``_project_and_add``.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from . import functional as F
from .collectives import all_reduce_sum_
from .experts import ExpertLayout, apply_stack
from .layout import MatrixLayout


class DirectionKernels:
    # torch runs baddbmm_ into a strided weight view as one addmm_ per block: a win (one pass over
    # W, no update temporary) for large blocks, launch-bound for small ones (docs/timing.md)
    _FUSE_MIN_BLOCK_WORK = 1 << 18
    _SMALL_BLOCK = 16  # CPU: blocks up to this size use the transposed products (_project_and_add)

    @classmethod
    def _decay_in_update(cls, pt: torch.Tensor, layout: MatrixLayout, group: dict) -> bool:
        if isinstance(layout, ExpertLayout) or group["side"] == "both":
            return False  # decayed by one foreach pass, then updated by apply_stack / _apply_two_sided
        rows = pt.shape[1 - layout.blocked_axis]
        return (pt.device.type == "cpu" and not isinstance(group["lr"], torch.Tensor)
                and pt.dtype == F.matmul_dtype(group["basis_dtype"], pt.device, group["product_dtype"])
                and min((rows * s * s for s in layout.local_sizes if s > 0), default=0) >= cls._FUSE_MIN_BLOCK_WORK)

    def _apply_directions(self, group: dict, active: list, u: list, params: list, betas: list) -> None:
        """``W -= lr * s * O`` with ``O`` from batched project -> normalize -> reconstruct.

        All equal-shape blocks of the group go through one pair of ``bmm`` calls, computed in the
        basis dtype (bf16 by default: half the memory traffic, bf16 matrix units). The constant
        ``-lr * s`` (and sign's ``1/sqrt(rows)``) is folded into the final in-place add, so no
        update-sized temporary is written besides the coefficients. ``betas[i]``: the decay factor
        folded into that matrix's reconstruction (``baddbmm``), or None (already decayed).
        """
        norm, lr, tau, product = group["norm"], group["lr"], group["tau"], group["product_dtype"]
        batches: dict[tuple, list] = defaultdict(list)
        for p, ut, pt, beta in zip(active, u, params, betas):
            layout = self._layouts[p]
            basis = layout.local(self.state[p]["basis"])
            factor = -lr * F.update_scale(*layout.shape, tau) / (math.sqrt(layout.rows) if norm == "sign" else 1.0)
            if isinstance(layout, ExpertLayout):
                apply_stack(layout, basis, ut, pt, norm, factor, F.matmul_dtype(basis.dtype, basis.device, product))
                continue
            uo, po = (ut, pt) if layout.blocked_axis == 1 else (ut.transpose(0, 1), pt.transpose(0, 1))
            r = uo.shape[0]
            for run in F.block_runs(layout.local_sizes):
                # l2 with sharded rows: one batch per matrix, so every rank of the l2 group issues the
                # same norm reductions in the same order (local row counts may differ across ranks)
                l2_key = (id(layout.l2_group), id(p) if layout.l2_group is not None else None)
                key = (r, run.size, F.matmul_dtype(basis.dtype, basis.device, product), layout.rows, l2_key if norm == "l2" else None)
                batches[key].append((uo[:, run.start : run.stop], F.block_view(basis, run), po, run, layout, factor, beta))
        for (r, size, dtype, _, _), items in batches.items():
            # One bmm pair per batch of equal blocks. On CPU a strided block view feeds bmm at no
            # cost while stacking matrices costs a transposing copy, so CPU batches per matrix;
            # accelerators stack all matrices to save kernel launches.
            if items[0][0].device.type == "cpu":
                for it in items:
                    self._project_and_add([it], r, size, dtype, norm)
            else:
                self._project_and_add(items, r, size, dtype, norm)

    @classmethod
    def _project_and_add(cls, items: list, r: int, size: int, dtype: torch.dtype, norm: str) -> None:
        if len(items) == 1 and norm == "sign" and size <= cls._SMALL_BLOCK and items[0][6] is None:
            # Small blocks: MKL's batched GEMM is far faster with the long row axis as the product's
            # N (C_b^T = Q_b^T U_b^T, (s x s)(s x r)) than as its M (3-7x at s = 8, docs/timing.md).
            ut, q, po, run, _, factor, _ = items[0]
            ct = torch.bmm(q.to(dtype).transpose(1, 2), ut.to(dtype).t().reshape(run.count, size, r)).sign_()
            po[:, run.start : run.stop].t().view(run.count, size, r).add_(torch.bmm(q.to(dtype), ct), alpha=factor)
            return
        counts = [it[3].count for it in items]
        views = [it[0].to(dtype).reshape(r, it[3].count, size).transpose(0, 1) for it in items]
        ub = views[0] if len(items) == 1 else torch.cat(views)
        q = (items[0][1] if len(items) == 1 else torch.cat([it[1] for it in items])).to(dtype)
        l2_group = items[0][4].l2_group
        c = F.block_coefficients(ub, q, norm, col_sq_sum=lambda sq: all_reduce_sum_(sq, l2_group))
        if len(items) == 1 and items[0][6] is not None:  # W_b <- beta W_b + factor C_b Q_b^T, one pass
            _, _, po, run, _, factor, beta = items[0]
            po[:, run.start : run.stop].view(r, run.count, size).transpose(0, 1).baddbmm_(
                c, q.transpose(1, 2), beta=beta, alpha=factor)
            return
        o = torch.bmm(c, q.transpose(1, 2))
        for ob, (_, _, po, run, _, factor, _) in zip(o.split(counts), items):
            po[:, run.start : run.stop].view(r, run.count, size).add_(ob.transpose(0, 1), alpha=factor)
