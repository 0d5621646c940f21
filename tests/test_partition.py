"""dobb.partition, the block partition of an axis: against torch's own ``tensor_split`` sizes and
hand cases of sharded axes (uneven and empty shards), with the ``ValueError`` that lists the counts
that work; ``dobb.functional`` re-exports it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dobb.functional as F
from dobb import partition as P


@given(size=st.integers(1, 200), blocks=st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_block_sizes_partition_properties(size, blocks):
    if blocks > size:
        with pytest.raises(ValueError, match="blocks"):
            P.block_sizes(size, blocks)
        return
    sizes = P.block_sizes(size, blocks)
    assert sum(sizes) == size and len(sizes) == blocks
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # longer blocks first, as torch.tensor_split
    assert sizes == [len(c) for c in torch.arange(size).tensor_split(blocks)]


def test_block_sizes_respects_shards_uneven_and_empty():
    # 18 rows over 4 ranks (torch.chunk: 5, 5, 5, 3) and 18 rows over 8 ranks (3 x 6 and two empty).
    assert P.block_sizes(18, 4, [5, 5, 5, 3]) == [5, 5, 5, 3]
    assert P.block_sizes(18, 8, [5, 5, 5, 3]) == [3, 2, 3, 2, 3, 2, 2, 1]
    assert P.block_sizes(18, 6, [3, 3, 3, 3, 3, 3, 0, 0]) == [3] * 6
    with pytest.raises(ValueError, match=r"valid block counts: 4, 8, 12"):
        P.block_sizes(18, 6, [5, 5, 5, 3])
    assert P.valid_block_counts(18, [3, 3, 3, 3, 3, 3, 0, 0]) == [6, 12, 18]


def test_functional_re_exports_the_partition():
    assert F.block_sizes is P.block_sizes and F.valid_block_counts is P.valid_block_counts
