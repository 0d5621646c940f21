"""dobb.baselines.dion_family.dion: Dion against float64 references: the update norm of Table 9 (exactly r), the
polar factor of a fixed full-rank gradient, one step written out from the published algorithm, the
Householder QR's span (randomized Cholesky QR), and a bf16 resume that keeps ``Q`` in fp32."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import dobb
from _baseline_refs import mlp, raw_update, spectrum, train
from dobb.baselines import Dion, dion_step
from dobb.baselines.dion_family.dion import dion_rank, qr_randomized_cholesky

SHAPES = [(24, 24), (40, 16), (16, 40)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qr", ["householder", "rcqr"])
def test_dion_update_norm_is_rank(shape, qr):
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(*shape, generator=g) for _ in range(3)]
    o, opt = raw_update(Dion, shape, grads, rank_fraction=0.5, qr=qr)
    r = dion_rank(*shape, 0.5)
    assert r == round(0.5 * min(shape))
    assert o.square().sum().item() == pytest.approx(r, rel=1e-6)  # Table 9: exactly r
    assert torch.linalg.matrix_rank(o).item() == r
    q = opt.state[opt.param_groups[0]["params"][0]]["Q"]
    assert q.shape == (max(shape), r)


@pytest.mark.parametrize("shape", SHAPES)
def test_dion_full_rank_fixed_gradient_converges_to_polar_factor(shape):
    m, n = shape
    k = min(m, n)
    G, polar = spectrum(m, n, [2.0 * 0.8**i for i in range(k)])
    o, _ = raw_update(Dion, shape, [G] * 60, rank_fraction=1.0)
    assert (o - polar).abs().max() < 1e-6


def test_dion_error_feedback_and_orientation():
    # One step by hand from the published algorithm, on a tall matrix (runs on B^T).
    m, n, r = 20, 12, 3
    g = torch.Generator().manual_seed(4)
    G = torch.randn(m, n, generator=g, dtype=torch.float64)
    w = nn.Parameter(torch.zeros(m, n, dtype=torch.float64))
    opt = Dion([w], lr=1.0, rank_fraction=r / n, momentum=0.9)
    q0 = opt.state[w]["Q"].clone()
    assert q0.shape == (m, r) and torch.allclose(q0.norm(dim=0), torch.ones(r, dtype=torch.float64))
    w.grad = G
    opt.step()
    bt = G.T  # B = M + G with M = 0, oriented so P has min(m, n) rows
    p = torch.linalg.qr(bt @ q0).Q
    R = bt.T @ p
    q1 = R / R.norm(dim=0)
    assert torch.allclose(opt.state[w]["Q"], q1)
    assert torch.allclose(opt.state[w]["momentum"], (bt - 0.1 * p @ R.T).T)
    assert torch.allclose(-w.detach() / (0.2 * math.sqrt(m)), (p @ q1.T).T)


def test_dion_q_seeded_identically():
    a, b = Dion([nn.Parameter(torch.zeros(8, 12))], lr=0.1), Dion([nn.Parameter(torch.zeros(8, 12))], lr=0.1)
    c = Dion([nn.Parameter(torch.zeros(8, 12))], lr=0.1, seed=1)
    qa, qb, qc = (next(iter(o.state.values()))["Q"] for o in (a, b, c))
    assert torch.equal(qa, qb) and not torch.equal(qa, qc)


def test_rcqr_orthonormal_same_span():
    p = torch.randn(4, 30, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    q = qr_randomized_cholesky(p, torch.Generator().manual_seed(0))
    eye = torch.eye(6, dtype=torch.float64)
    assert torch.allclose(q.mT @ q, eye.expand(4, -1, -1), atol=1e-10)
    h = torch.linalg.qr(p).Q
    assert torch.allclose(q @ q.mT, h @ h.mT, atol=1e-10)
    z = qr_randomized_cholesky(torch.zeros(1, 5, 2), torch.Generator().manual_seed(0))
    assert torch.isfinite(z).all()  # rank-deficient input: finite, no host-side branch


def test_dion_step_pure_batch_equals_loop():
    b = torch.randn(3, 6, 10, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    q = torch.randn(3, 10, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    o, m, qn = dion_step(b, q, 0.95)
    for i in range(3):
        oi, mi, qi = dion_step(b[i : i + 1], q[i : i + 1], 0.95)
        assert torch.allclose(oi[0], o[i]) and torch.allclose(mi[0], m[i]) and torch.allclose(qi[0], qn[i])


def test_bf16_resume_keeps_dion_q_fp32():
    model = mlp(dtype=torch.bfloat16)
    opt = Dion(dobb.param_groups(model, algorithm="dion"), lr=0.01)
    train(model, opt, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh = Dion(dobb.param_groups(model, algorithm="dion"), lr=0.01)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for p in fresh.iter_matrix_params():
        assert fresh.state[p]["Q"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["Q"], opt.state[p]["Q"])
        assert fresh.state[p]["momentum"].dtype == torch.bfloat16
