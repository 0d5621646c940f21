"""dobb._dtensor, the one DTensor test and unwrap of the package: true for a DTensor (one-rank mesh)
and false for every plain tensor kind; ``to_local`` a view of the shard; and the reason the test
goes by type name, checked: importing the package does not load ``torch.distributed.tensor``."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from _one_rank import one_rank_group
from dobb._dtensor import is_dtensor, is_dtensor_type, to_local


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with one_rank_group():
        yield init_device_mesh("cpu", (1,))


class Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("t", [torch.ones(2, 3), nn.Parameter(torch.ones(2, 3)), torch.ones(2, 3).as_subclass(Subclass),
                               torch.ones(6).to_sparse(), torch.ones(2, 3)[:, 1]], ids=["tensor", "parameter",
                               "subclass", "sparse", "view"])
def test_plain_tensors_are_not_dtensors_and_unwrap_to_themselves(t):
    assert not is_dtensor(t) and not is_dtensor_type(type(t))
    assert to_local(t) is t


def test_dtensor_is_one_and_unwraps_to_a_view_of_its_shard(mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    full = torch.arange(12.0).reshape(3, 4)
    d = distribute_tensor(full, mesh, [Shard(0)])
    p = nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
    assert is_dtensor(d) and is_dtensor(p) and is_dtensor_type(DTensor) and is_dtensor_type(type(p))
    local = to_local(d)
    assert not is_dtensor(local) and torch.equal(local, full)
    local.mul_(2)  # a view, not a copy: writing through it changes the DTensor
    assert torch.equal(d.full_tensor(), 2 * full)
    assert not is_dtensor(d.to_local()) and not is_dtensor(None) and not is_dtensor(3.0)


def test_importing_the_package_does_not_load_torch_distributed_tensor():
    """The docstring's reason for the type-name test: single-device users never pay the seconds of
    ``import torch.distributed.tensor``. Only ``dobb.sharding`` (DTensor layouts) loads it."""
    code = ("import sys, torch, dobb, dobb.baselines, dobb.meter, dobb.placement, dobb.collectives, dobb.factory\n"
            "print('torch.distributed.tensor' in sys.modules)\n"
            "import dobb.sharding\n"
            "print('torch.distributed.tensor' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]
