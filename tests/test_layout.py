"""dobb.layout / dobb.placement on plain tensors: block partition, feature restriction, block state;
and the package's one DTensor test and unwrap (``is_dtensor``, ``to_local``): true for a DTensor
(one-rank mesh) and false for every plain tensor kind, ``to_local`` a view of the shard, and the
reason the test goes by type name, checked: importing the package does not load
``torch.distributed.tensor``."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from _one_rank import one_rank_group
from dobb.layout import MatrixLayout, is_dtensor, is_dtensor_type, plain_layout, to_local
from dobb.placement import layout_for


# --------------------------------------------------------------------- layouts
@pytest.mark.parametrize("side,axis", [("input", 1), ("output", 0)])
def test_plain_layout_blocks_the_chosen_axis(side, axis):
    w = torch.zeros(6, 10)
    lay = layout_for(w, side, 3, stat_group=None)
    assert type(lay) is MatrixLayout and lay.blocked_axis == axis
    k = w.shape[axis]
    assert lay.local_sizes == [k // 3 + (i < k % 3) for i in range(3)]
    assert lay.rows == w.shape[1 - axis] and lay.state_cols == max(lay.local_sizes)


def test_local_features_accept_full_or_local_axis_and_name_a_wrong_one():
    lay = MatrixLayout((4, 10), (4, 6), 1, [3, 3], local_start=4)
    x = torch.arange(20.0).reshape(2, 10)
    assert torch.equal(lay.local_features(x), x[:, 4:10])  # the full axis is cut to the local blocks
    assert torch.equal(lay.local_features(x[:, :6]), x[:, :6])  # already local (row-wise TP)
    with pytest.raises(ValueError, match="last dimension 7"):
        lay.local_features(torch.zeros(2, 7))


def test_block_state_is_row_stacked_identity_or_zeros():
    lay = plain_layout(torch.zeros(3, 5), "input", 2, stat_group=None)  # blocks 3, 2
    eye = lay.new_block_state(torch.float64, identity=True, like=torch.zeros(1))
    expected = torch.zeros(5, 3, dtype=torch.float64)
    expected[:3, :3] = torch.eye(3)
    expected[3:, :2] = torch.eye(2)
    assert torch.equal(eye, expected)
    assert torch.equal(lay.new_block_state(torch.float32, identity=False, like=torch.zeros(1)), torch.zeros(5, 3))
    # a statistic of a narrower span is zero-padded to the state's columns
    assert lay.stat_to_state(torch.ones(5, 2)).shape == (5, 3)



def test_a_matrix_is_a_stack_of_one_and_an_expert_stack_one_of_E():
    """The stack view Dobb's step works on: leading stack dim, one capture per matrix of the span,
    means in the same typed form."""
    from dobb.core.experts import expert_layout

    w2, w3 = torch.randn(4, 6), torch.randn(3, 4, 6)
    lay2, lay3 = plain_layout(w2, "input", 2), expert_layout(w3, "input", 2)
    assert lay2.stacked(w2).shape == (1, 4, 6) and lay2.stacked(w2).data_ptr() == w2.data_ptr()
    assert lay3.stacked(w3) is w3
    assert (lay2.stack_size, lay2.stack_local, lay2.stack_span, lay2.stack_offset) == (1, 1, 1, 0)
    assert (lay3.stack_size, lay3.stack_local, lay3.stack_span, lay3.stack_offset) == (3, 3, 3, 0)
    sums = torch.arange(18.0).view(6, 3)
    r2 = lay2.mean(sums, [3])
    assert torch.equal(r2.mean, (sums / 3)[None]) and r2.seen == [True] and r2.keep is None
    assert lay2.mean(sums, [0]).seen == [False]
    r3 = lay3.mean(torch.stack([sums, sums, sums]), [2, 0, 4])
    assert r3.seen == [True, False, True]
    assert torch.equal(r3.mean[0], sums / 2) and torch.equal(r3.mean[2], sums / 4)
    d3 = lay3.mean_on_device(torch.stack([sums, sums, sums]), torch.tensor([2.0, 0.0, 4.0]))
    assert d3.seen == [True] * 3 and d3.keep.tolist() == [True, False, True]
    assert not lay2.routed and lay3.routed


# ------------------------------------------------------------ the DTensor test
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
