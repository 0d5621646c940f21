"""Everything that knows about placement: process groups, DTensor layouts, block/shard alignment.

The optimizers ask this module for a ``MatrixLayout`` per matrix parameter and then work on local
tensors only (``layout.local(t)``); the math in ``functional`` never sees a DTensor.

This file holds the single-process / data-parallel (plain tensor) layout; sharded layouts
(DTensor: FSDP2, tensor parallel) extend ``MatrixLayout``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .functional import block_sizes, identity_blocks


@dataclass
class MatrixLayout:
    """How one ``m x n`` matrix parameter is laid out, and where its blocks are.

    ``blocked_axis`` is 1 for input-side blocks (Dobb) and 0 for output-side blocks (Dobb-G).
    ``local_sizes`` are the sizes of the blocks held locally, in order; ``local_start`` is the
    global index of the first local entry of the blocked axis.
    """

    shape: tuple[int, int]
    local_shape: tuple[int, int]
    blocked_axis: int
    local_sizes: list[int]
    local_start: int = 0
    # Group over which captured statistics are averaged (ranks that see different data), or None.
    stat_group: object | None = None
    # Group of ranks holding other rows of the same columns (input side) whose column norms must be
    # summed for ell2 normalization, or None when rows are not sharded.
    l2_group: object | None = None
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Global length of the axis that is not blocked (sign normalization divides by its root)."""
        return self.shape[1 - self.blocked_axis]

    @property
    def local_blocked_len(self) -> int:
        return self.local_shape[self.blocked_axis]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def local_features(self, x: torch.Tensor) -> torch.Tensor:
        """Restrict captured features (last dim = blocked axis) to the locally held blocks.

        Activations arrive with the full axis under data parallelism and FSDP, and already local
        under row-wise tensor parallelism; both are accepted.
        """
        k = x.shape[-1]
        if k == self.local_blocked_len:
            return x
        if k == self.shape[self.blocked_axis]:
            return x[..., self.local_start : self.local_start + self.local_blocked_len]
        raise ValueError(
            f"captured features have last dimension {k}, but the matrix's blocked axis has length "
            f"{self.shape[self.blocked_axis]} (local {self.local_blocked_len}): is the hook on the right layer?"
        )

    def new_block_state(self, dtype: torch.dtype, identity: bool, like: torch.Tensor) -> torch.Tensor:
        """Row-stacked block storage ``(k_local, s_max)`` (see ``functional``), zeros or identity."""
        k, s = self.local_blocked_len, max(self.local_sizes) if self.local_sizes else 1
        if identity and self.local_sizes:
            return identity_blocks(self.local_sizes, dtype=dtype, device=like.device)
        return torch.zeros(k, s, dtype=dtype, device=like.device)

    def local_block_state(self, t: torch.Tensor) -> torch.Tensor:
        return t


def default_stat_group(param: torch.Tensor):
    """Data-parallel group for plain (replicated) parameters: the world, when initialized."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def layout_for(param: torch.Tensor, side: str, blocks: int, stat_group="default") -> MatrixLayout:
    """Choose the layout of a matrix parameter and validate its block partition."""
    if type(param).__name__ == "DTensor":
        from .sharding import dtensor_layout  # sharded layouts live beside this module

        return dtensor_layout(param, side, blocks, stat_group)
    m, n = param.shape
    axis = 1 if side == "input" else 0
    sizes = block_sizes(param.shape[axis], blocks)
    group = default_stat_group(param) if stat_group == "default" else stat_group
    return MatrixLayout((m, n), (m, n), axis, sizes, 0, group, None)


class StatReduction:
    """An in-flight mean of a captured statistic over the data-parallel group."""

    def __init__(self, tensor: torch.Tensor, group):
        self.tensor = tensor
        self.group = group
        self.size = dist.get_world_size(group)
        self.work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor.div_(self.size)


def reduce_stat_async(tensor: torch.Tensor, group) -> StatReduction | None:
    """Launch the data-parallel mean of a statistic (Dobb's only communication); None if no group."""
    if group is None:
        return None
    return StatReduction(tensor, group)


def all_reduce_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
