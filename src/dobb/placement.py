"""``layout_for``: the layout of any matrix parameter, plain (``layout``) or DTensor (``sharding``).

Why a module of its own: ``sharding`` extends ``layout``, so the dispatch between them sits above
both, and ``sharding`` (which imports ``torch.distributed.tensor``, seconds on first use) is loaded
only when a DTensor is actually present.
"""
from __future__ import annotations

import torch

from .layout import MatrixLayout, is_dtensor, plain_layout

__all__ = ["layout_for", "SIDES", "shard_counts", "follow_layout", "follow_axis"]

# The axis a layout blocks: "input" the columns (Dobb), "output" the rows (Dobb-G).
SIDES = ("input", "output")


def layout_for(param: torch.Tensor, side: str, blocks: int, stat_group="default") -> MatrixLayout:
    """Choose the layout of a matrix parameter and validate its block partition.

    ``stat_group``: for DTensors ``"default"`` (the mesh's data-parallel dims), mesh dim names or
    indices, a ProcessGroup or None; for plain tensors a ProcessGroup or None (resolved by the
    caller, ``collectives.plain_stat_group``).
    """
    # Checked here, above both layouts: each reads any side but "input" as the output side.
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if is_dtensor(param):
        from .sharding import dtensor_layout

        return dtensor_layout(param, side, blocks, stat_group)
    return plain_layout(param, side, blocks, None if stat_group == "default" else stat_group)


# ----------------------------------------------------------------------------- layout-following defaults
def shard_counts(param: torch.Tensor) -> tuple[int, int]:
    """``(rows, columns)`` of a matrix parameter as its placement cuts them (``sharding.axis_shard_counts``):
    1 an axis whole on every rank (every axis of a plain tensor), ``k`` one cut into ``k`` non-empty
    shards by one mesh dim, 0 one cut in a way no block count follows."""
    if not is_dtensor(param):
        return 1, 1
    from .sharding import axis_shard_counts

    return axis_shard_counts(param)


def follow_layout(value, param: torch.Tensor, axis: int, plain: int) -> int:
    """A block count of one matrix: ``value`` when the user gave one (not None), else one block per
    shard of ``axis`` when the placement cuts it (the step then stays on the local shard), else
    ``plain`` (the option's value on an unsharded matrix)."""
    if value is not None:
        return value
    k = shard_counts(param)[axis]
    return k if k > 1 else plain


def follow_axis(value, param: torch.Tensor, plain: int) -> int:
    """The axis a one-sided block cut runs along: ``value`` when given, else the axis the placement
    cuts when the other one is whole on this rank (whole rows or columns: each block is local),
    else ``plain``."""
    if value is not None:
        return value
    rows, cols = shard_counts(param)
    if rows > 1 and cols == 1:
        return 0
    if cols > 1 and rows == 1:
        return 1
    return plain
