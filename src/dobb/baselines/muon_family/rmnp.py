"""RMNP (Row-Momentum Normalized Preconditioning): momentum with every row scaled to unit norm.

Per matrix ``W`` (``m x n``): ``M <- mu M + G``; ``U = G + mu M`` (Nesterov) or ``U = M``;
``O = rownorm(U)`` so ``||O||_F^2 = m`` exactly (Table 9, zero rows excepted);
``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O`` (update RMS ``tau*sqrt(max(m, n)/n)``).
Row norms are local when rows are not split across ranks (FSDP's dim-0 sharding): no
communication then, which is what makes it a cheap baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._base import MatrixOptimizer
from ...layout import to_local
from ..._hparams import ScaledOptions, boolean, option, unit_interval
from .. import _common as C
from ...newton_schulz import row_normalize


@dataclass(frozen=True, kw_only=True)
class RMNPOptions(ScaledOptions):
    momentum: float = option(0.95, unit_interval)
    nesterov: bool = option(False, boolean)


class RMNP(MatrixOptimizer):
    """Args: ``lr``, ``weight_decay``, ``tau``, ``momentum`` (0.95), ``nesterov`` (False), AdamW args."""

    algorithm = "rmnp"
    Options = RMNPOptions

    def _init_matrix_state(self, group):
        for p in group["params"]:
            if "momentum" not in self.state[p]:
                self.state[p]["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _matrix_step(self, group, active):
        grads = [to_local(p.grad) for p in active]
        bufs = [to_local(self.state[p]["momentum"]) for p in active]
        mu = group["momentum"]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        u = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
        outs = [C.row_wise(lambda x: row_normalize(C.upcast(x)), ut, p) for ut, p in zip(u, active)]
        params = [to_local(p) for p in active]
        scales = [C.update_scale(*p.shape, group["tau"]) for p in active]
        C.apply_protocol(params, params, outs, scales, group["lr"], group["weight_decay"])
