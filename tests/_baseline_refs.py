"""Toy problems and float64 references shared by the baseline tests (``tests/baselines/``) and the
tests of their shared base class (``tests/test_base.py``).

Kept in one place because the per-module test files were split out of two files that shared them
(``test_baselines.py``, ``test_peers.py``); ``tests/`` is on ``sys.path`` (``conftest.py``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

COEFFS = (3.4445, -4.7750, 2.0315)


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8)).to(dtype)


def data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g, dtype=dtype), torch.randn(64, 8, generator=g, dtype=dtype)


ALL_2D = dict(is_matrix=lambda name, mod, p: p.dim() == 2)  # every weight matrix, incl. the last


def train(model, opt, steps, X=None, Y=None):
    X, Y = (X, Y) if X is not None else data(next(model.parameters()).dtype)
    for _ in range(steps):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        opt.step()


def raw_update(opt_cls, shape, grads, dtype=torch.float64, **kw):
    """Raw O of the last step: one m x n weight, lr=1, wd=0, so dW = -s O."""
    w = nn.Parameter(torch.zeros(shape, dtype=dtype))
    opt = opt_cls([w], lr=1.0, **kw)
    for g in grads:
        before = w.detach().clone()
        w.grad = g.to(dtype)
        opt.step()
    s = 0.2 * math.sqrt(max(shape))
    return (before - w.detach()) / s, opt


def spectrum(m, n, values, seed=0):
    """An m x n float64 matrix with the given singular values, and its polar factor U V^T."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(values), generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, len(values), generator=g, dtype=torch.float64)).Q
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T, u @ v.T


def ns5_reference(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic iteration written out in float64 on one matrix (the definition)."""
    a, b, c = COEFFS
    y = x.double()
    tall = y.shape[0] > y.shape[1]
    y = y.T if tall else y
    y = y / y.norm()
    for _ in range(steps):
        g = y @ y.T
        y = a * y + (b * g + c * g @ g) @ y
    return y.T if tall else y


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _weights_after(cls, grads, **kw):
    w = nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float64))
    opt = cls([w], lr=0.1, weight_decay=0.01, **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


def muonbp_reference(w0, grads, sizes, axis, period, lr=0.05, wd=0.1, mu=0.9, tau=0.2, nesterov=True):
    """MuonBP's schedule written out in float64 on one matrix (Muon's EMA momentum; a full step at
    the steps 0, P, 2P, ... at ``tau*sqrt(max(m, n))``, else each block of ``sizes`` along ``axis``
    alone at ``tau*sqrt(max(m_b, n_b))``; ``period=0``: never full). Returns the final weight."""
    w, buf = w0.clone(), torch.zeros_like(w0)
    m, n = w.shape
    for t, g in enumerate(grads):
        buf = buf + (1 - mu) * (g - buf)
        u = g + mu * (buf - g) if nesterov else buf
        w = (1 - lr * wd) * w
        if period > 0 and t % period == 0:  # full step: the whole matrix, Muon's scale
            w = w - lr * tau * math.sqrt(max(m, n)) * ns5_reference(u)
        else:  # block step: each block alone, its own scale
            start = 0
            for size in sizes:
                sl = (slice(start, start + size), slice(None)) if axis == 0 else (slice(None), slice(start, start + size))
                ub = u[sl]
                w[sl] = w[sl] - lr * tau * math.sqrt(max(ub.shape)) * ns5_reference(ub)
                start += size
    return w


def dion2_shard_reference(w0, grads, sizes, fraction, lr=0.05, wd=0.1, mu=0.9, tau=0.2):
    """Dion2 per row block written out in float64: each block of ``sizes`` rows keeps its
    ``max(1, round(fraction * m_b))`` heaviest rows (ell1), orthogonalizes them and moves them with
    ``tau*sqrt(max(k_b, n))``; the selected rows of the buffer decay by ``mu``."""
    w, mom = w0.clone(), torch.zeros_like(w0)
    n = w.shape[1]
    for g in grads:
        b = mom + g
        w = (1 - lr * wd) * w
        start = 0
        for size in sizes:
            blk = b[start:start + size]
            k = max(1, round(fraction * size))
            keep = sorted(start + int(r) for r in torch.argsort(blk.abs().sum(dim=1), descending=True)[:k])
            w[keep] -= lr * tau * math.sqrt(max(k, n)) * ns5_reference(b[keep])
            b[keep] *= mu
            start += size
        mom = b
    return w
