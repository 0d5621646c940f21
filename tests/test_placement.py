"""dobb.placement.layout_for, the dispatch between plain layouts (``dobb.layout``) and DTensor layouts
(``dobb.sharding``): plain tensors get ``plain_layout``'s layout with the statistic group passed
through, DTensors (a one-rank mesh here; many ranks in tests/distributed) a ``DTensorLayout`` on
their mesh, bad ``side`` / ``blocks`` a ValueError naming them, and ``dobb.sharding`` (which loads
``torch.distributed.tensor``) is imported only when a DTensor is present."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch import nn

import dobb
from _one_rank import one_rank_group
from dobb import registry
from dobb.layout import MatrixLayout, plain_layout
from dobb.placement import SIDES, follow_axis, follow_layout, layout_for, shard_counts


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("blocks", [1, 3])
def test_plain_tensor_gets_plain_layout(side, blocks):
    w = torch.zeros(6, 10)
    got = layout_for(w, side, blocks)  # "default" means no group for a plain tensor
    assert type(got) is MatrixLayout
    assert dataclasses.asdict(got) == dataclasses.asdict(plain_layout(w, side, blocks, None))
    assert got.blocked_axis == (1 if side == "input" else 0) and got.stat_group is None


def test_plain_tensor_keeps_the_given_group():
    with one_rank_group() as world:
        assert layout_for(torch.zeros(6, 10), "input", 2, stat_group=world).stat_group is world


@pytest.mark.parametrize("side,blocks,message", [
    ("sideways", 2, "side must be one of ('input', 'output'), got 'sideways'"),
    ("both", 2, "side must be one of ('input', 'output'), got 'both'"),
    ("input", 11, "blocks=11 is larger than the axis length 10"),
    ("input", 0, "blocks must be >= 1, got 0"),
])
def test_bad_side_or_blocks_is_a_value_error_naming_it(side, blocks, message):
    with pytest.raises(ValueError) as err:
        layout_for(torch.zeros(6, 10), side, blocks)
    assert str(err.value) == message


@pytest.mark.parametrize("placement", ["shard0", "shard1", "replicate"])
def test_dtensor_gets_a_dtensor_layout_on_its_mesh(placement):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dobb.sharding import DTensorLayout

    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        pl = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[placement]
        d = distribute_tensor(torch.zeros(6, 10), mesh, [pl])
        lay = layout_for(d, "input", 3)
        assert type(lay) is DTensorLayout and lay.mesh is mesh
        # one rank holds the whole matrix: the blocks are the plain layout's
        plain = plain_layout(torch.zeros(6, 10), "input", 3, None)
        assert (lay.shape, lay.local_shape, lay.blocked_axis, lay.local_sizes) == \
               (plain.shape, plain.local_shape, plain.blocked_axis, plain.local_sizes)
        with pytest.raises(ValueError, match="blocks=11 is larger than the axis length 10"):
            layout_for(d, "input", 11)


def test_plain_layouts_do_not_load_sharding():
    code = ("import sys, torch\nfrom dobb.placement import layout_for\n"
            "layout_for(torch.zeros(4, 6), 'input', 2)\nlayout_for(torch.zeros(4, 6), 'output', 2, None)\n"
            "print('dobb.sharding' in sys.modules, 'torch.distributed.tensor' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


# ----------------------------------------------------------------------------- layout-following defaults
# (issue 53, item 1) on plain tensors: an unsharded model steps exactly as with the options' former
# defaults, bitwise, and the registry lists those values. ``blocks``, ``out_blocks``, ``axis`` (Block
# Muon) and ``select`` (Dion2) are ``None`` in a group, "follow the layout" (``follow_layout``); on a
# plain tensor that is the value the option had before. The sharded side:
# tests/distributed/test_layout_defaults_sharded.py.

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
