"""dobb.baselines.muon_family.rmnp: RMNP's update is the momentum's rows normalized, computed by hand (Table 9's
norm: exactly m)."""
from __future__ import annotations

import pytest
import torch

from _baseline_refs import raw_update
from dobb.baselines import RMNP

SHAPES = [(24, 24), (40, 16), (16, 40)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_rmnp_unit_rows(shape, nesterov):
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(2)]
    o, _ = raw_update(RMNP, shape, grads, nesterov=nesterov, momentum=0.9)
    m_buf = 0.9 * grads[0] + grads[1]
    u = grads[1] + 0.9 * m_buf if nesterov else m_buf
    assert torch.allclose(o, u / u.norm(dim=1, keepdim=True), atol=1e-12)
    assert o.square().sum().item() == pytest.approx(shape[0], rel=1e-12)  # Table 9: exactly m
