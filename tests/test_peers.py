"""The strongest peers' single-process math against dense float64 references: Gram Newton-Schulz
(== NS5), NorMuon and Dion3 (row subset + per-neuron normalization)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dobb.baselines import BlockMuon, Muon, gram_newton_schulz, newton_schulz, orthogonalize

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = [(48, 12), (12, 48), (20, 20), (7, 30)]


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


# ----------------------------------------------------------------------------- Gram Newton-Schulz
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_gram_ns_equals_ns5_in_float64(shape, steps):
    x = randn(3, *shape, seed=steps)
    out = gram_newton_schulz(x, COEFFS, steps, 1e-7, dtype=torch.float64)
    for i in range(3):
        assert rel(out[i], ns5_reference(x[i], steps)) < 1e-12
    # restarts change the arithmetic, not the result
    again = gram_newton_schulz(x, COEFFS, steps, 1e-7, dtype=torch.float64, restarts=(0, 1, 2, 3))
    assert rel(again, out) < 1e-12


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_ns_half_precision_within_ns5_tolerance(shape):
    """In bf16 both iterations carry rounding; the Gram one (with its restart) stays within a few
    times NS5's own bf16 error of the exact iterate, and its singular values near the exact ones."""
    x = randn(*shape, seed=3)
    exact = ns5_reference(x)
    ns_err = rel(newton_schulz(x), exact)
    gram = gram_newton_schulz(x, COEFFS, 5, 1e-7)
    assert gram.dtype == torch.bfloat16
    assert rel(gram, exact) < max(4 * ns_err, 0.02)
    sv, sv_exact = torch.linalg.svdvals(gram.double()), torch.linalg.svdvals(exact)
    assert (sv - sv_exact).abs().max() < 0.1
    fp32 = gram_newton_schulz(x, COEFFS, 5, 1e-7, dtype=torch.float32)
    assert rel(fp32, exact) < 1e-4


def test_orthogonalize_gram_option_and_validation():
    mats = [randn(16, 40, seed=i) for i in range(3)] + [randn(40, 16, seed=9)]
    outs = orthogonalize(mats, method="gram", dtype=torch.float64)
    for m, o in zip(mats, outs):
        assert o.dtype == torch.float64 and rel(o, ns5_reference(m)) < 1e-12
    with pytest.raises(ValueError, match="method"):
        orthogonalize(mats, method="svd")


def _weights_after(cls, grads, **kw):
    w = nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float64))
    opt = cls([w], lr=0.1, weight_decay=0.01, **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


@pytest.mark.parametrize("cls,kw", [(Muon, {}), (BlockMuon, {"blocks": 3, "axis": 1}),
                                    (BlockMuon, {"blocks": 2, "axis": 0})])
def test_muon_and_block_muon_gram_option(cls, kw):
    grads = [randn(24, 36, seed=s) for s in range(3)]
    std = _weights_after(cls, grads, ns_dtype="float64", **kw)
    gram = _weights_after(cls, grads, ns_dtype=torch.float64, ns_method="gram", **kw)
    assert (std - gram).abs().max().item() < 1e-12
    # and the float64 standard path is the reference iteration itself (Muon: one block)
    if cls is Muon:
        mu, u, buf = 0.95, None, torch.zeros(24, 36, dtype=torch.float64)
        w = torch.zeros(24, 36, dtype=torch.float64)
        for g in grads:
            buf = buf + (1 - mu) * (g - buf)
            u = g + mu * (buf - g)
            w = (1 - 0.1 * 0.01) * w - 0.1 * 0.2 * math.sqrt(36) * ns5_reference(u)
        assert (std - w).abs().max().item() < 1e-12


@pytest.mark.parametrize("kw,arg", [({"ns_method": "svd"}, "ns_method"), ({"ns_dtype": "int8"}, "ns_dtype"),
                                    ({"ns_dtype": torch.int32}, "ns_dtype")])
def test_ns_option_validation(kw, arg):
    with pytest.raises(ValueError, match=arg):
        Muon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, **kw)
