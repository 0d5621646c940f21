"""The one lr rule of the 20-tokens tables (``table:frontier-20`` and ``table:long-horizon-best``).

The rule (``choose``): the seed-0 best on the common windows; its close neighbours (one grid
step, worse by less than two standard errors of the window noise) through seeds 0+1; a tie there
through seed 2 at both lrs; the chosen lr bracketed. What it still waits on is named, never
filled in silently with the seed-0 best.

Why one module: issue 55 found the two tables choosing different lrs for one row (the one on the
seed-0 best, the other through seeds 0+1) and the frontier's rule falling back silently to the
seed-0 best where a close neighbour lacked its seed-1 run. Every table that shows a chosen lr at
this setting calls ``choose`` here; ``dobb-bench report --check`` fails when two tables' best lrs
for one row disagree (``dobb_bench.reports.claims``).
"""
from __future__ import annotations

import math
import statistics
from typing import NamedTuple

from dobb_bench.reports.tables import paired
from dobb_bench.studies.define import best_of, grid_index, grid_lr


def bf16(r: dict) -> bool:
    """A run made with bf16 products (its hparams name bfloat16): outside the 20-tokens protocol,
    whose runs have fp32 products; kept in the records, left out of the tables that choose lrs."""
    return "bfloat16" in str(r.get("hparams", {}))


NEIGHBOUR = 0.51  # |log2| of one grid step (a factor sqrt 2, 0.5) with a margin for the lrs' rounding


class Choice(NamedTuple):
    """A row's lr under the one rule: the lr (provisional while ``needs`` is not empty), whether it
    is at an edge of the seed-0 lrs run, the runs the rule still waits on as ``(lr, seed)`` (an edge
    waits on the next lr out at seed 0), and how it was decided."""
    lr: float | None
    edge: bool
    needs: tuple[tuple[float, int], ...]
    how: str

    @property
    def settled(self) -> bool:
        return self.lr is not None and not self.needs

    def cell(self) -> str:
        """The ``best lr`` cell: ``0.00354 (edge) (lr not settled: needs 0.005 seed 0)``."""
        if self.lr is None:
            return ""
        out = f"{self.lr:.3g}" + (" (edge)" if self.edge else "")
        if self.needs:
            out += " (lr not settled: needs " + ", ".join(f"{x:.3g} seed {sd}" for x, sd in self.needs) + ")"
        return out


def _within_window_noise(by_lr: dict, a: float, b: float, seeds) -> bool:
    """``a`` and ``b`` differ by less than two standard errors of the window noise: their gap, mean
    over ``seeds``, paired over the common windows' groups (the same windows at every seed)."""
    ga = [by_lr[a][sd].get("common_groups") for sd in seeds]
    gb = [by_lr[b][sd].get("common_groups") for sd in seeds]
    if any(not g for g in ga + gb):
        return False  # not re-evaluated by groups: not called close
    mean = lambda gs: [statistics.fmean(x) for x in zip(*gs)]
    got = paired(mean(ga), mean(gb))
    return got is not None and abs(got[0]) < 2 * got[1]


def _next_out(lrs: list[float], lr: float) -> float:
    """The grid lr (``define.grid_lr``) one step out from ``lr`` past the end of ``lrs`` it sits at."""
    step = 1 if lr == max(lrs) else -1
    try:
        return float(f"{grid_lr(grid_index(lr) + step):.4g}")
    except ValueError:  # off the grid: a factor sqrt 2
        return float(f"{lr * 2 ** (step / 2):.4g}")


def choose(by_lr: dict[float, dict[int, dict]]) -> Choice:
    """The one lr rule, for every row of every table that picks a 20-tokens lr (this table and
    ``table:long-horizon-best``):

    1. the seed-0 best on the common windows;
    2. its *close* neighbours: one grid step either side (a factor sqrt 2), worse at seed 0 by less
       than two standard errors of the window noise (paired over the window groups). Each close
       neighbour and the best need seed 1; while one lacks it the row is *not settled* (the seed-0
       best is shown, marked, never silently kept);
    3. with seed 1 at all of them, the lowest mean over seeds 0 and 1 wins; a candidate within the
       window noise of it on that mean (paired over the groups of both seeds) is a *tie*, decided by
       seed 2 at both lrs (the lowest mean over seeds 0, 1 and 2); not settled while seed 2 is
       missing at one of them;
    4. the chosen lr is at an *edge* when it is the lowest or the highest lr run at seed 0: then the
       next lr out is needed at seed 0 (and the row is not settled).
    """
    seed0 = sorted((lr, s[0]["common_val_loss"]) for lr, s in by_lr.items() if 0 in s)
    best, _ = best_of(seed0)
    if best is None:
        return Choice(None, False, (), "not run")
    lrs = [lr for lr, _ in seed0]
    close = [lr for lr in lrs if lr != best and abs(math.log2(lr / best)) < NEIGHBOUR
             and _within_window_noise(by_lr, lr, best, (0,))]
    needs: list[tuple[float, int]] = []
    lr, how = best, "seed-0 best"
    if close:
        cands = [best] + close
        needs += [(x, 1) for x in cands if 1 not in by_lr[x]]
        if not needs:
            mean01 = {x: statistics.fmean(by_lr[x][sd]["common_val_loss"] for sd in (0, 1)) for x in cands}
            lr, how = min(cands, key=mean01.get), "seeds 0+1"
            tied = [x for x in cands if x != lr and _within_window_noise(by_lr, x, lr, (0, 1))]
            if tied:
                group = [lr] + tied
                needs += [(x, 2) for x in group if 2 not in by_lr[x]]
                if not needs:
                    mean = {x: statistics.fmean(by_lr[x][sd]["common_val_loss"] for sd in (0, 1, 2)) for x in group}
                    lr, how = min(group, key=mean.get), "seed 2"
    edge = len(lrs) > 1 and lr in (lrs[0], lrs[-1]) or len(lrs) == 1
    if edge:
        needs.append((_next_out(lrs, lr), 0))
    return Choice(lr, edge, tuple(sorted(set(needs), key=lambda n: (n[1], n[0]))), how)
