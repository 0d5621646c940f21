"""dobb.baselines.muon: Muon bitwise equal to torch.optim.Muon (with torch's AdamW for the rest), and
its Newton-Schulz options (``ns_method``, ``ns_dtype``; Block Muon shares them) against the float64
quintic iteration written out."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dobb
from _baseline_refs import ALL_2D, _weights_after, data, mlp, ns5_reference, randn
from dobb.baselines import BlockMuon, Muon


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon_bitwise(nesterov):
    ref, ours = mlp(), mlp()
    mats = [ref[0].weight, ref[2].weight, ref[4].weight]
    rest = [p for p in ref.parameters() if all(p is not q for q in mats)]
    a = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    b = torch.optim.AdamW(rest, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))
    opt = Muon(dobb.param_groups(ours, algorithm="muon", **ALL_2D), lr=0.02, weight_decay=0.1, nesterov=nesterov)
    X, Y = data()
    for _ in range(6):
        for model, opts in ((ref, (a, b)), (ours, (opt,))):
            for o in opts:
                o.zero_grad()
            ((model(X) - Y) ** 2).mean().backward()
            for o in opts:
                o.step()
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls,kw", [(Muon, {}), (BlockMuon, {"blocks": 3, "axis": 1}),
                                    (BlockMuon, {"blocks": 2, "axis": 0})])
def test_muon_and_block_muon_gram_option(cls, kw):
    grads = [randn(24, 36, seed=s) for s in range(3)]
    std = _weights_after(cls, grads, ns_dtype="float64", **kw)
    gram = _weights_after(cls, grads, ns_dtype=torch.float64, ns_method="gram", **kw)
    assert (std - gram).abs().max().item() < 1e-12
    # and the float64 standard path is the reference iteration itself (Muon: one block)
    if cls is Muon:
        mu, u, buf = 0.95, None, torch.zeros(24, 36, dtype=torch.float64)
        w = torch.zeros(24, 36, dtype=torch.float64)
        for g in grads:
            buf = buf + (1 - mu) * (g - buf)
            u = g + mu * (buf - g)
            w = (1 - 0.1 * 0.01) * w - 0.1 * 0.2 * math.sqrt(36) * ns5_reference(u)
        assert (std - w).abs().max().item() < 1e-12


@pytest.mark.parametrize("kw,arg", [({"ns_method": "svd"}, "ns_method"), ({"ns_dtype": "int8"}, "ns_dtype"),
                                    ({"ns_dtype": torch.int32}, "ns_dtype")])
def test_ns_option_validation(kw, arg):
    with pytest.raises(ValueError, match=rf"\b{arg}( must|=)"):
        Muon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, **kw)
