"""CMuon (``split_sizes`` / ``num_heads``): a fused weight orthogonalizes as its parts, equal to the
same optimizer on separate layers (the independent reference: Muon, Block Muon and NorMuon on a
model whose Q, K, V, or heads, are separate ``nn.Linear`` layers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dobb
from dobb.baselines import BlockMuon, Muon, NorMuon

D, HEADS = 8, 2


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.mlp = nn.Linear(D, 4 * D, bias=False)
        self.out = nn.Linear(4 * D, 3, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, dim=-1)
        return self.out(self.mlp(torch.tanh(q * k) + v))


class Separate(nn.Module):
    """The same function with q, k, v as three layers; or (``heads``) one layer per head of each."""

    def __init__(self, fused: Fused, heads: int = 1):
        super().__init__()
        rows = D // heads
        w = fused.qkv.weight.detach()
        self.parts = nn.ModuleList(nn.Linear(D, rows, bias=False) for _ in range(3 * heads))
        for i, lin in enumerate(self.parts):
            lin.weight.data.copy_(w[i * rows:(i + 1) * rows])
        self.mlp = nn.Linear(D, 4 * D, bias=False)
        self.out = nn.Linear(4 * D, 3, bias=False)
        self.mlp.weight.data.copy_(fused.mlp.weight)
        self.out.weight.data.copy_(fused.out.weight)
        self.heads = heads

    def forward(self, x):
        y = torch.cat([lin(x) for lin in self.parts], dim=-1)
        q, k, v = y.split(D, dim=-1)
        return self.out(self.mlp(torch.tanh(q * k) + v))

    def qkv_weight(self):
        return torch.cat([lin.weight for lin in self.parts], dim=0)


ALL_2D = dict(is_matrix=lambda name, mod, p: p.dim() == 2)
F64 = dict(ns_dtype="float64")


def train(model, opt, steps=4):
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(32, D, generator=g, dtype=torch.float64), torch.randn(32, 3, generator=g, dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        opt.step()


def pair(heads=1):
    torch.manual_seed(0)
    fused = Fused().double()
    return fused, Separate(fused, heads).double()


@pytest.mark.parametrize("cls,kw", [(Muon, {}), (NorMuon, {}), (BlockMuon, dict(blocks=2, axis=1)),
                                    (BlockMuon, dict(blocks=2, axis=0))])
@pytest.mark.parametrize("split", [dict(split_sizes=(D, D, D)), dict(split_sizes="qkv"),
                                   dict(split_sizes=[D, D, D], num_heads=HEADS)])
def test_fused_qkv_equals_separate_layers(cls, kw, split):
    heads = split.get("num_heads", 1)
    fused, sep = pair(heads)
    algo = cls.algorithm
    train(fused, cls(dobb.param_groups(fused, algorithm=algo, **ALL_2D), lr=0.05, weight_decay=0.1, **F64, **kw, **split))
    train(sep, cls(dobb.param_groups(sep, algorithm=algo, **ALL_2D), lr=0.05, weight_decay=0.1, **F64, **kw))
    assert torch.allclose(fused.qkv.weight, sep.qkv_weight(), rtol=0, atol=1e-12)
    assert torch.allclose(fused.mlp.weight, sep.mlp.weight, rtol=0, atol=1e-12)  # (4D x D) is not split
    # and the split changed something: plain Muon on the fused weight differs
    plain, _ = pair()
    train(plain, cls(dobb.param_groups(plain, algorithm=algo, **ALL_2D), lr=0.05, weight_decay=0.1, **F64, **kw))
    assert (plain.qkv.weight - fused.qkv.weight).abs().max() > 1e-4


def test_build_optimizer_applies_split_to_fitting_matrices_only():
    fused, sep = pair()
    opt = dobb.build_optimizer("muon", fused, lr=0.05, weight_decay=0.1, split_sizes=[D, D, D], **F64, **ALL_2D)
    train(fused, opt)
    train(sep, dobb.build_optimizer("muon", sep, lr=0.05, weight_decay=0.1, **F64, **ALL_2D))
    assert torch.allclose(fused.qkv.weight, sep.qkv_weight(), rtol=0, atol=1e-12)
    for a, b in ((fused.mlp, sep.mlp), (fused.out, sep.out)):
        assert torch.allclose(a.weight, b.weight, rtol=0, atol=1e-12)


def test_per_head_split_with_num_heads_alone():
    """num_heads without split_sizes cuts every matrix of its group: a per-group option (q, k, v)."""
    fused, sep = pair(HEADS)
    qkv = [fused.qkv.weight]
    rest = [fused.mlp.weight, fused.out.weight]
    opt = Muon([{"params": [fused.qkv.weight], "num_heads": 3 * HEADS}, {"params": rest}], lr=0.05,
               weight_decay=0.1, **F64)
    train(fused, opt)
    train(sep, Muon([p for p in sep.parameters()], lr=0.05, weight_decay=0.1, **F64))
    assert torch.allclose(qkv[0], sep.qkv_weight(), rtol=0, atol=1e-12)


def test_bitwise_muon_when_nothing_fits():
    """split_sizes that fit no matrix leave Muon's update untouched, bit for bit (bf16 NS5)."""
    a, _ = pair()
    b, _ = pair()
    train(a, Muon(dobb.param_groups(a, algorithm="muon", **ALL_2D), lr=0.05))
    train(b, Muon(dobb.param_groups(b, algorithm="muon", **ALL_2D), lr=0.05, split_sizes=(5, 6)))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw,name", [
    (dict(split_sizes=(4, 0)), "split_sizes"), (dict(split_sizes="thirds"), "split_sizes"),
    (dict(split_sizes=(4, 2.0)), "split_sizes"), (dict(num_heads=0), "num_heads"),
    (dict(split_sizes=(6, 6), num_heads=4), "num_heads"),
])
@pytest.mark.parametrize("cls", [Muon, NorMuon, BlockMuon])
def test_bad_split_arguments_name_themselves(cls, kw, name):
    w = nn.Parameter(torch.zeros(12, 8))
    extra = dict(blocks=1) if cls is BlockMuon else {}
    with pytest.raises(ValueError, match=rf"\b{name}( must|=)"):
        cls([w], lr=0.1, **kw, **extra)
