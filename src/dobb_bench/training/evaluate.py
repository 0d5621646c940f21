"""Validation: the mean loss over the fixed eval windows, on the weights the optimizer validates."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dobb_bench.training.data import Corpus, eval_batches
from dobb_bench.training.dist_env import DistEnv

__all__ = ["evaluate", "eval_weights", "weight_norms"]


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


@torch.no_grad()
def weight_norms(model) -> dict:
    """Each hidden matrix's RMS and top singular value, on the raw weights the optimizer moves.

    The hidden matrices are the 2-D weights inside ``model.blocks`` (what the matrix optimizers
    step); embeddings and the head are AdamW's. Under FSDP2 or TP the weights are DTensors: each
    is gathered with ``full_tensor()``, which every rank calls in the same (module) order. The top
    singular value is exact (``svdvals`` in float64): a few power iterations under-estimate it
    when the top two singular values are close, and the bench matrices are small enough for the
    exact value. Returns ``{"matrices": {name: [rms, top_sv]}, "max_rms": .., "max_top_sv": ..}``.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None and hasattr(model, "module"):  # DDP wrapper
        blocks = getattr(model.module, "blocks", None)
    out: dict[str, list[float]] = {}
    if blocks is None:
        return {"matrices": out, "max_rms": None, "max_top_sv": None}
    for name, p in blocks.named_parameters():
        if p.ndim != 2:
            continue
        w = p.full_tensor() if hasattr(p, "full_tensor") else p
        w = w.detach().to(torch.float64)
        if not bool(torch.isfinite(w).all()):  # a diverged run: no norm to report
            out[f"blocks.{name}"] = [None, None]
            continue
        out[f"blocks.{name}"] = [w.pow(2).mean().sqrt().item(), torch.linalg.svdvals(w)[0].item()]
    rms = [v[0] for v in out.values() if v[0] is not None]
    top = [v[1] for v in out.values() if v[1] is not None]
    return {"matrices": out, "max_rms": max(rms) if rms else None, "max_top_sv": max(top) if top else None}
