"""``dobb.core.optimizer``: the Dobb class against a float64 dense reference (schedule, state, error
handling), its plan and refresh schedule (``Plan``, ``due``, ``captures``, periods and stagger offsets
against hand-computed values, ``refresh_width``), its update (``apply_directions``: the CPU fast paths
of the step against the float64 dense reference, ``_dobb_reference``) and two-sided Dobb
(``side="both"``: bases built as full ``m x m`` / ``n x n`` matrices from ``eigh`` of the diagonal
blocks of the statistics, the update ``Q_out D Q_in^T / sqrt(m)`` with ``D = sign(C)`` or SOAP's Adam
ratio; state, memory, resume, transposed weights and errors). Capture hooks: test_capture.py; the
param group rule: test_groups.py; the options: test_options.py. Sharded runs: tests/distributed
(test_two_sided_sharded.py, test_schedule_sharded.py, ...)."""
import copy
import io
import math

import pytest
import torch
from torch import nn

import dobb
from dobb import functional as F
from _dobb_reference import block_bases, dense_direction, eigh_bases
from dobb.core import optimizer as O
from dobb.core import update as U


# --------------------------------------------------------------- the optimizer
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


def _train(opt_factory, steps, dtype=torch.float32, state=None, start=0, out=16):
    """Steps of two micro-batches each on a small MLP (``out`` outputs), resumable from ``state``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, out), nn.LayerNorm(out)).to(dtype)
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
                              betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)  # ours: fused by default
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


@pytest.mark.parametrize("saved,loaded,key,preset", [
    (dict(blocks=4), dict(blocks=2), "stat", None),            # (16, 4) vs (16, 8)
    # (16, 8) vs (12, 6); Dobb-G is another registry name: refused naming both, before the shapes
    (dict(blocks=2), dict(blocks=2, side="output", source="output_grad"), "stat", "Dobb-G"),
])
def test_loading_state_of_another_layout_names_parameter_and_shapes(saved, loaded, key, preset):
    layer = _one_layer(12, 16)
    opt = dobb.Dobb([("fc.weight", layer.weight)], layer, lr=0.1, **saved)
    layer(torch.randn(3, 16, dtype=torch.float64)).sum().backward()
    opt.step()
    other = dobb.Dobb([("fc.weight", layer.weight)], layer, lr=0.1, **loaded)
    want, got = tuple(opt.state[layer.weight][key].shape), tuple(other.state[layer.weight][key].shape)
    match = (rf"fc\.weight: saved state '{key}' has shape \({want[0]}, {want[1]}\).*needs \({got[0]}, {got[1]}\)"
             if preset is None else rf"^{preset} cannot load this state dict: it was saved by Dobb \(Dobb\)")
    with pytest.raises(ValueError, match=match):
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


# ----------------------------------------------------------- plan and schedule
@pytest.mark.parametrize("every,width,widest,period", [
    (9, None, 3072, 9), (9, 768, 3072, 36), (9, 768, 768, 9), (9, 128, 512, 36), (9, 128, 128, 9),
    (9, 128, 40, 9),    # narrower than the width: never shorter than refresh_every
    (9, 128, 320, 18),  # 2.5 rounds half to even: 2
    (9, 128, 448, 36),  # 3.5: 4
    (3, 16, 200, 36),   # 12.5: 12
])
def test_refresh_period_hand_values(every, width, widest, period):
    assert O.refresh_period(every, width, widest) == period


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "128", 128.0])
def test_refresh_width_validation_names_the_parameter(bad):
    with pytest.raises(ValueError, match="refresh_width must be None or an integer >= 1"):
        dobb.Dobb([nn.Linear(8, 8).weight], lr=0.1, source="grad_gram", refresh_width=bad)
    for good in (None, 1):
        dobb.Dobb([nn.Linear(8, 8).weight], lr=0.1, source="grad_gram", refresh_width=good)


def _old_offsets(works, T):
    """The schedule before ``refresh_width`` (one period ``T``): largest work first, the offset in
    ``range(T)`` with the least accumulated work, lowest on ties."""
    cost, out = [0] * T, [0] * len(works)
    for i in sorted(range(len(works)), key=lambda j: -works[j]):
        off = min(range(T), key=lambda o: cost[o])
        cost[off] += works[i]
        out[i] = off
    return out


def test_equal_periods_give_the_old_offsets():
    gen = torch.Generator().manual_seed(0)
    for T in (1, 2, 3, 9):
        for n in (1, 5, 13):
            works = torch.randint(1, 6, (n,), generator=gen).pow(3).tolist()  # ties included
            assert O.stagger_offsets(works, [T] * n) == _old_offsets(works, T)


def test_offsets_balance_the_longer_periods_by_hand():
    # bigs (work 8, period 4) first: 0, then 1 (step 0 is taken); smalls (period 2) hit steps
    # {0, 2} or {1, 3}: both carry max 8, sum 8 -> 0; then {0,2}: (9, 10) vs {1,3}: (8, 8) -> 1
    assert O.stagger_offsets([8, 8, 1, 1], [4, 4, 2, 2]) == [0, 1, 0, 1]
    # four layers of the bench model's shapes at refresh_width=128: qkv, proj, fc at width 128 (period 9),
    # mlp-out at 512 (period 36, 64x the work): each wide matrix alone on its refresh step
    works = [1, 1, 1, 64] * 4
    periods = [9, 9, 9, 36] * 4
    offs = O.stagger_offsets(works, periods)
    assert all(0 <= o < p for o, p in zip(offs, periods))
    load = [0] * 36
    for w, p, o in zip(works, periods, offs):
        for t in range(o, 36, p):
            load[t] += w
    # the wide ones take steps 0-3 (one each); the 12 narrow ones share the residues 4-8 mod 9
    # (3, 3, 2, 2, 2 of them), so no step carries a wide and a narrow refresh together
    assert [o for o, p in zip(offs, periods) if p == 36] == [0, 1, 2, 3]
    assert sorted(o for o, p in zip(offs, periods) if p == 9) == [4, 4, 4, 5, 5, 5, 6, 6, 7, 7, 8, 8]
    assert max(load) == 64 and sum(load) == 4 * 64 + 12 * 4


def test_cycle_and_offsets_are_deterministic():
    assert O.cycle([]) == 1 and O.cycle([9, 36, 18]) == 36 and O.cycle([4, 6]) == 12
    works, periods = [5, 5, 3, 3, 1], [6, 4, 6, 2, 4]
    assert O.stagger_offsets(works, periods) == O.stagger_offsets(list(works), list(periods))
    with pytest.raises(ValueError, match="one entry per matrix"):
        O.stagger_offsets([1, 2], [3])


class Mixed(nn.Module):
    """Input widths 16, 64, 16 (transposed storage: 64 wide on its dim 0), and an expert stack of input width 32."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(64, 16, generator=gen, dtype=torch.float64) / 4)
        self.b = nn.Parameter(torch.randn(16, 64, generator=gen, dtype=torch.float64) / 8)
        self.c = nn.Parameter(torch.randn(64, 8, generator=gen, dtype=torch.float64) / 8)   # (in, out)
        self.e = nn.Parameter(torch.randn(2, 8, 32, generator=gen, dtype=torch.float64) / 6)


def _groups(model, **kw):
    return [{"params": [model.a, model.b, model.e], **kw}, {"params": [model.c], "transposed": True, **kw}]


def _refresh_steps(model, opt, steps, seed=1):
    """The steps at which each parameter took a statistic (grad_gram: on its refresh steps only)."""
    gen = torch.Generator().manual_seed(seed)
    params = [model.a, model.b, model.e, model.c]
    seen = {id(p): [] for p in params}
    for t in range(steps):
        before = {id(p): repr(opt.state[p]["captures"]) for p in params}
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
        for p in params:
            if repr(opt.state[p]["captures"]) != before[id(p)]:
                seen[id(p)].append(t)
    return [seen[id(p)] for p in params]


@pytest.mark.parametrize("blocks,width,periods", [
    (1, 16, [3, 12, 6, 12]),   # widest blocks 16, 64, 32, 64
    (2, 16, [3, 6, 3, 6]),     # 8 (round(0.5) = 0 -> 1), 32, 16, 32
    (1, 40, [3, 6, 3, 6]),     # 16/40 -> 1, 64/40 = 1.6 -> 2, 32/40 -> 1
    (1, None, [3, 3, 3, 3]),
])
@pytest.mark.parametrize("stagger", [False, True])
def test_each_matrix_refreshes_on_its_hand_computed_period(blocks, width, periods, stagger):
    model = Mixed()
    opt = dobb.Dobb(_groups(model, blocks=blocks), lr=0.01, source="grad_gram", refresh_every=3, refresh_width=width,
                    stagger=stagger, **F64)
    steps = 25
    seen = _refresh_steps(model, opt, steps)
    params = [model.a, model.b, model.e, model.c]
    offsets = [opt._plans[p].offset for p in params]
    if not stagger:
        assert offsets == [0, 0, 0, 0]
    for got, period, off in zip(seen, periods, offsets):
        assert 0 <= off < period
        assert got == [0] + [t for t in range(1, steps) if (t - off) % period == 0]
    assert opt.refresh_cycle() == O.cycle(periods)


def test_two_sided_period_reads_the_widest_side():
    w = nn.Parameter(torch.randn(48, 16, dtype=torch.float64))  # output side 48 wide, input 16
    opt = dobb.Dobb([w], lr=0.01, source="grad_gram", side="both", refresh_every=2, refresh_width=16, stagger=False, **F64)
    assert opt._plans[w].period == 6


def _train_grads(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in (model.a, model.b, model.e, model.c):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
    return [p.detach().clone() for p in (model.a, model.b, model.e, model.c)]


@pytest.mark.parametrize("stagger", [False, True])
def test_unset_or_all_narrow_is_bitwise_the_run_without_the_option(stagger):
    runs = []
    for kw in ({}, {"refresh_width": None}, {"refresh_width": 1000}):  # 64/1000 rounds to 0 -> period 3
        model = Mixed()
        opt = dobb.Dobb(_groups(model), lr=0.01, source="grad_gram", refresh_every=3, stagger=stagger, **kw)
        runs.append(_train_grads(model, opt, 10))
    for other in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(runs[0], other))
    model = Mixed()  # a period that does change: the weights differ (the comparison can fail)
    opt = dobb.Dobb(_groups(model), lr=0.01, source="grad_gram", refresh_every=3, stagger=stagger, refresh_width=16)
    assert not all(torch.equal(x, y) for x, y in zip(runs[0], _train_grads(model, opt, 10)))


def test_longer_periods_equal_groups_with_those_periods():
    """Unstaggered, the option is the same algorithm as one param group per period (float64)."""
    model = Mixed()
    opt = dobb.Dobb(_groups(model), lr=0.01, source="grad_gram", refresh_every=3, refresh_width=16, stagger=False, **F64)
    got = _train_grads(model, opt, 26)
    ref_model = Mixed()
    m = ref_model
    groups = [{"params": [m.a], "refresh_every": 3}, {"params": [m.b], "refresh_every": 12},
              {"params": [m.e], "refresh_every": 6}, {"params": [m.c], "refresh_every": 12, "transposed": True}]
    ref = dobb.Dobb(groups, lr=0.01, source="grad_gram", stagger=False, **F64)
    want = _train_grads(ref_model, ref, 26)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- the plan, the due rule, captures
def _plan(spans, period, offset):
    sides = tuple(O.Side(type("L", (), {"stack_span": n})()) for n in spans)
    return O.Plan(sides, period, offset)


def test_due_against_a_hand_written_schedule():
    """Period 3, offset 1: steps 0, 1, 4, 7, 10 refresh; a matrix (or a side) without a statistic
    yet is due every step; per member of a stack, any side's missing statistic makes it due."""
    plan = _plan([1], 3, 1)
    seen = [[2]]
    assert [t for t in range(12) if O.due(t, seen, plan) == [True]] == [0, 1, 4, 7, 10]
    assert all(O.due(t, [[0]], plan) == [True] for t in range(12))
    stack = _plan([3], 3, 1)
    assert O.due(2, [[1, 0, 4]], stack) == [False, True, False]
    assert O.due(4, [[1, 0, 4]], stack) == [True, True, True]
    both = _plan([2, 2], 2, 0)
    assert O.due(3, [[1, 1], [1, 0]], both) == [False, True]
    assert O.due(4, [[1, 1], [1, 1]], both) == [True, True]


def test_hooks_are_armed_exactly_when_the_fold_counts():
    """The capture hooks' arming and the statistic fold read the one rule: over a staggered run with
    a layer that skips some forward passes, a matrix counts a capture on a step iff its hooks were
    armed for it and it ran, and it is armed iff ``due`` says so."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6, dtype=torch.float64) for _ in range(3)])
    opt = dobb.Dobb([m.weight for m in model], model, lr=0.01, refresh_every=3, stagger=True, **F64)
    for t in range(12):
        skip = 1 if t in (0, 4) else None  # layer 1 unused on steps 0 and 4: stays due / counts nothing
        armed = {id(p) for p in opt._hooks.armed}
        for m in model:
            st = opt.state[m.weight]
            assert (id(m.weight) in armed) == any(O.due(st["step"], st["captures"], opt._plans[m.weight]))
        before = [opt.state[m.weight]["captures"][0][0] for m in model]
        x = torch.randn(5, 6, dtype=torch.float64)
        for i, m in enumerate(model):
            if i != skip:
                x = m(x)
        x.square().sum().backward()
        opt.step()
        opt.zero_grad()
        for i, m in enumerate(model):
            counted = opt.state[m.weight]["captures"][0][0] - before[i]
            assert counted == (id(m.weight) in armed and i != skip), (t, i)


def test_captures_from_every_saved_form():
    one, stack, both = _plan([1], 3, 0), _plan([3], 3, 0), _plan([1, 1], 3, 0)
    assert O.captures(4, one) == [[4]] and O.captures(torch.tensor(4), one) == [[4]]
    assert O.captures([[4]], one) == [[4]]
    assert O.captures([1, 0, 2], stack) == [[1, 0, 2]] and O.captures([[1, torch.tensor(0), 2]], stack) == [[1, 0, 2]]
    assert O.captures([3, 2], both) == [[3], [2]] and O.captures([[3], [2]], both) == [[3], [2]]
    got = O.captures([torch.tensor(3), torch.tensor(2)], both)
    assert got == [[3], [2]] and all(type(c) is int for side in got for c in side)
    for bad, plan in (([1, 2], one), (5, stack), ([1, 2, 3], both)):
        with pytest.raises(ValueError, match="saved capture counts"):
            O.captures(bad, plan)


# ------------------------------------------------------------------ the update
PATHS = {"small": dict(small=16, fuse=1 << 60), "fused": dict(small=0, fuse=0),
         "general": dict(small=0, fuse=1 << 60)}


def _blocks_of(u, basis, blocks):
    """(column slice, float64 basis block) per block of the blocked (last) axis of ``u``."""
    s = u.shape[1] // blocks
    return [(slice(b * s, (b + 1) * s), q) for b, q in enumerate(block_bases(basis, [s] * blocks))]


def _raw_direction(u, basis, blocks, norm):
    """The float64 reference direction from the stored basis (blocked axis last)."""
    sizes = [u.shape[1] // blocks] * blocks
    return dense_direction(u, sizes, block_bases(basis, sizes), norm)


def _step_once(path_monkeypatch, path, norm, side, source, product, steps=3):
    """Three Dobb steps on one layer; yields (w0, u, basis, w1, factor) per step (u: the EMA
    momentum the step used, in the blocked orientation: rows x blocked axis)."""
    m, n, blocks, lr, wd, tau = 24, 32, 4, 0.05, 0.1, 0.2
    torch.manual_seed(0)
    layer = nn.Linear(n, m, bias=False)  # fp32 weights, default bf16 basis
    opt = dobb.Dobb([layer.weight], layer, lr=lr, weight_decay=wd, blocks=blocks, norm=norm, side=side,
                    source=source, basis="eigh", product_dtype=product)
    x = torch.randn(48, n)  # more rows than n: every coefficient of the gradient is clear of zero
    for _ in range(steps):  # later steps: momentum is no longer a multiple of the gradient
        w0 = layer.weight.detach().clone()
        opt.zero_grad()
        layer(x).square().sum().backward()
        grad = layer.weight.grad.clone()
        mom_before = opt.state[layer.weight]["momentum"].clone()
        opt.step()
        u = torch.lerp(mom_before, grad, 1 - 0.95)  # the EMA momentum the step used
        yield dict(w0=w0, w1=layer.weight.detach().clone(), u=u if side == "input" else u.T,
                   basis=opt.state[layer.weight]["basis"].clone(), blocks=blocks,
                   decay=1 - lr * wd, scale=lr * tau * math.sqrt(max(m, n)), side=side)


def _observed_direction(r):
    """The raw direction the step applied, recovered from the weights (float64, blocked orientation)."""
    o = (r["decay"] * r["w0"].double() - r["w1"].double()) / r["scale"]
    return o if r["side"] == "input" else o.T


def _force_path(monkeypatch, path):
    monkeypatch.setattr(F, "SMALL_BLOCK", PATHS[path]["small"])
    monkeypatch.setattr(U, "FUSE_MIN_BLOCK_WORK", PATHS[path]["fuse"])  # read by core.update.decay_in_update


VARIANTS = [("sign", "input", "activation"), ("l2", "input", "activation"), ("sign", "output", "output_grad")]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("norm,side,source", VARIANTS)
def test_cpu_paths_equal_float64_reference(monkeypatch, path, norm, side, source):
    """fp32 products (forced; the CPU default): the update equals float64 math on the stored basis."""
    _force_path(monkeypatch, path)
    for r in _step_once(monkeypatch, path, norm, side, source, torch.float32):
        ref = _raw_direction(r["u"], r["basis"], r["blocks"], norm)
        torch.testing.assert_close(_observed_direction(r), ref, atol=2e-6 / r["scale"], rtol=0)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("norm,side,source", VARIANTS)
def test_bf16_products_follow_bf16_rounding(monkeypatch, path, norm, side, source):
    """bf16 products (forced; the GPU default, and what a CPU with AVX512-BF16/AMX ran before
    ``product_dtype``): the reference is float64 math on the bf16-rounded momentum and basis. Sign:
    the step's sign pattern, read back from the update, equals the reference's wherever a
    coefficient is not within rounding of zero, and the update is that pattern reconstructed to
    bf16 precision. l2: the update equals the float64 one to bf16 precision. On a CPU without
    native bf16 torch emulates the products: slow, but exact enough at these sizes."""
    _force_path(monkeypatch, path)
    for r in _step_once(monkeypatch, path, norm, side, source, torch.bfloat16):
        u = r["u"].to(torch.bfloat16)  # what the kernel multiplies
        observed = _observed_direction(r)
        ref = _raw_direction(u, r["basis"], r["blocks"], norm)
        # the bf16 path really ran: the update is not the fp32-product one
        assert (observed - _raw_direction(r["u"], r["basis"], r["blocks"], norm)).abs().max() > 1e-5
        if norm == "l2":
            torch.testing.assert_close(observed, ref, atol=2**-6 * ref.abs().max().item(), rtol=0)
            continue
        rows = u.shape[0]
        pattern_o = torch.zeros_like(observed)
        for cols, q in _blocks_of(u, r["basis"], r["blocks"]):
            c_ref = u.double()[:, cols] @ q
            pattern = (observed[:, cols] @ q * math.sqrt(rows))  # ~ +-1 / 0 up to basis rounding
            assert (pattern - pattern.round()).abs().max() < 0.25
            pattern = pattern.round()
            clear = c_ref.abs() > 1e-3 * c_ref.abs().max()
            assert clear.float().mean() > 0.9
            assert torch.equal(pattern[clear], torch.sign(c_ref)[clear])
            pattern_o[:, cols] = pattern @ q.T / math.sqrt(rows)
        torch.testing.assert_close(observed, pattern_o, atol=2**-7 * pattern_o.abs().max().item(), rtol=0)


def test_matmul_dtype_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # auto: fp32 products on every CPU (whatever its native bf16 support), the basis dtype elsewhere
    assert F.matmul_dtype(torch.bfloat16, cpu) == torch.float32
    assert F.matmul_dtype(torch.float64, cpu) == torch.float64
    assert F.matmul_dtype(torch.bfloat16, cuda) == torch.bfloat16
    # a forced dtype holds on every device
    assert F.matmul_dtype(torch.bfloat16, cpu, torch.bfloat16) == torch.bfloat16
    assert F.matmul_dtype(torch.bfloat16, cuda, torch.float32) == torch.float32


def test_product_dtype_validated():
    layer = nn.Linear(8, 8, bias=False)
    with pytest.raises(ValueError, match="product_dtype"):
        dobb.Dobb([layer.weight], layer, lr=0.1, product_dtype="bf16")


def test_default_cpu_step_is_host_independent(monkeypatch):
    """The default step is the same whether or not the CPU reports native bf16 (the README's test
    command once failed on AMX hosts because it was not)."""
    outs = []
    for native in (False, True):
        monkeypatch.setattr(F, "cpu_native", lambda dtype, native=native: native)
        torch.manual_seed(0)
        layer = nn.Linear(32, 24, bias=False)
        opt = dobb.Dobb([layer.weight], layer, lr=0.05, blocks=4)
        for _ in range(2):
            opt.zero_grad()
            layer(torch.randn(6, 32)).square().sum().backward()
            opt.step()
        outs.append(layer.weight.detach().clone())
    assert torch.equal(outs[0], outs[1])


# -------------------------------------------------------------- two-sided Dobb
def _split(k, blocks):
    q, r = divmod(k, blocks)
    return [q + 1] * r + [q] * (blocks - r)


def _dense_basis(stat, sizes):
    """Block-diagonal matrix of the eigenvectors of each diagonal block of a dense statistic."""
    q = torch.zeros_like(stat)
    start = 0
    for s in sizes:
        q[start:start + s, start:start + s] = torch.linalg.eigh(stat[start:start + s, start:start + s]).eigenvectors
        start += s
    return q


def _dense_block_diag(stat, sizes):
    out = torch.zeros_like(stat)
    start = 0
    for s in sizes:
        out[start:start + s, start:start + s] = stat[start:start + s, start:start + s]
        start += s
    return out


def _stacked(dense, sizes):
    """Row-stacked (k, s_max) form of a block-diagonal dense matrix (the optimizer's storage)."""
    out = torch.zeros(dense.shape[0], max(sizes), dtype=dense.dtype)
    start = 0
    for s in sizes:
        out[start:start + s, :s] = dense[start:start + s, start:start + s]
        start += s
    return out


@pytest.mark.parametrize("lead", [(), (2,)])
def test_rotate_and_unrotate_equal_dense_block_diagonal_products(lead):
    g = torch.Generator().manual_seed(0)
    m, n, so, si = 10, 7, [4, 3, 3], [4, 3]
    qo = _dense_basis(_sym(m, g), so)
    qi = _dense_basis(_sym(n, g), si)
    u = torch.randn(*lead, m, n, generator=g, dtype=torch.float64)
    rows, cols = (_stacked(qo, so), so), (_stacked(qi, si), si)
    c = F.rotate(u, rows, cols)
    torch.testing.assert_close(c, qo.T @ u @ qi, atol=1e-12, rtol=0)
    torch.testing.assert_close(F.unrotate(c, rows, cols), u, atol=1e-12, rtol=0)


def _sym(k, g):
    a = torch.randn(k, k, generator=g, dtype=torch.float64)
    return a @ a.T


def _pair_rms(d, row_sizes, col_sizes):
    """Every block pair scaled to RMS 1 (norm='adam': sign's norm per block pair)."""
    out, r0 = d.clone(), 0
    for rs in row_sizes:
        c0 = 0
        for cs in col_sizes:
            blk = out[r0:r0 + rs, c0:c0 + cs]
            blk /= blk.square().mean().sqrt()
            c0 += cs
        r0 += rs
    return out


def _dense_run(steps, m, n, blocks, out_blocks, source, norm, lr, wd, mu, b2, eps, T_refresh, decay, tau=0.2):
    """The float64 dense reference of ``steps`` two-sided steps (exact eigh at every refresh)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(m, n, generator=g, dtype=torch.float64) / n**0.5
    w0 = w.clone()
    batches = [(torch.randn(16, n, generator=g, dtype=torch.float64), torch.randn(16, m, generator=g, dtype=torch.float64))
               for _ in range(steps)]
    si, so = _split(n, blocks), _split(m, out_blocks)
    mom, v = torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, n, dtype=torch.float64)
    a_in = a_out = qi = qo = None
    scale = tau * math.sqrt(max(m, n))
    ws, stats = [], []
    for t, (x, dy) in enumerate(batches, 1):
        grad = dy.T @ x  # loss sum(dy * (x W^T)): dL/dY = dy
        if (t - 1) % T_refresh == 0:
            new_in, new_out = (x.T @ x / 16, dy.T @ dy / 16) if source == "activation" else (grad.T @ grad / m, grad @ grad.T / n)
            a_in = new_in if a_in is None else decay * a_in + (1 - decay) * new_in
            a_out = new_out if a_out is None else decay * a_out + (1 - decay) * new_out
            qi, qo = _dense_basis(a_in, si), _dense_basis(a_out, so)
        mom = mu * mom + (1 - mu) * grad
        c = qo.T @ mom @ qi
        if norm == "sign":
            d = torch.sign(c)
        else:
            gr = qo.T @ grad @ qi
            v = b2 * v + (1 - b2) * gr**2
            d = (c / (1 - mu**t)) / ((v / (1 - b2**t)).sqrt() + eps)
            d = _pair_rms(d, so, si)
        o = qo @ d @ qi.T / math.sqrt(m)
        w = (1 - lr * wd) * w - lr * scale * o
        ws.append(w.clone())
        stats.append((_dense_block_diag(a_in, si), _dense_block_diag(a_out, so)))
    return w0, batches, ws, stats, (si, so)


@pytest.mark.parametrize("norm", ["sign", "adam"])
@pytest.mark.parametrize("source,blocks,out_blocks", [
    ("activation", 1, 1), ("activation", 2, 3), ("activation", 1, 4), ("activation", 3, 1),
    # grad_gram: one block on both sides makes the first C = Q_out^T G Q_in the diagonal of G's SVD
    # (sign of rounding noise off it), and one block over the 10 rows a rank-7 G G^T with a 3-dim
    # null space (arbitrary eigenvectors); blocks of <= 7 rows keep every eigenvalue distinct
    ("grad_gram", 2, 3), ("grad_gram", 1, 4), ("grad_gram", 3, 2),
])
def test_steps_equal_dense_reference(norm, source, blocks, out_blocks):
    """Five steps, refresh every 2 (statistic EMA on both sides), uneven blocks (10 rows in 2, 3 or 4
    blocks, 7 columns in 1, 2 or 3), against the dense float64 computation of every step."""
    m, n, lr, wd, mu, b2, eps, T_refresh, decay = 10, 7, 0.05, 0.1, 0.9, 0.8, 1e-8, 2, 0.6
    w0, batches, ws, stats, (si, so) = _dense_run(5, m, n, blocks, out_blocks, source, norm, lr, wd, mu, b2, eps,
                                                  T_refresh, decay)
    layer = nn.Linear(n, m, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(w0)
    opt = dobb.Dobb([layer.weight], layer, lr=lr, weight_decay=wd, side="both", norm=norm, source=source,
                    blocks=blocks, out_blocks=out_blocks, momentum=mu, beta2=b2, eps=eps, basis="eigh",
                    refresh_every=T_refresh, stat_decay=decay, stagger=False, **F64)
    st = opt.state[layer.weight]
    for (x, dy), w_ref, (a_in, a_out) in zip(batches, ws, stats):
        (layer(x) * dy).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(layer.weight.detach(), w_ref, atol=1e-11, rtol=0)
        torch.testing.assert_close(st["stat"], _stacked(a_in, si), atol=1e-12, rtol=0)
        torch.testing.assert_close(st["out_stat"], _stacked(a_out, so), atol=1e-12, rtol=0)
    assert st["captures"] == [[3], [3]]


def test_sign_update_norm_follows_shared_protocol():
    """||O||_F^2 = n, as one-sided Dobb's sign (Table 9), and the step is tau*sqrt(max(m, n)) O."""
    m, n, lr = 12, 16, 0.1
    torch.manual_seed(1)
    layer = nn.Linear(n, m, bias=False).double()
    opt = dobb.Dobb([layer.weight], layer, lr=lr, side="both", blocks=4, out_blocks=2, **F64)
    w0 = layer.weight.detach().clone()
    layer(torch.randn(9, n, dtype=torch.float64)).square().sum().backward()
    opt.step()
    o = (w0 - layer.weight.detach()) / (lr * 0.2 * math.sqrt(max(m, n)))
    assert o.square().sum().item() == pytest.approx(n, rel=1e-9)


def test_adam_direction_is_sign_for_a_constant_rotated_gradient():
    """beta2 = momentum and a constant gradient: |R| = 1 exactly (bias corrections included), so the
    adam step equals the sign step; eps negligible."""
    m, n = 6, 8
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ws = {}
    for norm in ("sign", "adam"):
        w = nn.Parameter(torch.zeros(m, n, dtype=torch.float64))
        opt = dobb.Dobb([w], lr=0.1, side="both", norm=norm, source="grad_gram", out_blocks=2, blocks=2,
                        momentum=0.9, beta2=0.9, eps=1e-30, refresh_every=100, **F64)
        for _ in range(4):
            w.grad = g.clone()
            opt.step()
        ws[norm] = w.detach()
    torch.testing.assert_close(ws["adam"], ws["sign"], atol=1e-12, rtol=0)


def test_adam_update_has_signs_norm_per_block_pair():
    """norm='adam' rescales each block pair of D to RMS 1: ||O||_F^2 = n, as sign's, on a noisy
    gradient where the raw Adam ratio is far below 1."""
    m, n, lr = 12, 10, 0.1
    g = torch.Generator().manual_seed(6)
    w = nn.Parameter(torch.zeros(m, n, dtype=torch.float64))
    opt = dobb.Dobb([w], lr=lr, side="both", norm="adam", source="grad_gram", blocks=2, out_blocks=3, **F64)
    for _ in range(3):
        before = w.detach().clone()
        w.grad = torch.randn(m, n, generator=g, dtype=torch.float64)
        opt.step()
    o = (before - w.detach()) / (lr * 0.2 * math.sqrt(max(m, n)))
    assert o.square().sum().item() == pytest.approx(n, rel=1e-9)


def test_state_memory_is_derived():
    """Table 18 plus the output side: stat (fp32) + basis (bf16) = 6 n^2 / B + 6 m^2 / B_out bytes;
    norm='adam' adds V (fp32, m n)."""
    m, n, B, Bo = 48, 64, 4, 2
    layer = nn.Linear(n, m, bias=False)
    for norm, extra in (("sign", 0), ("adam", 4 * m * n)):
        opt = dobb.Dobb([layer.weight], layer, lr=0.01, side="both", norm=norm, blocks=B, out_blocks=Bo)
        st = opt.state[layer.weight]
        assert st["out_basis"].dtype == torch.bfloat16 and st["out_stat"].dtype == torch.float32
        keys = ("stat", "basis", "out_stat", "out_basis", "second_moment")
        measured = sum(st[k].nbytes for k in keys if k in st)
        assert measured == 6 * n * n // B + 6 * m * m // Bo + extra
        opt.remove_hooks()


def _train_two_sided(factory, steps, dtype, state=None, start=0):  # a non-square second matrix
    return _train(factory, steps, dtype, state, start, out=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(norm="sign", blocks=2, out_blocks=3, refresh_every=3),
                                    dict(norm="adam", out_blocks=2, refresh_every=3, source="grad_gram")])
def test_resume_mid_cycle_is_exact_and_keeps_state_dtypes(dtype, kwargs):
    def factory(model):
        return dobb.Dobb(dobb.param_groups(model), model, lr=0.02, weight_decay=0.1, side="both", **kwargs)

    full, opt_full = _train_two_sided(factory, 8, dtype)
    half, opt = _train_two_sided(factory, 4, dtype)
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    resumed, opt2 = _train_two_sided(factory, 8, dtype, state=torch.load(buf, weights_only=True), start=4)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    st = opt2.state[resumed[0].weight]
    assert st["out_basis"].dtype == torch.bfloat16 and st["out_stat"].dtype == torch.float32
    caps = st["captures"]
    assert caps == opt_full.state[full[0].weight]["captures"] and caps[0] == caps[1] and caps[0][0] >= 3
    if kwargs["norm"] == "adam":
        assert st["second_moment"].dtype == torch.float32


def test_transposed_weight_equals_its_transpose():
    """A weight stored (in, out) with transposed=True takes the update of the (out, in) matrix."""
    m, n = 9, 6
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(m, n, generator=g, dtype=torch.float64)
    grads = [torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(3)]
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.T.clone())
    kw = dict(lr=0.1, weight_decay=0.1, side="both", norm="adam", source="grad_gram", blocks=2, out_blocks=3, **F64)
    oa, ob = dobb.Dobb([a], **kw), dobb.Dobb([{"params": [b], "transposed": True}], **kw)
    for gr in grads:
        a.grad, b.grad = gr.clone(), gr.T.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(b.detach().T, a.detach(), atol=1e-12, rtol=0)
    assert ob.state[b]["basis"].shape == (n, 3) and ob.state[b]["out_basis"].shape == (m, 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(side="both", norm="l2"), "norm='l2'.*side='both'"),
    (dict(norm="adam"), "norm='adam'.*side='both'"),
    (dict(side="both", source="output_grad"), "side='both' takes source"),
    (dict(side="both", out_blocks=0), "out_blocks"),
    (dict(side="both", out_blocks=9), "out_blocks=9"),
    (dict(side="both", beta2=1.0), "beta2"),
    (dict(side="both", eps=0.0), "eps"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    layer = nn.Linear(16, 8)
    with pytest.raises(ValueError, match=match):
        dobb.Dobb([layer.weight], layer, lr=0.01, **kwargs)


def test_expert_stack_with_hooked_output_side_is_refused():
    """A stack's output gradients are routed: side='both' takes source='grad_gram' for it (the steps
    against separate matrices: tests/core/test_experts.py)."""
    w = nn.Parameter(torch.randn(2, 4, 6))
    with pytest.raises(ValueError, match=r"w1.*expert stack.*routed.*source='grad_gram' for side='both'"):
        dobb.Dobb([("w1", w)], nn.Linear(1, 1), lr=0.01, side="both", source="activation")


def test_output_gradient_statistic_is_captured_only_on_refresh_steps():
    """source='activation': the output side reads dL/dY on refresh steps only (captures [[k], [k]])."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4, bias=False).double()
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, side="both", refresh_every=3, stagger=False, **F64)
    dys = []
    for step in range(5):
        x = torch.randn(5, 8, dtype=torch.float64)
        dy = torch.randn(5, 4, dtype=torch.float64)
        (layer(x) * dy).sum().backward()
        opt.step()
        opt.zero_grad()
        if step % 3 == 0:
            dys.append(dy.T @ dy / 5)
    st = opt.state[layer.weight]
    assert st["captures"] == [[2], [2]]
    torch.testing.assert_close(st["out_stat"], 0.9 * dys[0] + 0.1 * dys[1], atol=1e-12, rtol=0)
    assert not opt._hooks.pending_out  # cleared after each step


def test_build_optimizer_passes_two_sided_options():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    opt = dobb.build_optimizer("dobb", model, lr=0.01, side="both", out_blocks=2, norm="adam")
    st = opt.state[model[0].weight]
    assert F.block_runs([4, 4])[0].count == 2 and st["out_basis"].shape == (8, 4) and "second_moment" in st


def test_a_step_keeps_no_step_data_on_the_instance():
    """One step's data (the agreed statistics, the idle matrices) is passed between the step's methods,
    not kept on the instance (issue 42): a step adds or rebinds no attribute, refresh step or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.ReLU(), nn.Linear(12, 4, bias=False))
    opt = dobb.Dobb([model[0].weight, model[2].weight], model, lr=0.01, refresh_every=2)
    assert not hasattr(opt, "_agreed") and not hasattr(opt, "_idle")
    for _ in range(3):
        before = dict(vars(opt))
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        after = vars(opt)
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
