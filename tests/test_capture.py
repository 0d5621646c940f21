"""Capture hooks: when statistics are read (refresh steps, training mode, grad enabled, not during a
checkpoint recomputation, not while paused) and what they average."""
import pytest
import torch
from torch import nn

import dobb
import dobb.capture

F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64)


def _count_captures(monkeypatch):
    calls = []
    real = dobb.capture.F.second_moment_blocks

    def counting(x, sizes, dtype=torch.float32):
        calls.append(x.shape[0] if x.dim() == 2 else x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, sizes, dtype)

    monkeypatch.setattr(dobb.capture.F, "second_moment_blocks", counting)
    return calls


@pytest.mark.parametrize("capture,expected", [("first", 2), ("all", 6)])
def test_capture_only_on_refresh_steps(monkeypatch, capture, expected):
    calls = _count_captures(monkeypatch)
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, refresh_every=3, capture=capture)
    for step in range(5):  # refresh steps 0 and 3; 3 micro-batches each
        for _ in range(3):
            layer(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            layer(torch.randn(4, 8))  # no_grad passes never capture
        layer.eval()
        layer(torch.randn(4, 8))  # eval passes never capture
        layer.train()
        opt.step()
        opt.zero_grad()
    assert len(calls) == expected


def test_capture_all_equals_mean_over_micro_batches():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4).double()
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, capture="all", **F64)
    xs = [torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)]
    for x in xs:
        layer(x).sum().backward()
    opt.step()
    x = torch.cat(xs)
    torch.testing.assert_close(opt.state[layer.weight]["stat"], x.T @ x / 8, atol=1e-12, rtol=0)


@pytest.mark.parametrize("capture", ["first", "all"])
@pytest.mark.parametrize("source", ["activation", "output_grad"])
def test_checkpoint_recomputation_does_not_capture_twice(monkeypatch, capture, source):
    calls = _count_captures(monkeypatch)
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    side = "input" if source == "activation" else "output"
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, capture=capture, source=source, side=side)
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    opt.step()
    assert len(calls) == (1 if capture == "first" else 2)


def test_capture_paused_skips_passes_and_keeps_the_parameter_armed():
    """Inside capture_paused() nothing is read, and with capture="first" the next pass outside the
    block is the one captured: the statistic is that pass' second moment exactly."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4).double()
    other = dobb.Dobb([layer.weight], layer, lr=0.01, **F64)  # a second optimizer hooking the same layer
    opt = dobb.Dobb([layer.weight], layer, lr=0.01, **F64)
    x_skip, x_kept = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    with opt.capture_paused():
        layer(x_skip).sum().backward()
    layer(x_kept).sum().backward()
    opt.step()
    torch.testing.assert_close(opt.state[layer.weight]["stat"], x_kept.T @ x_kept / 3, atol=1e-12, rtol=0)
    # the optimizer that was not paused captured the first pass
    other.step()
    torch.testing.assert_close(other.state[layer.weight]["stat"], x_skip.T @ x_skip / 5, atol=1e-12, rtol=0)
