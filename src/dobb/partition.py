"""The block partition of an axis: how many blocks an axis may take and their sizes.

Why its own module: the partition is decided when an optimizer builds its layouts and plans (and by
the bench's payload formulas), never inside a step, while ``dobb.functional`` holds the step's
kernels. The rule: the axis is cut at its shard boundaries first (so no block straddles two
shards), then every non-empty shard is split into the same number of nearly equal blocks
(``torch.tensor_split`` sizes: the first ``s % k`` blocks are one longer). ``dobb.functional``
re-exports both names.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["block_sizes", "valid_block_counts"]


def _split_sizes(size: int, parts: int) -> list[int]:
    q, r = divmod(size, parts)
    return [q + 1] * r + [q] * (parts - r)


def valid_block_counts(size: int, shard_sizes: Sequence[int] | None = None) -> list[int]:
    """All block counts ``B`` for which every block lies within one shard of the axis."""
    shards = [s for s in (shard_sizes or [size]) if s > 0]
    if not shards:
        return []
    return [len(shards) * k for k in range(1, min(shards) + 1)]


def block_sizes(size: int, blocks: int, shard_sizes: Sequence[int] | None = None) -> list[int]:
    """Sizes of the ``blocks`` contiguous blocks of an axis of length ``size``.

    ``shard_sizes`` (the lengths of the axis' shards, in order, empty shards allowed) forces every
    block to lie within one shard: each non-empty shard gets ``blocks / n_nonempty`` blocks.
    """
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    if size < 1:
        raise ValueError(f"cannot partition an axis of length {size}")
    if shard_sizes is None:
        shard_sizes = [size]
    if sum(shard_sizes) != size:
        raise ValueError(f"shard sizes {list(shard_sizes)} do not add up to the axis length {size}")
    shards = [s for s in shard_sizes if s > 0]
    per, rem = divmod(blocks, len(shards))
    if rem or per > min(shards):
        if len(shards) == 1:
            raise ValueError(f"blocks={blocks} is larger than the axis length {size}")
        valid = valid_block_counts(size, shard_sizes)
        shown = ", ".join(map(str, valid[:8])) + (", ..." if len(valid) > 8 else "")
        raise ValueError(
            f"blocks={blocks} cannot keep every block within one shard of an axis of length {size} "
            f"sharded as {list(shard_sizes)}; valid block counts: {shown}"
        )
    return [b for s in shards for b in _split_sizes(s, per)]
