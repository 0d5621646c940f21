"""DDP and FSDP2 (2 CPU processes, gloo) against one process; resume under both is exact.

One ``torchrun`` launch runs every case (tests/bench/training/dist_worker.py) to keep the cost to one
process-group start-up. DDP/FSDP sum gradients in a different order than one process, so those
comparisons allow float32 round-off for AdamW; Dobb takes the sign of projected coefficients
(in a bf16 basis), so round-off flips a few near-zero signs and its tolerance is wider -- the
DDP replica check (bitwise-equal parameters on both ranks) is what catches rank-local state.
Resumed-vs-uninterrupted within one layout must be exact.
"""
import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dobb_bench.training.commands_train import make_optimizer
from dobb_bench.training.model import ModelConfig
from dobb_bench.training.train import TrainConfig, run_training

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _ranks
from _ranks import PlatformExitAbort, run_ranks  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")
TOL = {"adamw": 1e-5, "dobb": 3e-3}  # relative, per loss value


@pytest.mark.slow
def test_ddp_and_fsdp_match_single_process(tmp_path, text_dir, cache_dir, corpus):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), str(text_dir), str(cache_dir), str(tmp_path)]
    run_ranks(cmd, tmp_path, 2, env=env, timeout=300)  # a real failure raises; an abort at exit warns
    curves = json.loads((tmp_path / "curves.json").read_text())
    sys.path.insert(0, str(WORKER.parent))
    try:
        from .dist_worker import SPECS
    finally:
        sys.path.pop(0)
    model_cfg = ModelConfig(layers=2, width=32, heads=2, seq_len=32)
    cfg = TrainConfig(steps=6, batch_size=4, eval_every=3, eval_seqs=8, warmup=2)
    for name, hp in SPECS.items():
        single = run_training(model_cfg, cfg, corpus, functools.partial(make_optimizer, name, hp, 3e-3, 0.1))
        for mode in ("ddp", "fsdp"):
            got = curves[f"{name}-{mode}"]
            assert got["train"] == pytest.approx(single["train_losses"], rel=TOL[name]), (name, mode)
            assert got["val"] == pytest.approx([e["val_loss"] for e in single["evals"]], rel=TOL[name]), (name, mode)
            assert curves[f"{name}-{mode}-resumed"] == got, (name, mode)  # exact
        assert curves[f"{name}-ddp-replicas-equal"] is True, name


def _train_cmd(text_dir, cache_dir, out):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "dobb_bench.cli", "train", "--optimizer", "dobb", "--hp", "blocks=2", "--hp", "refresh_every=2",
            "--dist", "fsdp", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32",
            "--steps", "8", "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "8",
            "--checkpoint-every", "2", "--data", str(text_dir), "--cache-dir", str(cache_dir),
            "--val-fraction", "0.2", "--no-progress", "--out", str(out)]


def _has_final(out) -> bool:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return bool(lines) and json.loads(lines[-1]).get("type") == "final"


def _final(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["type"] == "final"
    return lines[-1]["train_losses"], [r["val_loss"] for r in lines[:-1]]


@pytest.mark.slow
def test_fsdp_sigkilled_rank_resumes_on_the_uninterrupted_curve(tmp_path, text_dir, cache_dir):
    """Issue 15.5: one rank SIGKILLed mid-run, or mid-save; rerunning the same command resumes
    from the last complete distributed checkpoint and ends on exactly the uninterrupted curve."""
    from dobb_bench.training.train import CKPT_DIR, COMPLETE, FAULT_ENV

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(FAULT_ENV, None)

    def launch(out, fault=None):
        e = {**env, **({FAULT_ENV: fault} if fault else {})}
        proc = subprocess.run(_train_cmd(text_dir, cache_dir, out), env=e, capture_output=True, text=True,
                              timeout=300)
        if fault is None and proc.returncode != 0 and _has_final(out):
            # the record is written: a non-zero status can only have come at exit
            warnings.warn(PlatformExitAbort(f"train --dist fsdp exited {proc.returncode} after writing its final "
                                            f"record: a platform abort at exit, not a failure"))
            return subprocess.CompletedProcess(proc.args, 0, proc.stdout, proc.stderr)
        return proc

    full = launch(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    reference = _final(tmp_path / "full")

    cut = tmp_path / "killed"
    killed = launch(cut, fault="1:step:5")  # rank 1 dies after step 5; last checkpoint at step 4
    assert killed.returncode != 0
    assert (cut / CKPT_DIR / COMPLETE).read_text() == "4"
    resumed = launch(cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _final(cut) == reference  # exact

    cut = tmp_path / "killed-in-save"
    killed = launch(cut, fault="0:save:2")  # rank 0 dies in its 2nd save (step 4), shards written
    assert killed.returncode != 0
    assert (cut / (CKPT_DIR + ".tmp")).exists() and not (cut / (CKPT_DIR + ".tmp") / COMPLETE).exists()
    assert (cut / CKPT_DIR / COMPLETE).read_text() == "2"  # the half-written save never loads
    resumed = launch(cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _final(cut) == reference
