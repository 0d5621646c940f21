"""The decisions every rank takes together before a Dobb step changes any state.

One pass of collectives, issued identically on every rank whatever its data: the statistics of
every matrix due for a refresh (token-weighted sums; zero with zero weight where a layer did not run
on this rank) and the finiteness flags of all gradients, folded into a statistic reduction over the
same ranks when there is one. Raising here leaves every weight and state untouched. A mixin of
``dobb.Dobb`` (which owns ``_layouts``, ``_hooks``, ``_is_refresh``, ``_reduced`` and ``_idle``).
"""
from __future__ import annotations

import itertools

import torch

from ._base import _name_of
from ._dtensor import to_local
from .collectives import SumBucket, group_ranks
from .experts import ExpertLayout

HOOK_SOURCES = ("activation", "output_grad")


class StepDecisions:
    def _prepare_step(self) -> None:
        """Everything the ranks must decide together before any state changes, in one pass of
        collectives issued identically on every rank: the statistics of every parameter due for a
        refresh (token-weighted sums, zero with zero weight where a layer did not run here) and the
        finiteness flags of all gradients (folded into a statistic reduction over the same ranks)."""
        params = [p for g in self.param_groups for p in g["params"]]
        self._idle.clear()
        buckets: dict[tuple, SumBucket] = {}
        slots = []  # (param, layout, bucket, index of sums, index of count, local row count, destination)
        for g in self._dobb_groups():
            if g["source"] not in HOOK_SOURCES or self._hooks is None:
                continue
            dtype = torch.promote_types(g["stat_dtype"], torch.float32)
            for p in g["params"]:
                layout = self._layouts[p]
                if p.grad is None and layout.stat_group is not None:
                    # a shared statistic is shared state: its schedule and collectives cannot depend on
                    # whether this rank got a gradient (no gradient sync, a layer unused here only)
                    self._idle.append((g, p))
                elif p.grad is None:
                    continue
                if not self._is_refresh(p, g):
                    continue
                sides = [(layout, self._hooks.pending, self._reduced)]
                if p in self._out_layouts:  # side="both": the output-gradient statistic joins the same buckets
                    sides.append((self._out_layouts[p], self._hooks.pending_out, self._reduced_out))
                for lay, pendings, dest in sides:
                    pending = pendings.get(p)
                    device = lay.local(p).device
                    sums = pending.sums if pending is not None else torch.zeros(lay.capture_shape, dtype=dtype, device=device)
                    # a stack counts rows per expert of its span (a list), a matrix in one int
                    n = pending.count if pending is not None else (
                        [0] * lay.span_count if isinstance(lay, ExpertLayout) else 0)
                    count = torch.tensor(n if isinstance(n, list) else [n], dtype=dtype, device=device)
                    key = (id(lay.stat_group), dtype, device)
                    bucket = buckets.get(key)
                    if bucket is None:
                        bucket = buckets[key] = SumBucket(lay.stat_group, dtype, device)
                    slots.append((p, lay, bucket, bucket.add(sums), bucket.add(count), n, dest))
        flags = self._local_nonfinite(params) if self.check_finite else None
        flag_slot = None
        if flags is not None and self._step_group is not None:
            ranks = group_ranks(self._step_group)
            shared = next((b for b in buckets.values() if b.group is not None and group_ranks(b.group) == ranks), None)
            if shared is None:
                shared = SumBucket(self._step_group, flags.dtype, flags.device)
                buckets[("finite",)] = shared
            flag_slot = (shared, shared.add(flags))
        reduced = {id(b): b.reduce("finite" if k == ("finite",) else "stat") for k, b in buckets.items()}
        if flags is not None:
            if flag_slot is not None:
                flags = reduced[id(flag_slot[0])][flag_slot[1]]
            bad = [i for i, v in enumerate(flags.tolist()) if v > 0]
            if bad:
                self._rearm()  # the next forward passes capture afresh
                self._raise_nonfinite(params[bad[0]], int(flags[bad[0]].item()))
        counts = [reduced[id(b)][c] for _, _, b, _, c, _, _ in slots]
        if all(b.group is None for _, _, b, _, _, _, _ in slots):
            # no statistic group (one process): the totals are this rank's row counts, known on the
            # host, so a step with check_finite=False reads no tensor value
            totals = [n for *_, n, _ in slots]
        elif self.check_finite or any(self._unseen(p) for p, *_ in slots):
            # host read: a first statistic needs it (schedule, exact eigh); with the flag read, exact captures
            flat = torch.cat(counts).tolist() if counts else []
            ends = [0, *itertools.accumulate(c.numel() for c in counts)]
            totals = [flat[a:z] if isinstance(slot[1], ExpertLayout) else flat[a]
                      for slot, a, z in zip(slots, ends, ends[1:])]
        else:  # every due matrix has a statistic: keep-or-update is decided on the device
            totals = [None] * len(slots)
        self._reduced.clear()
        self._reduced_out.clear()
        for (p, layout, b, i, _, _, dest), total, count in zip(slots, totals, counts):
            sums = reduced[id(b)][i]
            if total is None:  # (means, has-rows on the device): rows nowhere keep statistic and basis
                dest[p] = (layout.mean_on_device(sums, count) if isinstance(layout, ExpertLayout)
                           else (layout.stat_to_state(sums / count.clamp_min(1)), count > 0))
            elif isinstance(layout, ExpertLayout):  # (local means, has-rows per span expert), or None
                dest[p] = layout.mean(sums, total)
            else:  # None: no rank saw a token for this layer, keep its statistic and basis
                dest[p] = None if total == 0 else layout.stat_to_state(sums / total)

    @staticmethod
    def _local_nonfinite(params: list[torch.Tensor]) -> torch.Tensor | None:
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

    def _raise_nonfinite(self, p: torch.Tensor, ranks: int) -> None:
        index = next(i for g in self.param_groups for i, q in enumerate(g["params"]) if q is p)
        where = "" if self._step_group is None else f" on {ranks} of {len(group_ranks(self._step_group))} ranks"
        raise ValueError(
            f"non-finite gradient (NaN or Inf) in {_name_of(p, self._param_names, index)}{where}; no weight or "
            f"optimizer state was changed on any rank (pass check_finite=False to skip this check)"
        )
