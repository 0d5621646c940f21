"""Dobb's apply (``dobb._apply``, over ``functional.add_directions_``: the CPU fast paths of the step,
issue 12) against the float64 dense reference (``_dobb_reference``).

Three ways the step writes ``W <- (1 - lr wd) W - lr s O``: small blocks with transposed products,
large blocks with the decay folded into ``baddbmm``, and the general path (decay pass + strided
add). Each is forced in turn and must equal the float64 update built from the stored (bf16) basis;
the projection dtype rule (``matmul_dtype``) is checked on its own. Each path runs with fp32
products (the CPU default) and with bf16 products (forced), on every host.
"""
import math

import pytest
import torch
from torch import nn

import dobb
from dobb import _apply
from dobb import functional as F
from _dobb_reference import block_bases, dense_direction

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
    monkeypatch.setattr(_apply, "FUSE_MIN_BLOCK_WORK", PATHS[path]["fuse"])


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
