"""Two-sided Dobb (``side="both"``) against float64 dense math: block-diagonal bases built as full
``m x m`` / ``n x n`` matrices from ``eigh`` of the diagonal blocks of the statistics, the update
``Q_out D Q_in^T / sqrt(m)`` with ``D = sign(C)`` or SOAP's Adam ratio; plus state, memory, resume,
transposed weights and errors. Sharded runs: tests/distributed/test_two_sided_sharded.py."""
import io
import math

import pytest
import torch
from torch import nn

import dobb
from dobb import _two_sided as T
from dobb import functional as F

F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64)


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
    c = T.rotate(u, rows, cols)
    torch.testing.assert_close(c, qo.T @ u @ qi, atol=1e-12, rtol=0)
    torch.testing.assert_close(T.unrotate(c, rows, cols), u, atol=1e-12, rtol=0)


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


def _train(factory, steps, dtype, state=None, start=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 12), nn.LayerNorm(12)).to(dtype)
    opt = factory(model)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(2, 8, 16, generator=g).to(dtype) for _ in range(steps)]
    for x in data[start:]:
        for micro in x:
            model(micro).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(norm="sign", blocks=2, out_blocks=3, refresh_every=3),
                                    dict(norm="adam", out_blocks=2, refresh_every=3, source="grad_gram")])
def test_resume_mid_cycle_is_exact_and_keeps_state_dtypes(dtype, kwargs):
    def factory(model):
        return dobb.Dobb(dobb.param_groups(model), model, lr=0.02, weight_decay=0.1, side="both", **kwargs)

    full, opt_full = _train(factory, 8, dtype)
    half, opt = _train(factory, 4, dtype)
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    resumed, opt2 = _train(factory, 8, dtype, state=torch.load(buf, weights_only=True), start=4)
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
    against separate matrices: tests/test_experts.py)."""
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
