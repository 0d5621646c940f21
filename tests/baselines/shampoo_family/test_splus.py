"""SPlus against a float64 transcription of the authors' algorithm (their JAX ``optax/splus.py``,
written here dense and step by step), its iterate average and eval()/train() swap, checkpoints,
the block (shard-local) form, and argument checks."""
from __future__ import annotations

import copy

import pytest
import torch

import dobb
from dobb.baselines.shampoo_family.splus import SPlus

D = torch.float64


# ----------------------------------------------------------------------------- the reference
def _sizes(k, blocks):
    base, rem = divmod(k, blocks)
    return [base + 1] * rem + [base] * (blocks - rem)


def _blockdiag_eig(stat, sizes, eps):
    """Dense block-diagonal matrix of the eigenvectors of the diagonal blocks of ``stat + eps I``."""
    q = torch.zeros_like(stat)
    a = 0
    for s in sizes:
        blk = stat[a:a + s, a:a + s] + eps * torch.eye(s, dtype=D)
        q[a:a + s, a:a + s] = torch.linalg.eigh(blk).eigenvectors
        a += s
    return q


def reference(w0, grads, *, lr, wd=0.0, b1=0.9, b2=0.999, r=0.999, eps=1e-30, inverse_every=100,
              max_dim=10000, nsc=0.001, blocks=1, out_blocks=1):
    """SPlus on one matrix, float64, dense: returns the weights and the bias-corrected average
    after each step. Transcribed from the paper and the authors' JAX update_fn/shape_scaling."""
    m, n = w0.shape
    w = w0.to(D).clone()
    mom, ema = torch.zeros(m, n, dtype=D), torch.zeros(m, n, dtype=D)
    left, right = m < max_dim, n < max_dim
    L, R = torch.zeros(m, m, dtype=D), torch.zeros(n, n, dtype=D)
    QL, QR = torch.eye(m, dtype=D), torch.eye(n, dtype=D)
    s = 2.0 / (m + n) if left and right else nsc
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.to(D)
        mom = b1 * mom + (1 - b1) * g
        u = QL @ torch.sign(QL.T @ mom @ QR) @ QR.T  # the bases of the previous steps
        L = b2 * L + (1 - b2) * g @ g.T
        R = b2 * R + (1 - b2) * g.T @ g
        ema = r * ema + (1 - r) * w  # of the weights before this step
        if t == 1 or t % inverse_every == 0:
            if left:
                QL = _blockdiag_eig(L, _sizes(m, out_blocks), eps)
            if right:
                QR = _blockdiag_eig(R, _sizes(n, blocks), eps)
        w = w - lr * s * (u + wd * w)  # add_decayed_weights, scale(lr), shape scale
        out.append((w.clone(), ema / (1 - r ** t)))
    return out


def grads_for(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=D) for _ in range(steps)]


def run_ours(w0, grads, **kw):
    p = torch.nn.Parameter(w0.clone())
    opt = SPlus([p], **kw)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        w = p.detach().clone()
        opt.eval()
        avg = p.detach().clone()
        opt.train()
        assert torch.equal(p.detach(), w)
        out.append((w, avg))
    return out, opt, p


# Shapes and blocks whose statistics have full rank from step 1 (each block no longer than the
# other axis): a rank-deficient block has an eigenspace whose basis any correct eigh may choose.
CASES = [
    ((8, 8), {}),
    ((12, 8), {"out_blocks": 2}),
    ((6, 10), {"blocks": 2}),
    ((12, 9), {"out_blocks": 3, "blocks": 2}),   # unequal blocks: 9 -> 5 + 4
    ((6, 10), {"blocks": 2, "max_dim": 10}),     # input side at max_dim: identity, nonstandard scale
]


@pytest.mark.parametrize("shape,extra", CASES)
def test_matches_the_float64_transcription(shape, extra):
    """Seven steps with a refresh on steps 1, 3 and 6, weight decay and a fast average."""
    kw = dict(lr=0.05, wd=0.1, b1=0.9, b2=0.95, r=0.8, inverse_every=3, **{k: v for k, v in extra.items()
                                                                              if k not in ("max_dim",)})
    if "max_dim" in extra:
        kw["max_dim"] = extra["max_dim"]
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=D)
    grads = grads_for(shape, 7)
    ref = reference(w0, grads, **kw)
    ours, _, _ = run_ours(w0, grads, lr=kw["lr"], weight_decay=kw["wd"], b1=kw["b1"], b2=kw["b2"],
                          ema_rate=kw["r"], inverse_every=3, **extra)
    for (w, a), (wr, ar) in zip(ours, ref):
        torch.testing.assert_close(w, wr, rtol=0, atol=1e-12)
        torch.testing.assert_close(a, ar, rtol=0, atol=1e-12)


def test_first_step_is_the_sign_of_the_momentum_by_hand():
    """Step 1 runs with the identity bases (their init): W1 = (1 - lr s wd) W0 - lr s sign(G)."""
    w0, g = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)
    (w1, a1), = run_ours(w0, [g], lr=0.3, weight_decay=0.5)[0]
    s = 2 / (4 + 6)
    torch.testing.assert_close(w1, (1 - 0.3 * s * 0.5) * w0 - 0.3 * s * torch.sign(g), rtol=0, atol=1e-15)
    torch.testing.assert_close(a1, w0, rtol=0, atol=1e-15)  # (1 - r) W0 / (1 - r)


def test_rotates_in_the_eigenbases_of_the_gram_statistics():
    """Step 2 (after the step-1 refresh) is Q_L sign(Q_L^T M Q_R) Q_R^T with Q the eigenvectors
    of G1 G1^T and G1^T G1 (hand-built, b2 factors drop out of eigenvectors)."""
    g1, g2 = torch.randn(5, 5, dtype=D), torch.randn(5, 5, dtype=D)
    w0 = torch.zeros(5, 5, dtype=D)
    (w1, _), (w2, _) = run_ours(w0, [g1, g2], lr=1.0, b1=0.5)[0]
    ql, qr = torch.linalg.eigh(g1 @ g1.T).eigenvectors, torch.linalg.eigh(g1.T @ g1).eigenvectors
    mom = 0.25 * g1 + 0.5 * g2
    expect = w1 - 0.2 * (ql @ torch.sign(ql.T @ mom @ qr) @ qr.T)
    torch.testing.assert_close(w2, expect, rtol=0, atol=1e-12)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 6, generator=g)).square().mean().backward()
    opt.step()


def test_average_covers_the_adamw_part_and_the_swap_is_exact():
    model = _model()
    opt = dobb.build_optimizer("splus", model, lr=0.1, weight_decay=0.1, ema_rate=0.7, inverse_every=2)
    kinds = {g["algorithm"] for g in opt.param_groups}
    assert kinds == {"splus", "adamw"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.eval()  # never stepped: nothing to average, weights unchanged
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    history = {n: [] for n, _ in model.named_parameters()}
    for i in range(3):
        for n, p in model.named_parameters():
            history[n].append(p.detach().clone())
        _step(model, opt, i)
    raw = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.eval()
    for n, p in model.named_parameters():  # bias-corrected EMA of the weights before each step
        ema = torch.zeros_like(p)
        for w in history[n]:
            ema = 0.7 * ema + 0.3 * w
        torch.testing.assert_close(p.detach(), ema / (1 - 0.7**3), rtol=1e-6, atol=1e-7)
        assert not torch.equal(p.detach(), raw[n])
    opt.eval()  # idempotent
    with pytest.raises(RuntimeError, match="train"):
        _step(model, opt, 9)
    opt.train()
    assert all(torch.equal(p.detach(), raw[n]) for n, p in model.named_parameters())
    opt.train()  # idempotent
    assert all(torch.equal(p.detach(), raw[n]) for n, p in model.named_parameters())


def test_state_dict_round_trip_continues_bitwise():
    def build(model):
        return dobb.build_optimizer("splus", model, lr=0.1, weight_decay=0.05, inverse_every=3,
                                    out_blocks=2, blocks=2, ema_rate=0.9)

    a = _model()
    opt_a = build(a)
    for i in range(4):
        _step(a, opt_a, i)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    for i in range(4, 9):  # refreshes at 6 and the (in-loop) averages
        _step(a, opt_a, i)
    b = _model()
    b.load_state_dict(saved_model)
    opt_b = build(b)
    opt_b.load_state_dict(saved_opt)
    assert all(isinstance(opt_b.state[p]["ema_step"], int) for p in b.parameters())
    for i in range(4, 9):
        _step(b, opt_b, i)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    opt_a.eval(), opt_b.eval()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_checkpoint_taken_in_eval_mode_restores_the_raw_weights():
    a = _model()
    opt_a = dobb.build_optimizer("splus", a, lr=0.1)
    for i in range(3):
        _step(a, opt_a, i)
    raw = [p.detach().clone() for p in a.parameters()]
    opt_a.eval()
    b = _model()
    b.load_state_dict(a.state_dict())
    opt_b = dobb.build_optimizer("splus", b, lr=0.1)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    opt_b.train()
    assert all(torch.equal(p.detach(), r) for p, r in zip(b.parameters(), raw))


def test_one_block_each_side_is_the_whole_matrix_form():
    w0 = torch.randn(12, 8, dtype=D)
    grads = grads_for((12, 8), 5, seed=4)
    whole, _, _ = run_ours(w0, grads, lr=0.1, inverse_every=2)
    blocked, _, _ = run_ours(w0, grads, lr=0.1, inverse_every=2, blocks=1, out_blocks=1)
    for (w, a), (v, b) in zip(whole, blocked):
        assert torch.equal(w, v) and torch.equal(a, b)


def test_transposed_group_is_the_transposed_matrix():
    w0 = torch.randn(6, 10, dtype=D)
    grads = grads_for((6, 10), 4, seed=5)
    plain, _, _ = run_ours(w0, grads, lr=0.1, inverse_every=2, blocks=2)
    p = torch.nn.Parameter(w0.T.clone())
    opt = SPlus([{"params": [p], "transposed": True}], lr=0.1, inverse_every=2, blocks=2)
    for g, (w, a) in zip(grads, plain):
        p.grad = g.T.clone()
        opt.step()
        torch.testing.assert_close(p.detach().T, w, rtol=0, atol=1e-14)
        opt.eval()
        torch.testing.assert_close(p.detach().T, a, rtol=0, atol=1e-14)
        opt.train()


@pytest.mark.parametrize("kw,match", [
    (dict(b1=1.0), "b1"), (dict(b2=-0.1), "b2"), (dict(ema_rate=1.0), "ema_rate"), (dict(eps=0.0), "eps"),
    (dict(inverse_every=0), "inverse_every"), (dict(max_dim=0), "max_dim"), (dict(blocks=0), "blocks"),
    (dict(out_blocks=2.5), "out_blocks"), (dict(nonstandard_constant=-1.0), "nonstandard_constant"),
    (dict(out_blocks=9), "out_blocks=9"), (dict(blocks=7), "blocks=7"),
])
def test_bad_arguments_raise_value_errors_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        SPlus([torch.nn.Parameter(torch.zeros(8, 6))], lr=0.1, **kw)


def test_registry_validates_its_hyperparameters():
    with pytest.raises(ValueError, match="inverse_every"):
        dobb.build_optimizer("splus", _model(), lr=0.1, inverse_every="often")
    with pytest.raises(ValueError, match="momentum"):
        dobb.build_optimizer("splus", _model(), lr=0.1, momentum=0.9)


def test_adamw_lr_ratio_steps_the_other_parameters_as_torch_adamw_at_the_scaled_lr():
    # one step from the same weights and gradients (later gradients depend on the matrices' steps)
    model, ref = _model(), _model()
    opt = dobb.build_optimizer("splus", model, lr=0.2, weight_decay=0.1, adamw_lr_ratio=0.025)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    adamw_groups = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    torch_opt = torch.optim.AdamW([{"params": [ref_params[names[id(p)]] for p in g["params"]],
                                    "weight_decay": g["weight_decay"]} for g in adamw_groups],
                                  lr=0.2 * 0.025, betas=(0.9, 0.95), eps=1e-8)
    _step(model, opt, 0)
    torch_opt.zero_grad()
    ref(torch.randn(5, 6, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    torch_opt.step()
    others = [p for g in adamw_groups for p in g["params"]]
    assert others
    for p in others:
        assert torch.equal(p.detach(), ref_params[names[id(p)]].detach())
    with pytest.raises(ValueError, match="adamw_lr_ratio"):
        dobb.build_optimizer("splus", _model(), lr=0.2, adamw_lr_ratio=0.0)


def test_adamw_lr_and_adamw_lr_ratio_together_are_a_value_error():
    """The AdamW part's rate is given once: ``adamw_lr`` (its own rate, issue 53) or SPlus's
    ``adamw_lr_ratio`` (a multiple of ``lr``); alone, ``adamw_lr`` is the AdamW groups' lr."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="adamw_lr=0.001 and adamw_lr_ratio=0.02"):
        dobb.build_optimizer("splus", model, lr=0.2, adamw_lr=1e-3, adamw_lr_ratio=0.02)
    opt = dobb.build_optimizer("splus", model, lr=0.2, adamw_lr=1e-3)
    assert [(g["algorithm"], g["lr"]) for g in opt.param_groups] == [("splus", 0.2), ("adamw", 1e-3)]
