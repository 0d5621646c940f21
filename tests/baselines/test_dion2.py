"""dobb.baselines.dion2: Dion2 selects the heaviest rows (error feedback on the rest) and moves them as
torch's NS5 of the selected rows; the full fraction with momentum 1/2 is Muon without Nesterov."""
from __future__ import annotations

import math

import pytest
import torch

from _baseline_refs import COEFFS, raw_update
from dobb.baselines import Dion2, Muon, dion2_step

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz


def test_dion2_selects_heaviest_rows_with_error_feedback():
    m, n, mu = 12, 9, 0.9
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    G[3] *= 10
    G[7] *= 8
    G[0] *= 6
    o, opt = raw_update(Dion2, (m, n), [G], fraction=0.25, momentum=mu)
    rows = [0, 3, 7]
    k = len(rows)
    assert selected_nonzero(o) == rows
    s_ratio = math.sqrt(max(k, n)) / math.sqrt(max(m, n))  # moves as a Muon step of a k x n matrix
    ref = torch_ns(G[rows], COEFFS, 5, 1e-7).double() * s_ratio
    assert torch.allclose(o[rows], ref, atol=1e-6)
    mom = opt.state[opt.param_groups[0]["params"][0]]["momentum"]
    expect = G.clone()
    expect[rows] *= mu
    assert torch.allclose(mom, expect)
    sv = torch.linalg.svdvals(o[rows] / s_ratio)
    assert sv.min() > 0.6 and sv.max() < 1.25


def selected_nonzero(o):
    return [i for i in range(o.shape[0]) if o[i].abs().sum() > 0]


def test_dion2_full_fraction_is_muon_without_nesterov():
    # mu = 1/2 makes Dion2's buffer exactly 2x Muon's EMA: a power of two NS5 cannot see.
    g = torch.Generator().manual_seed(13)
    grads = [torch.randn(10, 14, generator=g, dtype=torch.float64) for _ in range(4)]
    o_muon, _ = raw_update(Muon, (10, 14), grads, momentum=0.5, nesterov=False, ns_dtype="bfloat16")
    o_dion2, _ = raw_update(Dion2, (10, 14), grads, momentum=0.5, fraction=1.0)
    assert torch.allclose(o_muon, o_dion2, atol=1e-12, rtol=0)


def test_dion2_pure_step_zero_rows():
    b = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(12))
    o, m_new, rows = dion2_step(b, 2, 0.5)
    for i in range(2):
        keep = [r for r in range(8) if r not in rows[i].tolist()]
        assert (o[i, keep] == 0).all() and torch.equal(m_new[i, keep], b[i, keep])
