"""The one DTensor test and unwrap used across the package (and the bench).

Why by type name and not ``isinstance``: importing ``torch.distributed.tensor`` takes seconds, and a
single-device user never needs it. Modules that build DTensors (``sharding``) import it themselves.
"""
from __future__ import annotations

import torch

__all__ = ["is_dtensor", "is_dtensor_type", "to_local"]


def is_dtensor_type(cls: type) -> bool:
    """Whether ``cls`` is ``torch.distributed.tensor.DTensor`` (a dispatch mode's ``types``)."""
    return cls.__name__ == "DTensor"


def is_dtensor(t) -> bool:
    return is_dtensor_type(type(t))


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view sharing storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t
