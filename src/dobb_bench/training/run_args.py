"""The flags every training command shares (``train``, ``compare``, ``sweep``, ``ablate`` and the
scripts that run rows outside compare), and the model and training configs they make.

Threads: one torch thread per process by default. Measured here (2 cores shared with other
jobs), ``compare --quick`` took 115 s with 1 thread and 638 s with 2: torch's intra-op pool spins
and collapses when cores are shared. Curves also depend on the thread count (reduction order), so
a fixed default makes them reproducible across machines. ``--threads N`` overrides it.
"""
from __future__ import annotations

import argparse

import torch

from dobb_bench.errors import CliError
from dobb_bench.training.data import load_corpus
from dobb_bench.training.model import PRESETS, ModelConfig, config_from_preset
from dobb_bench.training.train import TrainConfig

GRID_BASE = 5e-3
# Measured wall times are in the final report / README; both fit their budgets on 2 CPU cores.
RUN_PRESETS = {
    # 2 layers x width 128, 64-token context, 800 steps: past the loss plateau near 2.9 nats for
    # every optimizer (docs/results.md, horizon study) at a quarter of small-cpu's step cost.
    "default": dict(preset="small-cpu", layers=2, context=64, steps=800, batch_size=16, eval_every=50,
                    eval_seqs=64),
    "quick": dict(preset="tiny", steps=100, batch_size=8, eval_every=20, eval_seqs=32),
}


def grid_lr(j: float) -> float:
    """The paper's learning-rate grid ``lr_j = 5e-3 * 2**(j/2)`` [T8, T10]."""
    return GRID_BASE * 2 ** (j / 2)



# ----- shared arguments -------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: small-cpu)")
    m.add_argument("--layers", type=int, help="transformer layers (default 2; --quick or --preset: the preset's)")
    m.add_argument("--width", type=int, help="model width (default: the model preset's, 128 for small-cpu)")
    m.add_argument("--heads", type=int, help="attention heads (default: the model preset's, 4 for small-cpu)")
    m.add_argument("--context", type=int, help="model context (learned positions); default: preset's")
    m.add_argument("--seq-len", type=int, help="training sequence length (<= context; default: context)")
    m.add_argument("--separate-qkv", action="store_true", help="q/k/v as three Linears (default fused)")
    m.add_argument("--untied", action="store_true", help="untie the LM head from the embedding")
    d = p.add_argument_group("data")
    d.add_argument("--data", help="text file/folder, or nanoGPT train.bin/val.bin (default: stdlib .py)")
    d.add_argument("--cache-dir", help="token cache (default ~/.cache/dobb_bench)")
    d.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte",
                   help="byte-level tokens (default) or a BPE vocabulary trained on the corpus")
    d.add_argument("--vocab-size", type=int, help="bpe vocabulary size (default 4096)")
    d.add_argument("--val-fraction", type=float, default=0.02,
                   help="share of the corpus held out for validation (default 0.02)")
    t = p.add_argument_group("training")
    t.add_argument("--quick", action="store_true", help="the small preset (tiny model, few steps)")
    t.add_argument("--steps", type=int, help="optimizer steps (default 800; 100 with --quick)")
    t.add_argument("--batch-size", type=int, help="global sequences per optimizer step")
    t.add_argument("--micro-batches", type=int, default=1, help="gradient-accumulation micro-batches")
    t.add_argument("--lr", type=float, help="base lr (default 5e-3*2**(-1/2) = 3.54e-3, grid j=-1; "
                   "compare: each row's recorded best lr, this lr for every row when given)")
    t.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (default 0.1)")
    t.add_argument("--warmup", type=int, help="warmup steps (default 5%% of steps)")
    t.add_argument("--schedule", choices=("cosine", "linear", "constant"), default="cosine",
                   help="lr schedule after warmup (default cosine)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="decay floor, fraction of lr")
    t.add_argument("--grad-clip", type=float, default=0.0, help="max grad norm (0 = off)")
    t.add_argument("--eval-every", type=int, help="steps between validation evals (default 50; 20 with --quick)")
    t.add_argument("--eval-seqs", type=int, help="held-out windows per eval (default 64; 32 with --quick)")
    t.add_argument("--eval-seed", type=int,
                   help="seed of the held-out windows (default: --seed); give one value to every seed of a "
                        "study so that all of them are evaluated on the same windows")
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights, data order and eval windows (default 0)")
    t.add_argument("--device", default="auto", help="torch device: auto (CUDA when present, else CPU), cpu, cuda, ...")
    t.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per process (default 1: see the module docstring)")
    t.add_argument("--dist", choices=("none", "ddp", "fsdp"), default="none",
                   help="under torchrun: DDP or FSDP2 (gloo on CPU, nccl on GPU)")
    t.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0 = off)")
    t.add_argument("--no-resume", action="store_true",
                   help="start over: ignore, and replace, the checkpoints and finished results in --out "
                        "(without it a finished run with other settings is refused, never replaced)")
    t.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    t.add_argument("--out", help="output folder (default bench-out/<command>)")


def run_configs(args) -> tuple[ModelConfig, TrainConfig, dict]:
    preset = RUN_PRESETS["quick" if args.quick else "default"]
    if args.threads < 1:
        raise CliError(f"--threads must be a positive integer, got {args.threads}")
    torch.set_num_threads(args.threads)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--eval-every", args.eval_every), ("--eval-seqs", args.eval_seqs),
                        ("--micro-batches", args.micro_batches), ("--layers", args.layers),
                        ("--width", args.width), ("--heads", args.heads), ("--context", args.context),
                        ("--vocab-size", args.vocab_size)):
        if value is not None and value < 1:  # 0 must not fall through to the preset's value
            raise CliError(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--warmup", args.warmup), ("--checkpoint-every", args.checkpoint_every),
                        ("--grad-clip", args.grad_clip), ("--eval-seed", args.eval_seed)):
        if value is not None and value < 0:
            raise CliError(f"{flag} must be >= 0, got {value}")
    corpus = load_corpus(args.data, cache_dir=args.cache_dir, tokenizer=args.tokenizer,
                         vocab_size=args.vocab_size, val_fraction=args.val_fraction)
    own = args.preset is None  # the run preset's model overrides apply to its own model preset only
    model_cfg = config_from_preset(args.preset or preset["preset"],
                                   layers=args.layers if args.layers is not None else (
                                       preset.get("layers") if own else None),
                                   width=args.width, heads=args.heads,
                                   seq_len=args.context if args.context is not None else (
                                       preset.get("context") if own else None),
                                   vocab_size=corpus.vocab_size, fused_qkv=not args.separate_qkv,
                                   tied=not args.untied)
    if args.seq_len is not None and args.seq_len > model_cfg.seq_len:
        raise CliError(f"--seq-len {args.seq_len} exceeds the model context {model_cfg.seq_len} "
                       "(raise --context)")
    if args.seq_len is not None and args.seq_len < 1:
        raise CliError(f"--seq-len must be positive, got {args.seq_len}")
    train_cfg = TrainConfig(
        steps=args.steps or preset["steps"], seq_len=args.seq_len,
        batch_size=args.batch_size or preset["batch_size"], micro_batches=args.micro_batches,
        lr=args.lr if args.lr is not None else grid_lr(-1), weight_decay=args.weight_decay,
        warmup=args.warmup, schedule=args.schedule, min_lr_ratio=args.min_lr_ratio,
        grad_clip=args.grad_clip, eval_every=args.eval_every or preset["eval_every"],
        eval_seqs=args.eval_seqs or preset["eval_seqs"], seed=args.seed, eval_seed=args.eval_seed,
        checkpoint_every=args.checkpoint_every, device=args.device, dist=args.dist)
    data_args = dict(data=args.data, cache_dir=args.cache_dir, tokenizer=args.tokenizer,
                     vocab_size=args.vocab_size, val_fraction=args.val_fraction)
    return model_cfg, train_cfg, (corpus, data_args)
