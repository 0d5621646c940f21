"""Spectral-Aware Muon against independent references: Muon itself (gamma = 1, bitwise), the
prior's spectrum through an exact polar factor (float64 SVD), the cosine warmup written out, and
the lite variant (power iteration) against the exact top pair."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dobb
from dobb.baselines import Muon, SAMuon
from dobb.baselines.muon_family.samuon import default_top_k, power_pair, top_singular_pairs


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8)).to(dtype)


def train(model, opt, steps):
    g = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    X, Y = torch.randn(64, 16, generator=g, dtype=dtype), torch.randn(64, 8, generator=g, dtype=dtype)
    for _ in range(steps):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        opt.step()


def exact_polar(mats):
    """U V^T of each matrix by float64 SVD: the polar factor NS5 approximates."""
    out = []
    for m in mats:
        u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
        out.append(u @ vh)
    return out


def raw_update(shape, grads, monkeypatch=None, **kw):
    """Raw O of the last step of one m x n weight (lr=1, wd=0, so dW = -s O), with NS5 exact."""
    if monkeypatch is not None:
        monkeypatch.setattr(SAMuon, "_ns", lambda self, group: exact_polar)
    w = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = SAMuon([w], lr=1.0, nesterov=False, ns_dtype="float64", **kw)
    for g in grads:
        before = w.detach().clone()
        w.grad = g.to(torch.float64)
        opt.step()
    return (before - w.detach()) / (0.2 * math.sqrt(max(shape))), opt


@pytest.mark.parametrize("kw", [dict(gamma=1.0), dict(gamma=1.0, top_k=1, topk_method="power"),
                                dict(gamma=6.0, total_steps=100, gamma_warmup=0.3)])
def test_gamma_one_is_muon_bitwise(kw):
    """gamma = 1 (and gamma_t = 1 at the warmup's first step) is Muon: same weights, bit for bit."""
    steps = 1 if "total_steps" in kw else 6
    ref, ours = mlp(), mlp()
    train(ref, Muon(dobb.param_groups(ref, algorithm="muon"), lr=0.02, weight_decay=0.1), steps)
    train(ours, SAMuon(dobb.param_groups(ours, algorithm="samuon"), lr=0.02, weight_decay=0.1, **kw), steps)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("shape,k", [((24, 40), 5), ((48, 16), 4), ((20, 20), 1)])
def test_exact_polar_update_has_the_prior_spectrum(monkeypatch, shape, k):
    gamma = 7.0
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    o, _ = raw_update(shape, [G], monkeypatch, gamma=gamma, gamma_warmup=0.0, top_k=k, topk_method="exact")
    want = [1.0 + (gamma - 1) * math.log(i) / math.log(k) for i in range(1, k + 1)] if k > 1 else [1.0]
    want += [gamma] * (min(shape) - k)
    got = torch.linalg.svdvals(o)
    assert torch.allclose(got, torch.tensor(sorted(want, reverse=True), dtype=torch.float64), atol=1e-9)
    # the head keeps the momentum's top directions: u_1^T O v_1 = s_1 = 1
    u, _, vh = torch.linalg.svd(G)
    assert (u[:, 0] @ o @ vh[0]).item() == pytest.approx(1.0, abs=1e-9)


def test_gamma_warmup_is_a_cosine_from_one(monkeypatch):
    """The bulk singular value of the update is gamma_t: 1 at step 0, the cosine, gamma from 0.3 T on."""
    gamma, total = 9.0, 20
    shape = (12, 10)
    grads = [torch.randn(*shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(10)]
    for t in range(len(grads)):
        o, _ = raw_update(shape, grads[: t + 1], monkeypatch, gamma=gamma, total_steps=total, top_k=2,
                          topk_method="exact")
        warm = 0.3 * total
        want = gamma if t >= warm else 1 + (gamma - 1) * (1 - math.cos(math.pi * t / warm)) / 2
        assert torch.linalg.svdvals(o)[0].item() == pytest.approx(want, rel=1e-9)


def test_lite_equals_full_at_k1():
    """Power iteration (warm-started, many steps) finds the exact top pair: same updates as the SVD."""
    shape = (20, 30)
    grads = [torch.randn(*shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(4)]
    lite, _ = raw_update(shape, grads, gamma=4.0, gamma_warmup=0.0, top_k=1, topk_method="power", power_iters=200)
    full, _ = raw_update(shape, grads, gamma=4.0, gamma_warmup=0.0, top_k=1, topk_method="exact")
    assert (lite - full).abs().max() < 1e-9
    assert (full - raw_update(shape, grads, gamma=4.0, gamma_warmup=0.0, top_k=1)[0]).abs().max() == 0  # auto = exact


def test_lowrank_pairs_match_svd():
    x = torch.randn(3, 40, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x @ torch.diag(torch.logspace(0, -3, 30, dtype=torch.float64))  # a decaying spectrum
    sketch = torch.randn(30, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u1, v1 = top_singular_pairs(x, 4, "exact")
    u2, v2 = top_singular_pairs(x, 4, "lowrank", sketch, iters=6)
    for i in range(4):  # each rank-1 term u_i v_i^T is sign-free
        assert torch.allclose(u1[..., i:i + 1] @ v1[..., i:i + 1].mT, u2[..., i:i + 1] @ v2[..., i:i + 1].mT, atol=1e-8)


def test_power_pair_keeps_start_on_zero_matrix():
    v0 = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    u, v, v_next = power_pair(torch.zeros(1, 3, 2, dtype=torch.float64), v0, 3)
    assert torch.equal(v_next, v0) and torch.equal(u, torch.zeros(1, 3, 1, dtype=torch.float64))


def test_default_top_k_is_the_papers():
    assert default_top_k(512, 2048) == 32 and default_top_k(128, 384) == 16 and default_top_k(2048, 8192) == 64
    assert default_top_k(4, 100) == 3 and default_top_k(1, 5) == 1  # round(2.83), round(1.41)


@pytest.mark.parametrize("kw,name", [
    (dict(gamma=0.0, gamma_warmup=0.0), "gamma"),
    (dict(gamma=5.0, gamma_warmup=1.5, total_steps=10), "gamma_warmup"),
    (dict(gamma_warmup=0.0, top_k=0), "top_k"), (dict(gamma_warmup=0.0, topk_method="svd"), "topk_method"),
    (dict(gamma_warmup=0.0, topk_method="power"), "top_k"), (dict(gamma=5.0, total_steps=0), "total_steps"),
    (dict(gamma_warmup=0.0, power_iters=0), "power_iters"),
])
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}( must|=)"):
        SAMuon([nn.Parameter(torch.zeros(4, 3))], lr=0.1, **kw)


def test_without_total_steps_warns_and_applies_gamma_from_the_start(monkeypatch):
    shape = (12, 10)
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with pytest.warns(UserWarning, match="total_steps"):
        o, _ = raw_update(shape, [G], monkeypatch, gamma=6.0, top_k=2, topk_method="exact")
    assert torch.linalg.svdvals(o)[0].item() == pytest.approx(6.0, rel=1e-9)


def test_state_dict_round_trip_resumes_bitwise():
    def run(split_at=None):
        model = mlp()
        opt = SAMuon(dobb.param_groups(model, algorithm="samuon"), lr=0.02, gamma=4.0, total_steps=6,
                     top_k=1, topk_method="power")
        if split_at is None:
            train(model, opt, 6)
            return model
        train(model, opt, split_at)
        saved = opt.state_dict()
        opt2 = SAMuon(dobb.param_groups(model, algorithm="samuon"), lr=0.02, gamma=4.0, total_steps=6,
                      top_k=1, topk_method="power")
        opt2.load_state_dict(saved)
        train(model, opt2, 6 - split_at)
        return model

    for p, q in zip(run().parameters(), run(3).parameters()):
        assert torch.equal(p, q)
