"""dobb.baselines.muon_family.muonbp on one process: ``period=1`` is Muon, ``period=0`` is row-block Block Muon,
and any period follows a float64 transcription of the block-periodic schedule (block steps at
``tau*sqrt(max(m_b, n_b))``, owner-style full steps at ``tau*sqrt(max(m, n))``, full at the steps
``0, P, 2P, ...``). The sharded cases are in tests/distributed/test_muonbp_sharded.py."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dobb
from _baseline_refs import mlp, muonbp_reference as reference, ns5_reference, randn, train
from dobb.baselines import BlockMuon, Muon, MuonBP

F64 = dict(ns_dtype="float64")


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kw", [{}, F64])
def test_period_one_is_muon(kw):
    a, b = mlp(dtype=torch.float64), mlp(dtype=torch.float64)
    train(a, Muon(dobb.param_groups(a, algorithm="muon"), lr=0.02, weight_decay=0.1, **kw), 6)
    train(b, MuonBP(dobb.param_groups(b, algorithm="muonbp"), lr=0.02, weight_decay=0.1, period=1, **kw), 6)
    assert _same(a, b)


@pytest.mark.parametrize("axis,blocks", [(0, 4), (0, 2), (1, 2)])
def test_no_full_step_is_block_muon(axis, blocks):
    a, b = mlp(dtype=torch.float64), mlp(dtype=torch.float64)
    kw = dict(lr=0.02, weight_decay=0.1, axis=axis, blocks=blocks, **F64)
    train(a, BlockMuon(dobb.param_groups(a, algorithm="block-muon"), **kw), 6)
    train(b, MuonBP(dobb.param_groups(b, algorithm="muonbp"), period=0, **kw), 6)
    assert _same(a, b)
    # and the full steps make a difference (the comparison above could not pass by accident)
    c = mlp(dtype=torch.float64)
    train(c, MuonBP(dobb.param_groups(c, algorithm="muonbp"), period=2, **kw), 6)
    assert not _same(a, c)


@pytest.mark.parametrize("shape,axis,blocks,period,nesterov",
                         [((18, 10), 0, 4, 3, True), ((10, 22), 1, 3, 2, False), ((12, 12), 0, 3, 4, True)])
def test_schedule_matches_float64_reference(shape, axis, blocks, period, nesterov):
    steps = 8
    w0, grads = randn(*shape, seed=1), [randn(*shape, seed=10 + t) for t in range(steps)]
    w = nn.Parameter(w0.clone())
    opt = MuonBP([w], lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov, period=period, blocks=blocks,
                 axis=axis, **F64)
    full = []
    for g in grads:
        full.append(opt.is_full_step(opt.param_groups[0], w))
        w.grad = g.clone()
        opt.step()
    assert full == [t % period == 0 for t in range(steps)]  # phase: full at 0, P, 2P, ...
    sizes = dobb.functional.block_sizes(shape[axis], blocks)
    ref = reference(w0, grads, sizes, axis, period, nesterov=nesterov)
    assert (w.detach() - ref).abs().max().item() < 1e-12
    # a plant: the other phase (full at P-1, 2P-1, ...) is a different algorithm, far from this one
    shifted = reference(w0, grads[1:], sizes, axis, period, nesterov=nesterov)
    assert (w.detach() - shifted).abs().max().item() > 1e-3
    assert opt.state[w]["step"] == steps


def test_block_scale_is_per_block():
    """One block step on 2 row blocks of 4 and 12 rows of a 16 x 6 matrix: each block moves with
    RMS tau, so the short block is scaled by sqrt(6) and the tall one by sqrt(12)."""
    w = nn.Parameter(torch.zeros(16, 6, dtype=torch.float64))
    opt = MuonBP([w], lr=1.0, period=0, blocks=2, axis=0, momentum=0.0, **F64)
    g = randn(16, 6, seed=3)
    w.grad = g
    opt.step()
    for sl in (slice(0, 8), slice(8, 16)):
        expect = -0.2 * math.sqrt(8) * ns5_reference(g[sl])
        assert torch.allclose(w.detach()[sl], expect, atol=1e-12)


def test_validation_names_the_problem():
    p = nn.Parameter(torch.zeros(8, 8))
    for kw, msg in ((dict(period=-1), "period"), (dict(period=1.5), "period"), (dict(blocks=0), "blocks"),
                    (dict(axis=2), "axis")):
        with pytest.raises(ValueError, match=msg):
            MuonBP([p], lr=0.1, **kw)
    model = mlp()
    with pytest.raises(ValueError, match=r"0\.weight.*blocks=40"):
        MuonBP(dobb.param_groups(model, algorithm="muonbp"), lr=0.1, blocks=40)


def test_registry_entry_and_defaults():
    entry = dobb.registry.get("muonbp")
    assert entry.cls is MuonBP
    d = dobb.registry.hparam_defaults("muonbp")
    assert (d["period"], d["blocks"], d["axis"]) == (5, 4, 0)
    # the NS options are Muon's own defaults, inherited through the family's MuonOptions
    assert all(d[k] == Muon.matrix_defaults[k] for k in ("ns_dtype", "ns_steps", "ns_method", "momentum"))
