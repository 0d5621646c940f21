"""dobb.sharding's pure pieces (no process group): shard sizes and the block partition they force."""
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
