"""Helpers shared by the baselines' rooms: the update protocol (``apply_protocol``, here;
``update_scale``, with the math in ``dobb.functional``) and
forwarders to the DTensor gather/slice helpers of ``dobb.sharding``. (Their options and value rules
are declared with ``dobb._hparams``.)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

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


def apply_protocol(params: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                   scales: Sequence[float], lr, weight_decay) -> None:
    """The baselines' update: ``W <- (1 - lr*wd) W`` on ``params``, then ``T <- T - lr*s*O`` on ``targets``.

    ``targets`` are the params or views of them (Block Muon adds each block with its own ``s``).
    Updates are cast to the target dtype (exact for bf16 -> fp32) and added with ``alpha`` as
    ``torch.optim.Muon`` does, grouped by scale so each group is one ``_foreach`` call.

    Why not one apply shared with Dobb's (``core.update.apply_directions``): the Muon family
    produces bf16 directions, and ``torch.optim.Muon`` adds them with ``param.add_(O, alpha=-lr*s)``,
    one rounding per entry. Scaling ``O`` first and adding afterwards rounds twice (in bf16 even), so
    the baselines add with ``alpha`` to stay bitwise equal to torch's Muon on CPU. It lives with the
    baselines' other shared helpers: Dobb never calls it.
    """
    if not params:
        return
    if isinstance(weight_decay, torch.Tensor) or weight_decay != 0:
        torch._foreach_mul_(list(params), 1.0 - lr * weight_decay)
    # grouped by comparing scales, never hashing them: a scale that varies with the step count (SOAP's
    # bias correction) stays symbolic in a compiled step instead of making a graph per value
    by_scale: list[tuple[float, list, list]] = []
    for t, u, s in zip(targets, updates, scales):
        entry = next((e for e in by_scale if e[0] == s), None)
        if entry is None:
            entry = (s, [], [])
            by_scale.append(entry)
        entry[1].append(t)
        entry[2].append(u if u.dtype == t.dtype else u.to(t.dtype))
    for s, ts, us in by_scale:
        if isinstance(lr, torch.Tensor):  # a tensor lr cannot be an ``alpha``
            torch._foreach_add_(ts, torch._foreach_mul(us, -lr * s))
        else:
            torch._foreach_add_(ts, us, alpha=-lr * s)
