"""The training loop's settings (``TrainConfig``) and its learning-rate schedule (``lr_factor``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TrainConfig", "lr_factor"]


@dataclass
class TrainConfig:
    """Loop settings. ``batch_size`` is global sequences per step; warmup ``None`` = 5% of steps."""

    steps: int = 200
    seq_len: int | None = None  # training window; None = the model context
    batch_size: int = 16
    micro_batches: int = 1
    lr: float = 5e-3 * 2 ** -0.5  # the paper's grid point j = -1 [T8]
    weight_decay: float = 0.1
    warmup: int | None = None
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.0
    eval_every: int = 50
    eval_seqs: int = 64
    eval_batch_size: int = 32
    seed: int = 0
    # the held-out windows' seed; None: the run's seed (every seed then evaluates on windows of its
    # own, and a 64-window eval varies by about 0.05 nats from its windows alone, docs/results.md)
    eval_seed: int | None = None
    checkpoint_every: int = 0
    device: str = "auto"
    dist: str = "none"

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.micro_batches < 1 or self.eval_seqs < 1:
            raise ValueError("steps, batch_size, micro_batches and eval_seqs must be positive")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by micro_batches "
                             f"({self.micro_batches})")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown schedule {self.schedule!r}; choose cosine, linear or constant")
        if self.dist not in ("none", "ddp", "fsdp"):
            raise ValueError(f"unknown dist {self.dist!r}; choose none, ddp or fsdp")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.eval_seed is not None and (isinstance(self.eval_seed, bool) or not isinstance(self.eval_seed, int)
                                           or self.eval_seed < 0):
            raise ValueError(f"eval_seed must be None or a non-negative integer, got {self.eval_seed!r}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be positive, got {self.eval_every}")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, round(0.05 * self.steps))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the base lr at 0-based step ``step``: linear warmup, then decay to the floor.

    Warmup reaches 1 at step ``warmup - 1``; the decay starts at 1 on step ``warmup`` and reaches
    ``min_lr_ratio`` on the last step, ``steps - 1``.
    """
    warm = cfg.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    p = min(1.0, (step - warm) / max(1, cfg.steps - 1 - warm))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * p
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
