"""Layout-following defaults (issue 53, item 1) on plain tensors: an unsharded model steps exactly as
with the options' former defaults, bitwise, and the registry lists those values.

``blocks``, ``out_blocks``, ``axis`` (Block Muon) and ``select`` (Dion2) are ``None`` in a group,
"follow the layout" (``dobb.placement.follow_layout``). On a plain tensor that is the value the
option had before (Block Muon ``axis=1, blocks=4``, Dobb ``blocks=out_blocks=1``, ...), so the
check below is the same model stepped with the defaults and with those values given explicitly.
The sharded side is ``tests/distributed/test_layout_defaults_sharded.py``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dobb
from dobb import registry
from dobb.placement import follow_axis, follow_layout, shard_counts

PLAIN = {  # the former defaults, given explicitly
    "block-muon": dict(axis=1, blocks=4), "muonbp": dict(blocks=4), "dobb": dict(blocks=1, out_blocks=1),
    "dobb-g": dict(blocks=1, out_blocks=1), "dobb-muon": dict(blocks=1, out_blocks=1),
    "splus": dict(blocks=1, out_blocks=1), "dion2": dict(select="global", blocks=4),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(16, 16)
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.fc2 = nn.Linear(32, 16, bias=False)
        self.head = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(x)))))


def _run(name, **kw):
    model = Net()
    opt = dobb.build_optimizer(name, model, lr=0.02, weight_decay=0.01, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randint(0, 16, (8, 4), generator=g)
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    getattr(opt, "remove_hooks", lambda: None)()
    return model, opt


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_unsharded_defaults_step_bitwise_as_the_former_defaults(name):
    a, opt = _run(name)
    b, _ = _run(name, **PLAIN[name])
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    moved = Net()
    assert not torch.equal(a.fc1.weight, moved.fc1.weight)
    matrices = [g for g in opt.param_groups if g["algorithm"] != "adamw"]
    assert all(g[k] is None for g in matrices for k in PLAIN[name] if k in type(opt).Options.layout_names())


def test_registry_lists_the_unsharded_values_and_takes_none():
    assert registry.hparam_defaults("block-muon")["blocks"] == 4
    assert registry.hparam_defaults("block-muon")["axis"] == 1
    assert registry.hparam_defaults("dion2")["select"] == "global"
    assert dobb.BlockMuon.matrix_defaults["blocks"] == 4
    registry.validate("block-muon", {"blocks": None, "axis": None})  # None: follow the layout
    for bad, key in (({"blocks": "4"}, "blocks"), ({"axis": 2}, "axis"), ({"out_blocks": 0}, "out_blocks")):
        with pytest.raises(ValueError, match=key):
            registry.validate("dobb-muon" if key == "out_blocks" else "block-muon", bad)


def test_plain_tensors_follow_nothing():
    w = torch.zeros(8, 4)
    assert shard_counts(w) == (1, 1)
    assert follow_layout(None, w, 0, 4) == 4 and follow_layout(3, w, 0, 4) == 3
    assert follow_axis(None, w, 1) == 1 and follow_axis(0, w, 1) == 0
