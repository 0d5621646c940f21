"""dobb.baselines.muon_family.normuon: NorMuon against its float64 definition written out row by row, the
per-neuron normalization (``normuon_normalize``), and the neuron-variance state that NorMuon and
Dion3 share (``normuon.state_dtype``, ``check_neuron_options``): validation, bitwise resume, fp32
under a bf16 model."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _baseline_refs import _weights_after, ns5_reference, randn
from dobb.baselines import Muon


def normuon_reference(grads, lr=0.1, wd=0.01, tau=0.2, mu=0.95, beta2=0.95, eps=1e-8, nesterov=True):
    """NorMuon written out row by row in float64 (Li et al. 2025, Frobenius-preserving rescale)."""
    m, n = grads[0].shape
    w, buf, v = torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, n, dtype=torch.float64), [0.0] * m
    for g in grads:
        buf = mu * buf + (1 - mu) * g
        u = g + mu * (buf - g) if nesterov else buf
        o = ns5_reference(u)
        rows = []
        for i in range(m):
            v[i] = beta2 * v[i] + (1 - beta2) * sum(float(x) ** 2 for x in o[i]) / n
            rows.append(o[i] / (math.sqrt(v[i]) + eps))
        o2 = torch.stack(rows)
        o2 = o2 * o.norm() / o2.norm()
        w = (1 - lr * wd) * w - lr * tau * math.sqrt(max(m, n)) * o2
    return w, torch.tensor(v, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(24, 36), (36, 24)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_normuon_matches_dense_reference(shape, nesterov):
    from dobb.baselines import NorMuon

    grads = [randn(*shape, seed=s) * torch.linspace(0.1, 3, shape[0], dtype=torch.float64)[:, None]
             for s in range(4)]  # rows of very different scale: the normalization matters
    w = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = NorMuon([w], lr=0.1, weight_decay=0.01, ns_dtype="float64", nesterov=nesterov)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    ref_w, ref_v = normuon_reference(grads, nesterov=nesterov)
    assert (w.detach() - ref_w).abs().max().item() < 1e-12
    assert (opt.state[w]["neuron_variance"] - ref_v).abs().max().item() < 1e-14
    # the direction differs from Muon's: rows equalized, Frobenius norm kept
    muon = _weights_after(Muon, grads, ns_dtype="float64", nesterov=nesterov)
    assert (muon - ref_w).abs().max().item() > 1e-3


def test_normuon_normalize_zero_rows_and_norm():
    from dobb.baselines import normuon_normalize

    o = randn(2, 6, 10, seed=4)
    o[0, 2] = 0
    out, v = normuon_normalize(o, torch.zeros(2, 6, dtype=torch.float64), 0.9)
    assert out[0, 2].abs().max() == 0 and v[0, 2] == 0
    assert torch.allclose(out.norm(dim=(-2, -1)), o.norm(dim=(-2, -1)), rtol=1e-12)
    # first step from v = 0: every nonzero row gets the same norm
    norms = out[1].norm(dim=-1)
    assert torch.allclose(norms, norms[0].expand_as(norms), rtol=1e-6)  # up to eps


@pytest.mark.parametrize("name,kw,arg", [("normuon", {"beta2": 1.0}, "beta2"), ("dion3", {"fraction": 0}, "fraction"),
                                         ("dion3", {"neuron_eps": -1.0}, "neuron_eps"),
                                         ("dion3", {"ns_method": "x"}, "ns_method")])
def test_peer_validation(name, kw, arg):
    import dobb

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=rf"\b{arg}( must|=)"):
        dobb.build_optimizer(name, model, lr=0.1, **kw)


@pytest.mark.parametrize("name", ["normuon", "dion3"])
def test_peers_train_and_resume_bitwise(name):
    """The loss falls, and a saved/loaded optimizer continues bitwise (every state key round-trips)."""
    import io

    import dobb

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        return model, dobb.build_optimizer(name, model, lr=0.02, weight_decay=0.01)

    x = randn(64, 16, seed=1).float()
    y = torch.sin(x[:, :8])

    def run(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        return loss.item()

    model, opt = setup()
    first = ((model(x) - y) ** 2).mean().item()
    run(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict()}, buf)
    last = run(model, opt, 20)
    assert last < first * 0.9
    model2, opt2 = setup()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2.load_state_dict(saved["m"])
    opt2.load_state_dict(saved["o"])
    run(model2, opt2, 20)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["normuon", "dion3"])
def test_bf16_resume_keeps_neuron_variance_fp32(name):
    """torch casts floating state to the parameter's dtype on load; the row moments must stay fp32
    (in bf16 the EMA of small squares loses most of its digits)."""
    import io

    import dobb

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)).to(torch.bfloat16)
    opt = dobb.build_optimizer(name, model, lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = dobb.build_optimizer(name, model, lr=0.01)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    mats = [p for p in opt2.iter_matrix_params()]
    assert mats and all(opt2.state[p]["neuron_variance"].dtype == torch.float32 for p in mats)
    assert all(torch.equal(opt2.state[p]["neuron_variance"], opt.state[q]["neuron_variance"])
               for p, q in zip(mats, opt.iter_matrix_params()))
