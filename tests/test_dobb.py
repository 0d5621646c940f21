"""dobb.Dobb against a float64 dense reference, plus schedule, state and error handling
(capture hooks: test_capture.py; param group rule: test_groups.py)."""
import copy
import io
import math

import pytest
import torch
from torch import nn

import dobb
from dobb import functional as F
from _dobb_reference import dense_direction, eigh_bases

F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64)


def _one_layer(m, n, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n, m, bias=False).double()


@pytest.mark.parametrize("variant", [("sign", "input", "activation"), ("l2", "input", "activation"),
                                     ("sign", "output", "output_grad"), ("l2", "output", "output_grad")])
@pytest.mark.parametrize("blocks", [1, 4, 3])
def test_first_update_equals_dense_reference(variant, blocks):
    norm, side, source = variant
    m, n, lr, wd, tau = 12, 16, 0.1, 0.05, 0.2
    layer = _one_layer(m, n)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 9, n, generator=g, dtype=torch.float64)
    t = torch.randn(5, 9, m, generator=g, dtype=torch.float64)
    opt = dobb.Dobb([layer.weight], layer, lr=lr, weight_decay=wd, blocks=blocks, norm=norm, side=side,
                    source=source, basis="eigh", **F64)
    w0 = layer.weight.detach().clone()
    (layer(x) * t).sum().backward()
    grad = layer.weight.grad.clone()
    opt.step()
    feats = x.reshape(-1, n) if source == "activation" else t.reshape(-1, m)  # dL/dy = t
    sizes = F.block_sizes(n if side == "input" else m, blocks)
    o_ref = dense_direction(grad, sizes, eigh_bases(feats, sizes), norm, side)
    s = tau * math.sqrt(max(m, n))
    torch.testing.assert_close(layer.weight.detach(), (1 - lr * wd) * w0 - lr * s * o_ref, atol=1e-12, rtol=0)
    # Table 9: ||O||_F^2 = n (input side) or m (output side); update RMS tau*sqrt(max(m,n)/m) for Dobb.
    o = ((1 - lr * wd) * w0 - layer.weight.detach()) / (lr * s)
    assert o.square().sum().item() == pytest.approx(n if side == "input" else m, rel=1e-9)
    if side == "input":
        rms = (lr * s * o).square().mean().sqrt().item() / lr
        assert rms == pytest.approx(tau * math.sqrt(max(m, n) / m), rel=1e-9)


def test_refresh_schedule_ema_and_orthogonal_iteration():
    """Refresh on steps 0, T, 2T; EMA of captures; basis = one QR step of A Q warm-started from eigh."""
    m, n, T, decay = 6, 8, 3, 0.7
    layer = _one_layer(m, n)
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, refresh_every=T, stat_decay=decay, **F64)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(20, n, generator=g, dtype=torch.float64) for _ in range(7)]
    stats, expected_stat, expected_q = [], None, None
    for step, x in enumerate(xs):
        layer.weight.grad = None
        layer(x).square().sum().backward()
        opt.step()
        a_new = x.T @ x / x.shape[0]
        if step % T == 0:
            if expected_stat is None:
                expected_stat = a_new
                expected_q = torch.linalg.eigh(a_new).eigenvectors.flip(-1)  # descending
            else:
                expected_stat = decay * expected_stat + (1 - decay) * a_new
                expected_q = torch.linalg.qr(expected_stat @ expected_q).Q
        st = opt.state[layer.weight]
        torch.testing.assert_close(st["stat"], expected_stat, atol=1e-12, rtol=0)
        torch.testing.assert_close(st["basis"], expected_q, atol=1e-10, rtol=0)
        stats.append(st["captures"])
    assert stats == [[[c]] for c in (1, 1, 1, 2, 2, 2, 3)]


def test_basis_dtype_bf16_stores_6n2_over_B_bytes():
    n, B = 64, 4
    layer = nn.Linear(n, 32, bias=False)
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, blocks=B)
    st = opt.state[layer.weight]
    assert st["basis"].dtype == torch.bfloat16 and st["stat"].dtype == torch.float32
    assert st["stat"].nbytes + st["basis"].nbytes == 6 * n * n // B  # Table 18, principal precision


def _train(opt_factory, steps, dtype=torch.float32, state=None, start=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16), nn.LayerNorm(16)).to(dtype)
    opt = opt_factory(model)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(2, 8, 16, generator=g).to(dtype) for _ in range(steps)]
    for x in data[start:]:
        for micro in x:  # two micro-batches per step
            model(micro).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(blocks=4, refresh_every=3), dict(blocks=3, norm="l2", refresh_every=2, qr="cholesky"),
                                    dict(side="output", source="output_grad", blocks=2, capture="all", refresh_every=3)])
def test_resume_mid_cycle_is_exact(dtype, kwargs):
    def factory(model):
        return dobb.Dobb(dobb.param_groups(model), model, lr=0.02, weight_decay=0.1, **kwargs)

    full, _ = _train(factory, 8, dtype)
    half, opt = _train(factory, 4, dtype)  # step 4 lies between refreshes
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    resumed, opt2 = _train(factory, 8, dtype, state=state, start=4)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    st = opt2.state[resumed[0].weight]
    assert st["basis"].dtype == torch.bfloat16 and st["stat"].dtype == torch.float32


def test_adamw_groups_match_torch_adamw_exactly():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 8))

    a, b = make(), make()
    groups = [{"params": list(a[0].parameters()) + list(a[1].parameters()) + [a[2].bias], "algorithm": "adamw"}]
    opt_a = dobb.Dobb(groups, a, lr=0.01, weight_decay=0.1)
    opt_b = torch.optim.AdamW(list(b[0].parameters()) + list(b[1].parameters()) + [b[2].bias], lr=0.01,
                              betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.randint(0, 10, (4, 5))
    for _ in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(tokens).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_scheduler_changes_lr_like_manual_setting():
    def run(use_scheduler):
        torch.manual_seed(0)
        layer = nn.Linear(8, 8)
        opt = dobb.Dobb([layer.weight], layer, lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if use_scheduler else None
        for step in range(3):
            if not use_scheduler:
                opt.param_groups[0]["lr"] = 0.1 * 0.5**step
            layer(torch.ones(2, 8) * (step + 1)).sum().backward()
            opt.step()
            opt.zero_grad()
            if sched:
                sched.step()
        return layer.weight.detach()

    assert torch.equal(run(True), run(False))


def test_params_without_grad_are_untouched():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    opt = dobb.Dobb([a.weight, b.weight], nn.ModuleList([a, b]), lr=0.1, weight_decay=0.1)
    before = b.weight.detach().clone()
    a(torch.randn(3, 8)).sum().backward()
    opt.step()
    assert torch.equal(b.weight, before) and opt.state[b.weight]["step"] == 0
    assert opt.state[a.weight]["step"] == 1


def test_nonfinite_gradient_raises_and_changes_nothing():
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    opt = dobb.Dobb(dobb.param_groups(layer), layer, lr=0.1)
    layer(torch.randn(3, 8)).sum().backward()
    opt.step()
    layer(torch.randn(3, 8)).sum().backward()
    layer.weight.grad[0, 0] = float("nan")
    snap = {k: v.clone() for k, v in opt.state[layer.weight].items() if torch.is_tensor(v)}
    w = layer.weight.detach().clone()
    with pytest.raises(ValueError, match="non-finite gradient.*weight"):
        opt.step()
    assert torch.equal(layer.weight, w)
    for k, v in snap.items():
        assert torch.equal(opt.state[layer.weight][k], v)


def test_dead_units_give_finite_orthonormal_bases():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    for qr in ("householder", "cholesky"):
        opt = dobb.Dobb([layer.weight], layer, lr=0.01, blocks=2, refresh_every=1, qr=qr, init_basis="identity",
                        basis_dtype=torch.float32)
        for _ in range(3):
            x = torch.randn(6, 8)
            x[:, :4] = 0  # block 0 dead
            x[:, 5] = 0  # block 1 rank-deficient
            layer(x).sum().backward()
            opt.step()
            opt.zero_grad()
        q = F.block_view(opt.state[layer.weight]["basis"], F.block_runs([4, 4])[0])
        assert torch.isfinite(layer.weight).all()
        torch.testing.assert_close(q.transpose(1, 2) @ q, torch.eye(4).expand(2, -1, -1), atol=1e-5, rtol=0)


def test_non_matrix_in_dobb_group_and_missing_model_are_errors():
    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"bias.*1-D"):
        dobb.Dobb([("bias", layer.bias)], layer, lr=0.01)
    with pytest.raises(ValueError, match="pass model="):
        dobb.Dobb([layer.weight], lr=0.01)
    with pytest.raises(ValueError, match="not owned by any layer"):
        dobb.Dobb([layer.weight], nn.Linear(4, 4), lr=0.01)
    dobb.Dobb([layer.weight], lr=0.01, source="grad_gram")  # no hooks needed


def test_grad_gram_source_uses_gradient_blocks():
    layer = _one_layer(6, 8)
    opt = dobb.Dobb([layer.weight], lr=0.1, source="grad_gram", blocks=2, basis="eigh", **F64)
    layer(torch.randn(10, 8, dtype=torch.float64)).square().sum().backward()
    grad = layer.weight.grad.clone()
    w0 = layer.weight.detach().clone()
    opt.step()
    sizes = F.block_sizes(8, 2)
    o_ref = dense_direction(grad, sizes, eigh_bases(grad, sizes), "sign", "input")  # blocks of G^T G / m
    torch.testing.assert_close(layer.weight.detach(), w0 - 0.1 * 0.2 * math.sqrt(8) * o_ref, atol=1e-12, rtol=0)


def test_stagger_spreads_refresh_work_with_same_period():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    opt = dobb.Dobb([m.weight for m in model], model, lr=0.01, refresh_every=3, stagger=True, source="grad_gram")
    per_step = []
    for _ in range(7):
        before = {m: opt.state[m.weight]["captures"] for m in model}
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(sum(opt.state[m.weight]["captures"][0][0] - before[m][0][0] for m in model))
    assert per_step[0] == 6  # every matrix gets its first basis on step 0
    assert per_step[1:] == [2] * 6  # then a third of them per step, each every 3 steps


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("norm", ["sign", "l2"])
def test_momentum_forms_match_spec_sum_form(nesterov, norm):
    """Three steps against docs/algorithm.md step 1 in its sum form: M <- mu M + G; U = M or G + mu M."""
    m, n, lr, mu = 6, 8, 0.05, 0.9
    layer = _one_layer(m, n)
    opt = dobb.Dobb([layer.weight], layer, lr=lr, momentum=mu, nesterov=nesterov, norm=norm, basis="eigh",
                    refresh_every=100, **F64)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, n, generator=g, dtype=torch.float64)  # one batch: fixed basis from step 0
    s = 0.2 * math.sqrt(max(m, n))
    mom = torch.zeros(m, n, dtype=torch.float64)
    for _ in range(3):
        t = torch.randn(20, m, generator=g, dtype=torch.float64)
        w0 = layer.weight.detach().clone()
        (layer(x) * t).sum().backward()
        grad = layer.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        mom = mu * mom + grad
        u = grad + mu * mom if nesterov else mom
        expected = w0 - lr * s * dense_direction(u, [n], eigh_bases(x, [n]), norm, "input")
        torch.testing.assert_close(layer.weight.detach(), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("saved,loaded,key", [
    (dict(blocks=4), dict(blocks=2), "stat"),            # (16, 4) vs (16, 8)
    (dict(blocks=2), dict(blocks=2, side="output", source="output_grad"), "stat"),  # (16, 8) vs (12, 6)
])
def test_loading_state_of_another_layout_names_parameter_and_shapes(saved, loaded, key):
    layer = _one_layer(12, 16)
    opt = dobb.Dobb([("fc.weight", layer.weight)], layer, lr=0.1, **saved)
    layer(torch.randn(3, 16, dtype=torch.float64)).sum().backward()
    opt.step()
    other = dobb.Dobb([("fc.weight", layer.weight)], layer, lr=0.1, **loaded)
    want, got = tuple(opt.state[layer.weight][key].shape), tuple(other.state[layer.weight][key].shape)
    with pytest.raises(ValueError, match=rf"fc\.weight: saved state '{key}' has shape \({want[0]}, {want[1]}\).*needs \({got[0]}, {got[1]}\)"):
        other.load_state_dict(opt.state_dict())
    assert other.state[layer.weight]["step"] == 0  # nothing was loaded


def test_loading_dion_state_of_another_rank_is_a_value_error():
    layer = _one_layer(12, 16)
    opt = dobb.Dion([layer.weight], lr=0.1, rank_fraction=0.25)
    other = dobb.Dion([layer.weight], lr=0.1, rank_fraction=0.5)
    with pytest.raises(ValueError, match=r"saved state 'Q' has shape \(16, 3\).*needs \(16, 6\)"):
        other.load_state_dict(opt.state_dict())


_OLD_FORMS = {  # what earlier releases saved as a matrix's "captures", from today's [[...] per side]
    "matrix": (dict(), lambda c: c[0][0]),
    "stack": (dict(), lambda c: list(c[0])),
    "both": (dict(side="both", out_blocks=2), lambda c: [c[0][0], c[1][0]]),
}


@pytest.mark.parametrize("case", list(_OLD_FORMS))
def test_checkpoint_with_an_older_capture_form_resumes_exactly(case):
    """An optimizer state saved with the capture counts in an older form (an int for a matrix, a
    list per expert, ``[input, output]`` for side="both") loads into the one form and the run
    continues bitwise as the uninterrupted one."""
    kwargs, old_form = _OLD_FORMS[case]
    shape = (3, 6, 8) if case == "stack" else (6, 8)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = [torch.randn(shape, generator=torch.Generator().manual_seed(1 + t), dtype=torch.float64) for t in range(7)]

    def run(w, opt, steps):
        for g in steps:
            w.grad = g.clone()
            opt.step()

    def make():
        w = nn.Parameter(w0.clone())
        return w, dobb.Dobb([w], lr=0.02, source="grad_gram", blocks=2, refresh_every=2, **kwargs, **F64)

    w, opt = make()
    run(w, opt, grads[:3])
    sd = copy.deepcopy(opt.state_dict())
    st = sd["state"][0]
    st["captures"] = old_form(opt.state[w]["captures"])
    w2, opt2 = make()
    with torch.no_grad():
        w2.copy_(w)
    opt2.load_state_dict(sd)
    assert opt2.state[w2]["captures"] == opt.state[w]["captures"]
    run(w, opt, grads[3:])
    run(w2, opt2, grads[3:])
    assert torch.equal(w, w2)
    for k, v in opt.state[w].items():
        assert torch.equal(v, opt2.state[w2][k]) if isinstance(v, torch.Tensor) else v == opt2.state[w2][k], k


def test_plans_are_rebuilt_never_copied_or_saved():
    """The per-matrix plans are a cache of the param groups: a deepcopy or pickle of the optimizer
    and a load_state_dict rebuild them (new objects, keyed by the copy's parameters, equal periods
    and offsets), and nothing of them is pickled or saved."""
    import pickle

    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 6))
    opt = dobb.Dobb([m.weight for m in model], lr=0.01, source="grad_gram", blocks=2, refresh_every=3)
    assert b"_plans" not in pickle.dumps(opt) and "_plans" not in str(opt.state_dict())
    twin_model, twin = copy.deepcopy((model, opt))
    for m, t in zip(model, twin_model):
        mine, theirs = opt._plans[m.weight], twin._plans[t.weight]
        assert theirs is not mine and theirs.layout is not mine.layout
        assert (theirs.period, theirs.offset, theirs.layout.local_sizes) == (mine.period, mine.offset,
                                                                             mine.layout.local_sizes)
    assert set(map(id, twin._plans)) == {id(t.weight) for t in twin_model}
    before = dict(opt._plans)
    opt.load_state_dict(opt.state_dict())
    assert all(opt._plans[p] is not plan for p, plan in before.items())
