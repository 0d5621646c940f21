"""Runs under ``torchrun --nproc_per_node=2`` for test_train_dist.py (not collected by pytest).

For each optimizer and each of DDP / FSDP2: one uninterrupted run, and one run stopped after 3
steps and resumed from its checkpoint; under DDP also whether the replicas ended identical. Rank 0 writes the curves as JSON to argv[3]/curves.json.
Every rank then ends with ``_ranks.finish_rank`` (barrier, a marker, ``destroy_process_group``).
"""
import functools
import json
import sys
from pathlib import Path

from dobb_bench.training.commands_train import make_optimizer
from dobb_bench.training.data import load_corpus
from dobb_bench.training.model import ModelConfig
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _ranks
from _ranks import finish_rank  # noqa: E402

from dobb_bench.training.train import Run, TrainConfig, run_training, setup_dist

SPECS = {"adamw": {}, "dobb": {"blocks": 2, "refresh_every": 2}}


def curve(r):
    return {"train": r["train_losses"], "val": [e["val_loss"] for e in r["evals"]]}


def main():
    text_dir, cache_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    corpus = load_corpus(text_dir, cache_dir=cache_dir, val_fraction=0.2)
    model_cfg = ModelConfig(layers=2, width=32, heads=2, seq_len=32)
    results = {}
    for name, hp in SPECS.items():
        factory = functools.partial(make_optimizer, name, hp, 3e-3, 0.1)
        for mode in ("ddp", "fsdp"):
            cfg = TrainConfig(steps=6, batch_size=4, eval_every=3, eval_seqs=8, warmup=2, dist=mode)
            env = setup_dist(mode)
            run = Run(model_cfg, cfg, corpus, factory, env=env)
            final = run.run()
            final["evals"] = run.evals
            results[f"{name}-{mode}"] = curve(final)
            if mode == "ddp":  # replicas must stay bitwise identical (no rank-local optimizer state)
                flat = torch.cat([p.detach().flatten() for p in run.inner.parameters()])
                gathered = [torch.empty_like(flat) for _ in range(env.world)]
                dist.all_gather(gathered, flat)
                results[f"{name}-ddp-replicas-equal"] = all(torch.equal(gathered[0], g) for g in gathered)
            run_dir = out / f"{name}-{mode}"
            run_training(model_cfg, cfg, corpus, factory, env=env, out_dir=run_dir, stop_after=3)
            resumed = run_training(model_cfg, cfg, corpus, factory, env=env, out_dir=run_dir)
            results[f"{name}-{mode}-resumed"] = curve(resumed)
    if env.rank == 0:
        (out / "curves.json").write_text(json.dumps(results))
    finish_rank(out)


if __name__ == "__main__":
    main()
