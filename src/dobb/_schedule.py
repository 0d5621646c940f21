"""Dobb's per-matrix plan and refresh schedule, as plain rules.

``Plan``: what the step needs to know of one matrix parameter besides its state: its sides (the
layout of each statistic/basis side and the state keys it reads), its refresh period and its
stagger offset. It is derived from the param group and the parameter alone, built at set-up and
rebuilt (never copied or saved) after ``load_state_dict`` and copies; everything a checkpoint
needs is in the optimizer state. ``due`` is the one refresh rule: the capture hooks are armed by
it and the statistic fold reads it, so the two cannot disagree. ``captures`` is the one form of a
state's capture counts: one list per side, one count per matrix of the captured span (a checkpoint
keeps a one-sided matrix's single count as an int: ``saved_captures``).

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
from dataclasses import dataclass
from typing import Any

# Past this many steps in the common cycle of all periods, the stagger balances over the longest
# period instead (an approximation: a matrix is charged at its offsets within that window only).
# Real models have a few distinct widths (d, 4d), whose cycle is tiny; the cap only bounds the
# set-up time of a pathological mix of widths.
MAX_CYCLE = 4096


@dataclass(frozen=True, eq=False)
class Side:
    """One statistic/basis side of a matrix: its layout (``layout.MatrixLayout``) and the state keys
    of its statistic and bases."""

    layout: Any
    stat: str = "stat"
    basis: str = "basis"


@dataclass(frozen=True, eq=False)
class Plan:
    """One matrix parameter's plan: its ``sides`` (one, or input then output for ``side="both"``),
    refresh ``period`` and stagger ``offset`` (``0 <= offset < period``)."""

    sides: tuple[Side, ...]
    period: int
    offset: int = 0

    @property
    def layout(self):
        """The first side's layout (the one side, or the input side of ``side="both"``)."""
        return self.sides[0].layout

    @property
    def two_sided(self) -> bool:
        return len(self.sides) == 2

    def new_captures(self) -> list[list[int]]:
        """Capture counts before any capture: one zero per side and matrix of the captured span."""
        return [[0] * side.layout.stack_span for side in self.sides]


def due(step: int, captures: list[list[int]], plan: Plan) -> list[bool]:
    """Per matrix of the captured span: whether the step numbered ``step`` refreshes it. The first
    step and every ``period``-th after the offset refresh; and, until a first statistic exists on
    every side (``captures``: counts per side, per matrix), every step does (a zero-lr step or a
    forward pass that skipped the layer must not leave the identity basis for a whole period)."""
    on = step == 0 or (step - plan.offset) % plan.period == 0
    return [on or 0 in member for member in zip(*captures)]


def captures(value, plan: Plan) -> list[list[int]]:
    """A state's capture counts in the one form (per side, per matrix of the captured span), from
    that form or a checkpoint's older ones: an int (a 2-D matrix), a flat list (one count per expert
    of a stack, or ``[input, output]`` of a two-sided matrix); ints given as tensors (distributed
    checkpoints) become ints. A count list that fits no side of ``plan`` is a ``ValueError``."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, (list, tuple)) for v in value):
        out = [[int(c) for c in side] for side in value]
    elif isinstance(value, (list, tuple)):
        flat = [int(c) for c in value]
        out = [[c] for c in flat] if plan.two_sided and plan.layout.stack_span == 1 else [flat]
    else:
        out = [[int(value)]]
    want = [side.layout.stack_span for side in plan.sides]
    if [len(side) for side in out] != want:
        raise ValueError(f"saved capture counts {value!r} do not fit this matrix: it has {len(want)} side(s) of "
                         f"{want[0]} matrix/matrices (saved with another side or expert stack?)")
    return out


def saved_captures(value: list[list[int]]):
    """The form a checkpoint stores ``captures`` in: a one-sided 2-D matrix's single count as an int
    (``torch.distributed.checkpoint``'s flattened optimizer state takes ints, not lists), every
    other matrix's counts as they are. ``captures`` reads it back."""
    return value[0][0] if len(value) == 1 and len(value[0]) == 1 else value


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
