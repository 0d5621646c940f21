"""Head-aligned blocks (``heads``, ``dobb.core.heads``): attention matrices are blocked per head
(the output side of q/k/v, fused or not; the input side of the output projection), the MLP keeps the
group's equal cuts. The numbers: Dobb-preconditioned Muon with ``heads`` equals the float64 dense
reference of ``test_dobb_muon`` run with the per-head block counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dobb import Dobb
from dobb.core.heads import head_blocks, role
from test_dobb_muon import Reference


@pytest.mark.parametrize("name,want", [
    ("blocks.0.attn.qkv.weight", "qkv"), ("h.0.attn.c_attn.weight", "qkv"), ("layers.1.self_attn.q_proj.weight", "qkv"),
    ("blocks.0.attn.k.weight", "qkv"), ("blocks.0.attn.proj.weight", "out"), ("h.0.attn.c_proj.weight", "out"),
    ("layers.1.self_attn.o_proj.weight", "out"), ("blocks.0.mlp.proj.weight", None), ("blocks.0.mlp.fc.weight", None),
    ("h.0.mlp.c_proj.weight", None), ("head.weight", None), (None, None)])
def test_role_by_name(name, want):
    assert role(name) == want


def test_counts_per_role():
    assert head_blocks("blocks.0.attn.qkv.weight", (384, 128), 4, 1, 4) == (1, 12)
    assert head_blocks("blocks.0.attn.q.weight", (128, 128), 4, 1, 4) == (1, 4)
    assert head_blocks("layers.0.self_attn.k_proj.weight", (32, 128), 16, 1, 4) == (1, 4)  # 4 kv heads of 8
    assert head_blocks("blocks.0.attn.proj.weight", (128, 128), 4, 1, 4) == (4, 4)
    assert head_blocks("blocks.0.mlp.fc.weight", (512, 128), 4, 1, 4) == (1, 4)
    assert head_blocks("blocks.0.attn.qkv.weight", (384, 128), None, 1, 4) == (1, 4)
    with pytest.raises(ValueError, match="heads=3 must divide the attention width 128"):
        head_blocks("blocks.0.attn.proj.weight", (128, 128), 3, 1, 4)
    with pytest.raises(ValueError, match="not a whole number of heads"):
        head_blocks("blocks.0.attn.qkv.weight", (100, 128), 4, 1, 4)


class Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False, dtype=torch.float64)
        self.proj = nn.Linear(d, d, bias=False, dtype=torch.float64)


class Tiny(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.attn = Attn(d)
        self.mlp = nn.Sequential()
        self.mlp.fc = nn.Linear(d, 4 * d, bias=False, dtype=torch.float64)


def _opt(model, **kw):
    named = [(n, p) for n, p in model.named_parameters()]
    return Dobb([{"params": named}], lr=0.03, weight_decay=0.1, source="grad_gram", refresh_every=3, stagger=False,
                basis_dtype=torch.float64, stat_dtype=torch.float64, product_dtype=torch.float64, **kw)


def test_layouts_follow_heads_two_sided_and_muon():
    model = Tiny()
    opt = _opt(model, side="both", blocks=1, out_blocks=2, heads=2)
    sizes = {n: [list(s.layout.global_sizes) for s in opt._plans[p].sides] for n, p in model.named_parameters()}
    assert sizes == {"attn.qkv.weight": [[8], [4] * 6], "attn.proj.weight": [[4, 4], [4, 4]],
                     "mlp.fc.weight": [[8], [16, 16]]}
    opt = _opt(Tiny(), norm="muon", blocks=1, out_blocks=2, heads=2, ns_dtype="float64")
    rows = [list(plan.ns_rows.global_sizes) for plan in opt._plans.values()]
    assert rows == [[4] * 6, [4, 4], [16, 16]]


def test_muon_with_heads_matches_reference_with_per_head_counts():
    model = Tiny()
    opt = _opt(model, norm="muon", blocks=1, out_blocks=2, heads=2, ns_dtype="float64")
    refs = {"attn.qkv.weight": (1, 6), "attn.proj.weight": (2, 2), "mlp.fc.weight": (1, 2)}
    ref = {n: Reference(p.detach(), blocks=b, out_blocks=ob, refresh=3, lr=0.03, wd=0.1)
           for (n, p), (b, ob) in zip(model.named_parameters(), refs.values())}
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        for n, p in model.named_parameters():
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.grad = g.clone()
            ref[n].step(g)
        opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n].w, rtol=0, atol=1e-10)


def test_heads_need_names():
    with pytest.raises(ValueError, match="finds attention matrices by name"):
        Dobb([nn.Parameter(torch.randn(6, 4))], lr=0.1, source="grad_gram", heads=2)
