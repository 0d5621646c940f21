"""Second-moment capture: module hooks that feed Dobb's block statistics.

Activations are read by forward hooks, output gradients by tensor hooks that a forward hook puts
on the layer's output. A capture happens only when the optimizer has armed the parameter (the next
``step()`` refreshes it), the module is in training mode, grad mode is on (so ``torch.no_grad()``
and evaluation passes never capture), and the pass is not an activation-checkpoint recomputation
(a forward run while autograd is executing a backward graph; this covers non-reentrant
``torch.utils.checkpoint``, the recommended mode).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from . import functional as F
from .distributed import MatrixLayout, StatReduction, all_reduce_sum_, reduce_stat_async


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class PendingStat:
    """Captured sums for one parameter since the last ``step()``."""

    sums: torch.Tensor
    count: int
    reduction: StatReduction | None = None

    def finish(self, group) -> torch.Tensor:
        """The (data-parallel averaged) second moment ``(k_local, s_max)``."""
        if self.reduction is not None:
            return self.reduction.wait()
        mean = self.sums / self.count
        pending = reduce_stat_async(mean, group)
        return mean if pending is None else pending.wait()


class CaptureHooks:
    """Owns the hooks on ``model`` and the pending statistics of the armed parameters."""

    def __init__(self, model: nn.Module, params: dict[torch.Tensor, dict], layouts: dict[torch.Tensor, MatrixLayout]):
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
        self.layouts = layouts
        self.armed: set[torch.Tensor] = set()
        self.pending: dict[torch.Tensor, PendingStat] = {}
        self.handles = [m.register_forward_hook(self._forward_hook) for m in self._module_params]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ hooks
    def _forward_hook(self, module: nn.Module, args, output) -> None:
        if not self.armed or not module.training or not torch.is_grad_enabled() or in_backward():
            return
        for p in self._module_params[module]:
            if p not in self.armed:
                continue
            group = self.groups[p]
            if group["capture"] == "first":
                self.armed.discard(p)
            if group["source"] == "activation":
                self._accumulate(p, args[0].detach(), group)
            elif isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(functools.partial(self._grad_hook, p))

    def _grad_hook(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        self._accumulate(p, grad.detach(), self.groups[p])

    def _accumulate(self, p: torch.Tensor, feats: torch.Tensor, group: dict) -> None:
        layout = self.layouts[p]
        feats = layout.local_features(feats)
        # Accumulate in fp32 at least (fp64 when the statistic is kept in fp64).
        dtype = torch.promote_types(group["stat_dtype"], torch.float32)
        sums, count = F.second_moment_blocks(feats, layout.local_sizes, dtype)
        prev = self.pending.get(p)
        if group["capture"] == "first":
            # Complete after one micro-batch: start the data-parallel mean now, so it overlaps
            # the rest of forward/backward; step() waits for it.
            mean = sums.div_(count)
            self.pending[p] = PendingStat(mean, 1, reduce_stat_async(mean, layout.stat_group))
        elif prev is None:
            self.pending[p] = PendingStat(sums, count)
        else:
            prev.sums.add_(sums)
            prev.count += count


def gram_statistic(grad_local: torch.Tensor, layout: MatrixLayout, dtype=torch.float32) -> torch.Tensor:
    """Gradient-Gram source: diagonal blocks of ``G^T G / m`` (input side) or ``G G^T / n`` (output).

    Rows of the Gram sum may be sharded (the other axis split across ranks): partial sums are
    added over ``layout.l2_group`` (the same ranks that share column norms).
    """
    g = grad_local if layout.blocked_axis == 1 else grad_local.transpose(0, 1)
    sums, _ = F.second_moment_blocks(g, layout.local_sizes, dtype)
    all_reduce_sum_(sums, layout.l2_group)
    return sums.div_(layout.rows)
