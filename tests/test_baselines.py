"""Baselines against independent references: torch.optim.Muon / its NS kernel, float64 SVD,
exact norms from Table 9, and hand-computed per-block / per-row updates."""
from __future__ import annotations

import copy
import inspect
import io
import math

import pytest
import torch
from torch import nn

import dobb
from dobb.baselines import (RMNP, BlockMuon, Dion, Dion2, Muon, PeriodicRowMuon, dion2_step, dion_step,
                            newton_schulz, orthogonalize)
from dobb.baselines.dion import dion_rank, qr_randomized_cholesky

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = [(24, 24), (40, 16), (16, 40)]


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8)).to(dtype)


def data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g, dtype=dtype), torch.randn(64, 8, generator=g, dtype=dtype)


ALL_2D = dict(is_matrix=lambda name, mod, p: p.dim() == 2)  # every weight matrix, incl. the last


def train(model, opt, steps, X=None, Y=None):
    X, Y = (X, Y) if X is not None else data(next(model.parameters()).dtype)
    for _ in range(steps):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        opt.step()


def raw_update(opt_cls, shape, grads, dtype=torch.float64, **kw):
    """Raw O of the last step: one m x n weight, lr=1, wd=0, so dW = -s O."""
    w = nn.Parameter(torch.zeros(shape, dtype=dtype))
    opt = opt_cls([w], lr=1.0, **kw)
    for g in grads:
        before = w.detach().clone()
        w.grad = g.to(dtype)
        opt.step()
    s = 0.2 * math.sqrt(max(shape))
    return (before - w.detach()) / s, opt


def spectrum(m, n, values, seed=0):
    """An m x n float64 matrix with the given singular values, and its polar factor U V^T."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(values), generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, len(values), generator=g, dtype=torch.float64)).Q
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T, u @ v.T


# ----------------------------------------------------------------------------- Newton-Schulz
@pytest.mark.parametrize("shape", SHAPES + [(64, 64)])
def test_batched_ns_equals_torch_kernel(shape):
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([torch_ns(t, COEFFS, 5, 1e-7) for t in x])
    assert torch.equal(newton_schulz(x), ref)  # same arithmetic, bitwise on CPU
    outs = orthogonalize(list(x) + [x[0, :7]])  # a group of 3 (batched) and a singleton (torch's)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    assert torch.equal(outs[3], torch_ns(x[0, :7], COEFFS, 5, 1e-7))


@pytest.mark.parametrize("shape", SHAPES)
def test_ns_singular_values_in_band(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sv = torch.linalg.svdvals(newton_schulz(x).double())
    assert sv.min() > 0.6 and sv.max() < 1.25  # NS5's quintic lands in ~[0.7, 1.2], not at 1
    o, _ = raw_update(Muon, shape, [x])
    assert 0.6**2 < o.square().sum() / min(shape) < 1.25**2  # ||O||_F^2 ~ min(m, n) (Table 9)


# ----------------------------------------------------------------------------- Muon
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon_bitwise(nesterov):
    ref, ours = mlp(), mlp()
    mats = [ref[0].weight, ref[2].weight, ref[4].weight]
    rest = [p for p in ref.parameters() if all(p is not q for q in mats)]
    a = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    b = torch.optim.AdamW(rest, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))
    opt = Muon(dobb.param_groups(ours, algorithm="muon", **ALL_2D), lr=0.02, weight_decay=0.1, nesterov=nesterov)
    X, Y = data()
    for _ in range(6):
        for model, opts in ((ref, (a, b)), (ours, (opt,))):
            for o in opts:
                o.zero_grad()
            ((model(X) - Y) ** 2).mean().backward()
            for o in opts:
                o.step()
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


# every matrix class of the registry (each one compared, not only the last)
MATRIX_CLASSES = sorted({e.cls for e in dobb.registry.OPTIMIZERS.values() if e.is_matrix}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", MATRIX_CLASSES, ids=lambda c: c.__name__)
def test_adamw_groups_match_torch_adamw(cls):
    ref, ours = mlp(), mlp()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.05, betas=(0.9, 0.95))
    groups = [{"params": list(ours.parameters()), "algorithm": "adamw"}]
    hooked = {"model": ours} if "model" in inspect.signature(cls.__init__).parameters else {}
    train(ours, cls(groups, lr=0.01, weight_decay=0.05, **hooked), 4)
    train(ref, torch_opt, 4)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------- Dion
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


# ----------------------------------------------------------------------------- RMNP
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_rmnp_unit_rows(shape, nesterov):
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(2)]
    o, _ = raw_update(RMNP, shape, grads, nesterov=nesterov, momentum=0.9)
    m_buf = 0.9 * grads[0] + grads[1]
    u = grads[1] + 0.9 * m_buf if nesterov else m_buf
    assert torch.allclose(o, u / u.norm(dim=1, keepdim=True), atol=1e-12)
    assert o.square().sum().item() == pytest.approx(shape[0], rel=1e-12)  # Table 9: exactly m


# ----------------------------------------------------------------------------- PR-Muon
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
        o, _ = raw_update(PeriodicRowMuon, shape, grads[: k + 1], period=3, nesterov=False)
        buf = buf.lerp(grads[k], 0.05)
        if k % 3 == 0:
            assert torch.allclose(o, torch_ns(buf, COEFFS, 5, 1e-7).double())
        else:  # unit rows rescaled to Muon's norm min(m, n)
            assert torch.allclose(o, buf / buf.norm(dim=1, keepdim=True) * math.sqrt(min(m, n) / m), atol=1e-6)
            assert o.square().sum().item() == pytest.approx(min(m, n), rel=1e-5)


# ----------------------------------------------------------------------------- Block Muon
def test_block_muon_one_block_is_muon():
    a, b = mlp(), mlp()
    train(a, Muon(dobb.param_groups(a, algorithm="muon"), lr=0.02, weight_decay=0.1), 5)
    train(b, BlockMuon(dobb.param_groups(b, algorithm="block-muon"), lr=0.02, weight_decay=0.1, blocks=1), 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("axis", [0, 1])
def test_block_muon_blocks_are_independent_muon_updates(axis):
    shape, blocks = (21, 10), 3
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    o, _ = raw_update(BlockMuon, shape, [G], blocks=blocks, axis=axis, nesterov=False)
    sizes = dobb.functional.block_sizes(shape[axis], blocks)
    s = 0.2 * math.sqrt(max(shape))
    start = 0
    for size in sizes:
        sl = (slice(None), slice(start, start + size)) if axis == 1 else (slice(start, start + size),)
        block = (0.05 * G)[sl]  # first EMA step
        ref = torch_ns(block, COEFFS, 5, 1e-7).double() * (0.2 * math.sqrt(max(block.shape)) / s)
        assert torch.allclose(o[sl], ref, atol=1e-6)
        start += size


def test_block_muon_bad_blocks_names_parameter():
    model = mlp()
    with pytest.raises(ValueError, match=r"0\.weight.*blocks=20"):
        BlockMuon(dobb.param_groups(model, algorithm="block-muon"), lr=0.1, blocks=20, axis=1)


# ----------------------------------------------------------------------------- Dion2
def test_dion2_selects_heaviest_rows_with_error_feedback():
    m, n, mu = 12, 9, 0.9
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    G[3] *= 10
    G[7] *= 8
    G[0] *= 6
    o, opt = raw_update(Dion2, (m, n), [G], fraction=0.25, momentum=mu)
    rows = [0, 3, 7]
    k = len(rows)
    assert selected_nonzero(o) == rows
    s_ratio = math.sqrt(max(k, n)) / math.sqrt(max(m, n))  # moves as a Muon step of a k x n matrix
    ref = torch_ns(G[rows], COEFFS, 5, 1e-7).double() * s_ratio
    assert torch.allclose(o[rows], ref, atol=1e-6)
    mom = opt.state[opt.param_groups[0]["params"][0]]["momentum"]
    expect = G.clone()
    expect[rows] *= mu
    assert torch.allclose(mom, expect)
    sv = torch.linalg.svdvals(o[rows] / s_ratio)
    assert sv.min() > 0.6 and sv.max() < 1.25


def selected_nonzero(o):
    return [i for i in range(o.shape[0]) if o[i].abs().sum() > 0]


def test_dion2_full_fraction_is_muon_without_nesterov():
    # mu = 1/2 makes Dion2's buffer exactly 2x Muon's EMA: a power of two NS5 cannot see.
    g = torch.Generator().manual_seed(13)
    grads = [torch.randn(10, 14, generator=g, dtype=torch.float64) for _ in range(4)]
    o_muon, _ = raw_update(Muon, (10, 14), grads, momentum=0.5, nesterov=False)
    o_dion2, _ = raw_update(Dion2, (10, 14), grads, momentum=0.5, fraction=1.0)
    assert torch.allclose(o_muon, o_dion2, atol=1e-12, rtol=0)


def test_dion2_pure_step_zero_rows():
    b = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(12))
    o, m_new, rows = dion2_step(b, 2, 0.5)
    for i in range(2):
        keep = [r for r in range(8) if r not in rows[i].tolist()]
        assert (o[i, keep] == 0).all() and torch.equal(m_new[i, keep], b[i, keep])


# ----------------------------------------------------------------------------- common behaviour
CLASSES = [Muon, Dion, RMNP, PeriodicRowMuon, BlockMuon, Dion2]


@pytest.mark.parametrize("cls", CLASSES)
def test_validation_names_argument(cls):
    model = mlp()
    groups = lambda: dobb.param_groups(model, algorithm=cls.algorithm)  # noqa: E731
    for kw, arg in [({"lr": -1.0}, "lr"), ({"lr": 0.1, "weight_decay": -0.1}, "weight_decay"),
                    ({"lr": 0.1, "tau": 0.0}, "tau"), ({"lr": 0.1, "momentum": 1.0}, "momentum")]:
        with pytest.raises(ValueError, match=arg):
            cls(groups(), **kw)
    with pytest.raises(ValueError, match="bogus"):
        cls(groups(), lr=0.1, bogus=1)
    bad = [{"params": [("0.bias", model[0].bias)], "algorithm": cls.algorithm}]
    with pytest.raises(ValueError, match=r"0\.bias is 1-D"):
        cls(bad, lr=0.1)


@pytest.mark.parametrize("cls,kw,arg", [
    (Muon, {"ns_steps": 0}, "ns_steps"), (Muon, {"nesterov": 1}, "nesterov"),
    (Muon, {"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"), (Muon, {"eps": 0.0}, "eps"),
    (Dion, {"rank_fraction": 0.0}, "rank_fraction"), (Dion, {"rank_fraction": 1.5}, "rank_fraction"),
    (Dion, {"qr": "svd"}, "qr"), (Dion, {"seed": -1}, "seed"), (PeriodicRowMuon, {"period": 0}, "period"),
    (BlockMuon, {"blocks": 0}, "blocks"), (BlockMuon, {"axis": 2}, "axis"),
    (Dion2, {"fraction": 0.0}, "fraction"), (RMNP, {"nesterov": "yes"}, "nesterov"),
])
def test_hyperparameter_validation(cls, kw, arg):
    with pytest.raises(ValueError, match=arg):
        cls(dobb.param_groups(mlp(), algorithm=cls.algorithm), lr=0.1, **kw)


@pytest.mark.parametrize("cls", CLASSES)
def test_params_without_grad_untouched(cls):
    model = mlp()
    opt = cls(dobb.param_groups(model, algorithm=cls.algorithm), lr=0.1, weight_decay=0.1)
    frozen = model[2].weight
    before = frozen.detach().clone()
    state_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[frozen].items()}
    X, Y = data()
    for _ in range(3):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        frozen.grad = None
        opt.step()
    assert torch.equal(frozen, before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[frozen][k], v) if torch.is_tensor(v) else opt.state[frozen][k] == v


@pytest.mark.parametrize("cls", CLASSES)
def test_no_host_sync_in_matrix_step(cls, monkeypatch):
    model = mlp()
    mats = [(f"{i}.weight", model[i].weight) for i in (0, 2, 4)]
    opt = cls([{"params": mats, "algorithm": cls.algorithm}], lr=0.1)
    X, Y = data()

    def boom(*a, **k):
        raise AssertionError("host synchronisation inside step()")

    for _ in range(2):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        with monkeypatch.context() as mp:
            for name in ("item", "__bool__", "tolist"):
                mp.setattr(torch.Tensor, name, boom)
            opt.step()


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


@pytest.mark.parametrize("cls", CLASSES)
def test_one_momentum_key_and_old_checkpoints_load(cls):
    """Every optimizer keeps its momentum under "momentum"; a state dict saved with torch's
    "momentum_buffer" key (earlier Muon-family and RMNP releases) resumes the same run."""
    model = mlp()
    opt = cls(dobb.param_groups(model, algorithm=cls.algorithm), lr=0.01)
    train(model, opt, 2)
    assert all("momentum" in opt.state[p] and "momentum_buffer" not in opt.state[p] for p in opt.iter_matrix_params())
    sd = copy.deepcopy(opt.state_dict())  # torch's state_dict shares storage with the live state
    old = {**sd, "state": {i: {("momentum_buffer" if k == "momentum" else k): v for k, v in st.items()}
                           for i, st in sd["state"].items()}}
    twin = mlp()
    twin.load_state_dict(model.state_dict())
    fresh = cls(dobb.param_groups(twin, algorithm=cls.algorithm), lr=0.01)
    fresh.load_state_dict(old)
    train(model, opt, 2)
    train(twin, fresh, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
