"""Newton-Muon: an isotropic input covariance gives Muon bit for bit; one to three steps equal a
dense float64 reference written out here (hooks, EMA, damping, inverse, NS5, protocol)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dobb.baselines import Muon
from dobb.baselines.muon_family.newton_muon import NewtonMuon, damped_inverse, precondition

COEFFS = (3.4445, -4.7750, 2.0315)


class TwoHeads(nn.Module):
    """Two bias-free layers that both read the model input (so both see the same, chosen covariance)."""

    def __init__(self, n=8, m=6, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Linear(n, m, bias=False, dtype=dtype)
        self.b = nn.Linear(n, 2 * m, bias=False, dtype=dtype)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(m, n, generator=g) / n**0.5)
            self.b.weight.copy_(torch.randn(2 * m, n, generator=g) / n**0.5)

    def forward(self, x):
        return torch.tanh(self.a(x)).sum(-1) + torch.sin(self.b(x)).sum(-1)


def train(model, opt, inputs, targets):
    for x, y in zip(inputs, targets):
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    getattr(opt, "remove_hooks", lambda: None)()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("blocks", [1, 2, 4])
@pytest.mark.parametrize("nesterov", [True, False])
def test_isotropic_covariance_is_muon_bit_for_bit(blocks, nesterov):
    """Inputs ``+-a e_i`` have the second moment ``a^2/n I``: every block's damped inverse is a
    multiple of I, scaled to I exactly, and the step is Muon's (bf16 NS5, as torch) bitwise."""
    n = 8
    rows = torch.cat([torch.eye(n), -torch.eye(n)]) * 1.7
    inputs = [rows[torch.randperm(2 * n, generator=torch.Generator().manual_seed(s))] for s in range(4)]
    targets = [torch.randn(2 * n, generator=torch.Generator().manual_seed(10 + s)) for s in range(4)]
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    m1, m2 = TwoHeads(n), TwoHeads(n)
    w_newton = train(m1, NewtonMuon(m1.parameters(), m1, refresh_every=2, blocks=blocks, **kw), inputs, targets)
    w_muon = train(m2, Muon(m2.parameters(), **kw), inputs, targets)
    for a, b in zip(w_newton, w_muon):
        assert torch.equal(a, b)
    # the same data with an anisotropic scale is not Muon (the test above can fail)
    skew = torch.linspace(0.5, 2.0, n)
    m3, m4 = TwoHeads(n), TwoHeads(n)
    w3 = train(m3, NewtonMuon(m3.parameters(), m3, blocks=blocks, **kw), [x * skew for x in inputs], targets)
    w4 = train(m4, Muon(m4.parameters(), **kw), [x * skew for x in inputs], targets)
    assert not torch.equal(w3[0], w4[0])


# ----------------------------------------------------------------------------- float64 reference
def ns5(x):
    a, b, c = COEFFS
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / y.norm().clamp(min=1e-7)  # the batched kernel clamps (torch.optim.Muon adds eps)
    for _ in range(5):
        g = y @ y.T
        y = a * y + (b * g + c * g @ g) @ y
    return y.T if tall else y


def reference(model, inputs, targets, *, lr, wd, blocks, refresh_every, decay=0.95, damping=0.2, mu=0.95):
    """Dense float64 Newton-Muon on ``model``'s bias-free linear layers, written out step by step."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    feats = {}
    hooks = [m.register_forward_hook(lambda mod, args, out: feats.__setitem__(mod, args[0].detach())) for m in layers]
    stats = {m: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for m in layers}
    precs = {m: torch.eye(m.in_features, dtype=torch.float64) for m in layers}
    bufs = {m: torch.zeros_like(m.weight) for m in layers}
    for step, (x, y) in enumerate(zip(inputs, targets)):
        (model(x) - y).square().mean().backward()
        with torch.no_grad():
            for m in layers:
                n, s = m.in_features, m.in_features // blocks
                if step % refresh_every == 0:
                    f = feats[m].reshape(-1, n)
                    mask = torch.block_diag(*[torch.ones(s, s, dtype=torch.float64)] * blocks)
                    stats[m] = decay * stats[m] + (1 - decay) * (f.T @ f / f.shape[0]) * mask
                    inv = torch.zeros(n, n, dtype=torch.float64)
                    for i in range(blocks):
                        blk = stats[m][i * s:(i + 1) * s, i * s:(i + 1) * s]
                        ridge = damping * torch.trace(blk) / s + 1e-8
                        inv[i * s:(i + 1) * s, i * s:(i + 1) * s] = torch.linalg.inv(blk + ridge * torch.eye(s, dtype=torch.float64))
                    precs[m] = inv / inv.diagonal().max()
                g = m.weight.grad @ precs[m]
                bufs[m] = bufs[m] + (1 - mu) * (g - bufs[m])
                u = g + mu * (bufs[m] - g)
                rows, cols = m.weight.shape
                m.weight.mul_(1 - lr * wd).sub_(lr * 0.2 * math.sqrt(max(rows, cols)) * ns5(u))
        model.zero_grad()
    for h in hooks:
        h.remove()
    return [p.detach().clone() for p in model.parameters()]


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.up = nn.Linear(8, 12, bias=False, dtype=torch.float64)
        self.down = nn.Linear(12, 6, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.up.weight.copy_(torch.randn(12, 8, generator=g, dtype=torch.float64) / 8**0.5)
            self.down.weight.copy_(torch.randn(6, 12, generator=g, dtype=torch.float64) / 12**0.5)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("blocks", [1, 2, 4])
@pytest.mark.parametrize("steps,refresh_every", [(1, 64), (3, 2), (3, 1)])
def test_equals_dense_float64_reference(blocks, steps, refresh_every):
    g = torch.Generator().manual_seed(2)
    # correlated, anisotropic inputs so the preconditioner matters
    mix = torch.randn(8, 8, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, 8, dtype=torch.float64)
    inputs = [torch.randn(2, 5, 8, generator=g, dtype=torch.float64) @ mix for _ in range(steps)]
    targets = [torch.randn(2, 5, 6, generator=g, dtype=torch.float64) for _ in range(steps)]
    kw = dict(lr=0.03, wd=0.1, blocks=blocks, refresh_every=refresh_every)
    m1, m2 = Mlp(), Mlp()
    opt = NewtonMuon(m1.parameters(), m1, lr=0.03, weight_decay=0.1, blocks=blocks, refresh_every=refresh_every,
                     ns_dtype="float64")
    mine = train(m1, opt, inputs, targets)
    ref = reference(m2, inputs, targets, **kw)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # and the reference differs from plain Muon (the preconditioner is exercised)
    m3 = Mlp()
    muon = train(m3, Muon(m3.parameters(), lr=0.03, weight_decay=0.1, ns_dtype="float64"), inputs, targets)
    assert (muon[0] - ref[0]).abs().max() > 1e-4


def test_capture_only_before_refresh_steps():
    """Statistics change only on refresh steps (steps 0, 2, 4 with refresh_every=2)."""
    model = Mlp()
    opt = NewtonMuon(model.parameters(), model, lr=0.01, refresh_every=2, ns_dtype="float64")
    seen = []
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        model(torch.randn(4, 8, generator=g, dtype=torch.float64)).square().mean().backward()
        before = opt.state[model.up.weight]["stat"].clone()
        opt.step()
        opt.zero_grad()
        seen.append(not torch.equal(before, opt.state[model.up.weight]["stat"]))
    assert seen == [True, False, True, False, True]
    assert opt.state[model.up.weight]["captures"] == 3


def test_damped_inverse_and_precondition_against_dense_math():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    stat = a @ a.mT
    inv = damped_inverse(stat, 0.2)
    for k in range(3):
        ridge = 0.2 * torch.trace(stat[k]) / 5 + 1e-8
        torch.testing.assert_close(inv[k], torch.linalg.inv(stat[k] + ridge * torch.eye(5, dtype=torch.float64)))
    # a matrix that cannot be factored (NaN) keeps the identity
    bad = stat.clone()
    bad[1, 0, 0] = float("nan")
    assert torch.equal(damped_inverse(bad, 0.2)[1], torch.eye(5, dtype=torch.float64))
    x = torch.randn(2, 4, 10, generator=g, dtype=torch.float64)
    blocks = torch.randn(4, 5, 5, generator=g, dtype=torch.float64)
    out = precondition(x, blocks)
    for k in range(2):
        dense = torch.block_diag(blocks[2 * k], blocks[2 * k + 1])
        torch.testing.assert_close(out[k], x[k] @ dense)


@pytest.mark.parametrize("kw,match", [
    (dict(refresh_every=0), "refresh_every"), (dict(stat_decay=1.0), "stat_decay"), (dict(damping=0.0), "damping"),
    (dict(blocks=3), "blocks=3 must divide"), (dict(capture="some"), "capture"), (dict(momentum=1.0), "momentum"),
])
def test_bad_arguments_raise_naming_them(kw, match):
    model = Mlp()
    with pytest.raises(ValueError, match=match):
        NewtonMuon(model.parameters(), model, lr=0.01, **kw)


def test_model_is_required():
    with pytest.raises(ValueError, match="model="):
        NewtonMuon([nn.Parameter(torch.zeros(4, 4))], lr=0.01)
