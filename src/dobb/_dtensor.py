"""The one DTensor test and unwrap used across the package.

Why by type name and not ``isinstance``: importing ``torch.distributed.tensor`` takes seconds, and a
single-device user never needs it. Modules that build DTensors (``sharding``) import it themselves.
"""
from __future__ import annotations

import torch


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view sharing storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t
