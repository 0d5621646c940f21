"""Dobb-preconditioned Muon (``norm="muon"``, registry ``dobb-muon``) against a float64 dense reference
written here from the definition (docs/algorithm.md, "Dobb-preconditioned Muon"), independent of
``dobb.functional``:

- statistic: ``grad_gram`` blocks ``G^T G / m`` of the input axis (first capture copied, then EMA);
  basis: ``eigh`` of the first statistic (descending), then one ``qr(A Q)`` per refresh;
- ``C = M Q`` (block-diagonal ``Q``), ``V <- b2 V + (1-b2) (G Q)^2``,
  ``R = (C / (1 - mu^t)) / (sqrt(V / (1 - b2^t)) + eps)``, ``P = R Q^T``;
- row blocks ``P_b`` of ``out_blocks``: ``W_b <- (1 - lr wd) W_b - lr * 0.2 sqrt(max(m_b, n)) NS5(P_b)``.

The direction does not depend on the sign of any basis column (``C`` and ``R`` flip together, ``V``
does not), so the reference's QR need not share torch's sign convention.
"""
from __future__ import annotations

import math

import pytest
import torch

import dobb
from dobb import Dobb

NS = (3.4445, -4.7750, 2.0315)


def _sizes(size, parts):
    base, extra = divmod(size, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _blockdiag(blocks):
    return torch.block_diag(*blocks)


def _ns5(x):
    """Muon's quintic Newton-Schulz, float64, on the wide orientation."""
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / torch.linalg.matrix_norm(y).clamp_min(1e-7)  # torch.optim.Muon's normalisation
    a, b, c = NS
    for _ in range(5):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if tall else y


class Reference:
    def __init__(self, w, *, blocks, out_blocks, refresh, lr, wd, mu=0.95, beta2=0.95, eps=1e-8, decay=0.9, whole=0):
        self.whole = whole
        self.w = w.clone()
        m, n = w.shape
        self.cols, self.rows = _sizes(n, blocks), _sizes(m, out_blocks)
        self.refresh, self.lr, self.wd, self.mu, self.b2, self.eps, self.decay = refresh, lr, wd, mu, beta2, eps, decay
        self.mom = torch.zeros_like(w)
        self.v = torch.zeros_like(w)
        self.a = None
        self.q = None
        self.t = 0

    def step(self, g):
        m, n = self.w.shape
        if self.t % self.refresh == 0:
            new = [blk.T @ blk / m for blk in g.split(self.cols, dim=1)]
            if self.a is None:
                self.a = new
                self.q = []
                for a in new:
                    vals, vecs = torch.linalg.eigh(a)
                    self.q.append(vecs.flip(-1))
            else:
                self.a = [self.decay * a + (1 - self.decay) * b for a, b in zip(self.a, new)]
                self.q = [torch.linalg.qr(a @ q).Q for a, q in zip(self.a, self.q)]
        t = self.t + 1
        self.mom = self.mu * self.mom + g  # the plain form; the optimizer keeps (1 - mu) times it
        q = _blockdiag(self.q)
        c = self.mom * (1 - self.mu)
        gq = g @ q
        self.v = self.b2 * self.v + (1 - self.b2) * gq * gq
        r = (c @ q / (1 - self.mu**t)) / ((self.v / (1 - self.b2**t)).sqrt() + self.eps)
        p = r @ q.T
        self.w = self.w * (1 - self.lr * self.wd)
        start = 0
        if self.whole and self.t % self.whole == 0:  # whole-matrix step: NS5 of all of P, Muon's scale
            self.w -= self.lr * 0.2 * math.sqrt(max(m, n)) * _ns5(p)
            self.t = t
            return
        for size in self.rows:
            o = _ns5(p[start:start + size])
            self.w[start:start + size] -= self.lr * 0.2 * math.sqrt(max(size, n)) * o
            start += size
        self.t = t


def _run(m, n, blocks, out_blocks, steps=7, refresh=3, lr=0.03, wd=0.1, seed=0, whole=0):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(m, n, generator=gen, dtype=torch.float64) / n**0.5
    grads = [torch.randn(m, n, generator=gen, dtype=torch.float64) for _ in range(steps)]
    p = torch.nn.Parameter(w0.clone())
    opt = Dobb([p], lr=lr, weight_decay=wd, norm="muon", source="grad_gram", blocks=blocks, out_blocks=out_blocks,
               refresh_every=refresh, stagger=False, basis_dtype=torch.float64, stat_dtype=torch.float64,
               product_dtype=torch.float64, ns_dtype="float64", whole_every=whole)
    ref = Reference(w0, blocks=blocks, out_blocks=out_blocks, refresh=refresh, lr=lr, wd=wd, whole=whole)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        ref.step(g)
    return p.detach(), ref.w, w0


@pytest.mark.parametrize("m,n,blocks,out_blocks", [(24, 16, 1, 4), (24, 16, 2, 3), (12, 20, 2, 1), (18, 10, 3, 4)])
def test_matches_float64_dense_reference(m, n, blocks, out_blocks):
    # every input block no wider than m: G^T G / m has full rank (a null space has arbitrary eigenvectors)
    got, want, w0 = _run(m, n, blocks, out_blocks)
    assert (want - w0).abs().max() > 1e-2  # the weights moved
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("whole", [1, 3])
def test_whole_matrix_step_every_p_matches_reference(whole):
    got, want, w0 = _run(24, 16, 2, 4, whole=whole)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    other, _, _ = _run(24, 16, 2, 4)
    assert (other - got).abs().max() > 1e-3  # the whole steps changed the run


def test_two_sided_whole_step_is_muon_of_the_momentum_between_two_sided_steps():
    """``side="both", whole_every=2``: steps 0, 2, 4 are ``-lr * 0.2 sqrt(max(m, n)) NS5(M)`` after the
    decay; steps 1, 3 move as the plain two-sided optimizer does from the same state."""
    m, n, lr, wd = 20, 12, 0.05, 0.1
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(m, n, generator=gen, dtype=torch.float64) for _ in range(5)]
    kw = dict(lr=lr, weight_decay=wd, side="both", blocks=2, out_blocks=2, source="grad_gram", refresh_every=2,
              stagger=False, basis_dtype=torch.float64, stat_dtype=torch.float64, product_dtype=torch.float64,
              ns_dtype="float64")
    a = torch.nn.Parameter(torch.randn(m, n, generator=gen, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    oa, ob = Dobb([a], whole_every=2, **kw), Dobb([b], **kw)
    mom = torch.zeros(m, n, dtype=torch.float64)
    for t, g in enumerate(grads):
        mom = 0.95 * mom + g
        before = a.detach().clone()
        b.data.copy_(before)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        if t % 2 == 0:
            want = before * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(m, n)) * _ns5(mom)
        else:
            want = b.detach()
        torch.testing.assert_close(a.detach(), want, rtol=0, atol=1e-10)


def test_one_row_block_one_basis_block_is_whole_matrix_ns_of_the_rotated_adam_step():
    """At the first step (basis = eigenvectors of G^T G / m, V = (1-b2)(GQ)^2) the preconditioned
    direction is ``sign(G Q) Q^T`` up to eps: its NS5 is what moves the weight."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(10, 6, dtype=torch.float64))
    opt = Dobb([p], lr=1.0, norm="muon", source="grad_gram", basis_dtype=torch.float64, stat_dtype=torch.float64,
               product_dtype=torch.float64, ns_dtype="float64", eps=1e-30)
    p.grad = g
    opt.step()
    q = torch.linalg.eigh(g.T @ g).eigenvectors
    want = -0.2 * math.sqrt(10) * _ns5((g @ q).sign() @ q.T)
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-10)


def test_registry_entry_builds_and_steps_with_hooks():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12, bias=False), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    opt = dobb.build_optimizer("dobb-muon", model, lr=0.01, out_blocks=2)
    before = model[0].weight.detach().clone()
    for _ in range(3):
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(model[0].weight).all() and not torch.equal(before, model[0].weight)
    assert opt.param_groups[0]["norm"] == "muon" and "second_moment" in opt.state[model[0].weight]


@pytest.mark.parametrize("whole", [0, 2])
def test_transposed_weight_steps_as_its_transpose(whole):
    """A Hugging Face Conv1D weight, stored (in, out), moves as the (out, in) weight it stores."""
    gen = torch.Generator().manual_seed(6)
    w0 = torch.randn(16, 24, generator=gen, dtype=torch.float64)  # (in, out)
    grads = [torch.randn(16, 24, generator=gen, dtype=torch.float64) for _ in range(5)]
    kw = dict(lr=0.03, weight_decay=0.1, norm="muon", source="grad_gram", blocks=2, out_blocks=3, refresh_every=2,
              stagger=False, basis_dtype=torch.float64, stat_dtype=torch.float64, product_dtype=torch.float64,
              ns_dtype="float64", whole_every=whole)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.T.clone())
    oa = Dobb([{"params": [a], "transposed": True}], **kw)
    ob = Dobb([b], **kw)
    for g in grads:
        a.grad, b.grad = g.clone(), g.T.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a.detach(), b.detach().T, rtol=0, atol=1e-10)


def test_bad_input_is_a_value_error_naming_the_problem():
    p = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match="norm='muon'.*side='input'"):
        Dobb([p], lr=0.1, norm="muon", side="both", source="grad_gram")
    with pytest.raises(ValueError, match="ns_dtype"):
        Dobb([p], lr=0.1, norm="muon", source="grad_gram", ns_dtype="int8")
    with pytest.raises(ValueError, match="out_blocks"):
        Dobb([p], lr=0.1, norm="muon", source="grad_gram", out_blocks=7)
    with pytest.raises(ValueError, match="expert stack"):
        Dobb([torch.nn.Parameter(torch.randn(2, 6, 4))], lr=0.1, norm="muon", source="grad_gram")
    with pytest.raises(ValueError, match="whole_every=2 .* takes norm='muon', or side='both' with norm='sign'"):
        Dobb([p], lr=0.1, source="grad_gram", whole_every=2)
    with pytest.raises(ValueError, match="whole_every must"):
        Dobb([p], lr=0.1, norm="muon", source="grad_gram", whole_every=-1)
    with pytest.raises(ValueError, match="does not take"):
        dobb.build_optimizer("dobb-muon", torch.nn.Linear(4, 6), lr=0.1, norm="sign")


def test_cycle_includes_the_whole_steps():
    p = torch.nn.Parameter(torch.randn(6, 4))
    assert Dobb([p], lr=0.1, norm="muon", source="grad_gram", refresh_every=9).refresh_cycle() == 9
    assert Dobb([p], lr=0.1, norm="muon", source="grad_gram", refresh_every=9, whole_every=5).refresh_cycle() == 45
