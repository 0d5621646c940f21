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

from _one_rank import one_rank_group
from dobb.layout import MatrixLayout, plain_layout
from dobb.placement import SIDES, layout_for


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
