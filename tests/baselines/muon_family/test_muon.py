"""dobb.baselines.muon_family.muon: Muon bitwise equal to torch.optim.Muon (with torch's AdamW for the rest), and
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


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon (the reference) is not in this torch")
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_muon_bitwise(nesterov):
    ref, ours = mlp(), mlp()
    mats = [ref[0].weight, ref[2].weight, ref[4].weight]
    rest = [p for p in ref.parameters() if all(p is not q for q in mats)]
    a = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    # the AdamW part: its 1-D parameters (biases) without weight decay, by default; fused by default
    rest_groups = [{"params": [p for p in rest if p.dim() >= 2]},
                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    b = torch.optim.AdamW([g for g in rest_groups if g["params"]], lr=0.02, weight_decay=0.1, betas=(0.9, 0.95),
                          fused=True)
    opt = Muon(dobb.param_groups(ours, algorithm="muon", **ALL_2D), lr=0.02, weight_decay=0.1, nesterov=nesterov,
               ns_dtype="bfloat16")  # torch's Muon always runs NS5 in bf16
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


def test_ns_dtype_auto_resolves_to_native_bf16_only(monkeypatch):
    import dobb.newton_schulz as ns_mod
    from dobb.baselines import resolve_ns_dtype
    for native, expect in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(ns_mod, "cpu_native", lambda dt, native=native: native)
        assert resolve_ns_dtype("auto", "cpu") == expect
        assert resolve_ns_dtype("auto", torch.device("cuda")) == torch.bfloat16  # accelerators: bf16
        # a name or a dtype is taken as given on every device
        assert resolve_ns_dtype("float64", "cpu") == torch.float64
        assert resolve_ns_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="ns_dtype must be 'auto'"):
        Muon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, ns_dtype="fp8")


def test_muon_default_ns_dtype_is_auto_and_runs_the_resolved_dtype():
    # The default trains bitwise as the explicitly resolved dtype, and differs from the other one
    # (so the default cannot silently stay on a fixed dtype).
    from dobb.baselines import resolve_ns_dtype
    assert Muon.matrix_defaults["ns_dtype"] == "auto"
    resolved = resolve_ns_dtype("auto", "cpu")
    other = torch.float32 if resolved == torch.bfloat16 else torch.bfloat16
    runs = {}
    for key, kw in (("default", {}), ("resolved", {"ns_dtype": resolved}), ("other", {"ns_dtype": other})):
        model = mlp()
        opt = Muon(dobb.param_groups(model, algorithm="muon", **ALL_2D), lr=0.02, weight_decay=0.1, **kw)
        X, Y = data()
        for _ in range(3):
            opt.zero_grad()
            ((model(X) - Y) ** 2).mean().backward()
            opt.step()
        runs[key] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(runs["default"], runs["resolved"]))
    assert not all(torch.equal(a, b) for a, b in zip(runs["default"], runs["other"]))
