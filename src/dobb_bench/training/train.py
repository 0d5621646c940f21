"""The training loop: one run of one optimizer on one model/corpus, resumable and reproducible.

Why it is built this way:
- The optimizer arrives as a factory ``make_optimizer(model) -> torch.optim.Optimizer`` so the
  loop knows nothing about any optimizer (the CLI binds ``dobb.build_optimizer`` to it). The
  factory receives the DDP wrapper under DDP (its process group is the one Dobb averages
  statistics over; hooks reach the inner layers through it) and the module itself otherwise
  (FSDP2 shards in place).
- ``--batch-size`` is the *global* number of sequences per optimizer step, split over processes
  and micro-batches; each micro-batch loss is divided by the number of micro-batches, so the
  optimizer sees the mean gradient of the global batch whatever the layout.
- Everything random is a function of the seed and the step counter, so a checkpoint only needs
  (model, optimizer, scheduler, step, RNG states) and a resumed run reproduces the uninterrupted
  curve exactly (on the same device and thread count).
- Checkpoints are written atomically and loaded only from the same configuration
  (``run_checkpoint``).

Split by concern: settings and lr schedule (``config``), process layout (``dist_env``), validation
(``evaluate``), checkpoints (``run_checkpoint``), stopping between steps (``stop``); this module
is the loop and re-exports their public names.
"""
from __future__ import annotations

import math
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dobb_bench.provenance import provenance
from dobb_bench.training.checkpoint_io import (COMPLETE, FAULT_ENV, UnsafeCheckpoint,  # noqa: F401 (re-exported)
                                               inject_fault, check_dcp_metadata, safe_load)
from dobb_bench.training.config import TrainConfig, lr_factor
from dobb_bench.training.data import BatchSampler, Corpus, eval_offsets
from dobb_bench.training.dist_env import DistEnv, sync_device, setup_dist
from dobb_bench.training.evaluate import eval_weights, evaluate, weight_norms
from dobb_bench.training.model import GPT, ModelConfig
from dobb_bench.training.run_checkpoint import CKPT_DIR, CKPT_FILE, RunCheckpoints  # noqa: F401 (re-exported)
from dobb_bench.training.run_stats import peak_memory_mb, optimizer_state_bytes, optimizer_options, write_jsonl  # noqa: F401
from dobb_bench.training.stop import STOP, StopRequest  # noqa: F401 (re-exported)

__all__ = ["Run", "run_training", "METRICS_FILE", "CKPT_FILE", "CKPT_DIR", "TrainConfig", "lr_factor", "DistEnv",
           "setup_dist", "evaluate", "eval_weights", "write_jsonl"]

METRICS_FILE = "metrics.jsonl"


class Run(RunCheckpoints):
    """State of one training run; ``run()`` executes it (see ``run_training``)."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, corpus: Corpus,
                 make_optimizer: Callable, *, out_dir=None, meta: dict | None = None,
                 progress: bool = False, resume: bool = True, env: DistEnv | None = None):
        self.model_cfg, self.cfg, self.corpus, self.meta = model_cfg, cfg, corpus, dict(meta or {})
        # Provenance goes into the final record only (eval records stay small).
        self.provenance = self.meta.pop("provenance", None)
        self.out = Path(out_dir) if out_dir else None
        self.progress, self.resume = progress, resume
        self.env = env or setup_dist(cfg.dist, cfg.device)
        if cfg.batch_size % (cfg.micro_batches * self.env.world):
            raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by micro_batches x "
                             f"processes ({cfg.micro_batches} x {self.env.world})")
        if model_cfg.vocab_size < corpus.vocab_size:
            raise ValueError(f"model vocab {model_cfg.vocab_size} < corpus vocab {corpus.vocab_size}")
        self.seq_len = cfg.seq_len or model_cfg.seq_len
        if self.seq_len > model_cfg.seq_len:
            raise ValueError(f"sequence length {self.seq_len} exceeds the model context "
                             f"{model_cfg.seq_len} (raise --context)")
        self.sampler = BatchSampler(corpus.train, self.seq_len, cfg.batch_size, cfg.seed)
        n_eval = max(self.env.world, cfg.eval_seqs - cfg.eval_seqs % self.env.world)
        offs = eval_offsets(corpus.val, self.seq_len, n_eval, cfg.seed if cfg.eval_seed is None else cfg.eval_seed)
        self.eval_offsets = offs[self.env.rank::self.env.world]
        self._build(make_optimizer)

    # ----- construction -------------------------------------------------------------------
    def _build(self, make_optimizer):
        cfg, env = self.cfg, self.env
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        model = GPT(self.model_cfg, seed=cfg.seed).to(env.device)
        self.inner = model
        if env.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
        elif env.mode == "fsdp":
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            self.model = model
        else:
            self.model = model
        self.optimizer = make_optimizer(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0
        self.train_losses: list[float] = []
        self.evals: list[dict] = []
        self.acc = [0.0, 0]  # train-loss sum and count since the last eval
        self.train_time = self.opt_time = self.train_cpu = 0.0
        self.opt_steps_timed = 0
        self.diverged = False
        self._saves = 0

    def fingerprint(self) -> dict:
        keys = ("steps", "seq_len", "batch_size", "micro_batches", "lr", "weight_decay", "warmup", "schedule",
                "min_lr_ratio", "grad_clip", "seed")
        train = {k: getattr(self.cfg, k) for k in keys}
        if self.cfg.eval_seed is not None:  # absent by default: checkpoints from before the option resume
            train["eval_seed"] = self.cfg.eval_seed
        return {"model": self.model_cfg.to_dict(), "train": train,
                "optimizer": self.meta.get("optimizer"), "hparams": self.meta.get("hparams"),
                "corpus": self.corpus.name, "world": self.env.world}

    # ----- the loop -----------------------------------------------------------------------
    def _train_step(self) -> float:
        cfg, env = self.cfg, self.env
        k_total = cfg.micro_batches
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for k in range(k_total):
            x, y = self.sampler.micro_batch(self.step, env.rank * k_total + k, env.world * k_total)
            last = k == k_total - 1
            ctx = self.model.no_sync() if env.mode == "ddp" and not last else nullcontext()
            if env.mode == "fsdp":
                self.model.set_requires_gradient_sync(last)
            with ctx:
                _, loss = self.model(x.to(env.device), y.to(env.device))
                (loss / k_total).backward()
            loss_sum += loss.detach().double()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        sync_device(env.device)
        t0 = time.perf_counter()
        self.optimizer.step()
        sync_device(env.device)
        dt = time.perf_counter() - t0
        if self.step > 0:  # the first call allocates state; it is not representative
            self.opt_time += dt
            self.opt_steps_timed += 1
        self.scheduler.step()
        return env.all_mean([(loss_sum / k_total).item()])[0]

    def _eval_record(self) -> dict:
        weights = eval_weights(self.optimizer)
        if weights != "raw":  # the optimizer's averaged weights in, the raw ones back after
            self.optimizer.eval()
        try:
            loss = evaluate(self.model, self.corpus, self.eval_offsets, self.seq_len,
                            self.cfg.eval_batch_size, self.env)
        finally:
            if weights != "raw":
                self.optimizer.train()
        # an optimizer that validates an average is also scored on the weights it trains (SPlus's
        # authors report the average; the raw weights show what the average is worth)
        raw = loss if weights == "raw" else evaluate(self.model, self.corpus, self.eval_offsets, self.seq_len,
                                                     self.cfg.eval_batch_size, self.env)
        norms = weight_norms(self.model)  # raw weights: after train() swapped any average out
        bpb = loss / math.log(2) / self.corpus.bytes_per_token if self.corpus.bytes_per_token else None
        train = self.acc[0] / self.acc[1] if self.acc[1] else None
        self.acc = [0.0, 0]
        tokens = self.step * self.cfg.batch_size * self.seq_len
        return {"type": "eval", **self.meta, "step": self.step, "tokens": tokens, "val_loss": loss,
                "val_bpb": bpb, "train_loss": train, "lr_now": self.scheduler.get_last_lr()[0],
                "eval_weights": weights, "val_loss_raw": raw, "weight_norms": norms}

    def _write_metrics(self, final: dict | None = None) -> None:
        if self.out is not None and self.env.rank == 0:
            write_jsonl(self.out / METRICS_FILE, self.evals + ([final] if final else []))

    def run(self, stop_after: int | None = None, keep_checkpoint: bool = True) -> dict:
        """Trains to ``cfg.steps`` (or until ``stop_after`` steps, to simulate an interruption).

        In one process, SIGINT/SIGTERM stop it after the current step with a checkpoint and return
        ``{"type": "interrupted", "signal": ...}``: rerunning resumes where it stopped.
        """
        saved = STOP.install() if self.env.world == 1 else []
        try:
            return self._run(stop_after, keep_checkpoint)
        finally:
            STOP.restore(saved)

    def _run(self, stop_after: int | None, keep_checkpoint: bool) -> dict:
        cfg, env = self.cfg, self.env
        if self.out is not None and env.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        env.barrier()
        if self.resume and self._checkpoint_exists():
            self.load_checkpoint()
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        if self.step == 0 and not self.evals:
            self.evals.append(self._eval_record())
            self._write_metrics()
        tokens_per_step = cfg.batch_size * self.seq_len
        bar = None
        if self.progress and env.rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=self.step, desc=self.meta.get("run", "train"),
                       leave=False, dynamic_ncols=True)
        while self.step < cfg.steps and not self.diverged:
            if stop_after is not None and self.step >= stop_after or STOP.signal is not None:
                break
            t0, c0 = time.perf_counter(), time.process_time()
            loss = self._train_step()
            self.train_time += time.perf_counter() - t0
            self.train_cpu += time.process_time() - c0
            self.step += 1
            self.train_losses.append(loss)
            self.acc = [self.acc[0] + loss, self.acc[1] + 1]
            if not math.isfinite(loss):
                self.diverged = True
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}",
                                tok_s=f"{self.step * tokens_per_step / max(self.train_time, 1e-9):.0f}")
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps or self.diverged:
                self.evals.append(self._eval_record())
                self._write_metrics()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                self.save_checkpoint()
            inject_fault("step", self.step, env.rank)
        if bar is not None:
            bar.close()
        if STOP.signal is not None and self.step < cfg.steps and not self.diverged:
            self.save_checkpoint()  # whatever --checkpoint-every says: the stop must be resumable
            return {"type": "interrupted", **self.meta, "step": self.step,
                    "signal": signal.Signals(STOP.signal).name}
        if stop_after is not None and self.step < cfg.steps and not self.diverged:
            self.save_checkpoint()
            return {"type": "interrupted", **self.meta, "step": self.step}
        final = self.final_record()
        self._write_metrics(final)
        if keep_checkpoint:
            self.save_checkpoint()
        return final

    def final_record(self) -> dict:
        steps = self.step
        last = self.evals[-1] if self.evals else {}
        finite = [e["val_loss"] for e in self.evals if e["val_loss"] is not None and math.isfinite(e["val_loss"])]
        return {
            "type": "final", **self.meta, "steps": steps, "diverged": self.diverged,
            "final_val_loss": float("nan") if self.diverged else last.get("val_loss"),
            "final_val_bpb": None if self.diverged else last.get("val_bpb"),
            "best_val_loss": min(finite) if finite else None,
            "eval_weights": eval_weights(self.optimizer),
            "final_train_loss": self.train_losses[-1] if self.train_losses else None,
            "tokens_per_s": steps * self.cfg.batch_size * self.seq_len / max(self.train_time, 1e-9),
            "opt_ms_per_step": 1e3 * self.opt_time / max(1, self.opt_steps_timed),
            "train_wall_s": self.train_time, "train_cpu_s": self.train_cpu,  # CPU: all threads
            "peak_mem_mb": peak_memory_mb(self.env.device),
            "opt_state_mb": optimizer_state_bytes(self.optimizer.state_dict()["state"]) / 2**20,
            "n_params": self.inner.num_params(),
            "world": self.env.world, "device": str(self.env.device), "dist": self.env.mode,
            "threads": torch.get_num_threads(),
            "train_losses": self.train_losses,
            "tokens": steps * self.cfg.batch_size * self.seq_len,
            "model": self.model_cfg.to_dict(), "train": asdict(self.cfg),
            "optimizer_groups": optimizer_options(self.optimizer),
            "corpus": {"name": self.corpus.name, "vocab_size": self.corpus.vocab_size,
                       "train_tokens": len(self.corpus.train), "val_tokens": len(self.corpus.val)},
            "provenance": self.provenance or provenance(),
        }


def run_training(model_cfg: ModelConfig, cfg: TrainConfig, corpus: Corpus, make_optimizer: Callable,
                 *, out_dir=None, meta: dict | None = None, progress: bool = False,
                 resume: bool = True, stop_after: int | None = None, env: DistEnv | None = None,
                 keep_checkpoint: bool = True) -> dict:
    """Runs (or resumes) one training run and returns its final record (a JSON-ready dict).

    With ``keep_checkpoint=False`` no checkpoint is written once the run is complete (the final
    record in ``metrics.jsonl`` marks it done); intermediate checkpoints are still written.
    """
    run = Run(model_cfg, cfg, corpus, make_optimizer, out_dir=out_dir, meta=meta,
              progress=progress, resume=resume, env=env)
    result = run.run(stop_after=stop_after, keep_checkpoint=keep_checkpoint)
    result["evals"] = run.evals
    return result
