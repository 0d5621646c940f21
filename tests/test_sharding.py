"""dobb.sharding: shard sizes and the block partition they force (no process group), the baselines' DTensor
helpers on plain tensors and on a one-rank mesh (many ranks: tests/distributed)."""
import pytest
import torch

from dobb import functional as F
from dobb.sharding import chunk_sizes


@pytest.mark.parametrize("length", [1, 2, 5, 7, 13, 18, 31])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunk_sizes_follow_torch_chunk(length, parts):
    """Reference: the lengths torch.chunk gives, padded with empty trailing shards (DTensor Shard)."""
    got = [c.shape[0] for c in torch.arange(length).chunk(parts)]
    assert chunk_sizes(length, parts) == got + [0] * (parts - len(got))


@pytest.mark.parametrize("length,parts", [(18, 4), (2, 4), (13, 2), (31, 4)])
def test_blocks_never_straddle_a_shard(length, parts):
    shards = chunk_sizes(length, parts)
    bounds = {sum(shards[:i]) for i in range(parts + 1)}
    for blocks in F.valid_block_counts(length, shards):
        sizes = F.block_sizes(length, blocks, shards)
        starts = {sum(sizes[:i]) for i in range(len(sizes) + 1)}
        assert bounds <= starts  # every shard boundary is a block boundary


def test_plain_tensors_pass_the_baselines_helpers_and_axis_split_refuses_them():
    from dobb.sharding import axis_split, gather_full, local_slice, rows_are_local

    t = torch.arange(6.0).reshape(2, 3)
    assert gather_full(t, t) is t and local_slice(t, t) is t and rows_are_local(t)
    with pytest.raises(ValueError) as err:
        axis_split(t)
    assert str(err.value) == "axis_split needs a DTensor parameter, got a Tensor"


@pytest.mark.parametrize("placement,rows_local,dims", [("shard0", True, (0, None)), ("shard1", False, (None, 0)),
                                                       ("replicate", True, (None, None))])
def test_one_rank_dtensor_helpers(placement, rows_local, dims):
    """On a one-rank mesh every helper is an identity on the values; what differs by placement is
    whether rows are whole on a rank and which mesh dim splits which axis."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from _one_rank import one_rank_group
    from dobb.sharding import axis_split, gather_full, local_slice, rows_are_local

    full = torch.arange(12.0).reshape(3, 4)
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        pl = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[placement]
        d = distribute_tensor(full, mesh, [pl])
        assert rows_are_local(d) is rows_local
        assert torch.equal(gather_full(d.to_local(), d), full) and torch.equal(local_slice(full, d), full)
        split = axis_split(d)
        assert split.mesh_dims == dims and split.shape == split.local_shape == (3, 4) and split.starts == (0, 0)
