"""What every rank of a Dobb step decides together before the step changes any state.

One pass of collectives, issued identically on every rank whatever its data: the captured
statistics of every matrix due for a refresh (token-weighted sums; zero with zero weight where a
layer did not run on this rank), each as one ``layout.ReducedStat``, and the finiteness flags of
all gradients, folded into a statistic reduction over the same ranks when there is one. A
non-finite gradient is reported before any statistic is used, so raising on it leaves every weight
and state untouched on every rank. ``Dobb._prepare_step`` says what is due; this module reduces.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ._dtensor import to_local
from .capture import PendingStat
from .collectives import SumBucket, group_ranks
from .layout import MatrixLayout, ReducedStat

__all__ = ["DueStat", "Agreement", "agree", "local_nonfinite"]


@dataclass
class DueStat:
    """One side (0: the input side or the one side, 1: the output side of ``side="both"``) of one
    matrix due for a refresh, with what this rank captured for it (``capture.PendingStat``, or None)."""

    param: torch.Tensor
    side: int
    layout: MatrixLayout
    pending: PendingStat | None
    dtype: torch.dtype
    unseen: bool  # no statistic yet: the row counts must be read on the host (first capture, exact eigh)


@dataclass
class Agreement:
    """``stats[side][param]``: the agreed statistic of each due matrix side; ``nonfinite``: (index
    into the step's parameters, number of ranks) of the first gradient with a NaN/Inf, else None
    (then ``stats`` is empty: nothing may be used)."""

    stats: tuple[dict[torch.Tensor, ReducedStat], dict[torch.Tensor, ReducedStat]] = field(
        default_factory=lambda: ({}, {}))
    nonfinite: tuple[int, int] | None = None


def agree(due: list[DueStat], params: list[torch.Tensor], step_group, check_finite: bool) -> Agreement:
    """Reduce the statistics of ``due`` over their statistic groups and, with ``check_finite``, the
    finiteness flags of ``params``' gradients over ``step_group``, in one pass of collectives."""
    buckets: dict[tuple, SumBucket] = {}
    slots = []  # (due, bucket, index of sums, index of counts, local row counts)
    for d in due:
        lay = d.layout
        device = lay.local(d.param).device
        if d.pending is not None:
            count = d.pending.count  # rows: an int for a matrix, a list per expert for a stack
            sums, n = d.pending.sums, count if isinstance(count, list) else [count]
        else:
            sums, n = torch.zeros(lay.capture_shape, dtype=d.dtype, device=device), [0] * lay.stack_span
        key = (id(lay.stat_group), d.dtype, device)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = SumBucket(lay.stat_group, d.dtype, device)
        slots.append((d, bucket, bucket.add(sums), bucket.add(torch.tensor(n, dtype=d.dtype, device=device)), n))
    flags = local_nonfinite(params) if check_finite else None
    flag_slot = None
    if flags is not None and step_group is not None:
        ranks = group_ranks(step_group)
        shared = next((b for b in buckets.values() if b.group is not None and group_ranks(b.group) == ranks), None)
        if shared is None:
            shared = buckets[("finite",)] = SumBucket(step_group, flags.dtype, flags.device)
        flag_slot = (shared, shared.add(flags))
    reduced = {id(b): b.reduce("finite" if k == ("finite",) else "stat") for k, b in buckets.items()}
    if flags is not None:
        if flag_slot is not None:
            flags = reduced[id(flag_slot[0])][flag_slot[1]]
        bad = [i for i, v in enumerate(flags.tolist()) if v > 0]
        if bad:
            return Agreement(nonfinite=(bad[0], int(flags[bad[0]].item())))
    counts = [reduced[id(b)][c] for _, b, _, c, _ in slots]
    if all(b.group is None for _, b, _, _, _ in slots):
        # no statistic group (one process): the totals are this rank's row counts, known on the
        # host, so a step with check_finite=False reads no tensor value
        totals = [n for *_, n in slots]
    elif check_finite or any(d.unseen for d, *_ in slots):
        # host read: a first statistic needs it (schedule, exact eigh); with the flag read, exact captures
        flat = torch.cat(counts).tolist() if counts else []
        ends = [0, *itertools.accumulate(c.numel() for c in counts)]
        totals = [flat[a:z] for a, z in zip(ends, ends[1:])]
    else:  # every due matrix has a statistic: keep-or-update is decided on the device
        totals = [None] * len(slots)
    out = Agreement()
    for (d, b, i, _, _), total, count in zip(slots, totals, counts):
        sums = reduced[id(b)][i]
        out.stats[d.side][d.param] = (d.layout.mean_on_device(sums, count) if total is None
                                      else d.layout.mean(sums, total))
    return out


def local_nonfinite(params: list[torch.Tensor]) -> torch.Tensor | None:
    """1.0 for every parameter whose local gradient holds NaN/Inf, else 0.0 (no host sync).

    All zeros when this rank holds no gradient at all: the flags still take part in the step's
    collective, so a rank whose layers all went unused issues the same reductions as the others."""
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    if not params:
        return None
    if not with_grad:
        return torch.zeros(len(params), dtype=torch.float32, device=to_local(params[0]).device)
    norms = torch.stack(torch._foreach_norm([to_local(params[i].grad) for i in with_grad]))
    flags = torch.zeros(len(params), dtype=torch.float32, device=norms.device)
    flags[with_grad] = (~torch.isfinite(norms)).to(torch.float32)
    return flags
