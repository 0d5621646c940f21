"""Dobb's refresh schedule as plain integer rules: each matrix's period and its stagger offset.

A matrix refreshes on its first step and then every ``period`` steps after its ``offset``. With
``refresh_width`` unset the period is ``refresh_every`` for every matrix (the original schedule).
With ``refresh_width = w`` a matrix whose widest block is ``s`` wide refreshes every
``refresh_every * max(1, round(s / w))`` steps: a refresh costs ``O(s^3)`` per block, so the wide
blocks (an MLP's 4x-wide input block at B=1) that dominate the refresh step refresh less often.

Both rules read global (rank-invariant) block sizes only, so every rank of a sharded run picks the
same periods and offsets (the refresh steps, and with them the collectives, must agree).
"""
from __future__ import annotations

import math

# Past this many steps in the common cycle of all periods, the stagger balances over the longest
# period instead (an approximation: a matrix is charged at its offsets within that window only).
# Real models have a few distinct widths (d, 4d), whose cycle is tiny; the cap only bounds the
# set-up time of a pathological mix of widths.
MAX_CYCLE = 4096


def check_refresh_width(value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"refresh_width must be None or an integer >= 1 (block width per period step), got {value!r}")


def refresh_period(refresh_every: int, refresh_width: int | None, widest: int) -> int:
    """The refresh period of a matrix whose widest block (global size, any side) is ``widest``.
    ``round`` is Python's (half to even): 2.5 -> 2, 3.5 -> 4."""
    if refresh_width is None:
        return refresh_every
    return refresh_every * max(1, round(widest / refresh_width))


def cycle(periods) -> int:
    """The number of steps after which the whole schedule repeats (lcm of the periods; 1 if none)."""
    return math.lcm(1, *periods)


def stagger_offsets(works: list[int], periods: list[int]) -> list[int]:
    """One offset per matrix (``0 <= offset < period``) that spreads refresh work over the steps.

    Greedy, largest work first: each matrix takes the offset whose steps (within the common cycle
    of all periods) carry the least work so far (the least of their maximum, then of their sum,
    then the lowest offset). With equal periods ``T`` this is the original rule: the offset in
    ``range(T)`` with the least accumulated work, lowest first on ties. Deterministic given
    ``works`` and ``periods`` (stable sort), so rank-invariant when they are."""
    if len(works) != len(periods):
        raise ValueError(f"works and periods must have one entry per matrix, got {len(works)} and {len(periods)}")
    length = cycle(periods)
    if length > MAX_CYCLE:
        length = max(periods)
    cost = [0] * length
    offsets = [0] * len(works)
    for i in sorted(range(len(works)), key=lambda j: -works[j]):
        period = periods[i]
        best = min(range(period), key=lambda o: _load(cost, o, period) + (o,))
        for t in range(best, length, period):
            cost[t] += works[i]
        offsets[i] = best
    return offsets


def _load(cost: list[int], offset: int, period: int) -> tuple[int, int]:
    hits = cost[offset::period]
    return (max(hits), sum(hits)) if hits else (0, 0)
