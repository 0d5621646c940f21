"""``layout_for``: the layout of any matrix parameter, plain (``layout``) or DTensor (``sharding``).

Why a module of its own: ``sharding`` extends ``layout``, so the dispatch between them sits above
both, and ``sharding`` (which imports ``torch.distributed.tensor``, seconds on first use) is loaded
only when a DTensor is actually present.
"""
from __future__ import annotations

import torch

from .layout import MatrixLayout, is_dtensor, plain_layout

__all__ = ["layout_for", "SIDES"]

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
