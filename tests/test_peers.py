"""The strongest peers' single-process math against dense float64 references: Gram Newton-Schulz
(== NS5), NorMuon and Dion3 (row subset + per-neuron normalization)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dobb.baselines import BlockMuon, Muon, gram_newton_schulz, newton_schulz, orthogonalize

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = [(48, 12), (12, 48), (20, 20), (7, 30)]


def ns5_reference(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic iteration written out in float64 on one matrix (the definition)."""
    a, b, c = COEFFS
    y = x.double()
    tall = y.shape[0] > y.shape[1]
    y = y.T if tall else y
    y = y / y.norm()
    for _ in range(steps):
        g = y @ y.T
        y = a * y + (b * g + c * g @ g) @ y
    return y.T if tall else y


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------- Gram Newton-Schulz
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


def test_orthogonalize_gram_option_and_validation():
    mats = [randn(16, 40, seed=i) for i in range(3)] + [randn(40, 16, seed=9)]
    outs = orthogonalize(mats, method="gram", dtype=torch.float64)
    for m, o in zip(mats, outs):
        assert o.dtype == torch.float64 and rel(o, ns5_reference(m)) < 1e-12
    with pytest.raises(ValueError, match="method"):
        orthogonalize(mats, method="svd")


def _weights_after(cls, grads, **kw):
    w = nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float64))
    opt = cls([w], lr=0.1, weight_decay=0.01, **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


@pytest.mark.parametrize("cls,kw", [(Muon, {}), (BlockMuon, {"blocks": 3, "axis": 1}),
                                    (BlockMuon, {"blocks": 2, "axis": 0})])
def test_muon_and_block_muon_gram_option(cls, kw):
    grads = [randn(24, 36, seed=s) for s in range(3)]
    std = _weights_after(cls, grads, ns_dtype="float64", **kw)
    gram = _weights_after(cls, grads, ns_dtype=torch.float64, ns_method="gram", **kw)
    assert (std - gram).abs().max().item() < 1e-12
    # and the float64 standard path is the reference iteration itself (Muon: one block)
    if cls is Muon:
        mu, u, buf = 0.95, None, torch.zeros(24, 36, dtype=torch.float64)
        w = torch.zeros(24, 36, dtype=torch.float64)
        for g in grads:
            buf = buf + (1 - mu) * (g - buf)
            u = g + mu * (buf - g)
            w = (1 - 0.1 * 0.01) * w - 0.1 * 0.2 * math.sqrt(36) * ns5_reference(u)
        assert (std - w).abs().max().item() < 1e-12


@pytest.mark.parametrize("kw,arg", [({"ns_method": "svd"}, "ns_method"), ({"ns_dtype": "int8"}, "ns_dtype"),
                                    ({"ns_dtype": torch.int32}, "ns_dtype")])
def test_ns_option_validation(kw, arg):
    with pytest.raises(ValueError, match=arg):
        Muon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, **kw)


# ----------------------------------------------------------------------------- NorMuon, Dion3
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


def dion3_reference(grads, fraction, lr=0.1, wd=0.01, tau=0.2, mu=0.95, beta2=0.95, eps=1e-8):
    m, n = grads[0].shape
    k = max(1, round(fraction * m))
    w, mom, v = torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, n, dtype=torch.float64), [0.0] * m
    chosen = []
    for g in grads:
        b = mom + g
        l1 = [sum(abs(float(x)) for x in b[i]) for i in range(m)]
        rows = sorted(sorted(range(m), key=lambda i: -l1[i])[:k])
        chosen.append(rows)
        ok = ns5_reference(b[rows])
        scaled = []
        for j, i in enumerate(rows):
            v[i] = beta2 * v[i] + (1 - beta2) * sum(float(x) ** 2 for x in ok[j]) / n
            scaled.append(ok[j] / (math.sqrt(v[i]) + eps))
        scaled = torch.stack(scaled)
        scaled = scaled * ok.norm() / scaled.norm()
        o = torch.zeros(m, n, dtype=torch.float64)
        o[rows] = scaled
        mom = b.clone()
        mom[rows] = mu * b[rows]
        w = (1 - lr * wd) * w - lr * tau * math.sqrt(max(k, n)) * o
    return w, mom, torch.tensor(v, dtype=torch.float64), chosen


@pytest.mark.parametrize("shape,fraction", [((20, 12), 0.25), ((12, 30), 0.5), ((16, 16), 1.0)])
def test_dion3_matches_dense_reference(shape, fraction):
    from dobb.baselines import Dion3

    grads = [randn(*shape, seed=10 + s) * torch.linspace(0.2, 2, shape[0], dtype=torch.float64)[:, None]
             for s in range(4)]
    w = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = Dion3([w], lr=0.1, weight_decay=0.01, fraction=fraction, ns_dtype="float64")
    for g in grads:
        w.grad = g.clone()
        opt.step()
    ref_w, ref_m, ref_v, chosen = dion3_reference(grads, fraction)
    assert len({tuple(c) for c in chosen}) > 1 or fraction == 1.0  # the subset moves between steps
    assert (w.detach() - ref_w).abs().max().item() < 1e-12
    assert (opt.state[w]["momentum"] - ref_m).abs().max().item() < 1e-12
    assert (opt.state[w]["neuron_variance"] - ref_v).abs().max().item() < 1e-14
    gram = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = Dion3([gram], lr=0.1, weight_decay=0.01, fraction=fraction, ns_dtype="float64", ns_method="gram")
    for g in grads:
        gram.grad = g.clone()
        opt.step()
    assert (gram.detach() - ref_w).abs().max().item() < 1e-12


@pytest.mark.parametrize("name,kw,arg", [("normuon", {"beta2": 1.0}, "beta2"), ("dion3", {"fraction": 0}, "fraction"),
                                         ("dion3", {"neuron_eps": -1.0}, "neuron_eps"),
                                         ("dion3", {"ns_method": "x"}, "ns_method")])
def test_peer_validation(name, kw, arg):
    import dobb

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=arg):
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


def test_payload_rows_of_the_peers():
    """Derived per-step payload (dobb-bench payload): owner compute twice Muon's dense count, owner
    placement nothing in the step and 2 mn in forward/backward, NorMuon as Muon, Dion3 as Dion2."""
    P = pytest.importorskip("dobb_bench.payload")

    m, n = 24, 8
    assert P.payload_entries("owner-muon", m, n) == 2 * P.payload_entries("muon", m, n) == 2 * m * n
    assert P.payload_entries("owner-placement", m, n) == 0
    assert P.forward_backward_entries("owner-placement", m, n) == 2 * m * n
    assert P.forward_backward_entries("owner-placement", m, n, shards=1) == 0
    assert P.payload_entries("normuon", m, n) == m * n
    k = round(dion3_fraction() * m)
    assert P.payload_entries("dion3", m, n) == P.payload_entries("dion2", m, n) == k * n
    assert P.derived_state_bytes("normuon", m, n) == m * n * 4 + m * 4


def dion3_fraction():
    from dobb.baselines import Dion3

    return Dion3.matrix_defaults["fraction"]


def test_owner_muon_single_process_is_muon_and_validates():
    """Without a process group every matrix is computed locally: bitwise Muon (bf16 NS5 included)."""
    from dobb.baselines import OwnerMuon

    grads = [randn(24, 36, seed=s).float() for s in range(3)]
    ref = _weights_after(Muon, [g.double() for g in grads])
    ws = []
    for group in ("default", None):
        w = nn.Parameter(torch.zeros(24, 36, dtype=torch.float64))
        opt = OwnerMuon([w], lr=0.1, weight_decay=0.01, replicated_group=group)
        for g in grads:
            w.grad = g.double()
            opt.step()
        ws.append(w.detach())
        assert opt.owners == {} and opt.gathered == {}
    assert torch.equal(ws[0], ref) and torch.equal(ws[1], ref)
    with pytest.raises(ValueError, match="replicated_group"):
        OwnerMuon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, replicated_group="world")
