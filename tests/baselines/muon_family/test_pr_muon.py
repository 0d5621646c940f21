"""Periodic Row-wise Muon as its paper states it: the default K is the paper's 3, the steps between
refreshes normalize the rows of the *current* momentum, and their update RMS is the NS5 step's
(measured against NS5 of the same momentum, an independent computation). Period 1 = Muon
(bitwise) and the exact schedule (torch's NS5 on refresh steps, rescaled unit rows between)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dobb
from _baseline_refs import COEFFS, mlp, raw_update, train
from dobb.baselines import Muon, PeriodicRowMuon, newton_schulz

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz


def test_default_period_is_the_papers_three():
    assert PeriodicRowMuon.matrix_defaults["period"] == 3


@pytest.mark.parametrize("shape", [(32, 32), (64, 16), (16, 64)])
def test_row_step_rms_matches_the_ns_step(shape):
    """On the same momentum, the row step's RMS lies within NS5's own band of the polar RMS
    (NS5's singular values are ~[0.7, 1.2]), and equals the polar factor's RMS exactly."""
    m, n = shape
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(2)]
    w = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = PeriodicRowMuon([w], lr=1.0, period=3, nesterov=False, ns_dtype="float64")
    steps = []
    for grad in grads:
        before = w.detach().clone()
        w.grad = grad
        opt.step()
        steps.append((before - w.detach()) / (0.2 * math.sqrt(max(shape))))
    row = steps[1]  # step 1 is a row step (steps 0, 3, ... refresh)
    buf = opt.state[w]["momentum"]
    ns = newton_schulz(buf, dtype=torch.float64)
    rms = lambda t: t.square().mean().sqrt().item()  # noqa: E731
    assert rms(row) == pytest.approx(math.sqrt(min(m, n) / (m * n)), rel=1e-12)  # the polar factor's RMS
    assert 0.7 < rms(row) / rms(ns) < 1.25
    # the row step is built from the current momentum (after this step's gradient), not the last refresh's
    unit = buf / buf.norm(dim=1, keepdim=True)
    assert torch.allclose(row, unit * math.sqrt(min(m, n) / m), atol=1e-12)


def test_pr_muon_period_one_is_muon():
    a, b = mlp(), mlp()
    train(a, Muon(dobb.param_groups(a, algorithm="muon"), lr=0.02, weight_decay=0.1), 5)
    train(b, PeriodicRowMuon(dobb.param_groups(b, algorithm="pr-muon"), lr=0.02, weight_decay=0.1, period=1), 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("shape", [(40, 16), (16, 40)])
def test_pr_muon_schedule(shape):
    m, n = shape
    g = torch.Generator().manual_seed(9)
    grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(4)]
    buf = torch.zeros(shape, dtype=torch.float64)
    for k in range(4):
        o, _ = raw_update(PeriodicRowMuon, shape, grads[: k + 1], period=3, nesterov=False, ns_dtype="bfloat16")
        buf = buf.lerp(grads[k], 0.05)
        if k % 3 == 0:
            assert torch.allclose(o, torch_ns(buf, COEFFS, 5, 1e-7).double())
        else:  # unit rows rescaled to Muon's norm min(m, n)
            assert torch.allclose(o, buf / buf.norm(dim=1, keepdim=True) * math.sqrt(min(m, n) / m), atol=1e-6)
            assert o.square().sum().item() == pytest.approx(min(m, n), rel=1e-5)
