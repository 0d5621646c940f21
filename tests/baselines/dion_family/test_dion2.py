"""dobb.baselines.dion_family.dion2: Dion2 selects the heaviest rows (error feedback on the rest) and moves them as
torch's NS5 of the selected rows; the full fraction with momentum 1/2 is Muon without Nesterov."""
from __future__ import annotations

import math

import pytest
import torch

import dobb
from _baseline_refs import COEFFS, dion2_shard_reference, raw_update
from dobb.baselines import Dion2, Muon, dion2_step

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz


def test_dion2_selects_heaviest_rows_with_error_feedback():
    m, n, mu = 12, 9, 0.9
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    G[3] *= 10
    G[7] *= 8
    G[0] *= 6
    o, opt = raw_update(Dion2, (m, n), [G], fraction=0.25, momentum=mu, ns_dtype="bfloat16")
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
    o_muon, _ = raw_update(Muon, (10, 14), grads, momentum=0.5, nesterov=False)  # both ns_dtype="auto"
    o_dion2, _ = raw_update(Dion2, (10, 14), grads, momentum=0.5, fraction=1.0)
    assert torch.allclose(o_muon, o_dion2, atol=1e-12, rtol=0)


def test_dion2_pure_step_zero_rows():
    b = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(12))
    o, m_new, rows = dion2_step(b, 2, 0.5)
    for i in range(2):
        keep = [r for r in range(8) if r not in rows[i].tolist()]
        assert (o[i, keep] == 0).all() and torch.equal(m_new[i, keep], b[i, keep])


# ----------------------------------------------------------------------------- select="shard"
def _run(shape, grads, **kw):
    from torch import nn

    w = nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    w0 = w.detach().clone()
    opt = Dion2([w], lr=0.05, weight_decay=0.1, momentum=0.9, **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w0, w.detach(), opt


def _grads(shape, steps=5, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("ns_dtype", ["bfloat16", "float64"])
def test_dion2_shard_select_on_one_block_is_global(ns_dtype):
    grads = _grads((14, 9))
    _, a, _ = _run((14, 9), grads, ns_dtype=ns_dtype)
    _, b, _ = _run((14, 9), grads, ns_dtype=ns_dtype, select="shard", blocks=1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("shape,blocks,fraction", [((18, 10), 4, 0.25), ((16, 7), 2, 0.5), ((13, 20), 3, 0.3)])
def test_dion2_shard_select_matches_float64_reference(shape, blocks, fraction):
    grads = _grads(shape)
    w0, w, opt = _run(shape, grads, ns_dtype="float64", select="shard", blocks=blocks, fraction=fraction)
    sizes = dobb.functional.block_sizes(shape[0], blocks)
    ref = dion2_shard_reference(w0, grads, sizes, fraction)
    assert (w - ref).abs().max().item() < 1e-12
    # the global selection is a different algorithm here (the comparison can fail)
    assert (w - dion2_shard_reference(w0, grads, [shape[0]], fraction)).abs().max().item() > 1e-3


def test_dion2_select_validation_names_the_problem():
    from torch import nn

    from _baseline_refs import mlp

    with pytest.raises(ValueError, match="select"):
        Dion2([nn.Parameter(torch.zeros(8, 8))], lr=0.1, select="rows")
    with pytest.raises(ValueError, match=r"0\.weight.*blocks=40"):
        Dion2(dobb.param_groups(mlp(), algorithm="dion2"), lr=0.1, select="shard", blocks=40)
    # blocks only matters to the per-shard selection
    Dion2(dobb.param_groups(mlp(), algorithm="dion2"), lr=0.1, blocks=40)
