"""Second-moment capture: module hooks that feed Dobb's block statistics.

Activations are read by forward hooks, output gradients by tensor hooks that a forward hook puts
on the layer's output. A capture happens only when the optimizer has armed the parameter (the next
``step()`` refreshes it), the module is in training mode, grad mode is on (so ``torch.no_grad()``
and evaluation passes never capture), and the pass is not an activation-checkpoint recomputation
(a forward run while autograd is executing a backward graph; this covers non-reentrant
``torch.utils.checkpoint``, the recommended mode).

Hooks only add up local sums and row counts; no hook communicates. The data-parallel average is
taken in ``step()``, in parameter order, for every parameter due for a refresh whether or not its
layer ran on this rank (``Dobb._prepare_step``): a layer skipped on one rank (an MoE expert without
tokens, a conditional branch) cannot make the ranks issue different collectives.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import functional as F
from ._torch_private import current_graph_task_id
from .layout import MatrixLayout


def in_backward() -> bool:
    return current_graph_task_id() != -1


@dataclass
class PendingStat:
    """Captured sums for one parameter since the last ``step()``: ``sums`` over ``count`` rows,
    shaped like the captured span's row-stacked blocks. An expert stack keeps ``(E_span, k, s)``
    sums, a row count per expert, and ``taken`` (which experts recorded since the step)."""

    sums: torch.Tensor
    count: int | list[int]
    taken: list[bool] | None = None


class CaptureHooks:
    """Owns the hooks on ``model`` and the pending statistics of the armed parameters."""

    def __init__(self, model: nn.Module, params: dict[torch.Tensor, dict],
                 sides: Mapping[torch.Tensor, Sequence[MatrixLayout]]):
        owner: dict[int, nn.Module] = {}
        for module in model.modules():
            for p in module.parameters(recurse=False):
                owner.setdefault(id(p), module)
        self._module_params: dict[nn.Module, list[torch.Tensor]] = {}
        for p in params:
            module = owner.get(id(p))
            if module is None:
                raise ValueError(
                    f"a Dobb matrix of shape {tuple(p.shape)} is not owned by any layer of `model`; pass the "
                    f"model whose layers hold the optimized matrices, or use source='grad_gram' (no hooks)"
                )
            self._module_params.setdefault(module, []).append(p)
        self.groups = params  # param -> its param group (reads source/capture/stat_dtype live)
        # param -> the layout of each side: one, or (input, output) for side="both" with
        # source="activation", whose output-gradient sums go to ``pending_out`` (the input side's
        # activation sums to ``pending``)
        self.sides = sides
        self.armed: set[torch.Tensor] = set()
        self.paused = 0  # > 0 inside Dobb.capture_paused()
        self.pending: dict[torch.Tensor, PendingStat] = {}
        self.pending_out: dict[torch.Tensor, PendingStat] = {}
        # A module with ``dobb_capture = False`` gets no hook: its weights' statistics come only from
        # ``Dobb.capture`` (a layer whose first input is not the weight's input, e.g. routed experts).
        self.handles = [m.register_forward_hook(self._forward_hook) for m in self._module_params
                        if getattr(m, "dobb_capture", True)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ hooks
    def _forward_hook(self, module: nn.Module, args, output) -> None:
        if not self.armed or self.paused or not module.training or not torch.is_grad_enabled() or in_backward():
            return
        for p in self._module_params[module]:
            if p not in self.armed or self.sides[p][0].routed:
                continue  # an expert stack's rows are routed: only Dobb.capture knows them
            group = self.groups[p]
            if group["capture"] == "first":
                self.armed.discard(p)
            if group["source"] == "activation":
                self._accumulate(p, args[0].detach(), group)
            out_side = group["source"] == "activation" and len(self.sides[p]) == 2
            if (group["source"] == "output_grad" or out_side) and isinstance(output, torch.Tensor) \
                    and output.requires_grad:
                output.register_hook(functools.partial(self._grad_hook, p, out_side))

    def capture(self, p: torch.Tensor, features: torch.Tensor) -> bool:
        """``Dobb.capture``: the forward hook's decision and accumulation for given features."""
        if p not in self.armed or self.paused or not torch.is_grad_enabled() or in_backward():
            return False
        group = self.groups[p]
        if group["capture"] == "first":
            self.armed.discard(p)
        self._accumulate(p, features.detach(), group)
        return True

    def capture_experts(self, p: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> bool:
        """``Dobb.capture`` for an expert stack: ``parts`` are ``(expert, rows)``. Each expert's rows
        add to its own sums and count; with ``capture="first"`` an expert records only its first
        non-empty rows after a step. Experts outside this rank's captured span are skipped."""
        if p not in self.armed or self.paused or not torch.is_grad_enabled() or in_backward():
            return False
        group, layout = self.groups[p], self.sides[p][0]
        dtype = torch.promote_types(group["stat_dtype"], torch.float32)
        pending = self.pending.get(p)
        if pending is None:
            device = layout.local(p).device
            pending = self.pending[p] = PendingStat(torch.zeros(layout.capture_shape, dtype=dtype, device=device),
                                                    [0] * layout.span_count, [False] * layout.span_count)
        recorded = False
        for e, x in parts:
            j = e - layout.span_start
            x = layout.capture_features(x.detach())
            if not 0 <= j < layout.span_count or math.prod(x.shape[:-1]) == 0:
                continue
            if group["capture"] == "first" and pending.taken[j]:
                continue
            sums, count = F.second_moment_blocks(x, layout.local_sizes, dtype)
            pending.sums[j].add_(sums)
            pending.count[j] += count
            pending.taken[j] = recorded = True
        return recorded

    def _grad_hook(self, p: torch.Tensor, out_side: bool, grad: torch.Tensor) -> None:
        # Data parallelism averages gradients over the P ranks of the statistic's group (DDP/FSDP:
        # each rank's loss is a mean over its own rows), so the output gradient that forms the
        # averaged weight gradient is grad / P. Scaling by it keeps the statistic independent of
        # how many ranks share the batch, so a checkpoint resumed at another world size continues
        # the same EMA (the basis itself is scale-invariant).
        grad = grad.detach()
        layout = self.sides[p][1 if out_side else 0]
        group = layout.stat_group
        if group is not None and dist.get_world_size(group) > 1:
            grad = grad / dist.get_world_size(group)
        self._accumulate(p, grad, self.groups[p], out_side)

    def _accumulate(self, p: torch.Tensor, feats: torch.Tensor, group: dict, out_side: bool = False) -> None:
        layout = self.sides[p][1 if out_side else 0]
        pending = self.pending_out if out_side else self.pending
        # The span is the local blocks, or the whole axis when its shards are spread over the
        # data-parallel ranks (see MatrixLayout.span_sizes); stat_to_state() cuts it to the local rows.
        feats = layout.capture_features(feats)
        sizes = layout.capture_sizes
        # Accumulate in fp32 at least (fp64 when the statistic is kept in fp64).
        dtype = torch.promote_types(group["stat_dtype"], torch.float32)
        if sizes:
            sums, count = F.second_moment_blocks(feats, sizes, dtype)
        else:  # an empty shard: nothing to sum, but its rows count towards the token-weighted mean
            sums, count = feats.new_zeros(0, layout.state_cols, dtype=dtype), math.prod(feats.shape[:-1])
        prev = pending.get(p)
        if prev is None:
            pending[p] = PendingStat(sums, count)
        else:
            prev.sums.add_(sums)
            prev.count += count
