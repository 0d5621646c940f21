"""Dion (Ahn et al. 2025, "Dion: Distributed Orthonormalized Updates"), written from Algorithm 1.

Per matrix with gradient ``G`` and error-feedback momentum ``M`` (rank ``r``):

    B = M + G
    P = orth(B Q)                 # one warm-started power iteration; QR (or randomized Cholesky QR)
    R = B^T P
    M <- B - (1 - mu) P R^T       # error feedback: what the rank-r step did not consume stays
    Q <- colnorm(R)
    O = P Q^T                     # ||O||_F^2 = r exactly (orthonormal P, unit columns of Q)
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O

``r = max(1, round(rank_fraction * min(m, n)))``. Orientation (our convention): the iteration runs
on ``B`` if ``m <= n`` and on ``B^T`` otherwise, so the QR'd factor ``P`` always has ``min(m, n)``
rows (the cheaper QR) and the persistent ``Q`` has ``max(m, n)`` rows. ``Q`` starts as a Gaussian
matrix from ``torch.Generator().manual_seed(seed + k)`` (``k``: the parameter's position among the
optimizer's matrices), column-normalized: identical on every rank. The math runs in fp32 (fp64 for
fp64 weights); ``M`` is stored in the weight's dtype, ``Q`` in fp32. All equal-shape matrices of a
group run as one batch. Sharded (DTensor) weights are gathered: that all-gather is the
communication Dion's distributed algorithm reduces to ``O(r(m+n))``; this class is the
single-device reference of the algorithm, not its distributed implementation.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from .._base import MatrixOptimizer
from . import _common as C
from .newton_schulz import column_normalize

_QR = ("householder", "rcqr")


def dion_rank(m: int, n: int, rank_fraction: float) -> int:
    return max(1, round(rank_fraction * min(m, n)))


def qr_randomized_cholesky(p: Tensor, generator: torch.Generator | None = None,
                           oversample: float = 1.25) -> Tensor:
    """Orthonormal factor of a batch ``(b, s, r)`` by randomized Cholesky QR (no host sync).

    A Gaussian sketch ``S`` (``ceil(oversample*r) x s``) gives ``R1`` from a small QR of ``S P``;
    ``P1 = P R1^{-1}`` is well conditioned, and one Cholesky QR of ``P1`` finishes the job. Tiny
    pivots of ``R1`` and the Gram are shifted (shifted Cholesky QR) instead of branching, so a
    rank-deficient ``P`` (e.g. a zero gradient) yields finite, not exactly orthonormal, columns.
    """
    b, s, r = p.shape
    k = math.ceil(oversample * r)
    sketch = torch.randn(b, k, s, generator=generator, device=p.device, dtype=p.dtype) / math.sqrt(k)
    r1 = torch.linalg.qr(sketch @ p, mode="r").R
    tiny, eps = torch.finfo(p.dtype).tiny ** 0.5, torch.finfo(p.dtype).eps
    d = r1.diagonal(dim1=-2, dim2=-1)
    floor = (eps * r * d.abs().amax(-1, keepdim=True)).clamp_min(tiny)
    d_safe = torch.where(d.abs() < floor, torch.where(d < 0, -floor, floor), d)
    r1 = r1 - torch.diag_embed(d) + torch.diag_embed(d_safe)
    p1 = torch.linalg.solve_triangular(r1, p, upper=True, left=False)
    gram = p1.mT @ p1
    shift = (eps * gram.diagonal(dim1=-2, dim2=-1).mean(-1)).clamp_min(tiny)
    gram = gram + shift[:, None, None] * torch.eye(r, dtype=p.dtype, device=p.device)
    r2 = torch.linalg.cholesky_ex(gram, upper=True).L
    return torch.linalg.solve_triangular(r2, p1, upper=True, left=False)


def orthonormalize(p: Tensor, qr: str = "householder", generator: torch.Generator | None = None) -> Tensor:
    if qr == "householder":
        return torch.linalg.qr(p).Q
    if qr == "rcqr":
        return qr_randomized_cholesky(p, generator)
    raise ValueError(f"qr must be one of {_QR}, got {qr!r}")


def dion_step(b: Tensor, q: Tensor, mu: float, qr: str = "householder",
              generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One Dion step on an oriented batch ``b`` (``(batch, s, l)``, ``s <= l``), ``B = M + G``.

    Returns ``(O, M_new, Q_new)``: the raw update ``P Q^T`` (``(batch, s, l)``), the
    error-feedback momentum and the next warm start ``(batch, l, r)``.
    """
    p = orthonormalize(b @ q, qr, generator)
    r = b.mT @ p
    m_new = torch.baddbmm(b, p, r.mT, alpha=-(1.0 - mu))
    q_new = column_normalize(r)
    return p @ q_new.mT, m_new, q_new


class Dion(MatrixOptimizer):
    """Args: ``lr``, ``weight_decay``, ``tau``, ``rank_fraction`` (0.25), ``momentum`` (``mu``, 0.95),
    ``qr`` ("householder" or "rcqr": randomized Cholesky QR), ``seed`` (0), AdamW args."""

    algorithm = "dion"
    matrix_defaults: dict[str, Any] = dict(rank_fraction=0.25, momentum=0.95, qr="householder", seed=0)

    def __init__(self, params, *, lr: float, **kwargs):
        self._n_matrices = 0
        super().__init__(params, lr=lr, **kwargs)

    def _validate_matrix_group(self, group):
        C.check_fraction(group, "rank_fraction")
        C.check_unit_interval(group, "momentum")
        C.check_choice(group, "qr", _QR)
        C.check_int(group, "seed", 0)
        for p in group["params"]:
            state = self.state[p]
            if state:
                continue
            m, n = p.shape
            r = dion_rank(m, n, group["rank_fraction"])
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            gen = torch.Generator().manual_seed(group["seed"] + self._n_matrices)
            q0 = column_normalize(torch.randn(max(m, n), r, generator=gen, dtype=dtype))
            self._n_matrices += 1
            state["step"] = 0
            state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["Q"] = q0.to(_device_of(p))

    def _matrix_step(self, group):
        active = [p for p in group["params"] if p.grad is not None]
        if not active:
            return
        batches: dict[tuple, list[int]] = defaultdict(list)
        fulls = []
        for i, p in enumerate(active):
            st = self.state[p]
            mom, grad = C.local(st["momentum"]), C.local(p.grad)
            dtype = st["Q"].dtype
            b = C.gather_full(mom.to(dtype) + grad.to(dtype), p)
            fulls.append(b if p.shape[0] <= p.shape[1] else b.mT)
            batches[(tuple(fulls[-1].shape), st["Q"].shape[1], dtype, b.device)].append(i)
        outs: list[Tensor | None] = [None] * len(active)
        for idx in batches.values():
            ps = [active[i] for i in idx]
            qs = [self.state[p]["Q"] for p in ps]
            gen = None
            if group["qr"] == "rcqr":  # fresh sketch per step, reproducible on resume and on every rank
                step = self.state[ps[0]]["step"]
                gen = torch.Generator(device=qs[0].device).manual_seed(group["seed"] * 1_000_003 + step)
            o, m_new, q_new = dion_step(torch.stack([fulls[i] for i in idx]), torch.stack(qs),
                                        group["momentum"], group["qr"], gen)
            for j, (i, p) in enumerate(zip(idx, ps)):
                st = self.state[p]
                tall = p.shape[0] > p.shape[1]
                st["Q"].copy_(q_new[j])
                mj, oj = (m_new[j].mT, o[j].mT) if tall else (m_new[j], o[j])
                C.local(st["momentum"]).copy_(C.local_slice(mj, p))
                outs[i] = C.local_slice(oj, p)
        params = [C.local(p) for p in active]
        scales = [C.protocol_scale(*p.shape, group["tau"]) for p in active]
        C.apply_protocol(params, params, outs, scales, group["lr"], group["weight_decay"])
        for p in active:
            self.state[p]["step"] += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts floating state to the weight's dtype on load (it calls
        # Optimizer._process_value_according_to_param_policy directly, so overriding that has no
        # effect): put Q back in the dtype it was saved in, or a bf16 model would resume with bf16 Q.
        saved = C.saved_state_by_param(self, state_dict, "Q")
        super().load_state_dict(state_dict)
        for p, q in saved.items():
            self.state[p]["Q"] = q.to(device=_device_of(p), copy=True)
        for p in self.iter_matrix_params():
            if "step" in self.state[p]:
                self.state[p]["step"] = int(self.state[p]["step"])


def _device_of(p: Tensor) -> torch.device:
    return C.local(p).device if C.is_dtensor(p) else p.device
