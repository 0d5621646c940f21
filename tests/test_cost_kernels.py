"""The CPU fast paths of Dobb's step (issue 12) against a float64 dense reference.

Three ways the step writes ``W <- (1 - lr wd) W - lr s O``: small blocks with transposed products,
large blocks with the decay folded into ``baddbmm``, and the general path (decay pass + strided
add). Each is forced in turn and must equal the float64 update built from the stored (bf16) basis;
the projection dtype rule (``matmul_dtype``) is checked on its own.
"""
import math

import pytest
import torch
from torch import nn

import dobb
import dobb.dobb as D
from dobb import functional as F

PATHS = {"small": dict(small=16, fuse=1 << 60), "fused": dict(small=0, fuse=0),
         "general": dict(small=0, fuse=1 << 60)}


def _reference(w0, grad, basis, blocks, norm, side, lr, wd, tau):
    u = (grad if side == "input" else grad.T).double()
    q_all = basis.double()
    k = u.shape[1]
    s = k // blocks
    o = torch.zeros_like(u)
    for b in range(blocks):
        q = q_all[b * s:(b + 1) * s, :s]
        c = u[:, b * s:(b + 1) * s] @ q
        c = torch.sign(c) / math.sqrt(u.shape[0]) if norm == "sign" else c / c.norm(dim=0, keepdim=True)
        o[:, b * s:(b + 1) * s] = c @ q.T
    o = o if side == "input" else o.T
    m, n = w0.shape
    return (1 - lr * wd) * w0.double() - lr * tau * math.sqrt(max(m, n)) * o


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("norm,side,source", [("sign", "input", "activation"), ("l2", "input", "activation"),
                                              ("sign", "output", "output_grad")])
def test_cpu_paths_equal_float64_reference(monkeypatch, path, norm, side, source):
    monkeypatch.setattr(D.Dobb, "_SMALL_BLOCK", PATHS[path]["small"])
    monkeypatch.setattr(D.Dobb, "_FUSE_MIN_BLOCK_WORK", PATHS[path]["fuse"])
    m, n, blocks, lr, wd, tau = 24, 32, 4, 0.05, 0.1, 0.2
    torch.manual_seed(0)
    layer = nn.Linear(n, m, bias=False)  # fp32 weights, default bf16 basis
    opt = dobb.Dobb([layer.weight], layer, lr=lr, weight_decay=wd, blocks=blocks, norm=norm, side=side,
                    source=source, basis="eigh")
    x = torch.randn(6, n)
    for _ in range(3):  # later steps: momentum is no longer a multiple of the gradient
        w0 = layer.weight.detach().clone()
        opt.zero_grad()
        layer(x).square().sum().backward()
        grad = layer.weight.grad.clone()
        mom_before = opt.state[layer.weight]["momentum"].clone()
        opt.step()
        u = torch.lerp(mom_before, grad, 1 - 0.95)  # the EMA momentum the step used
        ref = _reference(w0, u, opt.state[layer.weight]["basis"], blocks, norm, side, lr, wd, tau)
        torch.testing.assert_close(layer.weight.detach().double(), ref, atol=2e-6, rtol=0)


def test_matmul_dtype_rule(monkeypatch):
    monkeypatch.setattr(F, "_cpu_native", lambda dtype: False)
    assert F.matmul_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert F.matmul_dtype(torch.float64, torch.device("cpu")) == torch.float64
    assert F.matmul_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(F, "_cpu_native", lambda dtype: True)
    assert F.matmul_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16

