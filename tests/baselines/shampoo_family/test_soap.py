"""SOAP against a released implementation (``pytorch_optimizer.SOAP``, a port of the authors' code)
on one to four steps at matched settings, and its basis math against known spectra."""
from __future__ import annotations

import pytest
import torch

from dobb.baselines.shampoo_family.soap import SOAP, soap_initial_basis, soap_refresh_basis

try:  # the released reference (the `peers` extra; CI installs it)
    import pytorch_optimizer as peer
except ImportError:  # pragma: no cover - depends on the environment
    peer = None
needs_peer = pytest.mark.skipif(peer is None, reason="pytorch_optimizer (the peers extra) is not installed")


def grads_for(shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(steps)]


def run(make, shapes, grads, seed=1):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    opt = make(params)
    traj = []
    for step in grads:
        for p, x in zip(params, step):
            p.grad = x.clone()
        opt.step()
        traj.append([p.detach().clone() for p in params])
    return traj


def ours(**kw):
    return lambda params: SOAP([{"params": params}], **kw)


def theirs(**kw):
    return lambda params: peer.SOAP(params, **kw)


def assert_same(a, b, rtol=2e-5, atol=2e-7):
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


# Shapes whose preconditioned sides get full-rank statistics (a rank-deficient factor has an
# eigenspace whose basis is arbitrary, so two correct implementations may pick different ones).
CASES = [
    ([(16, 16), (16, 16), (12, 12)], {}),                            # two-sided, a batch of two
    ([(8, 24), (8, 24)], {"max_precondition_dim": 16}),             # one-sided: left only
    ([(24, 8)], {"max_precondition_dim": 16}),                      # one-sided: right only
]


@needs_peer
@pytest.mark.parametrize("shapes,extra", CASES)
@pytest.mark.parametrize("freq", [1, 2])
def test_equals_pytorch_optimizer_soap(shapes, extra, freq):
    """Four steps (the first forms the statistics only; refreshes at every or every other update)
    equal the package's weights after every step, without weight decay (where the two orders of
    decay and update differ; see the next test)."""
    grads = grads_for(shapes, 4)
    kw = dict(lr=3e-3, weight_decay=0.0, precondition_frequency=freq, **extra)
    a = run(ours(betas=(0.95, 0.95), **kw), shapes, grads)
    b = run(theirs(betas=(0.95, 0.95), **kw), shapes, grads)
    assert not torch.equal(a[-1][0], a[0][0])  # it moved
    assert_same(a, b)


@needs_peer
def test_other_betas_and_shampoo_beta_match():
    shapes = [(10, 10)]
    grads = grads_for(shapes, 4, seed=5)
    kw = dict(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99), shampoo_beta=0.8, precondition_frequency=2, eps=1e-6)
    assert_same(run(ours(**kw), shapes, grads), run(theirs(**kw), shapes, grads))


@needs_peer
def test_weight_decay_is_decoupled_and_applied_before_the_update():
    """``W_t = (1 - lr wd) W_{t-1} - a_t O_t``, with ``a_t O_t`` read off the package without decay
    (fixed gradients: the moments do not depend on the weights)."""
    shapes = [(12, 12)]
    grads = grads_for(shapes, 4, seed=2)
    lr, wd = 3e-3, 0.1
    mine = run(ours(lr=lr, weight_decay=wd, precondition_frequency=1), shapes, grads)
    ref = run(theirs(lr=lr, weight_decay=0.0, precondition_frequency=1), shapes, grads)
    w0 = run(ours(lr=0.0), shapes, grads[:1])[0][0]  # the initial weights
    w, prev = w0, w0
    for k in range(4):
        step = prev - ref[k][0]  # a_t O_t (zero on the first step)
        prev = ref[k][0]
        w = w if k == 0 else (1 - lr * wd) * w - step
        torch.testing.assert_close(mine[k][0], w, rtol=2e-5, atol=2e-7)


def test_blocks_equal_separate_column_blocks():
    """``blocks=B``: each column block is a SOAP matrix of its own (stacked equals looped)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 16, generator=g, dtype=torch.float64)
    grads = [torch.randn(6, 16, generator=g, dtype=torch.float64) for _ in range(4)]
    whole = torch.nn.Parameter(w.clone())
    parts = [torch.nn.Parameter(w[:, i * 4:(i + 1) * 4].clone()) for i in range(4)]
    o1 = SOAP([{"params": [whole]}], lr=0.01, weight_decay=0.1, blocks=4, precondition_frequency=2)
    o2 = SOAP([{"params": parts}], lr=0.01, weight_decay=0.1, precondition_frequency=2)
    for x in grads:
        whole.grad = x.clone()
        for i, p in enumerate(parts):
            p.grad = x[:, i * 4:(i + 1) * 4].clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(whole.detach(), torch.cat([p.detach() for p in parts], 1), rtol=1e-12, atol=1e-14)


@needs_peer
@pytest.mark.parametrize("sides,shape,limit", [("input", (24, 8), 16), ("output", (8, 24), 16)])
def test_sides_equal_the_package_one_sided(sides, shape, limit):
    """``sides`` switches a side off as the package's ``max_precondition_dim`` does for long sides."""
    grads = grads_for([shape], 4, seed=4)
    a = run(ours(lr=3e-3, weight_decay=0.0, precondition_frequency=1, sides=sides), [shape], grads)
    b = run(theirs(lr=3e-3, weight_decay=0.0, precondition_frequency=1, max_precondition_dim=limit), [shape], grads)
    assert_same(a, b)


def test_initial_basis_sorts_a_known_spectrum():
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(2, 7, 7, generator=g, dtype=torch.float64))
    lam = torch.tensor([0.5, 3.0, 1.0, 7.0, 0.1, 2.0, 4.0], dtype=torch.float64)
    stat = q @ torch.diag(lam) @ q.mT
    basis = soap_initial_basis(stat)
    rayleigh = torch.einsum("kil,kij,kjl->kl", basis, stat, basis)
    torch.testing.assert_close(rayleigh, lam.sort(descending=True).values.expand(2, -1), rtol=1e-12, atol=1e-12)


def test_refresh_power_steps_converge_to_the_eigenbasis():
    """Repeated warm-started QR power steps from a rotated start recover the eigenbasis (up to signs),
    with the returned order sorting the Rayleigh quotients."""
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    lam = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64)
    stat = (q @ torch.diag(lam) @ q.mT)[None]
    basis, _ = torch.linalg.qr(torch.randn(1, 6, 6, generator=g, dtype=torch.float64))
    for _ in range(200):
        basis, order = soap_refresh_basis(stat, basis)
    overlap = (basis[0].mT @ q).abs()
    torch.testing.assert_close(overlap, torch.eye(6, dtype=torch.float64).flip(1), atol=1e-8, rtol=0)
    torch.testing.assert_close(order[0], torch.arange(6))


@pytest.mark.parametrize("kw,match", [
    (dict(betas=(0.9, 1.0)), "betas"), (dict(shampoo_beta=1.5), "shampoo_beta"), (dict(eps=0.0), "eps"),
    (dict(precondition_frequency=0), "precondition_frequency"), (dict(blocks=3), "blocks=3 must divide"),
    (dict(sides="left"), "sides"), (dict(max_precondition_dim=0), "max_precondition_dim"),
    (dict(correct_bias=1), "correct_bias"),
])
def test_bad_arguments_raise_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        SOAP([torch.nn.Parameter(torch.zeros(4, 8))], lr=0.01, **kw)


def test_state_is_fp32_for_bf16_weights_and_survives_a_reload():
    p = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    opt = SOAP([p], lr=0.01, precondition_frequency=1)
    for _ in range(3):
        p.grad = torch.randn(8, 8).bfloat16()
        opt.step()
    saved = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = SOAP([q], lr=0.01, precondition_frequency=1)
    opt2.load_state_dict(saved)
    for key in SOAP._own_dtype_keys:
        assert opt2.state[q][key].dtype == torch.float32
        torch.testing.assert_close(opt2.state[q][key], opt.state[p][key], rtol=0, atol=0)


def test_plain_tensors_take_the_unsharded_path():
    """Plain (non-DTensor) weights: no owners, whole state on this process, no collective, and a
    state dict that is torch's own (the live tensors, no DTensor conversion)."""
    from dobb.meter import PayloadMeter

    p = torch.nn.Parameter(torch.randn(6, 10))
    opt = SOAP([p], lr=0.01, precondition_frequency=2)
    assert opt.owners == {}
    with PayloadMeter() as m:
        for _ in range(3):
            p.grad = torch.randn(6, 10)
            opt.step()
    assert m.collectives == 0
    st = opt.state[p]
    assert st["momentum"].shape == (6, 10) and st["exp_avg_sq"].shape == (1, 6, 10)
    assert st["stat_left"].shape == (1, 6, 6) and st["basis_right"].shape == (1, 10, 10)
    saved = opt.state_dict()["state"][0]
    assert all(saved[k] is st[k] for k in st if isinstance(st[k], torch.Tensor))


def test_soap_cost_counts_the_preconditioned_sides():
    from dobb.baselines.shampoo_family.soap import soap_cost

    assert soap_cost(4, 6, 1, True, True) == 4 * 6 * (1 + 4 + 6)
    assert soap_cost(4, 6, 2, False, True) == 2 * 4 * 6 * (1 + 6)
    assert soap_cost(4, 6, 1, False, False) == 24
