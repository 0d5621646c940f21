"""Helpers shared by the baselines' rooms: the update protocol's names (``apply_protocol``, with the
shared loop in ``dobb._base``; ``update_scale``, with the math in ``dobb.functional``) and
forwarders to the DTensor gather/slice helpers of ``dobb.sharding``. (Their options and value rules
are declared with ``dobb._hparams``.)
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._base import apply_protocol  # noqa: F401  (the protocol's update, used by every baseline)
from ..layout import is_dtensor
from ..functional import update_scale  # noqa: F401  (the protocol's s, used by every baseline)


def upcast(x: Tensor) -> Tensor:
    """At least fp32 for the math (bf16/fp16 momentum), keeping fp64 as fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# The DTensor helpers live in ``dobb.sharding`` (the one module that knows placements); these
# forwarders import it only when a DTensor is actually present, so single-device use stays light.
def gather_full(local_t: Tensor, like: Tensor) -> Tensor:
    """Full matrix from this rank's shard (``dobb.sharding.gather_full``); plain tensors pass."""
    if not is_dtensor(like):
        return local_t
    from ..sharding import gather_full as impl

    return impl(local_t, like)


def local_slice(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of a full tensor (``dobb.sharding.local_slice``); plain tensors pass."""
    if not is_dtensor(like):
        return full
    from ..sharding import local_slice as impl

    return impl(full, like)


def rows_are_local(like: Tensor) -> bool:
    """Whether every rank holds whole rows (``dobb.sharding.rows_are_local``)."""
    if not is_dtensor(like):
        return True
    from ..sharding import rows_are_local as impl

    return impl(like)


def row_wise(fn, local_t: Tensor, like: Tensor) -> Tensor:
    """A row-wise function, locally when rows are whole (``dobb.sharding.row_wise``)."""
    if not is_dtensor(like):
        return fn(local_t)
    from ..sharding import row_wise as impl

    return impl(fn, local_t, like)
