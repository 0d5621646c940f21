"""Dion2-style row-subset Muon: orthogonalize only the heaviest ``fraction`` of momentum rows.

Our exact rule (Dion's error feedback with "keep a row subset" as the compression, after the
row-selection update of Amsel et al.'s Dion2/Dion3):

    B = M + G                                  # error-feedback buffer, as in Dion
    K = the k = max(1, round(fraction * m)) rows of B with the largest ell1 norms (ascending order)
    O[K] = NS5(B[K]);  O[rows not in K] = 0    # unselected rows get no update this step
    M = B;  M[K] <- mu * B[K]                  # selected rows decay (consumed), the rest accumulate
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(k, n)) * O

The scale is the shared protocol applied to the ``k x n`` matrix that was orthogonalized, so the
updated rows move with RMS ``tau``, as a Muon step does (``||O||_F^2 ~ min(k, n)``); weight decay
acts on the whole matrix every step. With ``fraction=1`` this is Muon without Nesterov (the buffer
is ``(1 - mu)^-1`` times Muon's EMA, a factor NS5 removes). Ties in the ell1 norms are broken by
``torch.topk``. Sharded weights are gathered (row selection is matrix-wide).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from .._base import MatrixOptimizer
from .._dtensor import to_local
from . import _common as C
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalize


def selected_rows(n_rows: int, fraction: float) -> int:
    return max(1, round(fraction * n_rows))


def dion2_step(b: Tensor, k: int, mu: float, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
               eps: float = NS_EPS) -> tuple[Tensor, Tensor, Tensor]:
    """One step on a batch ``b = M + G`` (``(batch, m, n)``). Returns ``(O, M_new, rows)``:
    the raw update (bf16, zero outside the selected rows), the new momentum, the row indices."""
    rows = torch.topk(b.abs().sum(dim=-1, dtype=torch.float32), k, dim=-1).indices.sort(dim=-1).values
    idx = rows.unsqueeze(-1).expand(-1, -1, b.shape[-1])
    sub = torch.gather(b, 1, idx)
    ortho = torch.stack(orthogonalize(list(sub.unbind(0)), coefficients, steps, eps))
    o = torch.zeros(b.shape, dtype=ortho.dtype, device=b.device).scatter_(1, idx, ortho)
    m_new = b.scatter(1, idx, sub * mu)
    return o, m_new, rows


class Dion2(MatrixOptimizer):
    """Args: ``lr``, ``weight_decay``, ``tau``, ``fraction`` (0.25), ``momentum`` (0.95),
    ``ns_coefficients``, ``ns_steps`` (5), ``eps``, AdamW args."""

    algorithm = "dion2"
    matrix_defaults: dict[str, Any] = dict(fraction=0.25, momentum=0.95, ns_coefficients=NS_COEFFICIENTS,
                                           ns_steps=NS_STEPS, eps=NS_EPS)

    def _check_matrix_group(self, group):
        C.check_fraction(group, "fraction")
        C.check_unit_interval(group, "momentum")
        C.check_int(group, "ns_steps", 1, 99)
        C.check_positive(group, "eps")

    def _init_matrix_state(self, group):
        for p in group["params"]:
            if "momentum" not in self.state[p]:
                self.state[p]["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _matrix_step(self, group, active):
        fulls, batches = gathered_lookahead(self.state, active)
        outs: list[Tensor | None] = [None] * len(active)
        scales = [0.0] * len(active)
        for (shape, _, _), idx in batches.items():
            k = selected_rows(shape[0], group["fraction"])
            o, m_new, _ = dion2_step(torch.stack([fulls[i] for i in idx]), k, group["momentum"],
                                     group["ns_coefficients"], group["ns_steps"], group["eps"])
            for j, i in enumerate(idx):
                p = active[i]
                to_local(self.state[p]["momentum"]).copy_(C.local_slice(m_new[j], p))
                outs[i] = C.local_slice(o[j], p)
                scales[i] = C.update_scale(k, shape[1], group["tau"])
        params = [to_local(p) for p in active]
        C.apply_protocol(params, params, outs, scales, group["lr"], group["weight_decay"])


def gathered_lookahead(state, active):
    """Whole ``momentum + grad`` of each active matrix (gathered when sharded), and the indices of
    equal (shape, dtype, device) matrices, so a row-subset step runs batched over each shape."""
    fulls, batches = [], defaultdict(list)
    for i, p in enumerate(active):
        b = C.gather_full(to_local(state[p]["momentum"]) + to_local(p.grad), p)
        fulls.append(b)
        batches[(tuple(b.shape), b.dtype, b.device)].append(i)
    return fulls, batches
