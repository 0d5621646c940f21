"""3-D expert stacks (E, out, in) in Dobb. Reference: the same experts as E separate 2-D parameters
optimized by Dobb (same weights, same routed tokens through ``capture``, or grad_gram), in float64,
and the float64 second moment of each expert's routed tokens."""
from __future__ import annotations

import dataclasses
import inspect
import io

import pytest
import torch
from torch import nn

import dobb
from dobb import registry

D, H, E, T = 8, 12, 3, 48
F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64)
VARIANTS = {
    "dobb": {},
    "dobb-l2": {"norm": "l2"},
    "eigh": {"basis": "eigh"},
    "identity-init": {"init_basis": "identity", "ortho_steps": 2},
    "grad_gram": {"source": "grad_gram"},
    "grad_gram-l2": {"source": "grad_gram", "norm": "l2"},
    "grad_gram-g": {"source": "grad_gram", "side": "output"},  # Dobb-G from the gradient Gram
    # two-sided Dobb: G^T G and G G^T blocks per expert (output gradients are routed: no hook source)
    "both": {"source": "grad_gram", "side": "both", "out_blocks": 2},
    "both-adam": {"source": "grad_gram", "side": "both", "out_blocks": 4, "norm": "adam"},
}
DROP = {0: 2, 2: 1}  # step -> expert that gets no token (2 on the first step, 1 on a refresh step)


class MoE(nn.Module):
    """Top-1 routing by a fixed router; experts as one (E, H, D) stack or E separate (H, D) weights."""

    dobb_capture = False  # the routed rows reach the optimizer through capture
    dobb_experts = ("w",)

    def __init__(self, stacked: bool, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(D, E, bias=False, dtype=torch.float64).requires_grad_(False)
        w = torch.randn(E, H, D, generator=gen, dtype=torch.float64) / D**0.5
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(E, D, generator=gen, dtype=torch.float64))
        self.stacked = stacked
        if stacked:
            self.w = nn.Parameter(w)
        else:
            self.ws = nn.ParameterList([nn.Parameter(w[e].clone()) for e in range(E)])
        self.head = nn.Linear(H, 1, dtype=torch.float64)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, H, generator=gen, dtype=torch.float64) / H**0.5)
            self.head.bias.zero_()
        self.capture = None

    def experts(self):
        return [self.w] if self.stacked else list(self.ws)

    def weight(self, e):
        return self.w[e] if self.stacked else self.ws[e]

    def forward(self, x, drop=None):
        logits = self.router(x)
        if drop is not None:
            logits[:, drop] = -float("inf")
        choice = logits.argmax(-1)
        rows = [x[(choice == e).nonzero().squeeze(-1)] for e in range(E)]
        if self.capture is not None:
            if self.stacked:
                self.capture(self.w, rows)
            else:
                for e in range(E):
                    self.capture(self.ws[e], rows[e])
        out = x.new_zeros(x.shape[0], H)
        for e in range(E):
            out[(choice == e).nonzero().squeeze(-1)] = rows[e] @ self.weight(e).T
        return self.head(torch.tanh(out))


def build(stacked, variant, **kw):
    model = MoE(stacked)
    opts = {"blocks": 3, "refresh_every": 2, "stagger": False, **VARIANTS[variant], **kw}
    opt = dobb.Dobb([{"params": model.experts(), **opts},
                     {"params": list(model.head.parameters()), "algorithm": "adamw"}],
                    model, lr=0.03, weight_decay=0.01, **F64)
    if opts.get("source", "activation") == "activation":
        model.capture = opt.capture
    return model, opt


def batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, 1, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def train(model, opt, data, start=0):
    for i, (x, y) in enumerate(data, start):
        opt.zero_grad()
        ((model(x, drop=DROP.get(i)) - y) ** 2).mean().backward()
        opt.step()


def experts_of(model, opt):
    """(weights, stats, bases, momenta, captures, and for side="both" the output side's stats and
    bases and the second moments, per expert); captures as [[per side] per expert]."""
    keys = [k for k in ("out_stat", "out_basis", "second_moment") if k in opt.state[opt.param_groups[0]["params"][0]]]
    if model.stacked:
        st = opt.state[model.w]
        return ([model.w[e] for e in range(E)], list(st["stat"]), list(st["basis"]), list(st["momentum"]),
                [list(c) for c in zip(*st["captures"])], *(list(st[k]) for k in keys))
    sts = [opt.state[w] for w in model.ws]
    return (list(model.ws), [s["stat"] for s in sts], [s["basis"] for s in sts], [s["momentum"] for s in sts],
            [[side[0] for side in s["captures"]] for s in sts], *([s[k] for s in sts] for k in keys))


def assert_same(a, b, tol=1e-12):
    assert len(a) == len(b)
    for xs, ys in zip(a[:4] + a[5:], b[:4] + b[5:]):
        for x, y in zip(xs, ys):
            assert (x.detach() - y.detach()).abs().max().item() <= tol
    assert a[4] == b[4]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stack_equals_separate_matrices(variant):
    data = batches(7)
    runs = []
    for stacked in (True, False):
        model, opt = build(stacked, variant)
        train(model, opt, data)
        runs.append(experts_of(model, opt))
    assert_same(*runs)
    if VARIANTS[variant].get("source") != "grad_gram":
        # refreshes at steps 0, 2, 4, 6; expert 1 got no token on step 2 (kept its statistic and basis);
        # expert 2 none on step 0, so it stayed due and took its first statistic on step 1
        assert runs[0][4] == [[4], [3], [4]]
    moved = max((w - w0).abs().max().item() for w, w0 in zip(runs[0][0], MoE(True).w))
    assert moved > 1e-3


def test_stagger_shares_one_offset_and_matches_matrices_on_it():
    data = batches(6)
    stack, opt_s = build(True, "dobb", stagger=True, refresh_every=3)
    sep, opt_m = build(False, "dobb", stagger=True, refresh_every=3)
    for w in sep.ws:  # the stack's offset for every separate matrix (a plan is rebuilt, here replaced)
        opt_m._plans[w] = dataclasses.replace(opt_m._plans[w], offset=opt_s._plans[stack.w].offset)
    train(stack, opt_s, data)
    train(sep, opt_m, data)
    assert_same(experts_of(stack, opt_s), experts_of(sep, opt_m))


def test_statistic_is_the_mean_over_each_experts_own_rows():
    model, opt = build(True, "dobb")
    x, y = batches(1)[0]
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    choice = model.router(x).argmax(-1)
    for e in range(E):
        xe = x[choice == e]
        a = xe.T @ xe / xe.shape[0]
        ref = torch.cat([a[s:s + k, s:s + k].new_zeros(k, 3).copy_(torch.nn.functional.pad(a[s:s + k, s:s + k], (0, 3 - k)))
                         for s, k in ((0, 3), (3, 3), (6, 2))])
        torch.testing.assert_close(opt.state[model.w]["stat"][e], ref, atol=1e-13, rtol=0)
    assert opt.state[model.w]["stat"].shape == (E, D, 3) and opt.state[model.w]["basis"].shape == (E, D, 3)


def test_state_dict_round_trip_is_exact():
    data = batches(7)
    model, opt = build(True, "dobb")
    train(model, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = build(True, "dobb")
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.state[model2.w]["captures"] == opt.state[model.w]["captures"]
    train(model, opt, data[3:], start=3)
    train(model2, opt2, data[3:], start=3)
    assert_same(experts_of(model, opt), experts_of(model2, opt2), tol=0.0)


def test_capture_by_expert_index_equals_the_list_form():
    x = torch.randn(10, D, dtype=torch.float64)
    stats = []
    for by_index in (False, True):
        model, opt = build(True, "dobb")
        model.capture = None
        parts = [x[:4], x[4:4], x[4:]]  # expert 1: no row
        if by_index:
            assert [opt.capture(model.w, parts[e], expert=e) for e in range(E)] == [True, False, True]
            assert opt.capture(model.w, x, expert=0) is False  # capture="first": expert 0 already recorded
        else:
            assert opt.capture(model.w, parts) is True
        model.w.grad = torch.ones_like(model.w)
        opt.step()
        stats.append(opt.state[model.w]["stat"].clone())
        assert opt.state[model.w]["captures"] == [[1, 0, 1]]
    assert torch.equal(stats[0], stats[1])
    assert torch.equal(stats[0][1], torch.zeros(D, 3, dtype=torch.float64))  # kept (never captured)


def test_capture_rejects_wrong_shapes_naming_the_parameter():
    model = MoE(True)
    opt = dobb.Dobb([{"params": [("moe.w", model.w)]}], model, lr=0.01)
    bad = [
        ([torch.randn(4, D)] * (E - 1), {}, "list of length 2"),
        ([torch.randn(4, D + 1)] * E, {}, r"\(4, 9\)"),
        (torch.randn(4, D), {}, "without expert="),
        (torch.randn(4, D), {"expert": E}, f"expert={E}"),
    ]
    for features, kw, what in bad:
        with pytest.raises(ValueError, match=what) as err:
            opt.capture(model.w, features, **kw)
        assert "moe.w" in str(err.value) and f"list of {E} tensors" in str(err.value)
    layer = nn.Linear(D, H)
    opt2 = dobb.Dobb([("layer.weight", layer.weight)], layer, lr=0.01)
    with pytest.raises(ValueError, match="layer.weight is a 2-D matrix"):
        opt2.capture(layer.weight, torch.randn(2, D), expert=0)


def test_output_grad_source_refuses_stacks():
    model = MoE(True)
    with pytest.raises(ValueError, match="moe.w is an expert stack.*grad_gram"):
        dobb.Dobb([{"params": [("moe.w", model.w)]}], model, lr=0.01, side="output", source="output_grad")


@pytest.mark.parametrize("name", [n for n, e in registry.OPTIMIZERS.items() if e.is_matrix and not e.cls._expert_stacks])
def test_baselines_refuse_stacks_naming_the_way_out(name):
    cls, preset = registry.get(name).cls, dict(registry.get(name).preset)
    w = nn.Parameter(torch.randn(E, H, D))
    if "model" in inspect.signature(cls.__init__).parameters:  # classes that hook the model's layers
        preset["model"] = nn.ParameterList([w])
    with pytest.raises(ValueError, match=r"moe\.w is a 3-D expert stack .*Dobb.*'adamw' group"):
        cls([("moe.w", w)], lr=0.01, **preset)


def test_transposed_stack_equals_transposed_matrices():
    """Stacks stored (E, in, out) in a transposed=True group: the matrix is each expert's transpose."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(E, D, H, generator=g, dtype=torch.float64)
    stack, mats = nn.Parameter(w.clone()), [nn.Parameter(w[e].clone()) for e in range(E)]
    holder = nn.ParameterList([stack, *mats])
    kw = dict(lr=0.05, blocks=2, refresh_every=2, stagger=False, transposed=True, **F64)
    o1 = dobb.Dobb([{"params": [stack], "transposed": True}], holder, **{k: v for k, v in kw.items() if k != "transposed"})
    o2 = dobb.Dobb([{"params": mats, "transposed": True}], holder, **{k: v for k, v in kw.items() if k != "transposed"})
    holder.dobb_capture = False
    for step in range(5):
        xs = [torch.randn(5 + e, D, generator=g, dtype=torch.float64) for e in range(E)]
        o1.capture(stack, xs)
        for e in range(E):
            o2.capture(mats[e], xs[e])
        grad = torch.randn(E, D, H, generator=g, dtype=torch.float64)
        stack.grad = grad.clone()
        for e in range(E):
            mats[e].grad = grad[e].clone()
        o1.step()
        o2.step()
    for e in range(E):
        assert (stack[e] - mats[e]).abs().max().item() <= 1e-12
        assert (o1.state[stack]["basis"][e] - o2.state[mats[e]]["basis"]).abs().max().item() <= 1e-12


def test_param_groups_send_declared_stacks_to_dobb_and_others_to_adamw():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE(True)
            self.other = nn.Parameter(torch.randn(2, 3, 4))  # 3-D, not declared: AdamW
            self.named_stack = nn.Parameter(torch.randn(E, 4, 4))  # declared through experts=

    model = Block()
    groups = dobb.param_groups(model, experts=["named_stack"])
    matrix = [n for n, _ in groups[0]["params"]]
    adamw = [n for g in groups if g["algorithm"] == "adamw" for n, _ in g["params"]]
    assert groups[0]["algorithm"] == "dobb" and matrix == ["named_stack", "moe.w"]
    assert "other" in adamw and "moe.router.weight" not in adamw + matrix  # frozen
    muon = dobb.param_groups(model, "muon", experts=["named_stack"])
    assert {"moe.w", "named_stack"} <= {n for g in muon if g["algorithm"] == "adamw" for n, _ in g["params"]}
    with pytest.raises(ValueError, match="experts names 'other.x'"):
        dobb.param_groups(model, experts=["other.x"])
    with pytest.raises(ValueError, match=r"experts names 'moe.head.weight'.*shape \(1, 12\)"):
        dobb.param_groups(model, experts=["moe.head.weight"])
    # the whole split builds a working optimizer
    dobb.build_optimizer("dobb", model.moe, lr=0.01, source="grad_gram")
