"""``dobb-bench timing`` and ``dobb-bench payload``: optimizer-call time and cross-shard payload.

Why: the paper's systems claims are the optimizer-call times of Tables 5 and 22-25 (Dobb's call
close to AdamW's, far below Muon's and Dion's) and the payload of Tables 3, 7 and Figure 1. Both
depend only on the matrices an optimizer updates, so this benchmark uses GPT-2 *matrix sets*
(``dobb_bench.shapes``): one ``nn.Linear`` (no bias) per hidden matrix, no model, no data.

What one timed "optimizer call" is (the paper's: ``optimizer.step()`` only):

- gradients are synthetic (Gaussian, set once; the optimizers never modify them), so every step
  does the same work. Under ``torchrun`` the gradients come from one real backward pass instead, so
  that they carry the FSDP2 / TP placements.
- Dobb's ``source="activation"`` / ``"output_grad"`` statistics are captured by hooks during
  forward/backward, not in ``step()``: before each step that ``Dobb.is_refresh_step()`` announces,
  a capture pass runs every layer on ``--tokens`` random rows (plus a backward for output
  gradients). The capture pass is *not* timed, as in the paper; the basis refresh (QR / eigh on
  the captured statistics) *is* part of the refresh step's call.
- Dobb is built with ``check_finite=False`` (its default NaN check costs one host sync per step;
  the baselines have no such check).
- times: ``time.perf_counter`` around ``step()`` on CPU; CUDA events after a ``synchronize`` on GPU.

Each optimizer runs whole cycles (Dobb: ``refresh_every`` steps starting at a refresh; PR-Muon:
``period``; others: one step). Warm-up cycles (including Dobb's first, exact-eigh step) are not
measured. Measured repeats are *interleaved* (every repeat runs one cycle of every optimizer, in a
rotated order), so ratios compare numbers taken under the same machine load: ``x AdamW`` is the
median over repeats of (cycle mean / torch AdamW's cycle mean in the same repeat). Amortized =
cycle mean = ``(Refresh + (T-1) Non-refresh) / T`` for Dobb.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import payload as P
from .shapes import matrix_shapes, preset

TIMING_ONLY = ("torch-adamw", "torch-muon")
DEFAULT_OPTIMIZERS = ("torch-adamw", "torch-muon", "dion:rank_fraction=1/16", "dobb", "dobb:stagger=true")
DEFAULT_PAYLOAD_OPTIMIZERS = (
    "adamw", "muon", "dion:rank_fraction=1", "dion:rank_fraction=1/4", "dion:rank_fraction=1/16", "rmnp",
    "pr-muon", "block-muon", "dion2", "dobb:blocks=16", "dobb-l2:blocks=16", "dobb-g:blocks=16",
    "dobb-g-l2:blocks=16",
)
_DOBB_NAMES = ("dobb", "dobb-l2", "dobb-g", "dobb-g-l2")
_COLWISE = ("q", "k", "v", "qkv", "fc")  # output axis sharded under TP (column parallel)


def _cli_error(msg: str) -> Exception:
    from .cli import CliError

    return CliError(msg)


# ----------------------------------------------------------------------------- optimizers
@dataclass
class OptSpec:
    label: str
    name: str
    hparams: dict[str, Any]

    @property
    def is_dobb(self) -> bool:
        return self.name in _DOBB_NAMES


def library_names() -> tuple[str, ...]:
    try:
        from dobb import OPTIMIZER_NAMES
    except ImportError:
        return ("dobb",)
    return tuple(OPTIMIZER_NAMES)


def parse_optimizers(specs, blocks: int = 16, refresh_every: int = 9) -> list[OptSpec]:
    """Specs ``NAME[:key=value,...]``; Dobb variants get ``blocks``/``refresh_every`` unless given.
    ``torch-adamw`` (the reference of every ratio) is added first when missing."""
    valid = TIMING_ONLY + library_names()
    out: list[OptSpec] = []
    for spec in specs:
        name, hp = P.parse_spec(spec)
        name = name.lower()
        if name not in valid:
            raise ValueError(f"unknown optimizer {name!r} in --optimizers; valid: {', '.join(valid)}")
        if name in _DOBB_NAMES:
            hp.setdefault("blocks", blocks)
            hp.setdefault("refresh_every", refresh_every)
        label = str(spec).strip()
        if any(o.label == label for o in out):
            raise ValueError(f"optimizer {label!r} is listed twice in --optimizers")
        out.append(OptSpec(label, name, hp))
    if not any(o.name == "torch-adamw" for o in out):
        out.insert(0, OptSpec("torch-adamw", "torch-adamw", {}))
    return out


def _torch_hparams(hp: dict) -> dict:
    out = {}
    for k, v in hp.items():
        if k.endswith("_dtype") and isinstance(v, str):
            dt = getattr(torch, v.replace("torch.", ""), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"{k}: unknown dtype {v!r}")
            v = dt
        out[k] = v
    return out


def make_optimizer(spec: OptSpec, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters()]
    hp = _torch_hparams(spec.hparams)
    if spec.name == "torch-adamw":
        hp.setdefault("betas", (0.9, 0.95))
        hp.setdefault("foreach", True)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **hp)
    if spec.name == "torch-muon":
        hp.setdefault("adjust_lr_fn", "match_rms_adamw")
        return torch.optim.Muon(params, lr=lr, weight_decay=weight_decay, **hp)
    if spec.is_dobb:
        hp.setdefault("check_finite", False)
    try:
        from dobb import build_optimizer
    except ImportError:  # the factory is not there yet: plain Dobb only
        from dobb import Dobb

        if spec.name != "dobb":
            raise ValueError(f"{spec.name!r} needs dobb.build_optimizer, which this tree lacks") from None
        return Dobb(params, model=model, lr=lr, weight_decay=weight_decay, **hp)
    return build_optimizer(spec.name, model, lr=lr, weight_decay=weight_decay, **hp)


def _cycle_length(opt) -> int:
    group = next((g for g in opt.param_groups if g.get("algorithm") not in (None, "adamw")), None)
    if group is None:
        return 1
    if "refresh_every" in group:
        return int(group["refresh_every"])
    if group.get("algorithm") == "pr-muon":
        return int(group["period"])
    return 1


def _capture_kind(opt) -> str | None:
    """None (no hooks), "forward" (activation statistics) or "backward" (output gradients)."""
    sources = {g.get("source") for g in opt.param_groups if "source" in g}
    if "output_grad" in sources:
        return "backward"
    if "activation" in sources:
        return "forward"
    return None


def _is_refresh(opt) -> bool:
    fn = getattr(opt, "is_refresh_step", None)
    return bool(fn()) if fn is not None else False


# ----------------------------------------------------------------------------- the matrix bank
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


class MatrixBank:
    """One bias-free ``nn.Linear`` per matrix of the set (weights ``m x n``), optionally sharded."""

    def __init__(self, shapes, device, dtype, seed: int = 0, tokens: int = 16, dist_ctx=None):
        # Built and initialized on the device itself (no default init, no host copy): GPT-2 XL's
        # 1.5B entries would take tens of seconds through the CPU.
        gen = _generator(device, seed)
        self.names = [name for name, _ in shapes]
        self.module = nn.ModuleList()
        for _, (m, n) in shapes:
            lin = torch.nn.utils.skip_init(nn.Linear, n, m, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                lin.weight.normal_(0.0, 1.0 / math.sqrt(n), generator=gen)
            self.module.append(lin)
        self.device, self.dtype, self.tokens, self.dist = device, dtype, tokens, dist_ctx
        self._inputs: dict[int, torch.Tensor] = {}
        if dist_ctx is not None:
            dist_ctx.shard(self)

    def parameters(self):
        return list(self.module.parameters())

    def synthetic_grads(self, seed: int = 1) -> None:
        gen = _generator(self.device, seed)
        for p in self.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype).mul_(1e-2)

    def _x(self, n: int) -> torch.Tensor:
        if n not in self._inputs:
            gen = _generator(self.device, 1000 + n)
            self._inputs[n] = torch.randn(self.tokens, n, generator=gen, device=self.device, dtype=self.dtype)
        return self._inputs[n]

    def capture_pass(self, backward: bool, accumulate: bool) -> None:
        """Run every layer on ``tokens`` rows so capture hooks fire; ``backward`` also propagates
        an output gradient (Dobb-G's statistic). ``accumulate``: ``loss.backward()`` (gradients
        land in ``.grad``, needed under FSDP2); else ``autograd.grad`` leaves ``.grad`` alone."""
        with torch.enable_grad():
            for lin in self.module:
                y = lin(self._x(lin.in_features))
                if accumulate:
                    y.backward(torch.ones_like(y) / y.numel())
                elif backward:
                    torch.autograd.grad(y, lin.weight, torch.ones_like(y) / y.numel())


# ----------------------------------------------------------------------------- distributed
class DistContext:
    """DP x FS x TP layout under torchrun (or a spawned gloo group): mesh ``("dp", "fs", "tp")``.

    TP: ``q, k, v, qkv, fc`` column-parallel (output axis sharded), ``o, proj`` row-parallel
    (input axis sharded). FSDP2 (``fully_shard``) shards dim 0 over ``fs`` (HSDP over
    ``("dp", "fs")`` when ``dp > 1``). ``fs = tp = 1`` is plain data parallelism (replicated
    tensors; Dobb averages its statistics over the world).
    """

    def __init__(self, dp: int, fs: int, tp: int, device: str):
        import torch.distributed as dist

        self.dist = dist
        self.dp, self.fs, self.tp = dp, fs, tp
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if dp * fs * tp != self.world:
            raise _cli_error(f"--dp {dp} x --fs {fs} x --tp {tp} = {dp * fs * tp} processes, but the world size "
                             f"is {self.world}")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device, (dp, fs, tp), mesh_dim_names=("dp", "fs", "tp"))

    def shard(self, bank: MatrixBank) -> None:
        if self.tp > 1:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for name, lin in zip(bank.names, bank.module):
                style = (ColwiseParallel() if name.rsplit(".", 1)[-1] in _COLWISE
                         else RowwiseParallel(input_layouts=Replicate()))
                parallelize_module(lin, self.mesh["tp"], style)
        if self.fs > 1 or (self.dp > 1 and self.tp > 1):
            from torch.distributed.fsdp import fully_shard

            mesh = self.mesh["dp", "fs"] if self.dp > 1 else self.mesh["fs"]
            for lin in bank.module:
                fully_shard(lin, mesh=mesh)

    def shards(self, name: str) -> tuple[int, int]:
        """``(ranks splitting the rows, ranks splitting the columns)`` of a matrix of the set."""
        colwise = name.rsplit(".", 1)[-1] in _COLWISE
        fsdp = self.fs if (self.fs > 1 or (self.dp > 1 and self.tp > 1)) else 1
        return (fsdp * (self.tp if colwise else 1), 1 if colwise else self.tp)

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, obj):
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


def _init_distributed(dp: int, fs: int, tp: int, device: str) -> DistContext | None:
    import torch.distributed as dist

    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world_env > 1:
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if not dist.is_initialized():
        if dp * fs * tp != 1:
            raise _cli_error(f"--dp/--fs/--tp ask for {dp * fs * tp} processes: launch with "
                             f"torchrun --nproc_per_node {dp * fs * tp} -m dobb_bench.cli timing ...")
        return None
    return DistContext(dp, fs, tp, device)


# ----------------------------------------------------------------------------- measurement
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the (local) tensors in the optimizer state, each storage counted once."""
    seen, total = set(), 0

    def visit(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            t = _local(v)
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    for st in opt.state.values():
        visit(st)
    return total


class _Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _stats(values: list[float]) -> dict | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    if len(vals) == 1:
        q1 = q3 = vals[0]
    else:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": statistics.median(vals), "q25": q1, "q75": q3, "min": vals[0], "max": vals[-1], "n": len(vals)}


@dataclass
class TimingConfig:
    preset: str = "small"
    layers: str | None = None
    fused_qkv: bool = False
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    blocks: int = 16
    refresh_every: int = 9
    repeats: int = 5
    warmup: int = 1
    time_budget: float | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    tokens: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    dp: int = 1
    fs: int = 1
    tp: int = 1
    meter: bool | None = None  # None: when distributed
    profile: tuple[str, ...] | None = None  # labels to profile; () = the Dobb variants
    rep_seconds: float = 30.0
    log: bool = True


def _validate(cfg: TimingConfig) -> None:
    for key in ("repeats", "warmup", "tokens", "blocks", "refresh_every", "dp", "fs", "tp"):
        v = getattr(cfg, key)
        low = 0 if key == "warmup" else 1
        if not isinstance(v, int) or v < low:
            raise _cli_error(f"--{key.replace('_', '-')} must be an integer >= {low}, got {v!r}")
    if cfg.threads is not None and cfg.threads < 1:
        raise _cli_error(f"--threads must be >= 1, got {cfg.threads}")
    if cfg.dtype not in ("float32", "bfloat16", "float64"):
        raise _cli_error(f"--dtype must be float32, bfloat16 or float64, got {cfg.dtype!r}")
    if cfg.device not in ("cpu", "cuda"):
        raise _cli_error(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise _cli_error("--device cuda: no CUDA device is available")
    if cfg.rep_seconds < 0:
        raise _cli_error(f"--rep-seconds must be >= 0, got {cfg.rep_seconds}")
    if cfg.time_budget is not None and cfg.time_budget <= 0:
        raise _cli_error(f"--time-budget must be > 0 seconds, got {cfg.time_budget}")


def _machine(cfg: TimingConfig) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    if cfg.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run_timing(cfg: TimingConfig) -> dict:
    """Time every optimizer of ``cfg``; returns ``{"run": ..., "summaries": [...], "reps": [...]}``
    (on every rank; under torch.distributed the summaries carry every rank's numbers)."""
    _validate(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist_ctx = _init_distributed(cfg.dp, cfg.fs, cfg.tp, cfg.device)
    rank0 = dist_ctx is None or dist_ctx.rank == 0
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if (cfg.log and rank0) else (lambda msg: None)
    shapes = matrix_shapes(cfg.preset, cfg.layers, cfg.fused_qkv)
    specs = parse_optimizers(cfg.optimizers, cfg.blocks, cfg.refresh_every)
    dtype = getattr(torch, cfg.dtype)
    device = cfg.device
    if device == "cuda" and dist_ctx is not None:
        device = f"cuda:{torch.cuda.current_device()}"
    bank = MatrixBank(shapes, device, dtype, cfg.seed, cfg.tokens, dist_ctx)
    if dist_ctx is None:
        bank.synthetic_grads(cfg.seed + 1)
    else:
        bank.capture_pass(backward=True, accumulate=True)  # real gradients with their placements
    timer = _Timer(cfg.device)
    meter_cls = _meter_class() if (cfg.meter or (cfg.meter is None and dist_ctx is not None)) else None
    say(f"timing: GPT-2 {cfg.preset} matrices, {len(shapes)} matrices "
        f"({sum(m * n for _, (m, n) in shapes) / 1e6:.1f}M entries), device {cfg.device}, dtype {cfg.dtype}, "
        f"{torch.get_num_threads()} thread(s), world {1 if dist_ctx is None else dist_ctx.world}")

    entries = []

    def capture(entry) -> None:
        with _only_armed(entry, entries):
            bank.capture_pass(backward=entry["capture"] == "backward", accumulate=dist_ctx is not None)

    def one_step(entry) -> tuple[bool, float]:
        opt = entry["opt"]
        refresh = _is_refresh(opt)
        if refresh and entry["capture"]:
            capture(entry)
        if dist_ctx is not None:
            dist_ctx.barrier()
        return refresh, timer(opt.step)

    for spec in specs:  # construct + warm up one at a time, so memory deltas belong to one optimizer
        if cfg.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            alloc0 = torch.cuda.memory_allocated()
        rss0 = _rss_bytes()
        t0 = time.perf_counter()
        try:
            opt = make_optimizer(spec, bank.module, cfg.lr, cfg.weight_decay)
        except (ValueError, ImportError, NotImplementedError) as exc:
            if dist_ctx is None:
                raise
            say(f"  {spec.label}: skipped under this layout: {exc}")
            entries.append({"spec": spec, "skipped": f"{type(exc).__name__}: {exc}"})
            continue
        entry = {"spec": spec, "opt": opt, "cycle": _cycle_length(opt), "capture": _capture_kind(opt), "reps": []}
        warm_steps = entry["cycle"] * max(cfg.warmup, -(-2 // entry["cycle"]))
        for _ in range(warm_steps):
            one_step(entry)
        entry["warmup_s"], entry["warm_steps"] = time.perf_counter() - t0, warm_steps
        entry["state_bytes"] = state_bytes(opt)
        entry["rss_delta_bytes"] = _rss_bytes() - rss0
        if cfg.device == "cuda":
            torch.cuda.synchronize()
            entry["cuda_state_bytes"] = torch.cuda.memory_allocated() - alloc0
            entry["cuda_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - alloc0
        entries.append(entry)
        say(f"  {spec.label}: built, {warm_steps} warm-up step(s) in {entry['warmup_s']:.1f} s; cycle {entry['cycle']}")
    live = [e for e in entries if "opt" in e]

    # Steps per repeat: the longest cycle (a multiple of each optimizer's own), so that cheap
    # optimizers are sampled at the same moments as Dobb's cycle; one cycle for those whose
    # repeat would exceed --rep-seconds (e.g. Muon on CPU). Steps of all optimizers interleave.
    longest = max(e["cycle"] for e in live)
    est = [e["warmup_s"] / e["warm_steps"] for e in live]
    if dist_ctx is not None:
        est = [max(col) for col in zip(*dist_ctx.gather(est))]
    for e, t in zip(live, est):
        full = -(-longest // e["cycle"]) * e["cycle"]
        e["per_rep"] = full if t * full <= cfg.rep_seconds else e["cycle"]
    reps_out = []
    t_start = time.perf_counter()
    for rep in range(cfg.repeats):
        order = live[rep % len(live):] + live[: rep % len(live)]
        steps = {id(e): [] for e in order}
        for pos in range(max(e["per_rep"] for e in order)):
            for entry in order:
                if pos < entry["per_rep"]:
                    steps[id(entry)].append(one_step(entry))
        for entry in order:
            entry["reps"].append(steps[id(entry)])
            reps_out.append({"kind": "rep", "rank": 0 if dist_ctx is None else dist_ctx.rank, "rep": rep,
                             "label": entry["spec"].label, "steps_ms": [t for _, t in steps[id(entry)]],
                             "refresh": [r for r, _ in steps[id(entry)]]})
        ref = next(e for e in live if e["spec"].name == "torch-adamw")
        say(f"  repeat {rep + 1}/{cfg.repeats}: " + ", ".join(
            f"{e['spec'].label} {statistics.fmean(t for _, t in e['reps'][-1]):.2f} ms" for e in live)
            + f" (AdamW {statistics.fmean(t for _, t in ref['reps'][-1]):.2f})")
        done = rep + 1
        stop = cfg.time_budget is not None and time.perf_counter() - t_start > cfg.time_budget and done >= 2
        if dist_ctx is not None:  # every rank stops at the same repeat
            stop = any(dist_ctx.gather(stop))
        if stop:
            say(f"  time budget {cfg.time_budget} s reached after {done} repeats")
            break

    def advance_to(entry, refresh: bool) -> bool:
        """Untimed steps until the next step is (not) a refresh; False if none within a cycle."""
        for _ in range(entry["cycle"] + 1):
            if _is_refresh(entry["opt"]) == refresh:
                return True
            one_step(entry)
        return False

    profiles = {}
    if cfg.profile is not None:
        wanted = [e for e in live if (e["spec"].label in cfg.profile if cfg.profile else e["spec"].is_dobb)]
        for entry in wanted:
            profiles[entry["spec"].label] = _profile_steps(entry, capture, advance_to, cfg.device)
            say(f"  profiled {entry['spec'].label}")

    metered = {}
    if meter_cls is not None:
        for entry in live:
            if entry["spec"].is_dobb:
                advance_to(entry, True)
            metered[entry["spec"].label] = _meter_steps(entry, capture, meter_cls, dist_ctx)

    summaries = [_summarize(e, live, shapes, cfg, metered.get(e["spec"].label), dist_ctx) for e in entries]
    ratios = _ratio_matrix(live)
    if dist_ctx is not None:
        per_rank = dist_ctx.gather(summaries)
        summaries = _merge_ranks(per_rank)
    run = {"kind": "run", "config": _jsonable(asdict(cfg)), "machine": _machine(cfg),
           "matrices": len(shapes), "entries": sum(m * n for _, (m, n) in shapes),
           "world": 1 if dist_ctx is None else dist_ctx.world, "meter": meter_cls is not None,
           "meter_note": None if meter_cls is not None or not (cfg.meter or dist_ctx is not None)
           else "dobb.meter.PayloadMeter not available", "ratio_matrix": ratios}
    return {"run": run, "summaries": summaries, "reps": reps_out, "rank0": rank0, "profiles": profiles}


def _profile_steps(entry, capture, advance_to, device: str) -> dict[str, str]:
    """torch.profiler tables (operators by self time) of one step; Dobb: a non-refresh and a
    refresh step. The capture pass runs before the profiled region, as in the timed steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    out = {}
    for kind in (("non-refresh", False), ("refresh", True)) if entry["spec"].is_dobb else (("step", None),):
        name, refresh = kind
        if refresh is not None and not advance_to(entry, refresh):
            continue
        if refresh and entry["capture"]:
            capture(entry)
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts, record_shapes=True) as prof:
            entry["opt"].step()
            if device == "cuda":
                torch.cuda.synchronize()
        out[name] = (prof.key_averages().table(sort_by=sort, row_limit=25) + "\nby input shape:\n"
                     + prof.key_averages(group_by_input_shape=True).table(
                         sort_by=sort, row_limit=25, max_name_column_width=24, max_shapes_column_width=60))
    return out


@contextlib.contextmanager
def _only_armed(entry, entries):
    """All Dobb instances hook the same layers: during one optimizer's capture pass the others'
    hooks are disarmed, so each optimizer captures (and meters) only its own statistics."""
    saved = []
    for other in entries:
        hooks = getattr(other.get("opt"), "_hooks", None)
        if other is not entry and hooks is not None and hasattr(hooks, "armed"):
            saved.append((hooks, hooks.armed))
            hooks.armed = set()
    try:
        yield
    finally:
        for hooks, armed in saved:
            hooks.armed = armed


def _ratio_matrix(live) -> dict:
    """``{row: {col: median over repeats of (row's cycle mean / col's cycle mean)}}`` (this rank)."""
    means = {e["spec"].label: [statistics.fmean(t for _, t in steps) for steps in e["reps"]] for e in live}
    return {a: {b: statistics.median(x / y for x, y in zip(means[a], means[b])) for b in means} for a in means}


def _meter_class():
    try:
        from dobb.meter import PayloadMeter
    except ImportError:
        return None
    return PayloadMeter


def _meter_steps(entry, capture, meter_cls, dist_ctx) -> dict:
    """Meter one step (a refresh step for Dobb, with its capture pass metered separately) and,
    for Dobb, the following non-refresh step. Not timed."""
    opt, out = entry["opt"], {}
    for which in ("step", "next_step") if entry["spec"].is_dobb else ("step",):
        refresh = _is_refresh(opt)
        if refresh and entry["capture"]:
            with meter_cls() as cap:
                capture(entry)
            kind = getattr(cap, "kind", None)
            stat = kind("stat") if kind else None
            out["capture_stat"] = {"collectives": getattr(stat, "count", None), "bytes": getattr(stat, "bytes", None)}
        if dist_ctx is not None:
            dist_ctx.barrier()
        with meter_cls() as m:
            opt.step()
        out[which] = {"refresh": refresh, "collectives": m.collectives, "bytes": m.bytes,
                      "by_op": {k: vars(v) if hasattr(v, "__dict__") else v for k, v in getattr(m, "by_op", {}).items()}}
    return out


def _summarize(entry, live, shapes, cfg: TimingConfig, metered, dist_ctx=None) -> dict:
    spec = entry["spec"]
    out = {"kind": "summary", "label": spec.label, "name": spec.name, "hparams": _jsonable(spec.hparams)}
    if "skipped" in entry:
        out["skipped"] = entry["skipped"]
        return out
    reps = entry["reps"]
    ref = next(e for e in live if e["spec"].name == "torch-adamw")
    amort = [statistics.fmean(t for _, t in steps) for steps in reps]
    refresh = [statistics.fmean(t for r, t in steps if r) if any(r for r, _ in steps) else None for steps in reps]
    nonref = [statistics.fmean(t for r, t in steps if not r) if not all(r for r, _ in steps) else None for steps in reps]
    spread = [max(t for _, t in steps) / statistics.median(t for _, t in steps) for steps in reps if len(steps) > 1]
    ratio = [a / statistics.fmean(t for _, t in r) for a, r in zip(amort, ref["reps"])]
    name = P.canonical_name(spec.name)
    pbytes = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    derived = sum(P.derived_state_bytes(name, m, n, spec.hparams, pbytes) for _, (m, n) in shapes)
    per_rank = sum(P.derived_state_bytes(name, m, n, spec.hparams, pbytes, *(dist_ctx.shards(mat) if dist_ctx else (1, 1)))
                   for mat, (m, n) in shapes)
    out.update(
        cycle=entry["cycle"], steps_per_repeat=entry["per_rep"], has_refresh=spec.is_dobb,
        amortized_ms=_stats(amort), refresh_ms=_stats(refresh) if spec.is_dobb else None,
        nonrefresh_ms=_stats(nonref) if spec.is_dobb else None,
        max_over_median=_stats(spread), ratio_to_adamw=_stats(ratio),
        state_bytes=entry["state_bytes"], rss_delta_bytes=entry["rss_delta_bytes"],
        derived_state_bytes=derived, derived_state_bytes_per_rank=per_rank,
        cuda_state_bytes=entry.get("cuda_state_bytes"), cuda_peak_extra_bytes=entry.get("cuda_peak_extra_bytes"),
        warmup_s=entry["warmup_s"], metered=metered,
    )
    return out


def _merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Headline numbers are the slowest rank's medians (a step ends when every rank is done)."""
    merged = []
    for i, s0 in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        out = dict(s0)
        if "skipped" not in s0:
            for key in ("amortized_ms", "refresh_ms", "nonrefresh_ms", "max_over_median", "ratio_to_adamw"):
                vals = [r[key] for r in ranks if r.get(key)]
                out[key] = max(vals, key=lambda s: s["median"]) if vals else None
            out["per_rank"] = [{"rank": k, "amortized_ms": r["amortized_ms"], "refresh_ms": r["refresh_ms"],
                                "nonrefresh_ms": r["nonrefresh_ms"], "state_bytes": r["state_bytes"],
                                "metered": r.get("metered")} for k, r in enumerate(ranks)]
        merged.append(out)
    return merged


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


# ----------------------------------------------------------------------------- reports
def _fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def _med(s, spec=".2f") -> str:
    return "–" if not s else format(s["median"], spec)


def timing_markdown(result: dict) -> str:
    run, sums = result["run"], [s for s in result["summaries"]]
    cfg = run["config"]
    ok = [s for s in sums if "skipped" not in s]
    model = f"GPT-2 {cfg['preset']}" + (f" layers {cfg['layers']}" if cfg.get("layers") else "")
    dev = run["machine"].get("gpu") or f"CPU ({run['machine'].get('cpu') or 'unknown'})"
    head = ["Model", "device", "DP", "FS", "TP", "procs"] + [s["label"] for s in ok]
    lines = ["Optimizer call, amortized over one cycle (ms, median over repeats; slowest rank):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| " + " | ".join([model, dev, str(cfg["dp"]), str(cfg["fs"]), str(cfg["tp"]), str(run["world"])]
                               + [_med(s["amortized_ms"]) for s in ok]) + " |", ""]
    head = ["method", "Non-refresh", "Refresh", "Amortized [IQR]", "x AdamW [IQR]", "max/median in cycle",
            "state MB (measured)", "state MB (derived)",
            "GPU alloc delta / peak MB" if cfg["device"] == "cuda" else "RSS delta MB", "reps x steps"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mb = 1 / 2**20
    for s in sums:
        if "skipped" in s:
            lines.append(f"| {s['label']} | skipped: {s['skipped']} |" + " |" * (len(head) - 2))
            continue
        a, r = s["amortized_ms"], s["ratio_to_adamw"]
        cells = [s["label"], _med(s["nonrefresh_ms"]), _med(s["refresh_ms"]),
                 f"{a['median']:.2f} [{a['q25']:.2f}, {a['q75']:.2f}]",
                 f"{r['median']:.2f} [{r['q25']:.2f}, {r['q75']:.2f}]", _med(s["max_over_median"]),
                 _fmt(s["state_bytes"] * mb, ".1f"), _fmt(s["derived_state_bytes_per_rank"] * mb, ".1f"),
                 _memory_cell(s, mb), f"{a['n']} x {s['steps_per_repeat']}"]
        lines.append("| " + " | ".join(cells) + " |")
    m = run["machine"]
    lines += ["", f"{run['matrices']} matrices ({run['entries'] / 1e6:.1f}M entries), dtype {cfg['dtype']}, "
              f"device {cfg['device']}, {m.get('threads')} thread(s), torch {m.get('torch')}. Optimizer call = "
              "optimizer.step() only (capture passes excluded); Dobb with check_finite=False. Repeats interleaved "
              "across optimizers; warm-up excluded. Derived state: AdamW 2mn, Muon mn, Dion mn + max(m,n) r (fp32), "
              "Dobb mn + 6 n^2/B bytes (fp32 statistic + bf16 basis, Table 18); per rank under FS x TP."]
    ratios = run.get("ratio_matrix") or {}
    if len(ratios) > 1:
        labels = list(ratios)
        lines += ["", "Time ratios row / column (median over repeats of the per-repeat ratio of cycle means"
                      + ("; rank 0" if run["world"] > 1 else "") + "):", "",
                  "| row / column | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        lines += ["| " + " | ".join([a] + [f"{ratios[a][b]:.3g}" for b in labels]) + " |" for a in labels]
    meters = [s for s in ok if s.get("metered")]
    if meters:
        lines += ["", "| method | step collectives | step bytes | next step collectives | next step bytes | "
                      "capture stat collectives | capture stat bytes |", "|---|---|---|---|---|---|---|"]
        for s in meters:
            mt = s["metered"]
            st, nx, cap = mt.get("step", {}), mt.get("next_step", {}), mt.get("capture_stat", {})
            lines.append(f"| {s['label']} | {st.get('collectives', '–')} | {st.get('bytes', '–')} | "
                         f"{nx.get('collectives', '–')} | {nx.get('bytes', '–')} | {cap.get('collectives', '–')} | "
                         f"{cap.get('bytes', '–')} |")
        lines.append("(payload meter on rank 0: one step not timed; 'step' is a refresh step for Dobb)")
    elif run.get("meter_note"):
        lines += ["", f"Payload meter: {run['meter_note']}."]
    return "\n".join(lines) + "\n"


def _memory_cell(s: dict, mb: float) -> str:
    if s.get("cuda_state_bytes") is not None:
        return f"{s['cuda_state_bytes'] * mb:.1f} / {s['cuda_peak_extra_bytes'] * mb:.1f}"
    return _fmt(s["rss_delta_bytes"] * mb, ".1f")


def timing_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in result["summaries"] if "skipped" not in s]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(ok)), 4))
    xs = range(len(ok))
    med = [s["amortized_ms"]["median"] for s in ok]
    err = [[m - s["amortized_ms"]["q25"] for m, s in zip(med, ok)], [s["amortized_ms"]["q75"] - m for m, s in zip(med, ok)]]
    ax.bar(xs, med, yerr=err, capsize=3, color="#4c72b0", label="amortized (IQR)")
    for i, s in enumerate(ok):
        if s.get("refresh_ms"):
            ax.scatter([i], [s["refresh_ms"]["median"]], marker="^", color="#c44e52",
                       label="refresh step" if i == next(j for j, t in enumerate(ok) if t.get("refresh_ms")) else None)
        if s.get("nonrefresh_ms"):
            ax.scatter([i], [s["nonrefresh_ms"]["median"]], marker="v", color="#55a868",
                       label="non-refresh step" if i == next(j for j, t in enumerate(ok) if t.get("nonrefresh_ms")) else None)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([s["label"] for s in ok], rotation=20, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("optimizer.step() ms")
    cfg = result["run"]["config"]
    ax.set_title(f"GPT-2 {cfg['preset']} matrices, {cfg['device']}, DPxFSxTP {cfg['dp']}x{cfg['fs']}x{cfg['tp']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_timing(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timing.jsonl", out / "timing.md", out / "timing.png"]
    with open(paths[0], "w") as f:
        for rec in [result["run"], *result["summaries"], *result["reps"]]:
            f.write(json.dumps(_jsonable(rec)) + "\n")
    paths[1].write_text(timing_markdown(result))
    if result.get("profiles"):
        prof = out / "profile.txt"
        prof.write_text("".join(f"=== {label}: {kind} step (torch.profiler, self time)\n{table}\n"
                                for label, tables in result["profiles"].items() for kind, table in tables.items()))
        paths.append(prof)
    try:
        timing_plot(result, out / "timing.png")
    except ImportError as exc:  # matplotlib is an optional (bench) dependency
        print(f"timing.png skipped: {exc}", file=sys.stderr)
        paths.remove(out / "timing.png")
    return paths


# ----------------------------------------------------------------------------- payload command
def payload_rows(specs: list[str], shapes, sharded: str, shards: int) -> dict:
    """Per distinct shape and per optimizer: derived entries; plus the aggregate ratio to Muon."""
    parsed = []
    for spec in specs:
        name, hp = P.parse_spec(spec)
        P.canonical_name(name)
        parsed.append((spec, name, hp))
    counts: dict[tuple[int, int], int] = {}
    for _, shape in shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    rows = []
    for spec, name, hp in parsed:
        per_shape = {f"{m}x{n}": P.payload_entries(name, m, n, hp, sharded=sharded, shards=shards) for (m, n) in counts}
        rows.append({"optimizer": spec, "per_matrix": per_shape,
                     "relative_to_muon": P.relative_payload(name, hp, shapes, sharded=sharded, shards=shards),
                     "dp_stat_per_refresh": sum(P.dp_stat_entries(name, m, n, hp) * c for (m, n), c in counts.items())})
    return {"shapes": {f"{m}x{n}": c for (m, n), c in counts.items()}, "rows": rows}


def payload_markdown(table: dict, title: str) -> str:
    shapes = list(table["shapes"])
    head = ["optimizer"] + [f"{s} (x{table['shapes'][s]})" for s in shapes] + ["aggregate / Muon mn", "DP stat sync per refresh"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table["rows"]:
        lines.append("| " + " | ".join([r["optimizer"]] + [f"{r['per_matrix'][s]:.4g}" for s in shapes]
                                       + [f"{r['relative_to_muon']:.4f}", f"{r['dp_stat_per_refresh']:.4g}"]) + " |")
    return "\n".join(lines) + "\n"


def _measure_worker(rank: int, world: int, port: int, cfg_dict: dict, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run_timing(TimingConfig(**cfg_dict))
        if rank == 0:
            Path(result_path).write_text(json.dumps(_jsonable(result)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure_label(spec: str) -> str:
    """The timing label of a payload spec (``adamw`` is timed as ``torch-adamw``)."""
    name, _, rest = spec.partition(":")
    return {"adamw": "torch-adamw"}.get(name.strip().lower(), name.strip().lower()) + (":" + rest if rest else "")


def measure_fsdp_payload(specs: list[str], preset_name: str, layers: str, fs: int) -> dict:
    """A small FSDP2 run (gloo, ``fs`` CPU processes): metered collectives/bytes per optimizer."""
    import torch.multiprocessing as mp

    names = [_measure_label(spec) for spec in specs]
    cfg = dict(preset=preset_name, layers=layers, optimizers=tuple(names), repeats=1, warmup=1, fs=fs,
               meter=True, log=False, threads=1, blocks=fs, refresh_every=3)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_measure_worker, args=(fs, _free_port(), cfg, path), nprocs=fs, join=True)
        return json.loads(Path(path).read_text())


def cmd_payload(args) -> int:
    shapes = matrix_shapes(args.preset, args.layers, args.fused_qkv)
    specs = list(args.optimizers)
    table = payload_rows(specs, shapes, args.sharded, args.shards)
    title = (f"Derived optimizer-specific cross-shard payload, logical entries per matrix per step: GPT-2 "
             f"{preset(args.preset).name} ({len(shapes)} matrices), {args.sharded} axis sharded over "
             f"{args.shards} devices (Tables 3, 7; Figure 1 uses output/FSDP, 4)")
    text = payload_markdown(table, title)
    measured = None
    if args.measure:
        if _meter_class() is None:
            text += "\nMeasured: dobb.meter.PayloadMeter is not available in this tree; nothing measured.\n"
        else:
            mshapes = matrix_shapes(args.measure_preset, args.measure_layers, args.fused_qkv)
            mtable = payload_rows(specs, mshapes, "output", args.measure_fs)
            measured = measure_fsdp_payload(specs, args.measure_preset, args.measure_layers, args.measure_fs)
            text += "\n" + _measured_markdown(mtable, measured, args, mshapes)
    else:
        text += "\n(measured bytes: add --measure for a small FSDP2 run with the payload meter)\n"
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "payload.md").write_text(text)
        (out / "payload.json").write_text(json.dumps(_jsonable({"derived": table, "measured": measured}), indent=1))
    return 0


def _measured_markdown(mtable: dict, measured: dict, args, mshapes) -> str:
    lines = [f"Measured with the payload meter: GPT-2 {args.measure_preset} layers {args.measure_layers} "
             f"({len(mshapes)} matrices), FSDP2 FS={args.measure_fs} on CPU (gloo), rank 0, one optimizer.step() "
             "(PR-Muon: a full step); Dobb: a refresh step (T = 3; B from the spec, else B = FS) and the next "
             "step, plus its capture pass's statistic mean (tagged 'stat'). Derived bytes = entries x 4 (fp32); "
             "the meter counts each collective's logical tensor (constant collective factors omitted, as in "
             "Table 3).", "",
             "| optimizer | derived entries (all matrices) | derived bytes | measured collectives | measured bytes "
             "| next-step bytes | derived stat bytes per refresh | capture stat bytes | implementation note |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_label = {s["label"]: s for s in measured["summaries"]}
    for row in mtable["rows"]:
        s = by_label[_measure_label(row["optimizer"])]
        name, hp = P.parse_spec(row["optimizer"])
        total = sum(P.payload_entries(name, m, n, hp, sharded="output", shards=args.measure_fs) for _, (m, n) in mshapes)
        stat = sum(P.dp_stat_entries(name, m, n, {"blocks": args.measure_fs, **hp}) for _, (m, n) in mshapes) * 4
        if "skipped" in s:
            lines.append(f"| {row['optimizer']} | {total:.4g} | {total * 4:.4g} | skipped | {s['skipped']} | | | | |")
            continue
        mt = s.get("metered") or {}
        st, nx, cap = mt.get("step", {}), mt.get("next_step", {}), mt.get("capture_stat", {})
        note = "gathers whole matrices" if st.get("bytes") and st["bytes"] > 2 * total * 4 else ""
        lines.append(f"| {row['optimizer']} | {total:.4g} | {total * 4:.4g} | {st.get('collectives', '–')} | "
                     f"{st.get('bytes', '–')} | {nx.get('bytes', '–')} | {stat:.4g} | {cap.get('bytes', '–')} | {note} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI
def cmd_timing(args) -> int:
    cfg = TimingConfig(
        preset=args.preset, layers=args.layers, fused_qkv=args.fused_qkv, optimizers=tuple(args.optimizers),
        blocks=args.blocks, refresh_every=args.refresh_every, repeats=args.repeats, warmup=args.warmup,
        time_budget=args.time_budget, device=args.device, dtype=args.dtype, threads=args.threads,
        tokens=args.tokens, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, dp=args.dp, fs=args.fs,
        tp=args.tp, meter=True if args.meter else None, rep_seconds=args.rep_seconds,
        profile=None if args.profile is None else tuple(args.profile),
    )
    preset(cfg.preset)
    matrix_shapes(cfg.preset, cfg.layers, cfg.fused_qkv)  # bad --layers fails before anything runs
    parse_optimizers(cfg.optimizers, cfg.blocks, cfg.refresh_every)
    result = run_timing(cfg)
    if result["rank0"]:
        paths = write_timing(result, Path(args.out))
        print(paths[1].read_text(), end="")
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("timing", help="optimizer-call time on GPT-2 matrix sets (Tables 5, 22-25)")
    p.add_argument("--preset", default="small", help="GPT-2 size: small, medium, large, xl (default small)")
    p.add_argument("--layers", default=None, help="layers to include: all (default), K (first K) or a:b")
    p.add_argument("--fused-qkv", action="store_true", help="one 3d x d qkv matrix instead of q, k, v")
    p.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS),
                   help="specs NAME[:key=value,...]; names: torch-adamw, torch-muon and dobb.OPTIMIZER_NAMES "
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
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--tokens", type=int, default=16, help="rows per capture pass (default 16)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (under torchrun)")
    p.add_argument("--fs", type=int, default=1, help="FSDP2 shard degree (under torchrun)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (under torchrun)")
    p.add_argument("--meter", action="store_true", help="meter one extra step per optimizer (default: when distributed)")
    p.add_argument("--profile", nargs="*", default=None, metavar="LABEL",
                   help="after timing, torch.profiler tables of one step per listed optimizer label (none "
                        "listed: the Dobb variants, a refresh and a non-refresh step) into profile.txt")
    p.add_argument("--out", default="runs/timing", help="folder for timing.jsonl, timing.md, timing.png")
    p.set_defaults(func=cmd_timing)

    p = subparsers.add_parser("payload", help="derived cross-shard payload per matrix (Tables 3, 7; Figure 1)")
    p.add_argument("--preset", default="xl", help="GPT-2 size (default xl, Figure 1's)")
    p.add_argument("--layers", default=None, help="all (default), K or a:b")
    p.add_argument("--fused-qkv", action="store_true")
    p.add_argument("--sharded", choices=("output", "input"), default="output",
                   help="sharded axis: output (rows; FSDP2, column-parallel TP; default) or input")
    p.add_argument("--shards", type=int, default=4, help="shard count (default 4, Figure 1's FS)")
    p.add_argument("--optimizers", nargs="+", default=list(DEFAULT_PAYLOAD_OPTIMIZERS), help="specs NAME[:key=value,...]")
    p.add_argument("--measure", action="store_true", help="also meter a small FSDP2 run (CPU, gloo processes)")
    p.add_argument("--measure-preset", default="small")
    p.add_argument("--measure-layers", default="1")
    p.add_argument("--measure-fs", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for payload.md and payload.json")
    p.set_defaults(func=_checked_payload)


def _checked_payload(args) -> int:
    if args.shards < 1:
        raise _cli_error(f"--shards must be >= 1, got {args.shards}")
    if args.measure_fs < 2:
        raise _cli_error(f"--measure-fs must be >= 2, got {args.measure_fs}")
    return cmd_payload(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m dobb_bench.timing timing|payload ...``: this module's commands without importing
    the rest of the harness (for machines that lack its training dependencies)."""
    import argparse

    from .cli import CliError

    parser = argparse.ArgumentParser(prog="python -m dobb_bench.timing", description=__doc__.splitlines()[0])
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError) as exc:
        print(f"dobb-bench {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
