"""Every private torch API this package uses, in one place.

torch may rename or change any of these between releases without notice; keeping them here makes
the list short to read and ``tests/test_torch_private.py`` checks each one (its presence, its
signature where we call it, and its behaviour where that is cheap), so a torch that changes one
fails there, by name, instead of somewhere inside a step.

- ``adamw_init_group``: ``torch.optim.AdamW._init_group``, called with a ``MatrixOptimizer`` as
  ``self``: the AdamW part of every matrix optimizer gathers its tensors, checks (sparse
  gradients) and ``has_complex`` flag exactly as ``torch.optim.AdamW`` does. It reads only
  ``self.state`` and the group's flags.
- ``fused_adamw_devices``: the device types with a fused AdamW kernel
  (``torch.optim.optimizer._get_fused_kernels_supported_devices``).
- ``current_graph_task_id``: ``torch._C._current_graph_task_id``, ``-1`` outside a backward pass
  (capture hooks tell a backward recomputation from the forward pass).
- ``HigherOrderOperator``: ``torch._ops.HigherOrderOperator`` (the payload meter's dispatch mode
  lets them through).
- ``TorchDispatchMode``, ``tree_flatten``: ``torch.utils._python_dispatch`` and
  ``torch.utils._pytree`` (the payload meter).
- ``torch_newton_schulz``: ``torch.optim._muon._zeropower_via_newtonschulz`` (torch >= 2.9;
  ``None`` before), which Muon calls for one bf16 matrix to match ``torch.optim.Muon`` bitwise.
- ``mkldnn_native``: ``torch.ops.mkldnn._is_mkldnn_bf16_supported``/``_fp16_supported``.
- ``strided_shard_type``: ``torch.distributed.tensor.placement_types._StridedShard``, the placement
  FSDP2 and TP give an axis sharded twice (``dobb.sharding`` reads it); imported when first asked
  for, so ``import dobb`` does not load ``torch.distributed.tensor``.
- ``disable_dynamo``: ``torch._disable_dynamo``, ``torch.compiler.disable`` that imports Dynamo when
  the function is first called, not when it is decorated (``torch.compiler.disable`` at class
  definition imports ``torch._dynamo``, which loads ``torch.distributed.tensor``: seconds on
  ``import dobb``); torch.optim decorates its own optimizers with it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:  # torch >= 2.9 ships Muon; older versions have no reference Newton-Schulz
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz
except ImportError:  # pragma: no cover - depends on the installed torch
    torch_newton_schulz = None

__all__ = ["adamw_init_group", "fused_adamw_devices", "current_graph_task_id", "HigherOrderOperator",
           "TorchDispatchMode", "tree_flatten", "torch_newton_schulz", "mkldnn_native", "strided_shard_type",
           "disable_dynamo"]

disable_dynamo = torch._disable_dynamo


def adamw_init_group(opt: torch.optim.Optimizer, group: dict[str, Any], params: list, grads: list,
                     exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list, state_steps: list) -> bool:
    """``torch.optim.AdamW._init_group(opt, group, ...)``: fills the lists from ``opt.state`` for
    the parameters of ``group`` that have a gradient; returns ``has_complex``."""
    return torch.optim.AdamW._init_group(opt, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                         state_steps)


def fused_adamw_devices() -> list[str]:
    """Device types on which ``torch.optim.AdamW(fused=True)`` runs."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def current_graph_task_id() -> int:
    """The id of the autograd graph task running now; ``-1`` outside a backward pass."""
    return torch._C._current_graph_task_id()


def mkldnn_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN reports native CPU products for ``dtype`` (bf16 or fp16); ``False`` for any
    other dtype or when this torch cannot tell."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return False


def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard`` (a ``Shard`` subclass)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard
