"""The timing runner behind ``dobb-bench timing``: optimizer-call time on GPT-2 matrix sets.

Why: the paper's systems claims are the optimizer-call times of Tables 5 and 22-25 (Dobb's call
close to AdamW's, far below Muon's and Dion's). They depend only on the matrices an optimizer
updates, so the benchmark uses GPT-2 *matrix sets* (``dobb_bench.cost.matrices``), no model, no data.

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

Each optimizer runs whole cycles (Dobb: ``refresh_every`` steps starting at a refresh; PR-Muon and
MuonBP: ``period``; SPlus: ``inverse_every``; DASH: ``precondition_every``; others: one step). Warm-up cycles (including Dobb's first, exact-eigh step) are not
measured. Measured repeats are *interleaved* (every repeat runs one cycle of every optimizer, in a
rotated order), so ratios compare numbers taken under the same machine load: ``x AdamW`` is the
median over repeats of (cycle mean / torch AdamW's cycle mean in the same repeat). Amortized =
cycle mean = ``(Refresh + (T-1) Non-refresh) / T`` for Dobb.
"""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

import dobb
from dobb.meter import PayloadMeter, state_bytes  # state_bytes: the one definition (re-exported)

from dobb_bench.cost.matrices import DistContext, MatrixBank, init_distributed
from dobb_bench.cost.shapes import matrix_shapes
from dobb_bench.cost.timing_report import jsonable, merge_ranks, summarize
from dobb_bench.errors import CliError
from dobb_bench.specs import recorded_adamw_part, recorded_refresh
from dobb_bench.specs import ADAMW_REFERENCES, OptimizerSpec, parse_spec
from dobb_bench.training.row_settings import with_product_dtype

TIMING_ONLY = ("torch-adamw", "torch-adamw-fused", "torch-muon")
# The package's Muon, not torch's: its ns_dtype="auto" runs Newton-Schulz in bf16 only where the
# device multiplies bf16 natively, so the default list never times an emulated path.
DEFAULT_OPTIMIZERS = ("torch-adamw", "muon", "dion:rank_fraction=1/16", "dobb", "dobb:stagger=false")
# The optimizers that refresh a basis from captured statistics (dobb.registry: Dobb and its presets)
DOBB_NAMES = tuple(name for name, entry in dobb.registry.OPTIMIZERS.items() if entry.refreshes)


# ----------------------------------------------------------------------------- optimizers
def parse_optimizers(texts, blocks: int = 16, refresh_every: int = 9) -> list[OptimizerSpec]:
    """Specs in the ``dobb_bench.specs`` grammar, labelled by their text (or ``@Label``); Dobb
    variants get ``blocks``/``refresh_every`` unless given. ``torch-adamw`` (the reference of every
    ratio) and ``torch-adamw-fused`` (torch's fused kernel, every ratio's second reference) are
    added first when missing."""
    valid = TIMING_ONLY + tuple(dobb.OPTIMIZER_NAMES)
    out: list[OptimizerSpec] = []
    for text in texts:
        spec = parse_spec(text)
        if spec.name not in valid:
            raise ValueError(f"unknown optimizer {spec.name!r} in --optimizers; valid: {', '.join(valid)}")
        hp = dict(spec.hparams)
        if spec.name in DOBB_NAMES:
            hp.setdefault("blocks", blocks)
            hp.setdefault("refresh_every", refresh_every)
        label = spec.label if "@" in spec.text else spec.text
        if any(o.label == label for o in out):
            raise ValueError(f"optimizer {label!r} is listed twice in --optimizers")
        out.append(replace(spec, hparams=hp, label=label))
    # both AdamW references: foreach (every ratio's first reference) and fused (the second)
    for i, ref in enumerate(ADAMW_REFERENCES):
        if not any(o.name == ref for o in out):
            out.insert(i, OptimizerSpec(ref, {}, ref, ref))
    return out


def make_optimizer(spec: OptimizerSpec, model: nn.Module, lr: float, weight_decay: float,
                   dist_ctx: DistContext | None = None) -> torch.optim.Optimizer:
    hp = dict(spec.hparams)
    if spec.name in ADAMW_REFERENCES:
        hp.setdefault("betas", (0.9, 0.95))
        hp.setdefault("fused" if spec.name == "torch-adamw-fused" else "foreach", True)
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, **hp)
    if spec.name == "torch-muon":
        hp.setdefault("adjust_lr_fn", "match_rms_adamw")
        return torch.optim.Muon(model.parameters(), lr=lr, weight_decay=weight_decay, **hp)
    if spec.name in DOBB_NAMES:
        hp.setdefault("check_finite", False)
        if dist_ctx is not None and dist_ctx.plain:  # replicated plain tensors: statistics over the world
            hp.setdefault("stat_group", torch.distributed.group.WORLD)
    return dobb.build_optimizer(spec.name, model, lr=lr, weight_decay=weight_decay, **hp,
                                **recorded_adamw_part(spec.name, model, hp), **recorded_refresh(spec.name, hp))


def cycle_length(opt) -> int:
    group = next((g for g in opt.param_groups if g.get("algorithm") not in (None, "adamw")), None)
    if group is None:
        return 1
    if isinstance(opt, dobb.Dobb):  # refresh_width gives wide matrices a multiple of refresh_every
        return opt.refresh_cycle()
    if "refresh_every" in group:
        return int(group["refresh_every"])
    if group.get("algorithm") == "pr-muon":
        return int(group["period"])
    if group.get("algorithm") == "muonbp":  # its block steps and one full step (period 0: no full step)
        return max(1, int(group["period"]))
    if group.get("algorithm") == "splus":  # one eigh refresh of both bases every inverse_every steps
        return int(group["inverse_every"])
    if group.get("algorithm") in ("dash", "shampoo"):  # inverse roots every precondition_every steps
        return int(group["precondition_every"])
    if group.get("algorithm") in ("soap", "soap-muon"):  # a QR refresh of the bases every precondition_frequency steps
        return int(group["precondition_frequency"])
    return 1


def capture_kind(opt) -> str | None:
    """None (no hooks), "forward" (activation statistics) or "backward" (output gradients)."""
    sources = {g.get("source") for g in opt.param_groups if "source" in g}
    # two-sided Dobb from activations takes its output side from output gradients: a backward pass
    # (whose forward also captures the activations); a forward pass alone leaves that side unseen
    two_sided = any(g.get("side") == "both" and g.get("source") == "activation" for g in opt.param_groups)
    if "output_grad" in sources or two_sided:
        return "backward"
    if "activation" in sources:
        return "forward"
    return None


def is_refresh(opt) -> bool:
    return isinstance(opt, dobb.Dobb) and opt.is_refresh_step()


# ----------------------------------------------------------------------------- measurement
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


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
    # one dtype for every row's matrix products (ns_dtype / product_dtype where a spec does not set
    # it; labels unchanged), as compare's --product-dtype; None: each optimizer's own default
    product_dtype: str | None = None


def validate(cfg: TimingConfig) -> None:
    for key in ("repeats", "warmup", "tokens", "blocks", "refresh_every", "dp", "fs", "tp"):
        v = getattr(cfg, key)
        low = 0 if key == "warmup" else 1
        if not isinstance(v, int) or v < low:
            raise CliError(f"--{key.replace('_', '-')} must be an integer >= {low}, got {v!r}")
    if cfg.threads is not None and cfg.threads < 1:
        raise CliError(f"--threads must be >= 1, got {cfg.threads}")
    if cfg.dtype not in ("float32", "bfloat16", "float64"):
        raise CliError(f"--dtype must be float32, bfloat16 or float64, got {cfg.dtype!r}")
    if cfg.device not in ("cpu", "cuda"):
        raise CliError(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available")
    if cfg.product_dtype not in (None, "float32", "bfloat16"):
        raise CliError(f"--product-dtype must be float32 or bfloat16, got {cfg.product_dtype!r}")
    if cfg.rep_seconds < 0:
        raise CliError(f"--rep-seconds must be >= 0, got {cfg.rep_seconds}")
    if cfg.time_budget is not None and cfg.time_budget <= 0:
        raise CliError(f"--time-budget must be > 0 seconds, got {cfg.time_budget}")
    matrix_shapes(cfg.preset, cfg.layers, cfg.fused_qkv)  # bad --preset / --layers fail before anything runs
    parse_optimizers(cfg.optimizers, cfg.blocks, cfg.refresh_every)


def _provenance() -> dict:
    from dobb_bench.provenance import provenance

    return provenance()


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


@dataclass
class Entry:
    """One optimizer under test: its spec, the optimizer, and what was measured of it."""
    spec: OptimizerSpec
    opt: torch.optim.Optimizer | None = None
    skipped: str | None = None  # why it could not be built under this layout
    cycle: int = 1
    capture: str | None = None  # capture_kind(opt)
    per_rep: int = 1  # steps per repeat
    reps: list[list[tuple[bool, float]]] = field(default_factory=list)  # per repeat: (refresh, ms) per step
    warmup_s: float = 0.0
    warm_steps: int = 0
    state_bytes: int = 0
    rss_delta_bytes: int = 0
    cuda_state_bytes: int | None = None
    cuda_peak_extra_bytes: int | None = None

    @property
    def is_dobb(self) -> bool:
        return self.spec.name in DOBB_NAMES


class _Runner:
    """The bank, the timer and the optimizers of one run; steps one optimizer at a time."""

    def __init__(self, cfg: TimingConfig, dist_ctx: DistContext | None, say):
        self.cfg, self.dist, self.say = cfg, dist_ctx, say
        self.shapes = matrix_shapes(cfg.preset, cfg.layers, cfg.fused_qkv)
        device = cfg.device
        if device == "cuda" and dist_ctx is not None:
            device = f"cuda:{torch.cuda.current_device()}"
        self.bank = MatrixBank(self.shapes, device, getattr(torch, cfg.dtype), cfg.seed, cfg.tokens, dist_ctx)
        if dist_ctx is None:
            self.bank.synthetic_grads(cfg.seed + 1)
        else:
            self.bank.capture_pass(backward=True, accumulate=True)  # real gradients with their placements
        self.timer = _Timer(cfg.device)
        self.entries: list[Entry] = []

    def capture(self, entry: Entry) -> None:
        with _only_armed(entry, self.entries):
            self.bank.capture_pass(backward=entry.capture == "backward", accumulate=self.dist is not None)

    def step(self, entry: Entry) -> tuple[bool, float]:
        refresh = is_refresh(entry.opt)
        if refresh and entry.capture:
            self.capture(entry)
        if self.dist is not None:
            self.dist.barrier()
        return refresh, self.timer(entry.opt.step)

    def advance_to(self, entry: Entry, refresh: bool) -> bool:
        """Untimed steps until the next step is (not) a refresh; False if none within a cycle."""
        for _ in range(entry.cycle + 1):
            if is_refresh(entry.opt) == refresh:
                return True
            self.step(entry)
        return False

    def build(self, spec: OptimizerSpec) -> Entry:
        """Construct and warm up one optimizer alone, so memory deltas belong to it."""
        cfg = self.cfg
        if cfg.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            alloc0 = torch.cuda.memory_allocated()
        rss0, t0 = _rss_bytes(), time.perf_counter()
        try:
            opt = make_optimizer(spec, self.bank.model, cfg.lr, cfg.weight_decay, self.dist)
        except (ValueError, NotImplementedError) as exc:
            if self.dist is None:
                raise
            self.say(f"  {spec.label}: skipped under this layout: {exc}")
            return Entry(spec, skipped=f"{type(exc).__name__}: {exc}")
        entry = Entry(spec, opt, cycle=cycle_length(opt), capture=capture_kind(opt))
        entry.warm_steps = entry.cycle * max(cfg.warmup, -(-2 // entry.cycle))
        for _ in range(entry.warm_steps):
            self.step(entry)
        entry.warmup_s = time.perf_counter() - t0
        entry.state_bytes, entry.rss_delta_bytes = state_bytes(opt), _rss_bytes() - rss0
        if cfg.device == "cuda":
            torch.cuda.synchronize()
            entry.cuda_state_bytes = torch.cuda.memory_allocated() - alloc0
            entry.cuda_peak_extra_bytes = torch.cuda.max_memory_allocated() - alloc0
        self.say(f"  {spec.label}: built, {entry.warm_steps} warm-up step(s) in {entry.warmup_s:.1f} s; "
                 f"cycle {entry.cycle}")
        return entry

    def repeats(self, live: list[Entry]) -> list[dict]:
        """Interleaved measured repeats; returns the per-repeat records of this rank."""
        cfg, dist_ctx = self.cfg, self.dist
        # Steps per repeat: the longest cycle (a multiple of each optimizer's own), so that cheap
        # optimizers are sampled at the same moments as Dobb's cycle; one cycle for those whose
        # repeat would exceed --rep-seconds (e.g. Muon on CPU).
        longest = max(e.cycle for e in live)
        est = [e.warmup_s / e.warm_steps for e in live]
        if dist_ctx is not None:  # every rank takes the same decision
            est = [max(col) for col in zip(*dist_ctx.gather(est))]
        for e, t in zip(live, est):
            full = -(-longest // e.cycle) * e.cycle
            e.per_rep = full if t * full <= cfg.rep_seconds else e.cycle
        records, t_start = [], time.perf_counter()
        ref = next(e for e in live if e.spec.name == "torch-adamw")
        for rep in range(cfg.repeats):
            order = live[rep % len(live):] + live[: rep % len(live)]
            for entry in order:
                entry.reps.append([])
            for pos in range(max(e.per_rep for e in order)):
                for entry in order:
                    if pos < entry.per_rep:
                        entry.reps[-1].append(self.step(entry))
            for entry in order:
                records.append({"kind": "rep", "rank": 0 if dist_ctx is None else dist_ctx.rank, "rep": rep,
                                "label": entry.spec.label, "steps_ms": [t for _, t in entry.reps[-1]],
                                "refresh": [r for r, _ in entry.reps[-1]]})
            self.say(f"  repeat {rep + 1}/{cfg.repeats}: " + ", ".join(
                f"{e.spec.label} {statistics.fmean(t for _, t in e.reps[-1]):.2f} ms" for e in live)
                + f" (AdamW {statistics.fmean(t for _, t in ref.reps[-1]):.2f})")
            stop = cfg.time_budget is not None and time.perf_counter() - t_start > cfg.time_budget and rep >= 1
            if dist_ctx is not None:  # every rank stops at the same repeat
                stop = any(dist_ctx.gather(stop))
            if stop:
                self.say(f"  time budget {cfg.time_budget} s reached after {rep + 1} repeats")
                break
        return records


def run_timing(cfg: TimingConfig) -> dict:
    """Time every optimizer of ``cfg``; returns ``{"run": ..., "summaries": [...], "reps": [...]}``
    (on every rank; under torch.distributed the summaries carry every rank's numbers)."""
    validate(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist_ctx = init_distributed(cfg.dp, cfg.fs, cfg.tp, cfg.device)
    rank0 = dist_ctx is None or dist_ctx.rank == 0
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if (cfg.log and rank0) else (lambda msg: None)
    run = _Runner(cfg, dist_ctx, say)
    shapes = run.shapes
    say(f"timing: GPT-2 {cfg.preset} matrices, {len(shapes)} matrices "
        f"({sum(m * n for _, (m, n) in shapes) / 1e6:.1f}M entries), device {cfg.device}, dtype {cfg.dtype}, "
        f"{torch.get_num_threads()} thread(s), world {1 if dist_ctx is None else dist_ctx.world}")
    for spec in parse_optimizers(cfg.optimizers, cfg.blocks, cfg.refresh_every):
        if cfg.product_dtype is not None:
            spec = with_product_dtype(spec, getattr(torch, cfg.product_dtype))
        run.entries.append(run.build(spec))
    live = [e for e in run.entries if e.opt is not None]
    reps_out = run.repeats(live)

    profiles = {}
    if cfg.profile is not None:
        for entry in [e for e in live if (e.spec.label in cfg.profile if cfg.profile else e.is_dobb)]:
            profiles[entry.spec.label] = _profile_steps(run, entry)
            say(f"  profiled {entry.spec.label}")
    metered = {}
    if cfg.meter or (cfg.meter is None and dist_ctx is not None):
        for entry in live:
            if entry.is_dobb:
                run.advance_to(entry, True)
            metered[entry.spec.label] = _meter_steps(run, entry)

    summaries = [summarize(e, live, shapes, cfg.dtype, metered.get(e.spec.label), dist_ctx) for e in run.entries]
    ratios = _ratio_matrix(live)
    if dist_ctx is not None:
        summaries = merge_ranks(dist_ctx.gather(summaries))
    record = {"kind": "run", "config": jsonable(asdict(cfg)), "machine": _machine(cfg),
              "matrices": len(shapes), "entries": sum(m * n for _, (m, n) in shapes),
              "world": 1 if dist_ctx is None else dist_ctx.world, "meter": bool(metered), "ratio_matrix": ratios,
              # each ratio's range over the repeats (min, max): a step ratio's spread within one run
              "ratio_range": _ratio_range(live),
              # the run records' provenance (40-hex revision, dirty flag, bf16 flags, command)
              "provenance": _provenance()}
    return {"run": record, "summaries": summaries, "reps": reps_out, "rank0": rank0, "profiles": profiles}


def _profile_steps(run: _Runner, entry: Entry) -> dict[str, str]:
    """torch.profiler tables (operators by self time) of one step; Dobb: a non-refresh and a
    refresh step. The capture pass runs before the profiled region, as in the timed steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.cfg.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    out = {}
    for name, refresh in (("non-refresh", False), ("refresh", True)) if entry.is_dobb else (("step", None),):
        if refresh is not None and not run.advance_to(entry, refresh):
            continue
        if refresh and entry.capture:
            run.capture(entry)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts, record_shapes=True) as prof:
            entry.opt.step()
            if cuda:
                torch.cuda.synchronize()
        out[name] = (prof.key_averages().table(sort_by=sort, row_limit=25) + "\nby input shape:\n"
                     + prof.key_averages(group_by_input_shape=True).table(
                         sort_by=sort, row_limit=25, max_name_column_width=24, max_shapes_column_width=60))
    return out


class _only_armed:
    """All Dobb instances hook the same layers: during one optimizer's capture pass the others'
    capture is paused, so each optimizer captures (and meters) only its own statistics."""

    def __init__(self, entry: Entry, entries: list[Entry]):
        self.others = [e.opt for e in entries if e is not entry and isinstance(e.opt, dobb.Dobb)]
        self.stack = contextlib.ExitStack()

    def __enter__(self):
        for opt in self.others:
            self.stack.enter_context(opt.capture_paused())

    def __exit__(self, *exc):
        self.stack.close()


def _ratio_matrix(live: list[Entry]) -> dict:
    """``{row: {col: median over repeats of (row's cycle mean / col's cycle mean)}}`` (this rank)."""
    means = {e.spec.label: [statistics.fmean(t for _, t in steps) for steps in e.reps] for e in live}
    return {a: {b: statistics.median(x / y for x, y in zip(means[a], means[b])) for b in means} for a in means}


def _ratio_range(live: list[Entry]) -> dict:
    """``{row: {col: [min, max] over repeats of (row's cycle mean / col's cycle mean)]}}`` (this rank)."""
    means = {e.spec.label: [statistics.fmean(t for _, t in steps) for steps in e.reps] for e in live}
    out = {}
    for a in means:
        out[a] = {}
        for b in means:
            r = [x / y for x, y in zip(means[a], means[b])]
            out[a][b] = [min(r), max(r)]
    return out


def _meter_steps(run: _Runner, entry: Entry) -> dict:
    """Meter one step (a refresh step for Dobb, with its capture pass metered separately) and,
    for Dobb, the following non-refresh step. Not timed. ``stat_bytes``: Dobb's statistic mean
    (tagged ``"stat"``), in the capture pass or in the step, wherever the library takes it."""
    opt, out = entry.opt, {}
    for which in ("step", "next_step") if entry.is_dobb else ("step",):
        refresh = is_refresh(opt)
        if refresh and entry.capture:
            with PayloadMeter() as cap:
                run.capture(entry)
            stat = cap.kind("stat")
            out["capture_stat"] = {"collectives": stat.count, "bytes": stat.bytes}
        if run.dist is not None:
            run.dist.barrier()
        with PayloadMeter() as m:
            opt.step()
        out[which] = {"refresh": refresh, "collectives": m.collectives, "bytes": m.bytes,
                      "stat_bytes": m.kind("stat").bytes, "by_op": {k: vars(v) for k, v in m.by_op.items()}}
    return out
