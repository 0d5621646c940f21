"""Optimizer cost against this machine's limits: `dobb-bench roofline` and `dobb-bench looptime`.

- ``looptime``: ``optimizer.step()`` time *inside a training loop* (real forward/backward on the
  bench's GPT model, capture hooks live), every optimizer on its own copy of the model, interleaved
  step by step with a rotated order so that all of them see the same machine load; per cycle of
  ``T`` steps the amortized time, its ratio to torch AdamW (foreach) of the same cycle and
  max/median; optionally a ``torch.profiler`` split of the step into matmul/QR, element-wise work
  and overhead; optimizer-state bytes per parameter, measured against derived.
- ``roofline``: this machine's memory bandwidth and fp32/bf16 matmul throughput, the minimum bytes
  and FLOPs of each optimizer's step (``step_cost``), and the achieved fraction of the roofline
  bound ``max(bytes / bandwidth, flops / matmul peak)`` for the times in ``looptime`` and
  ``dobb-bench timing`` records.

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
from dobb.meter import state_bytes  # noqa: F401  (the one measured state size; re-exported)

from .payload import derived_state_bytes

_MATMUL_OPS = ("bmm", "mm", "matmul", "baddbmm", "addmm", "addbmm", "linalg_", "geqrf", "orgqr",
               "householder_product", "cholesky", "triangular_solve", "eigh", "_linalg")


# ----------------------------------------------------------------------------- derived costs
def _dobb_block_width(n: int, blocks: int) -> float:
    return n / blocks


def step_cost(name: str, m: int, n: int, hp: dict | None = None) -> dict:
    """Minimum bytes moved, FLOPs and state bytes of one optimizer step on an ``m x n`` fp32 matrix.

    State bytes: the one derived formula, ``dobb_bench.payload.derived_state_bytes`` (fp32 weights).
    """
    cost = _traffic(name, m, n, hp)
    cost["state_bytes"] = derived_state_bytes(name, m, n, hp)
    return cost


def _traffic(name: str, m: int, n: int, hp: dict | None = None) -> dict:
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
    if name in ("torch-adamw", "adamw"):
        return {"bytes": 28 * N, "flops": 0, "flops_dtype": None}
    if name in ("torch-muon", "muon"):
        a, b = min(m, n), max(m, n)
        steps = hp.get("ns_steps", 5)
        # Newton-Schulz quintic on the short side: X X^T (2a^2 b), A A (2a^3), (bA + cA^2) X (2a^2 b)
        return {"bytes": 20 * N, "flops": steps * (4 * a * a * b + 2 * a ** 3), "flops_dtype": "bfloat16"}
    if name == "dion":
        r = max(1, round(hp.get("rank_fraction", 1.0) * min(m, n)))
        # P = M Q, R = M^T P (after QR of P), error feedback M -= P R^T, update P R^T: four m n r
        # products, plus the column-normalisation / QR of the m x r and n x r factors
        # Q (fp32) lives on the long axis (this package's orientation), read and written once
        return {"bytes": 20 * N + 8 * max(m, n) * r, "flops": 8 * m * n * r + 4 * (m + n) * r * r,
                "flops_dtype": "float32"}
    if name.startswith("dobb"):
        B, T = hp.get("blocks", 16), hp.get("refresh_every", 9)
        side = "output" if name.startswith("dobb-g") else "input"
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
        reps = repeats if dtype == torch.float32 or _fast_bf16() else 1  # a slow path costs seconds
        best, med = _best_of(lambda: torch.mm(x, y), reps)
        name = str(dtype).removeprefix("torch.")
        out["matmul_gflops"][name] = 2 * size ** 3 / best / 1e9
        out["matmul_gflops_median"][name] = 2 * size ** 3 / med / 1e9
    out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    out["native_bf16"] = _fast_bf16()
    return out


def _fast_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# ----------------------------------------------------------------------------- records
def _provenance(argv=None) -> dict:
    from .provenance import provenance

    return provenance(argv)


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def _q(values: list[float]) -> dict:
    v = sorted(values)
    if len(v) == 1:
        return {"median": v[0], "q25": v[0], "q75": v[0], "n": 1}
    q = statistics.quantiles(v, n=4, method="inclusive")
    return {"median": statistics.median(v), "q25": q[0], "q75": q[2], "n": len(v)}


# ----------------------------------------------------------------------------- training-loop timing
def build(spec_text: str, model, lr: float, weight_decay: float):
    """``torch-adamw`` (``torch.optim.AdamW(foreach=True)``, betas 0.9/0.95, the reference) or any
    ``dobb.build_optimizer`` spec; Dobb variants default to ``blocks=16``."""
    import dobb

    from .specs import parse_spec

    spec = parse_spec(spec_text)
    if spec.name == "torch-adamw":
        return spec, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                                       foreach=True, **spec.hparams)
    hp = dict(spec.hparams)
    if spec.name.startswith("dobb"):
        hp.setdefault("blocks", 16)
    return spec, dobb.build_optimizer(spec.name, model, lr=lr, weight_decay=weight_decay, **hp)


def _matrix_split(opt) -> tuple[list[tuple[int, int]], int]:
    """Shapes of the matrices an optimizer updates with its matrix rule, and the entries it hands to
    AdamW (all of them for torch AdamW)."""
    shapes, other = [], 0
    for g in opt.param_groups:
        matrix = g.get("algorithm", "adamw") != "adamw"
        for p in g["params"]:
            if matrix:
                shapes.append(tuple(p.shape))
            else:
                other += p.numel()
    return shapes, other


def classify_profile(events, wall_us: float) -> dict:
    """Split a step's time into matmul/QR, element-wise (every other aten kernel) and overhead
    (Python, dispatch, allocator: the wall time no aten operator accounts for)."""
    mat = elem = 0.0
    for e in events:
        if not e.key.startswith("aten::"):
            continue
        if any(op in e.key for op in _MATMUL_OPS):
            mat += e.self_cpu_time_total
        else:
            elem += e.self_cpu_time_total
    over = max(0.0, wall_us - mat - elem)
    tot = max(wall_us, 1e-9)
    return {"matmul_qr": mat / tot, "elementwise": elem / tot, "overhead": over / tot, "wall_ms": wall_us / 1e3}


def run_looptime(optimizers: list[str], *, preset: str = "small-cpu", vocab: int = 4096, batch: int = 16,
                 seq_len: int = 128, layers: int | None = None, cycles: int = 5, cycle_len: int = 9, warmup: int = 9, lr: float = 3.54e-3,
                 weight_decay: float = 0.1, seed: int = 0, profile: bool = False, log=print) -> dict:
    """Interleaved training-loop step timing; see the module docstring."""
    from .model import GPT, config_from_preset

    if not optimizers or optimizers[0] != "torch-adamw":
        optimizers = ["torch-adamw"] + [o for o in optimizers if o != "torch-adamw"]
    cfg = config_from_preset(preset, vocab_size=vocab, seq_len=max(seq_len, 1), layers=layers)
    entries = []
    for text in optimizers:
        model = GPT(cfg, seed=seed)
        spec, opt = build(text, model, lr, weight_decay)
        entries.append({"spec": spec.text, "name": spec.name, "hparams": spec.hparams, "model": model, "opt": opt,
                        "ms": [], "loss": [], "refresh": []})
    gen = torch.Generator().manual_seed(seed)

    def one_step(e, x) -> None:
        opt = e["opt"]
        refresh = bool(getattr(opt, "is_refresh_step", lambda: False)())
        opt.zero_grad(set_to_none=True)
        _, loss = e["model"](x[:, :-1], x[:, 1:])
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        e["ms"].append(1e3 * (time.perf_counter() - t0))
        e["loss"].append(loss.item())
        e["refresh"].append(refresh)

    total = warmup + cycles * cycle_len
    for step in range(total):
        x = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
        k = step % len(entries)
        for e in entries[k:] + entries[:k]:  # rotated order: no optimizer always runs first
            one_step(e, x)
    summaries = []
    ref = entries[0]
    for e in entries:
        ms = e["ms"][warmup:]
        cyc = [ms[i * cycle_len:(i + 1) * cycle_len] for i in range(cycles)]
        refc = [ref["ms"][warmup:][i * cycle_len:(i + 1) * cycle_len] for i in range(cycles)]
        shapes, other = _matrix_split(e["opt"])
        try:
            derived = set_cost(e["name"], shapes, e["hparams"], other) if shapes or e["name"].endswith("adamw") else None
        except ValueError:  # no derived cost model for this optimizer (block Muon): time it anyway
            derived = None
        measured = state_bytes(e["opt"])
        summaries.append({
            "spec": e["spec"], "name": e["name"], "hparams": e["hparams"],
            "amortized_ms": _q([statistics.mean(c) for c in cyc]),
            "ratio_to_adamw": _q([statistics.mean(c) / statistics.mean(r) for c, r in zip(cyc, refc)]),
            "max_over_median": _q([max(c) / statistics.median(c) for c in cyc]),
            "final_loss": statistics.mean(e["loss"][-cycle_len:]),
            "params": sum(p.numel() for p in e["model"].parameters()),
            "matrix_shapes": shapes, "adamw_entries": other,
            "state_bytes_measured": measured, "derived": derived,
            "steps_ms": ms, "refresh": e["refresh"][warmup:],
        })
        log(f"  {e['spec']:34s} amortized {summaries[-1]['amortized_ms']['median']:8.2f} ms  "
            f"x AdamW {summaries[-1]['ratio_to_adamw']['median']:.2f}  "
            f"max/median {summaries[-1]['max_over_median']['median']:.2f}")
    if profile:
        for e, s in zip(entries, summaries):
            s["profile"] = _profile(e, lambda: torch.randint(0, vocab, (batch, seq_len + 1), generator=gen),
                                    one_step, cycle_len)
    return {"kind": "looptime", "config": {"preset": preset, "layers": cfg.layers, "width": cfg.width,
                                           "vocab": vocab, "batch": batch, "seq_len": seq_len,
                                           "cycles": cycles, "cycle_len": cycle_len, "warmup": warmup, "lr": lr,
                                           "weight_decay": weight_decay, "seed": seed,
                                           "threads": torch.get_num_threads()},
            "summaries": summaries}


def _profile(e, batch_fn, one_step, steps: int) -> dict:
    """Shares of one cycle's ``step()`` time; forward/backward run outside the profiled region."""
    from torch.profiler import profile

    agg: dict[str, list[float]] = {"matmul_qr": [], "elementwise": [], "overhead": [], "wall_ms": []}
    opt = e["opt"]
    for _ in range(steps):
        x = batch_fn()
        opt.zero_grad(set_to_none=True)
        _, loss = e["model"](x[:, :-1], x[:, 1:])
        loss.backward()
        with profile() as prof:
            t0 = time.perf_counter()
            opt.step()
            wall = 1e6 * (time.perf_counter() - t0)
        for k, v in classify_profile(prof.key_averages(), wall).items():
            agg[k].append(v)
    walls = agg["wall_ms"]
    return {k: (sum(w * x for w, x in zip(walls, v)) / sum(walls) if k != "wall_ms" else statistics.mean(v))
            for k, v in agg.items()}


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
    from .shapes import matrix_shapes

    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    run = next(x for x in lines if x.get("kind") == "run")
    cfg = run["config"]
    shapes = [s for _, s in matrix_shapes(cfg["preset"], cfg.get("layers"), cfg.get("fused_qkv", False))]
    rows = []
    for s in (x for x in lines if x.get("kind") == "summary" and x.get("amortized_ms")):
        hp = dict(s.get("hparams") or {})
        if s["name"].startswith("dobb"):
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


def looptime_markdown(rec: dict) -> str:
    out = ["| optimizer | amortized ms [IQR] | x torch AdamW [IQR] | max/median | state B/param measured | "
           "derived | matmul/QR | element-wise | overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for s in rec["summaries"]:
        a, r, mm = s["amortized_ms"], s["ratio_to_adamw"], s["max_over_median"]
        d = s.get("derived")
        p = s.get("profile") or {}
        share = [f"{100 * p[k]:.0f}%" if k in p else "–" for k in ("matmul_qr", "elementwise", "overhead")]
        derived = f"{d['state_bytes'] / d['params']:.3f}" if d else "–"
        out.append(f"| {s['spec']} | {a['median']:.2f} [{a['q25']:.2f}, {a['q75']:.2f}] | "
                   f"{r['median']:.2f} [{r['q25']:.2f}, {r['q75']:.2f}] | {mm['median']:.2f} | "
                   f"{s['state_bytes_measured'] / s['params']:.3f} | {derived} | " + " | ".join(share) + " |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- commands
def cmd_looptime(args) -> int:
    from .cli import CliError

    if args.cycles < 2 or args.cycle_len < 1:
        raise CliError("--cycles must be >= 2 and --cycle-len >= 1")
    torch.set_num_threads(args.threads)
    rec = run_looptime(args.optimizers, preset=args.preset, vocab=args.vocab, batch=args.batch,
                       seq_len=args.seq_len, layers=args.layers, cycles=args.cycles, cycle_len=args.cycle_len, warmup=args.warmup,
                       seed=args.seed, profile=args.profile)
    rec["provenance"] = _provenance()
    out = Path(args.out)
    write_record(out / "looptime.json", rec)
    (out / "looptime.md").write_text(looptime_markdown(rec))
    print((out / "looptime.md").read_text())
    return 0


def cmd_roofline(args) -> int:
    from .cli import CliError

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
           "threads": torch.get_num_threads(), "provenance": _provenance()}
    out = Path(args.out)
    write_record(out / "roofline.json", rec)
    (out / "roofline.md").write_text(roofline_markdown(peaks, rows))
    print((out / "roofline.md").read_text())
    return 0


def add_parsers(sub) -> None:
    lt = sub.add_parser("looptime", help="optimizer.step() time inside the training loop, interleaved")
    lt.add_argument("--optimizers", nargs="+", default=["torch-adamw", "dobb:blocks=16", "dobb:blocks=4",
                                                        "dobb:blocks=16:stagger=false", "muon", "dion:rank_fraction=1/16"])
    lt.add_argument("--preset", default="small-cpu", help="bench model preset (default: the compare default)")
    lt.add_argument("--layers", type=int, help="layers (default: the preset's; the loss records use 2)")
    lt.add_argument("--vocab", type=int, default=4096)
    lt.add_argument("--batch", type=int, default=16)
    lt.add_argument("--seq-len", type=int, default=128)
    lt.add_argument("--cycles", type=int, default=5, help="measured cycles (repeats)")
    lt.add_argument("--cycle-len", type=int, default=9, help="steps per cycle (Dobb's refresh period)")
    lt.add_argument("--warmup", type=int, default=9)
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--threads", type=int, default=1)
    lt.add_argument("--profile", action="store_true", help="also split one cycle by operator class")
    lt.add_argument("--out", default="runs/looptime")
    lt.set_defaults(func=cmd_looptime)
    rf = sub.add_parser("roofline", help="bandwidth / matmul peaks and each step's achieved fraction")
    rf.add_argument("--looptime", nargs="*", help="looptime.json records to place on the roofline")
    rf.add_argument("--timing", nargs="*", help="timing.jsonl records (dobb-bench timing) to place")
    rf.add_argument("--mb", type=int, default=256, help="MB per triad array")
    rf.add_argument("--size", type=int, default=1024, help="matmul size")
    rf.add_argument("--threads", type=int, default=1)
    rf.add_argument("--out", default="runs/roofline")
    rf.set_defaults(func=cmd_roofline)
