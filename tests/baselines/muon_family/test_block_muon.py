"""dobb.baselines.muon_family.block_muon: one block is Muon (bitwise), each block is torch's NS5 of that block
scaled by its own update scale, and a block count a matrix cannot take names the parameter."""
from __future__ import annotations

import math

import pytest
import torch

import dobb
from _baseline_refs import COEFFS, mlp, raw_update, train
from dobb.baselines import BlockMuon, Muon

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz


def test_block_muon_one_block_is_muon():
    a, b = mlp(), mlp()
    train(a, Muon(dobb.param_groups(a, algorithm="muon"), lr=0.02, weight_decay=0.1), 5)
    train(b, BlockMuon(dobb.param_groups(b, algorithm="block-muon"), lr=0.02, weight_decay=0.1, blocks=1), 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("axis", [0, 1])
def test_block_muon_blocks_are_independent_muon_updates(axis):
    shape, blocks = (21, 10), 3
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    o, _ = raw_update(BlockMuon, shape, [G], blocks=blocks, axis=axis, nesterov=False, ns_dtype="bfloat16")
    sizes = dobb.functional.block_sizes(shape[axis], blocks)
    s = 0.2 * math.sqrt(max(shape))
    start = 0
    for size in sizes:
        sl = (slice(None), slice(start, start + size)) if axis == 1 else (slice(start, start + size),)
        block = (0.05 * G)[sl]  # first EMA step
        ref = torch_ns(block, COEFFS, 5, 1e-7).double() * (0.2 * math.sqrt(max(block.shape)) / s)
        assert torch.allclose(o[sl], ref, atol=1e-6)
        start += size


def test_block_muon_bad_blocks_names_parameter():
    model = mlp()
    with pytest.raises(ValueError, match=r"0\.weight.*blocks=20"):
        BlockMuon(dobb.param_groups(model, algorithm="block-muon"), lr=0.1, blocks=20, axis=1)
