"""dobb.baselines.muon_family.owner_muon on one process (no process group): every matrix computed locally, bitwise
Muon. The sharded cases are in tests/distributed/test_owner_muon_sharded.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from _baseline_refs import _weights_after, randn
from dobb.baselines import Muon


def test_owner_muon_single_process_is_muon_and_validates():
    """Without a process group every matrix is computed locally: bitwise Muon (bf16 NS5 included)."""
    from dobb.baselines import OwnerMuon

    grads = [randn(24, 36, seed=s).float() for s in range(3)]
    ref = _weights_after(Muon, [g.double() for g in grads])
    ws = []
    for group in ("default", None):
        w = nn.Parameter(torch.zeros(24, 36, dtype=torch.float64))
        opt = OwnerMuon([w], lr=0.1, weight_decay=0.01, replicated_group=group)
        for g in grads:
            w.grad = g.double()
            opt.step()
        ws.append(w.detach())
        assert opt.owners == {} and opt.gathered == {}
    assert torch.equal(ws[0], ref) and torch.equal(ws[1], ref)
    with pytest.raises(ValueError, match="replicated_group"):
        OwnerMuon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, replicated_group="world")
