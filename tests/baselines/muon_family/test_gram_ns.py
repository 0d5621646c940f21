"""dobb.baselines.muon_family.gram_ns: Gram Newton-Schulz equals NS5 (the quintic written out in float64), and in
bf16 stays within a few times NS5's own bf16 error."""
from __future__ import annotations

import pytest
import torch

from _baseline_refs import COEFFS, ns5_reference, randn, rel
from dobb.baselines import gram_newton_schulz, newton_schulz

SHAPES = [(48, 12), (12, 48), (20, 20), (7, 30)]


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
