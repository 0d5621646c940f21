"""dobb.baselines.muon_family.newton_schulz (NS5, ``orthogonalize``) against torch.optim.Muon's NS kernel (bitwise),
float64 SVD (the singular-value band) and the quintic iteration written out in float64."""
from __future__ import annotations

import pytest
import torch

from _baseline_refs import COEFFS, ns5_reference, randn, raw_update, rel
from dobb.baselines import Muon, newton_schulz, orthogonalize

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
SHAPES = [(24, 24), (40, 16), (16, 40)]


@pytest.mark.parametrize("shape", SHAPES + [(64, 64)])
def test_batched_ns_equals_torch_kernel(shape):
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([torch_ns(t, COEFFS, 5, 1e-7) for t in x])
    assert torch.equal(newton_schulz(x), ref)  # same arithmetic, bitwise on CPU
    outs = orthogonalize(list(x) + [x[0, :7]])  # a group of 3 (batched) and a singleton (torch's)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    assert torch.equal(outs[3], torch_ns(x[0, :7], COEFFS, 5, 1e-7))


@pytest.mark.parametrize("shape", SHAPES)
def test_ns_singular_values_in_band(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sv = torch.linalg.svdvals(newton_schulz(x).double())
    assert sv.min() > 0.6 and sv.max() < 1.25  # NS5's quintic lands in ~[0.7, 1.2], not at 1
    o, _ = raw_update(Muon, shape, [x])
    assert 0.6**2 < o.square().sum() / min(shape) < 1.25**2  # ||O||_F^2 ~ min(m, n) (Table 9)


def test_orthogonalize_gram_option_and_validation():
    mats = [randn(16, 40, seed=i) for i in range(3)] + [randn(40, 16, seed=9)]
    outs = orthogonalize(mats, method="gram", dtype=torch.float64)
    for m, o in zip(mats, outs):
        assert o.dtype == torch.float64 and rel(o, ns5_reference(m)) < 1e-12
    with pytest.raises(ValueError, match="method"):
        orthogonalize(mats, method="svd")
