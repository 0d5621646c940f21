"""Dobb.capture: statistics for layers the hooks cannot read (here: experts that see only the
tokens routed to them). Reference: the float64 second moment of each expert's routed tokens."""
import pytest
import torch
from torch import nn

import dobb

D, H, E, T = 8, 12, 3, 60


class Experts(nn.Module):
    """E experts (each its own 2-D weight, (H, D)), top-1 routing by a fixed projection."""

    dobb_capture = False  # the forward hook would see all tokens; the experts capture their own

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        for e in range(E):
            self.register_parameter(f"w{e}", nn.Parameter(torch.randn(H, D) / D**0.5))
        self.capture = None  # set to the optimizer's capture
        self.routed = {}

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = x.new_zeros(x.shape[0], H)
        for e in range(E):
            idx = (choice == e).nonzero().squeeze(-1)
            xe = x[idx]
            self.routed[e] = xe.detach().double()
            if self.capture is not None:
                self.capture(getattr(self, f"w{e}"), xe)
            out[idx] = xe @ getattr(self, f"w{e}").T
        return out


def _setup(**kw):
    kw.setdefault("stagger", False)  # these tests name the refresh steps: every expert refreshes together
    torch.manual_seed(0)
    moe = Experts()
    head = nn.Linear(H, 1)
    model = nn.Sequential(moe, nn.Tanh(), head)
    experts = [getattr(moe, f"w{e}") for e in range(E)]
    opt = dobb.Dobb([{"params": experts, "blocks": 2},
                     {"params": [moe.router.weight, head.weight, head.bias], "algorithm": "adamw"}],
                    model, lr=1e-2, stat_dtype=torch.float64, **kw)
    moe.capture = opt.capture
    return model, moe, experts, opt


def _blocks(x, blocks=2):
    a = x.T @ x / x.shape[0]
    s = a.shape[0] // blocks
    return torch.cat([a[i * s:(i + 1) * s, i * s:(i + 1) * s] for i in range(blocks)])


@pytest.mark.parametrize("capture", ["first", "all"])  # "all": a hook on the module would add all tokens
def test_each_expert_gets_the_second_moment_of_its_routed_tokens(capture):
    model, moe, experts, opt = _setup(refresh_every=2, stat_decay=0.5, capture=capture)
    g = torch.Generator().manual_seed(1)
    history = {e: [] for e in range(E)}
    for step in range(3):  # refreshes at steps 0 and 2
        model(torch.randn(T, D, generator=g)).square().mean().backward()
        if step % 2 == 0:
            for e in range(E):
                assert moe.routed[e].shape[0] > 0
                history[e].append(_blocks(moe.routed[e]))
        opt.step()
        opt.zero_grad()
    for e, w in enumerate(experts):
        first, second = history[e]
        torch.testing.assert_close(opt.state[w]["stat"], 0.5 * first + 0.5 * second, atol=1e-12, rtol=0)
        assert opt.state[w]["captures"] == [[2]]


def test_capture_counts_only_when_due_and_once_with_capture_first():
    model, moe, experts, opt = _setup(refresh_every=3)
    x = torch.randn(T, D)
    assert opt.capture(experts[0], x) is True   # due (first step), first call after the step
    assert opt.capture(experts[0], x) is False  # capture="first": already recorded
    moe.capture = None
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert opt.capture(experts[0], x) is False  # step 1 is not a refresh step
    assert opt.capture(experts[1], x) is True  # never captured yet: due until its first statistic
    with pytest.raises(ValueError, match="not a matrix"):
        opt.capture(moe.router.weight, x)


def test_capture_needs_an_activation_group():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4, bias=False)
    opt = dobb.Dobb([layer.weight], layer, lr=1e-2, source="grad_gram")
    with pytest.raises(ValueError, match="source='activation'"):
        opt.capture(layer.weight, torch.randn(3, 4))
