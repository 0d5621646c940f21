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
- Checkpoints are written to a temp file and renamed, so an interrupted write leaves the previous
  checkpoint intact. Under FSDP the model/optimizer go through ``torch.distributed.checkpoint``
  (``get_state_dict``/``set_state_dict``) into a folder that is renamed the same way.
"""
from __future__ import annotations

import math
import os
import random
import shutil
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dobb_bench.training.data import BatchSampler, Corpus, eval_batches, eval_offsets
from dobb_bench.training.checkpoint_io import (COMPLETE, FAULT_ENV, UnsafeCheckpoint, _fault, _fqn_to_index,
                                               _fsync_file, _rng_state, _set_rng_state, check_dcp_metadata, safe_load)
from dobb_bench.provenance import provenance
from dobb_bench.training.model import GPT, ModelConfig
from dobb_bench.training.run_stats import _peak_mem_mb, _state_bytes, optimizer_options, write_jsonl  # noqa: F401

CKPT_FILE = "checkpoint.pt"
CKPT_DIR = "checkpoint_dcp"
METRICS_FILE = "metrics.jsonl"


class _StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM while a single-process loop runs: honoured between steps, where
    model, optimizer, scheduler and RNG are whole, so the checkpoint written then resumes exactly.
    A second signal, or one outside the loop, raises ``KeyboardInterrupt`` at once."""

    def __init__(self):
        self.active, self.signal = False, None

    def __call__(self, signum, frame):
        if self.active and self.signal is None:
            self.signal = signum
            return
        raise KeyboardInterrupt

    def install(self) -> list:
        """Handlers for SIGINT/SIGTERM; returns what to restore. Not under torchrun (ranks would
        stop at different steps and hang in a collective) nor off the main thread (Python allows
        handlers only there). A SIGINT ignored by the parent (``compare``'s children: the parent
        stops them) stays ignored."""
        self.signal = None
        if threading.current_thread() is not threading.main_thread():
            return []
        saved = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                saved.append((sig, signal.signal(sig, self)))
        self.active = bool(saved)
        return saved

    def restore(self, saved: list) -> None:
        self.active = False
        for sig, handler in saved:
            signal.signal(sig, handler)


_STOP = _StopRequest()



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


@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    mode: str = "none"

    def all_mean(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def setup_dist(mode: str, device: str = "auto") -> DistEnv:
    """Joins the torchrun process group when ``mode`` is ddp/fsdp (gloo on CPU, nccl on GPU)."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if mode == "none" and world > 1:
        # Without a process group every torchrun process would be a "rank 0" training the whole
        # model and writing the same files.
        raise ValueError(f"torchrun started {world} processes but --dist is none: add --dist ddp or "
                         "--dist fsdp, or run without torchrun")
    if mode == "none":
        return DistEnv(device=torch.device(("cuda" if use_cuda else "cpu") if device == "auto" else device))
    if "RANK" not in os.environ:
        raise ValueError(f"--dist {mode} needs torchrun (e.g. torchrun --nproc_per_node=2 -m dobb_bench.cli ...)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), dev, mode)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


class Run:
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
        offs = eval_offsets(corpus.val, self.seq_len, n_eval, cfg.seed)
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
        return {"model": self.model_cfg.to_dict(), "train": {k: getattr(self.cfg, k) for k in keys},
                "optimizer": self.meta.get("optimizer"), "hparams": self.meta.get("hparams"),
                "corpus": self.corpus.name, "world": self.env.world}

    # ----- checkpointing ------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "rng": _rng_state(),
                "train_losses": self.train_losses, "evals": self.evals, "acc": self.acc,
                "timing": [self.train_time, self.opt_time, self.opt_steps_timed, self.train_cpu],
                "diverged": self.diverged, "fingerprint": self.fingerprint()}

    def save_checkpoint(self) -> None:
        if self.out is None:
            return
        if self.env.mode == "fsdp":
            return self._save_dcp()
        if self.env.rank == 0:
            state = self._extra_state()
            state["model"] = self.inner.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
            path = self.out / CKPT_FILE
            tmp = path.with_name(path.name + ".tmp")
            torch.save(state, tmp)
            _fsync_file(tmp)
            os.replace(tmp, path)
        self.env.barrier()

    def _save_dcp(self) -> None:
        """Writes into ``checkpoint_dcp.tmp``, marks it complete, then renames it into place.

        A loader takes only a folder holding the ``COMPLETE`` marker (written by rank 0 after
        every rank's shards and the metadata are on disk), so a save killed at any point leaves
        the previous checkpoint as the one that loads.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        final, tmp, old = (self.out / CKPT_DIR, self.out / (CKPT_DIR + ".tmp"), self.out / (CKPT_DIR + ".old"))
        if self.env.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.env.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
        extras = [None] * self.env.world
        dist.all_gather_object(extras, self._extra_state())
        self._saves += 1
        _fault("save", self._saves, self.env.rank)
        if self.env.rank == 0:
            torch.save(extras, tmp / "extra.pt")
            _fsync_file(tmp / "extra.pt")
            (tmp / COMPLETE).write_text(str(self.step))
            _fsync_file(tmp / COMPLETE)
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        self.env.barrier()

    def _dcp_folder(self) -> Path | None:
        for folder in (self.out / CKPT_DIR, self.out / (CKPT_DIR + ".old")):
            if (folder / COMPLETE).exists():
                return folder
        return None

    def _checkpoint_exists(self) -> bool:
        if self.out is None:
            return False
        if self.env.mode == "fsdp":
            if self._dcp_folder() is not None:
                return True
            # checkpoint_dcp (or .old) without COMPLETE was never a whole checkpoint; restarting at
            # step 0 in silence would discard the run's progress without a word. (A .tmp folder
            # without it is an interrupted save, expected: the previous checkpoint is the one used.)
            torn = [f for f in (self.out / CKPT_DIR, self.out / (CKPT_DIR + ".old")) if f.exists()]
            if torn:
                raise ValueError(f"cannot resume from {torn[0]}: it has no {COMPLETE} marker (its save "
                                 "did not finish, or it was copied in part); delete it to start the run "
                                 "over, or rerun with --no-resume or another --out")
            return False
        return (self.out / CKPT_FILE).exists()

    def _materialize_optimizer_state(self) -> None:
        """Gives every parameter its optimizer state, as DCP's loader needs a complete template.

        ``get_state_dict`` initializes state with a zero-gradient, lr=0 step only when the state
        is entirely empty; an optimizer that creates some state eagerly (Dobb: its matrices) would
        leave the AdamW-group parameters without a template, and ``set_state_dict`` then fails.
        We run the same lr=0 step whenever any parameter lacks state; everything it touches is
        overwritten by the checkpoint right after.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        if all(p in self.optimizer.state and self.optimizer.state[p] for p in params):
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def load_checkpoint(self) -> None:
        if self.env.mode == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
            folder = self._dcp_folder()
            check_dcp_metadata(folder)
            extras = safe_load(folder / "extra.pt")
            self._materialize_optimizer_state()
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            sd = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(sd, checkpoint_id=str(folder))
            set_model_state_dict(self.model, sd["model"])
            self.optimizer.load_state_dict(_fqn_to_index(sd["optimizer"]))
            if len(extras) != self.env.world:
                raise ValueError(f"checkpoint in {self.out} was written by {len(extras)} processes, "
                                 f"not {self.env.world}")
            state = extras[self.env.rank]
        else:
            state = safe_load(self.out / CKPT_FILE, map_location=self.env.device)
        if state["fingerprint"] != self.fingerprint():
            diff = [k for k in state["fingerprint"] if state["fingerprint"][k] != self.fingerprint().get(k)]
            raise ValueError(f"checkpoint in {self.out} comes from a different configuration "
                             f"({', '.join(diff)} differ); use another --out or --no-resume")
        if self.env.mode != "fsdp":
            self.inner.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.train_losses, self.evals, self.acc = state["train_losses"], state["evals"], state["acc"]
        self.train_time, self.opt_time, self.opt_steps_timed, self.train_cpu = state["timing"]
        self.diverged = state["diverged"]
        _set_rng_state(state["rng"])

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
        _sync(env.device)
        t0 = time.perf_counter()
        self.optimizer.step()
        _sync(env.device)
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
        bpb = loss / math.log(2) / self.corpus.bytes_per_token if self.corpus.bytes_per_token else None
        train = self.acc[0] / self.acc[1] if self.acc[1] else None
        self.acc = [0.0, 0]
        tokens = self.step * self.cfg.batch_size * self.seq_len
        return {"type": "eval", **self.meta, "step": self.step, "tokens": tokens, "val_loss": loss,
                "val_bpb": bpb, "train_loss": train, "lr_now": self.scheduler.get_last_lr()[0],
                "eval_weights": weights}

    def _write_metrics(self, final: dict | None = None) -> None:
        if self.out is not None and self.env.rank == 0:
            write_jsonl(self.out / METRICS_FILE, self.evals + ([final] if final else []))

    def run(self, stop_after: int | None = None, keep_checkpoint: bool = True) -> dict:
        """Trains to ``cfg.steps`` (or until ``stop_after`` steps, to simulate an interruption).

        In one process, SIGINT/SIGTERM stop it after the current step with a checkpoint and return
        ``{"type": "interrupted", "signal": ...}``: rerunning resumes where it stopped.
        """
        saved = _STOP.install() if self.env.world == 1 else []
        try:
            return self._run(stop_after, keep_checkpoint)
        finally:
            _STOP.restore(saved)

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
            if stop_after is not None and self.step >= stop_after or _STOP.signal is not None:
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
            _fault("step", self.step, env.rank)
        if bar is not None:
            bar.close()
        if _STOP.signal is not None and self.step < cfg.steps and not self.diverged:
            self.save_checkpoint()  # whatever --checkpoint-every says: the stop must be resumable
            return {"type": "interrupted", **self.meta, "step": self.step,
                    "signal": signal.Signals(_STOP.signal).name}
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
            "peak_mem_mb": _peak_mem_mb(self.env.device),
            "opt_state_mb": _state_bytes(self.optimizer.state_dict()["state"]) / 2**20,
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
