"""Dion3 (Amsel et al., the ``dion`` package's NorDion2): Dion2's row subset plus NorMuon's
per-neuron normalization of the orthogonalized rows.

Per matrix ``W`` (``m x n``), with error-feedback momentum ``M`` and per-row second moment ``v``:

    B = M + G
    K = the k = max(1, round(fraction * m)) rows of B with the largest ell1 norms (ascending order)
    O_K = NS5(B[K])                                      # k x n
    v[K] <- beta2 v[K] + (1 - beta2) mean_j O_K[:, j]^2  # only the selected rows' moments move
    O'_K = O_K / (sqrt(v[K]) + eps) * ||O_K||_F / ||O_K / (sqrt(v[K]) + eps)||_F
    O[K] = O'_K;  O[rows not in K] = 0
    M = B;  M[K] <- mu * B[K]
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(k, n)) * O

i.e. ``Dion2`` (same selection, error feedback and scale; see ``dion2.py``) with ``O_K`` passed
through ``normuon_normalize``, which keeps its Frobenius norm, so the moved rows keep update RMS
``tau``. ``ns_method="gram"`` and ``ns_dtype`` are Muon's options. Sharded weights are gathered
(row selection is matrix-wide); ``v`` is a whole vector, identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._base import MatrixOptimizer
from ...layout import to_local
from .. import _common as C
from .dion2 import gathered_lookahead, selected_rows
from ..._hparams import ScaledOptions, option, unit_interval
from ..._hparams import fraction as fraction_rule
from ...newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, NSOptions, ns_options, orthogonalize
from ..muon_family.normuon import NeuronOptions, normuon_normalize, state_dtype


def dion3_step(b: Tensor, v: Tensor, k: int, mu: float, beta2: float, neuron_eps: float = 1e-8,
               coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS,
               method: str = "standard", dtype: torch.dtype = torch.bfloat16,
               compile: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One step on a batch ``b = M + G`` (``(batch, m, n)``) with row moments ``v`` (``(batch, m)``).

    Returns ``(O, M_new, v_new, rows)``: the raw update (zero outside the selected rows, ``v``'s
    dtype), the new momentum, the new row moments and the selected row indices.
    """
    rows = torch.topk(b.abs().sum(dim=-1, dtype=torch.float32), k, dim=-1).indices.sort(dim=-1).values
    idx = rows.unsqueeze(-1).expand(-1, -1, b.shape[-1])
    sub = torch.gather(b, 1, idx)
    ortho = torch.stack(orthogonalize(list(sub.unbind(0)), coefficients, steps, eps, method=method, dtype=dtype,
                                       compile=compile))
    normed, v_sel = normuon_normalize(ortho, torch.gather(v, 1, rows), beta2, neuron_eps)
    o = torch.zeros(b.shape, dtype=normed.dtype, device=b.device).scatter_(1, idx, normed)
    return o, b.scatter(1, idx, sub * mu), v.scatter(1, rows, v_sel), rows


@dataclass(frozen=True, kw_only=True)
class Dion3Options(ScaledOptions, NSOptions, NeuronOptions):
    fraction: float = option(0.25, fraction_rule)
    momentum: float = option(0.95, unit_interval)


class Dion3(MatrixOptimizer):
    """Args: ``lr``, ``weight_decay``, ``tau``, ``fraction`` (0.25), ``momentum`` (0.95), ``beta2``
    (0.95), ``neuron_eps`` (1e-8), ``ns_coefficients``, ``ns_steps`` (5), ``eps``, ``ns_method``,
    ``ns_dtype``, AdamW args."""

    algorithm = "dion3"
    _own_dtype_keys = ("neuron_variance",)  # stays fp32 when a bf16 model resumes
    Options = Dion3Options

    def _init_matrix_state(self, group):
        for p in group["params"]:
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["neuron_variance"] = torch.zeros(p.shape[0], dtype=state_dtype(p), device=p.device)

    def _matrix_step(self, group, active):
        fulls, batches = gathered_lookahead(self.state, active)
        outs: list[Tensor | None] = [None] * len(active)
        scales = [0.0] * len(active)
        for (shape, _, _), idx in batches.items():
            k = selected_rows(shape[0], group["fraction"])
            v = torch.stack([self.state[active[i]]["neuron_variance"] for i in idx])
            o, m_new, v_new, _ = dion3_step(torch.stack([fulls[i] for i in idx]), v, k, group["momentum"],
                                            group["beta2"], group["neuron_eps"], group["ns_coefficients"],
                                            group["ns_steps"], group["eps"], **ns_options(group))
            for j, i in enumerate(idx):
                st = self.state[active[i]]
                to_local(st["momentum"]).copy_(C.local_slice(m_new[j], active[i]))
                st["neuron_variance"].copy_(v_new[j])
                outs[i] = C.local_slice(o[j], active[i])
                scales[i] = C.update_scale(k, shape[1], group["tau"])
        params = [to_local(p) for p in active]
        C.apply_protocol(params, params, outs, scales, group["lr"], group["weight_decay"])
