"""Validation: the mean loss over the fixed eval windows, on the weights the optimizer validates."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dobb_bench.training.data import Corpus, eval_batches
from dobb_bench.training.dist_env import DistEnv

__all__ = ["evaluate", "eval_weights"]


@torch.no_grad()
def evaluate(model, corpus: Corpus, offsets: np.ndarray, seq_len: int, batch_size: int,
             env: DistEnv) -> float:
    """Mean loss (nats/token) over this rank's slice of the fixed eval windows, averaged over ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for x, y in eval_batches(corpus.val, offsets, seq_len, batch_size):
        logits, _ = model(x.to(env.device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(env.device).flatten(), reduction="sum")
        total += torch.stack([loss.double(), torch.tensor(float(y.numel()), dtype=torch.float64,
                                                          device=env.device)])
    if env.world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


def eval_weights(optimizer) -> str:
    """Which weights validation uses: ``"iterate-ema"`` for an optimizer that keeps an average of
    its iterates and swaps it in with ``eval()``/``train()`` (SPlus), else ``"raw"``."""
    return getattr(optimizer, "eval_weights", "raw")
