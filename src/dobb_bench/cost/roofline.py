"""Optimizer cost against this machine's limits: ``dobb-bench roofline``.

This machine's memory bandwidth and fp32/bf16 matmul throughput, the minimum bytes and FLOPs of
each optimizer's step (``step_cost``), and the achieved fraction of the roofline bound
``max(bytes / bandwidth, flops / matmul peak)`` for the times in ``dobb-bench looptime``
(``dobb_bench.cost.looptime``) and ``dobb-bench timing`` records.

Why derive a minimum: a ratio to AdamW says nothing about whether a step is close to what the
hardware allows; the fraction of the roofline bound does (AdamW is memory-bound by construction).
Every record carries ``dobb_bench.provenance`` (clean-tree revision, command, machine, threads).
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

import dobb

from dobb_bench.bench_entries import bench_entry
from dobb_bench.cost.payload import derived_state_bytes
from dobb_bench.provenance import native_bf16, provenance
from dobb_bench.specs import refreshes, registry_entry

# ----------------------------------------------------------------------------- derived costs
def _dobb_block_width(n: int, blocks: int) -> float:
    return n / blocks


def step_cost(name: str, m: int, n: int, hp: dict | None = None) -> dict:
    """Minimum bytes moved, FLOPs and state bytes of one optimizer step on an ``m x n`` fp32 matrix.

    State bytes: the one derived formula, ``dobb_bench.cost.payload.derived_state_bytes`` (fp32 weights).
    """
    cost = traffic(name, m, n, hp)
    cost["state_bytes"] = derived_state_bytes(name, m, n, hp)
    return cost


def traffic(name: str, m: int, n: int, hp: dict | None = None) -> dict:
    """Minimum bytes moved and FLOPs of one optimizer step on an ``m x n`` fp32 matrix.

    Bytes: every weight-sized fp32 buffer the update must read or write once (AdamW: read
    W, G, M, V, write W, M, V = 28 bytes per entry; the Muon family and Dobb: read W, G, M, write
    W, M = 20), plus the small factors (Dobb's bf16 basis, Dion's ``Q``); amortized refresh work is
    included for Dobb (statistic EMA and ``A Q`` / QR every ``T`` steps). FLOPs: the matrix
    products only (element-wise arithmetic is at most a few FLOPs per byte and never the bound).
    ``flops_dtype`` names the precision the products run in (the matmul peak that applies).
    """
    hp = dict(hp or {})
    N = m * n
    entry = registry_entry(name)  # what the optimizer is, from dobb.registry (not its name's prefix)
    cls = entry.cls if entry is not None else None
    if cls is torch.optim.AdamW:
        return {"bytes": 28 * N, "flops": 0, "flops_dtype": None}
    if cls is dobb.Muon and not entry.preset:  # muon, torch-muon (CMuon's split Q/K/V: no model here)
        a, b = min(m, n), max(m, n)
        steps = hp.get("ns_steps", 5)
        # Newton-Schulz quintic on the short side: X X^T (2a^2 b), A A (2a^3), (bA + cA^2) X (2a^2 b)
        return {"bytes": 20 * N, "flops": steps * (4 * a * a * b + 2 * a ** 3), "flops_dtype": "bfloat16"}
    if cls is dobb.Dion:
        r = max(1, round(hp.get("rank_fraction", 1.0) * min(m, n)))
        # P = M Q, R = M^T P (after QR of P), error feedback M -= P R^T, update P R^T: four m n r
        # products, plus the column-normalisation / QR of the m x r and n x r factors
        # Q (fp32) lives on the long axis (this package's orientation), read and written once
        return {"bytes": 20 * N + 8 * max(m, n) * r, "flops": 8 * m * n * r + 4 * (m + n) * r * r,
                "flops_dtype": "float32"}
    if entry is not None and entry.refreshes:  # Dobb and its presets
        B, T = hp.get("blocks", 16), hp.get("refresh_every", 9)
        # the blocked axis: the preset's (Dobb-G: output), a side= hyperparameter overrides it;
        # side="both" is priced as its input side (the output side's work is not counted here)
        side = "output" if hp.get("side", bench_entry(entry.name).blocks_side) == "output" else "input"
        k, rows = (n, m) if side == "input" else (m, n)
        s = _dobb_block_width(k, B)
        stat = k * s  # entries of the row-stacked block statistic / basis (k^2 / B)
        # project U[:, b] Q_b and reconstruct C_b Q_b^T: 2 * 2 rows k s; refresh every T steps:
        # A_b Q_b (2 k s^2) and Householder QR of B blocks s x s (4/3 s^3 each)
        refresh_flops = 2 * k * s * s + B * (4 / 3) * s ** 3
        refresh_bytes = 4 * 3 * stat + 2 * 2 * stat  # EMA: read A, new A, write A; basis r/w in bf16
        return {"bytes": 20 * N + 2 * stat + refresh_bytes / T, "flops": 4 * rows * k * s + refresh_flops / T,
                "flops_dtype": "float32"}
    raise ValueError(f"no cost model for optimizer {name!r}")


def set_cost(name: str, shapes: list[tuple[int, int]], hp: dict | None = None, adamw_entries: int = 0) -> dict:
    """``step_cost`` summed over a matrix set; ``adamw_entries`` are non-matrix parameters (embeddings,
    norms) that every optimizer hands to AdamW."""
    tot = {"bytes": 28.0 * adamw_entries, "flops": 0.0, "state_bytes": 8.0 * adamw_entries}
    dtype = None
    for m, n in shapes:
        c = step_cost(name, m, n, hp)
        for key in tot:
            tot[key] += c[key]
        dtype = c["flops_dtype"] or dtype
    tot["flops_dtype"] = dtype
    tot["params"] = sum(m * n for m, n in shapes) + adamw_entries
    return tot


def roofline_fraction(cost: dict, step_ms: float, peaks: dict) -> dict:
    """Bound ``max(bytes / bandwidth, flops / matmul peak)`` and the achieved fraction of it."""
    t_mem = cost["bytes"] / (peaks["bandwidth_gbs"] * 1e9)
    # The ceiling is the faster of the step's precision and fp32: where bf16 is emulated (CPUs
    # without native bf16) an implementation may always multiply in fp32 instead.
    gflops = max(peaks["matmul_gflops"]["float32"], peaks["matmul_gflops"].get(cost["flops_dtype"], 0.0))
    t_flop = cost["flops"] / (gflops * 1e9) if cost["flops"] else 0.0
    bound = max(t_mem, t_flop)
    return {"t_mem_ms": 1e3 * t_mem, "t_flop_ms": 1e3 * t_flop, "bound_ms": 1e3 * bound,
            "bound": "memory" if t_mem >= t_flop else "matmul", "measured_ms": step_ms,
            "fraction": 1e3 * bound / step_ms if step_ms > 0 else math.nan}


# ----------------------------------------------------------------------------- machine probes
def _best_of(fn, repeats: int) -> tuple[float, float]:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def measure_peaks(mb: int = 256, size: int = 1024, repeats: int = 7) -> dict:
    """Memory bandwidth (triad ``a = b + s c``, fp32, ``mb`` MB per array, 3 arrays moved) and
    square-matmul throughput in fp32 and bf16. Best and median of ``repeats``: the best is the
    ceiling this (shared) machine reached, the median what a typical call saw."""
    n = mb * 2 ** 20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best, med = _best_of(lambda: torch.add(b, c, alpha=0.5, out=a), repeats)
    out = {"bandwidth_gbs": 12 * n / best / 1e9, "bandwidth_gbs_median": 12 * n / med / 1e9,
           "triad_mb": mb, "matmul_size": size, "matmul_gflops": {}, "matmul_gflops_median": {}}
    del a, b, c
    for dtype in (torch.float32, torch.bfloat16):
        x, y = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        reps = repeats if dtype == torch.float32 or native_bf16() else 1  # a slow path costs seconds
        best, med = _best_of(lambda: torch.mm(x, y), reps)
        name = str(dtype).removeprefix("torch.")
        out["matmul_gflops"][name] = 2 * size ** 3 / best / 1e9
        out["matmul_gflops_median"][name] = 2 * size ** 3 / med / 1e9
    out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    out["native_bf16"] = native_bf16()
    return out


# ----------------------------------------------------------------------------- records
def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


# ----------------------------------------------------------------------------- reports
def _fractions_from_looptime(rec: dict, peaks: dict) -> list[dict]:
    rows = []
    for s in rec["summaries"]:
        if s.get("derived"):
            rows.append({"source": "looptime", "spec": s["spec"],
                         **roofline_fraction(s["derived"], s["amortized_ms"]["median"], peaks),
                         "bytes": s["derived"]["bytes"], "flops": s["derived"]["flops"]})
    return rows


def _fractions_from_timing(path: Path, peaks: dict) -> list[dict]:
    from dobb_bench.cost.shapes import matrix_shapes

    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    run = next(x for x in lines if x.get("kind") == "run")
    cfg = run["config"]
    shapes = [s for _, s in matrix_shapes(cfg["preset"], cfg.get("layers"), cfg.get("fused_qkv", False))]
    rows = []
    for s in (x for x in lines if x.get("kind") == "summary" and x.get("amortized_ms")):
        hp = dict(s.get("hparams") or {})
        if refreshes(s["name"]):
            hp.setdefault("blocks", cfg.get("blocks", 16))
            hp.setdefault("refresh_every", cfg.get("refresh_every", 9))
        try:
            cost = set_cost(s["name"], shapes, hp)
        except ValueError:
            continue
        rows.append({"source": f"timing {cfg['preset']}", "spec": s["label"],
                     **roofline_fraction(cost, s["amortized_ms"]["median"], peaks),
                     "bytes": cost["bytes"], "flops": cost["flops"]})
    return rows


def roofline_markdown(peaks: dict, rows: list[dict]) -> str:
    mm = peaks["matmul_gflops"]
    out = [f"Machine: triad bandwidth {peaks['bandwidth_gbs']:.1f} GB/s (median {peaks['bandwidth_gbs_median']:.1f}); "
           f"{peaks['matmul_size']}^3 matmul fp32 {mm['float32']:.1f} GFLOP/s, bf16 {mm['bfloat16']:.2f} GFLOP/s "
           f"(CPU capability {peaks['cpu_capability']}, native bf16 {peaks['native_bf16']}).", "",
           "| source | optimizer | min bytes (MB) | min FLOPs (G) | memory bound ms | matmul bound ms | "
           "bound | measured ms | achieved fraction |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['source']} | {r['spec']} | {r['bytes'] / 1e6:.1f} | {r['flops'] / 1e9:.3f} | "
                   f"{r['t_mem_ms']:.2f} | {r['t_flop_ms']:.2f} | {r['bound']} | {r['measured_ms']:.2f} | "
                   f"{r['fraction']:.2f} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- command
def cmd_roofline(args) -> int:
    from dobb_bench.errors import CliError

    for p in (args.looptime or []) + (args.timing or []):
        if not Path(p).exists():
            raise CliError(f"no such record: {p}")
    torch.set_num_threads(args.threads)
    peaks = measure_peaks(mb=args.mb, size=args.size)
    rows = []
    for p in args.looptime or []:
        rows += _fractions_from_looptime(json.loads(Path(p).read_text()), peaks)
    for p in args.timing or []:
        rows += _fractions_from_timing(Path(p), peaks)
    rec = {"kind": "roofline", "peaks": peaks, "rows": rows, "inputs": (args.looptime or []) + (args.timing or []),
           "threads": torch.get_num_threads(), "provenance": provenance()}
    out = Path(args.out)
    write_record(out / "roofline.json", rec)
    (out / "roofline.md").write_text(roofline_markdown(peaks, rows))
    print((out / "roofline.md").read_text())
    return 0


def add_parsers(sub) -> None:
    rf = sub.add_parser("roofline", help="bandwidth / matmul peaks and each step's achieved fraction")
    rf.add_argument("--looptime", nargs="*", help="looptime.json records to place on the roofline")
    rf.add_argument("--timing", nargs="*", help="timing.jsonl records (dobb-bench timing) to place")
    rf.add_argument("--mb", type=int, default=256, help="MB per triad array")
    rf.add_argument("--size", type=int, default=1024, help="matmul size")
    rf.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    rf.add_argument("--out", default="runs/roofline", help="output folder (default runs/roofline)")
    rf.set_defaults(func=cmd_roofline)
