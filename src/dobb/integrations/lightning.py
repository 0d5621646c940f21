"""Lightning: Dobb under automatic optimization.

A ``LightningModule`` is an ``nn.Module``, so the optimizer is built from the module itself (its
layers carry Dobb's capture hooks)::

    class LitModel(pl.LightningModule):
        def configure_optimizers(self):
            return dobb.integrations.lightning.configure_optimizers(
                self, "dobb", lr=5e-3, weight_decay=0.1, warmup_steps=10, blocks=4)

Lightning calls ``optimizer.step(closure)``, where the closure runs ``training_step`` and
``backward``. Every optimizer of this package evaluates the closure once, inside ``step()``, with
grad enabled; the capture hooks were armed at the end of the previous step, so the closure's
forward pass is the one captured (one capture per closure evaluation, as in a hand-written loop).
Checkpoints (``Trainer.fit(ckpt_path=...)``) restore the full optimizer state.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..factory import build_optimizer

__all__ = ["configure_optimizers"]


def configure_optimizers(module: nn.Module, name: str = "dobb", *, lr: float, weight_decay: float = 0.0,
                         warmup_steps: int = 0, **hparams: Any):
    """The value for ``LightningModule.configure_optimizers``.

    ``name`` and ``hparams`` as in ``dobb.build_optimizer`` (built on ``module``). With
    ``warmup_steps > 0`` a per-step linear warmup (``LambdaLR``) is attached, in Lightning's
    dictionary form; otherwise the optimizer alone is returned.
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    opt = build_optimizer(name, module, lr=lr, weight_decay=weight_decay, **hparams)
    if warmup_steps == 0:
        return opt
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup_steps))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
