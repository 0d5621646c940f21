"""Dobb's plan and schedule: one ``Plan`` per matrix, the one refresh rule ``due`` and the one
capture rule ``captured``.

A ``Plan`` holds a matrix's sides (their layouts and state keys), its refresh period and offset and
its capture period; the optimizer (``core.optimizer.Dobb``) builds one per matrix from the param
groups and rebuilds it after a load or a copy. Which matrices refresh is ``due``; which capture and
fold a statistic is ``captured`` (every refresh step and, with ``capture_every = k``, every ``k``-th
step too), read both by the capture hooks' arming and by the statistic fold.

A matrix refreshes on its first step and then every ``period`` steps after its ``offset``. With
``refresh_width`` unset the period is ``refresh_every`` for every matrix; with ``refresh_width = w``
a matrix whose widest block is ``s`` wide refreshes every ``refresh_every * max(1, round(s / w))``
steps: a refresh costs ``O(s^3)`` per block, so the wide blocks (an MLP's wide input block at B=1)
that dominate the refresh step refresh less often. Both rules read global (rank-invariant) block
sizes only, so every rank of a sharded run picks the same periods and offsets (the refresh steps, and
with them the collectives, must agree). The capture steps read the step count and the plan only, so
they are rank-invariant too. ``captures`` is the one form of a state's capture counts (the captures
folded on refresh steps; a capture-only step does not count): one list per side, one count per
matrix of the captured span (a checkpoint keeps a one-sided matrix's single count as an int:
``saved_captures``).

The two-sided layouts (``side="both"``: one layout per axis, each cut at its own shard boundaries)
are part of a plan: ``two_sided_layouts``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..attention_heads import head_blocks
from ..placement import follow_layout
from .statistics import fold_side, gram_statistic, shared_group

__all__ = ["Side", "Plan", "due", "captured", "plans_of", "captures", "saved_captures", "refresh_period", "cycle",
           "stagger_offsets", "two_sided_layouts", "ns_rows", "schedule_of", "queue_refresh", "MAX_CYCLE"]

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
    refresh ``period`` and stagger ``offset`` (``0 <= offset < period``), and ``capture_every``
    (None: capture on refresh steps only; ``k``: also on every step whose count is a multiple of ``k``)."""

    sides: tuple[Side, ...]
    period: int
    offset: int = 0
    # norm="muon": the layout of the out_blocks row blocks that Newton-Schulz orthogonalises (None otherwise)
    ns_rows: Any = None
    capture_every: int | None = None

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


def captured(step: int, captures: list[list[int]], plan: Plan, refresh: list[bool] | None = None) -> list[bool]:
    """Per matrix of the captured span: whether the step numbered ``step`` captures and folds its
    statistic: every refresh step (``due``; ``refresh``: its result, if already computed) and, with
    ``plan.capture_every = k``, every step with ``step % k == 0`` (a capture-only step: the EMA fold,
    no new basis). From the step count and the plan only: the same on every rank. With
    ``capture_every=None`` this is ``due``."""
    now = due(step, captures, plan) if refresh is None else refresh
    if plan.capture_every is None or step % plan.capture_every:
        return now
    return [True] * len(now)


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


def refresh_period(refresh_every: int, refresh_width: int | None, widest: int) -> int:
    """The refresh period of a matrix whose widest block (global size, any side) is ``widest``.
    ``round`` is Python's (half to even): 2.5 -> 2, 3.5 -> 4."""
    if refresh_width is None:
        return refresh_every
    return refresh_every * max(1, round(widest / refresh_width))


def schedule_of(sides: list[tuple[Side, ...]], group: dict) -> tuple[list[int], list[int]]:
    """The refresh periods and offsets of the matrices of ``group`` whose sides are ``sides``, from
    global (rank-invariant) block sizes: every rank must pick the same periods and offsets."""
    periods = [refresh_period(group["refresh_every"], group["refresh_width"],
                              max(s for side in ss for s in side.layout.global_sizes)) for ss in sides]
    offsets = [0] * len(sides)
    if group["stagger"]:  # a stack refreshes all its matrices together
        works = [sum(sum(s**3 for s in side.layout.global_sizes) * side.layout.stack_size for side in ss)
                 for ss in sides]
        offsets = stagger_offsets(works, periods)
    return periods, offsets


def plans_of(sides: list[tuple[Side, ...]], group: dict, rows: list) -> list[Plan]:
    """The plans of the matrices of ``group`` (``sides``; ``rows``: their ``ns_rows``): periods and
    offsets (``schedule_of``) and the group's ``capture_every``."""
    periods, offsets = schedule_of(sides, group)
    every = group.get("capture_every")
    return [Plan(ss, period, offset, r, every) for ss, period, offset, r in zip(sides, periods, offsets, rows)]


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


# ------------------------------------------------------------------ two-sided layouts
# Shard-local by construction: each side's blocks come from ``placement.layout_for`` on its own axis,
# which cuts the axis at its shard boundaries (FSDP2 ``Shard(0)`` rows, tensor parallel
# ``Shard(0)``/``Shard(1)``), so every block pair is either wholly on a rank or wholly absent, and the
# two-sided step issues no collective. A placement that would split a block (a strided shard, one axis
# over two mesh dims, a block count that does not divide the non-empty shards) is the ``ValueError``
# of that layout, prefixed here with the way out.
_WAY_OUT = ("side='both' blocks both axes, so each must be cut at its own shard boundaries: shard each axis "
            "with a plain Shard over at most one mesh dim and give each side a block count that divides its "
            "non-empty shards (or use side='input' / side='output')")


def block_counts(p: Tensor, group: dict, name: str | None) -> tuple[int, int]:
    """``(blocks, out_blocks)`` of one matrix (``name``: its parameter name, read with ``heads``).

    Left ``None`` (the default) each follows the placement of the axis it blocks
    (``placement.follow_layout``): one block per shard of an axis a DTensor's placement cuts, 1
    otherwise (an unsharded model: the former defaults). ``blocks`` blocks the input axis (the
    output axis for ``side="output"``), ``out_blocks`` the output axis (``side="both"``,
    ``norm="muon"``); a transposed weight's input axis is its dim 0. Then ``heads`` sets the
    per-head counts of attention matrices (``dobb.attention_heads``, on the logical ``(out, in)`` shape)."""
    blocks, out_blocks = group["blocks"], group["out_blocks"]
    if p.dim() == 2:
        in_axis, out_axis = (0, 1) if group["transposed"] else (1, 0)
        blocks = follow_layout(blocks, p, out_axis if group["side"] == "output" else in_axis, 1)
        out_blocks = follow_layout(out_blocks, p, out_axis, 1)
    blocks, out_blocks = 1 if blocks is None else blocks, 1 if out_blocks is None else out_blocks
    shape = tuple(p.shape[-2:])
    if group["transposed"]:
        shape = shape[::-1]  # the logical (out, in) matrix of a weight stored (in, out)
    return head_blocks(name, shape, group["heads"], blocks, out_blocks, group["transposed"])


def two_sided_layouts(p: Tensor, group: dict, stat_group, transposed: bool, layout_for):
    """``(input-side layout, output-side layout)`` of a matrix or expert stack; a ``ValueError`` with
    the way out when either axis cannot be blocked locally. ``layout_for(p, side, blocks,
    stat_group)`` makes one side's layout (``placement.layout_for``, ``experts.expert_layout``)."""
    in_side, out_side = ("output", "input") if transposed else ("input", "output")
    try:
        lin = layout_for(p, in_side, group["blocks"], stat_group)
    except ValueError as exc:
        raise ValueError(f"input side: {exc}. {_WAY_OUT}") from None
    try:
        lout = layout_for(p, out_side, group["out_blocks"], stat_group)
    except ValueError as exc:
        raise ValueError(f"output side: {str(exc).replace('blocks=', 'out_blocks=', 1)}. {_WAY_OUT}") from None
    return lin, lout


def ns_rows(p: Tensor, group: dict, out_blocks: int, name: str, layout_for):
    """``norm="muon"``: the layout of ``p``'s ``out_blocks`` row blocks (cut at shard boundaries, by
    ``layout_for``: ``placement.layout_for``), which must hold whole rows on this rank (a ``ValueError``
    naming ``name`` otherwise); None for other norms."""
    if group["norm"] != "muon":
        return None
    try:
        # the output axis: dim 0, or dim 1 of a transposed (in, out) weight
        rows = layout_for(p, "input" if group["transposed"] else "output", out_blocks, None)
    except ValueError as exc:
        raise ValueError(f"{name}: norm='muon' row blocks: {str(exc).replace('blocks=', 'out_blocks=', 1)}") from None
    other = 1 - rows.blocked_axis  # the input axis: each rank must hold all of it
    if rows.local_shape[other] != rows.shape[other]:
        raise ValueError(f"{name}: norm='muon' orthogonalises row blocks on the "
                         f"rank that holds them, so each rank needs whole rows (the input axis unsharded: "
                         f"FSDP2 Shard(0) of an (out, in) weight); this rank holds {rows.local_shape[other]} of "
                         f"{rows.shape[other]} entries of the input axis")
    return rows


# ------------------------------------------------------------------ the refresh queue
def queue_refresh(group: dict, params: list[Tensor], grads: list, states: list[dict], plans: list[Plan],
                  agreed: tuple[dict, ...]) -> tuple[list, list]:
    """Fold the new statistics of ``params`` (their ``states`` and ``plans``; ``agreed``: the statistics
    agreed in ``Dobb._prepare_step``, ``[side][param]``, or their gradient Gram) into their EMAs where
    the step captures (``captured``) and queue the blocks that take a new basis (``due``): ``(A, Q0,
    exact, put)`` requests and, per request, the group of ranks that hold it identically
    (``statistics.shared_group``)."""
    requests: list[tuple] = []  # (A blocks, Q blocks, exact, put)
    shared: list = []
    dtype = torch.promote_types(group["stat_dtype"], torch.float32)
    lerps: list = []  # the plain EMAs of 2-D matrices, folded by one foreach lerp below
    for p, g, st, plan in zip(params, grads, states, plans):
        now = due(st["step"], st["captures"], plan)
        fold = captured(st["step"], st["captures"], plan, now)  # ``now``, or all on a capture step
        # new lists, not the state's in place: a state_dict taken before keeps its counts
        st["captures"] = [list(side) for side in st["captures"]]
        for i, (side, counts) in enumerate(zip(plan.sides, st["captures"])):
            new = (gram_statistic(g, side.layout, dtype) if group["source"] == "grad_gram"
                   else agreed[i].get(p))
            if new is not None:
                fold_side(new, layout=side.layout, stat=st[side.stat], basis=st[side.basis], counts=counts,
                          due=fold, refresh=now, stat_decay=group["stat_decay"], eigh=group["basis"] == "eigh",
                          eigh_every=group["eigh_every"], init_eigh=group["init_basis"] == "eigh",
                          requests=requests, lerps=lerps)
                shared += [shared_group(side.layout)] * (len(requests) - len(shared))
    if lerps:  # before the solve reads the statistics (the requests hold views of them)
        torch._foreach_lerp_(*map(list, zip(*lerps)), 1.0 - group["stat_decay"])
    return requests, shared
