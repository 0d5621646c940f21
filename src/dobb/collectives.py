"""Every collective the library issues on its own behalf (not those of FSDP, DTensor or Dion's
partial sums), each tagged with ``collective_kind`` so a meter can tell them apart.

Tags: ``"stat"`` for the data-parallel statistic mean, ``"norm"`` for ell2 column norms and
gradient-Gram partial sums. The tag is a context variable read by ``dobb.meter``; this module does
not know the meter exists.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

__all__ = ["collective_kind", "current_kind", "StatReduction", "reduce_stat_async", "all_reduce_sum_"]

_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("dobb_collective_kind", default=None)


@contextlib.contextmanager
def collective_kind(kind: str):
    """Tag the collectives issued inside the block."""
    token = _KIND.set(kind)
    try:
        yield
    finally:
        _KIND.reset(token)


def current_kind() -> str | None:
    """The tag of the enclosing ``collective_kind`` block, or None."""
    return _KIND.get()


class StatReduction:
    """An in-flight mean of a captured statistic over the data-parallel group."""

    def __init__(self, tensor: torch.Tensor, group):
        self.tensor = tensor
        self.size = dist.get_world_size(group)
        with collective_kind("stat"):
            self.work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor.div_(self.size)


def reduce_stat_async(tensor: torch.Tensor, group) -> StatReduction | None:
    """Launch the data-parallel mean of a statistic (Dobb's only communication); None if no group."""
    if group is None or tensor.numel() == 0:  # every rank of the group holds the same (empty) span
        return None
    return StatReduction(tensor, group)


def all_reduce_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` (ell2 column norms, gradient-Gram partial sums); no-op without a group."""
    if group is not None:
        with collective_kind("norm"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
