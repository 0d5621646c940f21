"""dobb_bench.training.config: the lr schedule against hand-computed values, and settings refused
with a ValueError that says why."""
from dataclasses import replace

import pytest

from dobb_bench.training.config import TrainConfig, lr_factor


def test_lr_schedule():
    cfg = TrainConfig(steps=101, warmup=10, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # cosine midpoint
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    lin = replace(cfg, schedule="linear")
    assert lr_factor(55, lin) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(77, replace(cfg, schedule="constant")) == 1.0
    assert TrainConfig(steps=200).warmup_steps == 10
    with pytest.raises(ValueError, match="divisible"):
        TrainConfig(batch_size=6, micro_batches=4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(steps=0), "must be positive"), (dict(schedule="step"), "unknown schedule 'step'"),
    (dict(dist="mpi"), "unknown dist 'mpi'"), (dict(min_lr_ratio=1.5), r"min_lr_ratio must be in \[0, 1\]"),
    (dict(eval_every=0), "eval_every must be positive"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)
