"""``capture_every = k``: the hook statistic captured and folded into its EMA every ``k``-th step (and on
every refresh step) while the basis refreshes every ``refresh_every`` steps (``core.schedule.captured``).

Against a float64 reference written here with plain torch (the EMA of the captured ``X^T X / tokens``,
the exact ``eigh`` of the first capture, one warm ``qr(A Q)`` on a later refresh); ``capture_every=None``
bitwise the run without the option; the option's checks; a checkpoint taken mid-cycle resumes bitwise."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dobb
from dobb import Dobb

F64 = dict(stat_dtype=torch.float64, basis_dtype=torch.float64)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5, bias=False, dtype=torch.float64), nn.Tanh(),
                         nn.Linear(5, 3, bias=False, dtype=torch.float64))


def _inputs(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 6, generator=gen, dtype=torch.float64) for _ in range(steps)]  # 8 tokens a step


def _train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _signs_fixed(q, ref):
    return q * torch.sign(torch.diagonal(q.T @ ref))


@pytest.mark.parametrize("every", [1, 2])
def test_statistic_is_the_ema_folded_on_capture_steps_and_the_basis_moves_on_refreshes(every):
    d, steps = 0.8, 6
    model = _model()
    w = model[0].weight
    opt = Dobb([w, model[2].weight], model, lr=0.01, capture_every=every, refresh_every=3, stat_decay=d,
               stagger=False, **F64)
    xs = _inputs(steps)
    a = q = None
    for t, x in enumerate(xs):
        before_stat, before_basis = opt.state[w]["stat"].clone(), opt.state[w]["basis"].clone()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        refresh, capture = t % 3 == 0, t % 3 == 0 or t % every == 0
        flat = x.reshape(-1, 6)
        if capture:  # the reference: plain torch, the first capture copied, then the EMA
            new = flat.T @ flat / flat.shape[0]
            a = new if a is None else d * a + (1 - d) * new
        st = opt.state[w]
        torch.testing.assert_close(st["stat"].reshape(6, 6), a, rtol=1e-13, atol=1e-15)
        assert torch.equal(st["stat"], before_stat) == (not capture)
        assert torch.equal(st["basis"], before_basis) == (not refresh)
        assert st["captures"] == [[t // 3 + 1]]  # refreshes folded: a capture-only step does not count
        if refresh:  # the basis of the folded statistic: exact eigh first, then one warm qr(A Q)
            q = torch.linalg.eigh(a).eigenvectors.flip(-1) if t == 0 else torch.linalg.qr(a @ q).Q
            basis = st["basis"].reshape(6, 6)
            torch.testing.assert_close(_signs_fixed(basis, q), q, rtol=0, atol=1e-10)
            q = basis.clone()  # the next warm start: the stored basis (a view of the state: copied)


def test_capture_every_none_is_bitwise_the_run_without_it():
    runs = []
    for kw in ({}, {"capture_every": None}):
        model = _model()
        opt = Dobb([model[0].weight, model[2].weight], model, lr=0.02, refresh_every=3, **kw)
        _train(model, opt, _inputs(7))
        runs.append((model, opt))
    (ma, oa), (mb, ob) = runs
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    for p, q in zip(ma.parameters(), mb.parameters()):
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k] for k in sa)


def test_capture_every_changes_the_run():
    """The option is live (the comparisons above and in the sharded test can fail)."""
    out = []
    for kw in ({}, {"capture_every": 1}):
        model = _model()
        opt = Dobb([model[0].weight, model[2].weight], model, lr=0.02, refresh_every=3, **kw)
        _train(model, opt, _inputs(5))
        out.append(model[0].weight.detach().clone())
    assert not torch.equal(*out)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "3", True])
def test_capture_every_must_be_a_positive_int_or_none(bad):
    model = _model()
    with pytest.raises(ValueError, match="capture_every must be None or an integer >= 1"):
        Dobb([model[0].weight], model, lr=0.1, capture_every=bad)


def test_capture_every_needs_hooks():
    with pytest.raises(ValueError, match="capture_every=2 .*source='grad_gram' has no hooks"):
        Dobb([nn.Linear(4, 4).weight], lr=0.1, source="grad_gram", capture_every=2)
    Dobb([nn.Linear(4, 4).weight], lr=0.1, source="grad_gram", capture_every=None)  # the default


def test_output_gradient_source_and_dobb_muon_take_it():
    model = _model()
    opt = Dobb([model[0].weight, model[2].weight], model, lr=0.01, side="output", source="output_grad",
               capture_every=1, refresh_every=3, stagger=False, **F64)
    muon = dobb.build_optimizer("dobb-muon", _model(), lr=0.01, capture_every=1, refresh_every=3, stagger=False)
    assert {g["capture_every"] for g in muon.param_groups if g.get("algorithm") == "dobb"} == {1}
    for o, m in ((opt, model), (muon, muon.model)):
        w = m[0].weight
        stats = []
        for x in _inputs(3):
            o.zero_grad()
            m(x.to(w.dtype)).square().mean().backward()
            o.step()
            stats.append(o.state[w]["stat"].clone())
        assert not torch.equal(stats[0], stats[1]) and not torch.equal(stats[1], stats[2])  # folded every step
        assert o.state[w]["captures"] == [[1]]


@pytest.mark.parametrize("split_at", [1, 2, 4])
def test_state_dict_mid_cycle_resumes_bitwise(split_at):
    xs = _inputs(8)
    kw = dict(lr=0.02, capture_every=2, refresh_every=3, stat_decay=0.7)
    model = _model()
    opt = Dobb([model[0].weight, model[2].weight], model, **kw)
    _train(model, opt, xs[:split_at])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, xs[split_at:])

    resumed = _model(seed=5)
    resumed.load_state_dict(saved_model)
    ropt = Dobb([resumed[0].weight, resumed[2].weight], resumed, **kw)
    ropt.load_state_dict(saved_opt)
    _train(resumed, ropt, xs[split_at:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert all(torch.equal(v, ropt.state[q][k]) if isinstance(v, torch.Tensor) else v == ropt.state[q][k]
                   for k, v in opt.state[p].items())
