"""``dobb-bench timing``: optimizer-call time on GPT-2 matrix sets (paper Tables 5, 22-25).

The command only; the runner is ``dobb_bench.cost.timing_run`` (what one timed call is, how repeats
interleave), the tables and plot ``dobb_bench.cost.timing_report``, the matrices ``dobb_bench.cost.matrices``.

``python -m dobb_bench.timing timing|payload ...`` (the shim ``dobb_bench/timing.py``) runs these
two commands without importing the training harness (for a bare GPU machine that has torch only).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dobb_bench.cost.timing_report import write_timing
from dobb_bench.cost.timing_run import DEFAULT_OPTIMIZERS, TimingConfig, run_timing


def cmd_timing(args) -> int:
    cfg = TimingConfig(
        preset=args.preset, layers=args.layers, fused_qkv=args.fused_qkv, optimizers=tuple(args.optimizers),
        blocks=args.blocks, refresh_every=args.refresh_every, repeats=args.repeats, warmup=args.warmup,
        time_budget=args.time_budget, device=args.device, dtype=args.dtype, threads=args.threads,
        tokens=args.tokens, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, dp=args.dp, fs=args.fs,
        tp=args.tp, meter=True if args.meter else None, rep_seconds=args.rep_seconds,
        profile=None if args.profile is None else tuple(args.profile), product_dtype=args.product_dtype,
    )
    result = run_timing(cfg)
    if result["rank0"]:
        paths = write_timing(result, Path(args.out))
        print(paths[1].read_text(), end="")
        print("wrote " + ", ".join(str(p) for p in paths))
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # torchrun: leave together
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("timing", help="optimizer-call time on GPT-2 matrix sets (Tables 5, 22-25)")
    p.add_argument("--preset", default="small", help="GPT-2 size: small, medium, large, xl (default small)")
    p.add_argument("--layers", default=None, help="layers to include: all (default), K (first K) or a:b")
    p.add_argument("--fused-qkv", action="store_true", help="one 3d x d qkv matrix instead of q, k, v")
    p.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS),
                   help="specs NAME[:key=value...] (dobb_bench.specs); names: torch-adamw, torch-muon and dobb.OPTIMIZER_NAMES "
                        f"(default: {' '.join(DEFAULT_OPTIMIZERS)})")
    p.add_argument("--blocks", type=int, default=16, help="Dobb blocks B unless a spec sets blocks (default 16)")
    p.add_argument("--refresh-every", type=int, default=9, help="Dobb refresh period T (default 9)")
    p.add_argument("--repeats", type=int, default=5, help="measured cycles per optimizer (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up cycles per optimizer, not measured (default 1)")
    p.add_argument("--rep-seconds", type=float, default=30.0,
                   help="an optimizer whose warm-up says a repeat of the longest cycle would take longer "
                        "than this runs one cycle (its own) per repeat instead (default 30)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop repeating after this many seconds of measurement (at least 2 repeats)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="parameter dtype: float32 (default), bfloat16, float64")
    p.add_argument("--product-dtype", choices=("float32", "bfloat16"), default=None,
                   help="one dtype for every row's matrix products (ns_dtype or product_dtype where a spec does "
                        "not set it), as compare's --product-dtype; default: each optimizer's own")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--tokens", type=int, default=16, help="rows per capture pass (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="lr of every timed optimizer (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="weight decay of every timed optimizer (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the matrices and gradients (default 0)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (under torchrun)")
    p.add_argument("--fs", type=int, default=1, help="FSDP2 shard degree (under torchrun)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (under torchrun)")
    p.add_argument("--meter", action="store_true", help="meter one extra step per optimizer (default: when distributed)")
    p.add_argument("--profile", nargs="*", default=None, metavar="LABEL",
                   help="after timing, torch.profiler tables of one step per listed optimizer label (none "
                        "listed: the Dobb variants, a refresh and a non-refresh step) into profile.txt")
    p.add_argument("--out", default="runs/timing", help="folder for timing.jsonl, timing.md, timing.png")
    p.set_defaults(func=cmd_timing)
