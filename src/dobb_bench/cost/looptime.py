"""``optimizer.step()`` time inside a training loop: ``dobb-bench looptime``.

Real forward/backward on the bench's GPT model, capture hooks live, every optimizer on its own
copy of the model, interleaved step by step with a rotated order so that all of them see the same
machine load; per cycle of ``T`` steps the amortized time, its ratios to torch AdamW (foreach, the
reference ``torch-adamw``) and to torch's fused AdamW (``torch-adamw-fused``) of the same cycle and max/median; optionally a ``torch.profiler`` split of the step into matmul/QR,
element-wise work and overhead; optimizer-state bytes per parameter, measured
(``dobb.meter.state_bytes``) against derived (``dobb_bench.cost.roofline.set_cost``). The record
(``looptime.json``) is what ``dobb-bench roofline --looptime`` places on the roofline.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from dobb.meter import state_bytes

from dobb_bench.cost.roofline import set_cost, write_record
from dobb_bench.provenance import provenance
from dobb_bench.specs import ADAMW_REFERENCES, parse_spec, recorded_adamw_part, refreshes, registry_entry

_MATMUL_OPS = ("bmm", "mm", "matmul", "baddbmm", "addmm", "addbmm", "linalg_", "geqrf", "orgqr",
               "householder_product", "cholesky", "triangular_solve", "eigh", "_linalg")


def _q(values: list[float]) -> dict:
    v = sorted(values)
    if len(v) == 1:
        return {"median": v[0], "q25": v[0], "q75": v[0], "n": 1}
    q = statistics.quantiles(v, n=4, method="inclusive")
    return {"median": statistics.median(v), "q25": q[0], "q75": q[2], "n": len(v)}


# ----------------------------------------------------------------------------- training-loop timing
def build(spec_text: str, model, lr: float, weight_decay: float):
    """``torch-adamw`` (``torch.optim.AdamW(foreach=True)``, betas 0.9/0.95, the reference),
    ``torch-adamw-fused`` (the same with ``fused=True``, the second reference) or any
    ``dobb.build_optimizer`` spec; Dobb variants default to ``blocks=16``."""
    import dobb

    spec = parse_spec(spec_text)
    if spec.name == "torch-adamw":
        return spec, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                                       foreach=True, **spec.hparams)
    if spec.name == "torch-adamw-fused":
        return spec, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                                       fused=True, **spec.hparams)
    hp = dict(spec.hparams)
    if refreshes(spec.name):  # Dobb and its presets (dobb.registry)
        hp.setdefault("blocks", 16)
    return spec, dobb.build_optimizer(spec.name, model, lr=lr, weight_decay=weight_decay, **hp,
                                      **recorded_adamw_part(spec.name, model, hp))


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


def _is_product(name: str) -> bool:
    return any(op in name for op in _MATMUL_OPS)


def classify_profile(events, wall_us: float) -> dict:
    """Split a step's time into matmul/QR, element-wise (every other aten kernel) and overhead
    (Python, dispatch, allocator: the wall time no aten operator accounts for).

    ``events``: the profiler's event list (``prof.events()``), each with its ``cpu_parent``. An aten
    operator's self time counts where its outermost aten ancestor does: the copy ``geqrf`` makes of its
    input into LAPACK's column-major layout, or ``householder_product``'s, is QR time, not an
    element-wise pass of the step (a ``key_averages`` split by the operator's own name counted it as
    one, until 2026-12-03)."""
    mat = elem = 0.0
    for e, _, product in _charged(events):
        if product:
            mat += e.self_cpu_time_total
        else:
            elem += e.self_cpu_time_total
    over = max(0.0, wall_us - mat - elem)
    tot = max(wall_us, 1e-9)
    return {"matmul_qr": mat / tot, "elementwise": elem / tot, "overhead": over / tot, "wall_ms": wall_us / 1e3}


def _charged(events):
    """Each aten event with the outermost aten call it runs inside (itself when it is one) and whether
    its time is product/QR time (it or that call is a product or a factorization)."""
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        top = e
        while top.cpu_parent is not None and top.cpu_parent.name.startswith("aten::"):
            top = top.cpu_parent
        yield e, top, _is_product(top.name) or _is_product(e.name)


def non_product_ops(events, n: int = 12) -> list[list]:
    """The ``n`` dearest non-product calls of a step: ``[name, input shapes, calls, microseconds]`` per
    top-level aten call and shapes, each charged the self time of everything it ran (``classify_profile``'s
    rule), dearest first. Shapes are empty unless the profile recorded them."""
    agg: dict[tuple, list] = {}
    for e, top, product in _charged(events):
        if product:
            continue
        key = (top.name, str(getattr(top, "input_shapes", None) or []))
        a = agg.setdefault(key, [0, 0.0])
        a[0] += e is top
        a[1] += e.self_cpu_time_total
    rows = sorted(([k[0], k[1], c, round(us, 1)] for k, (c, us) in agg.items()), key=lambda r: -r[3])
    return rows[:n]


def recompile_limit_for(n_compiled: int, cycle_len: int) -> int:
    """The Dynamo recompile limit that lets ``n_compiled`` optimizers each compile a graph per refresh
    pattern: the first step and each step of a staggered cycle, with room to spare. Past the limit
    the later patterns run eagerly behind failed guard checks, slower than eager
    (docs/integrations.md). Every optimizer's ``opt.step`` is the same code object (torch's step
    wrapper), so their graphs share one cache and one limit: the limit is per code, not per
    optimizer, and a second optimizer's graphs count on top of the first's."""
    return (cycle_len + 4) * max(n_compiled, 1)


def run_looptime(optimizers: list[str], *, preset: str = "small-cpu", vocab: int = 4096, batch: int = 16,
                 seq_len: int = 128, layers: int | None = None, cycles: int = 5, cycle_len: int = 9,
                 warmup: int | None = None, lr: float = 3.54e-3, weight_decay: float = 0.1, seed: int = 0,
                 profile: bool = False, compile_backend: str | None = None, skip_guards: bool = False,
                 log=print) -> dict:
    """Interleaved training-loop step timing; see the module docstring.

    ``compile_backend``: also time every optimizer but torch's AdamW with its step compiled,
    ``torch.compile(opt.step, backend=...)``, as a row of its own (``SPEC compiled``); the warmup
    must cover the refresh cycle and the first step, so that every graph is compiled before the timing
    starts, and Dynamo's recompile limit is raised to cover the cycle (one graph per refresh pattern).

    ``skip_guards`` (with ``compile_backend``): a third row per optimizer (``SPEC compiled, guards
    skipped``), its own compiled step, whose timed calls (after the warmup) run under
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: Dynamo checks only the guards that tell
    the cached graphs apart, so the gap to the ``compiled`` row is what checking every guard of the
    cached graphs costs a step. A diagnostic: unsafe for training, where a guard that is not checked
    may let a stale graph run; its final loss is in the record beside the ``compiled`` row's."""
    from dobb_bench.training.model import GPT, config_from_preset

    # both AdamW references first: torch's foreach kernel (entries[0]) and its fused kernel
    optimizers = list(ADAMW_REFERENCES) + [o for o in optimizers if o not in ADAMW_REFERENCES]
    if warmup is None:  # default: one cycle, and the first step besides when compiling
        warmup = cycle_len + (compile_backend is not None)
    cfg = config_from_preset(preset, vocab_size=vocab, seq_len=max(seq_len, 1), layers=layers)
    if skip_guards and compile_backend is None:
        raise ValueError("--skip-guards (skip_guards) times a compiled step with its guards skipped: it needs "
                         "--compile (compile_backend)")
    if compile_backend is not None and warmup <= cycle_len:
        raise ValueError(f"--compile needs --warmup > --cycle-len ({cycle_len}): every graph of the cycle, and "
                         f"the first step's, must compile before the timing starts, got --warmup {warmup}")
    if compile_backend is not None:
        n_compiled = sum(o not in ADAMW_REFERENCES for o in optimizers) * (2 if skip_guards else 1)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   recompile_limit_for(n_compiled, cycle_len))
    entries = []
    for text in optimizers:
        kinds = ("eager", "compiled", "unguarded")[: 3 if skip_guards else 2] if compile_backend else ("eager",)
        for kind in kinds if text not in ADAMW_REFERENCES else ("eager",):
            model = GPT(cfg, seed=seed)
            spec, opt = build(text, model, lr, weight_decay)
            step = opt.step if kind == "eager" else torch.compile(opt.step, backend=compile_backend)
            suffix = {"eager": "", "compiled": " compiled", "unguarded": " compiled, guards skipped"}[kind]
            entries.append({"spec": spec.text + suffix, "name": spec.name,
                            "hparams": spec.hparams, "model": model, "opt": opt, "step": step,
                            "timed_step": _unguarded(step) if kind == "unguarded" else step,
                            "compiled": compile_backend if kind != "eager" else None, "guards_skipped": kind == "unguarded",
                            "ms": [], "loss": [], "refresh": []})
    gen = torch.Generator().manual_seed(seed)

    def one_step(e, x, timed: bool = True) -> None:
        opt = e["opt"]
        refresh = bool(getattr(opt, "is_refresh_step", lambda: False)())
        opt.zero_grad(set_to_none=True)
        _, loss = e["model"](x[:, :-1], x[:, 1:])
        loss.backward()
        t0 = time.perf_counter()
        (e["timed_step"] if timed else e["step"])()
        e["ms"].append(1e3 * (time.perf_counter() - t0))
        e["loss"].append(loss.item())
        e["refresh"].append(refresh)

    total = warmup + cycles * cycle_len
    for step in range(total):
        x = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
        k = step % len(entries)
        for e in entries[k:] + entries[:k]:  # rotated order: no optimizer always runs first
            one_step(e, x, timed=step >= warmup)
    summaries = []
    ref, fused = entries[0], entries[1]
    for e in entries:
        ms = e["ms"][warmup:]
        cyc = [ms[i * cycle_len:(i + 1) * cycle_len] for i in range(cycles)]
        refc = [ref["ms"][warmup:][i * cycle_len:(i + 1) * cycle_len] for i in range(cycles)]
        fusc = [fused["ms"][warmup:][i * cycle_len:(i + 1) * cycle_len] for i in range(cycles)]
        shapes, other = _matrix_split(e["opt"])
        try:
            entry = registry_entry(e["name"])
            adamw = entry is not None and not entry.is_matrix  # torch-adamw, adamw: every entry to AdamW
            derived = set_cost(e["name"], shapes, e["hparams"], other) if shapes or adamw else None
        except ValueError:  # no derived cost model for this optimizer (block Muon): time it anyway
            derived = None
        measured = state_bytes(e["opt"])
        summaries.append({
            "spec": e["spec"], "name": e["name"], "hparams": e["hparams"], "compiled": e["compiled"],
            "guards_skipped": e["guards_skipped"],
            "amortized_ms": _q([statistics.mean(c) for c in cyc]),
            "ratio_to_adamw": _q([statistics.mean(c) / statistics.mean(r) for c, r in zip(cyc, refc)]),
            "ratio_to_fused_adamw": _q([statistics.mean(c) / statistics.mean(r) for c, r in zip(cyc, fusc)]),
            "max_over_median": _q([max(c) / statistics.median(c) for c in cyc]),
            "final_loss": statistics.mean(e["loss"][-cycle_len:]),
            "params": sum(p.numel() for p in e["model"].parameters()),
            "matrix_shapes": shapes, "adamw_entries": other,
            "state_bytes_measured": measured, "derived": derived,
            "steps_ms": ms, "refresh": e["refresh"][warmup:],
        })
        log(f"  {e['spec']:34s} amortized {summaries[-1]['amortized_ms']['median']:8.2f} ms  "
            f"x AdamW {summaries[-1]['ratio_to_adamw']['median']:.2f}  "
            f"x fused {summaries[-1]['ratio_to_fused_adamw']['median']:.2f}  "
            f"max/median {summaries[-1]['max_over_median']['median']:.2f}")
    if profile:
        for e, s in zip(entries, summaries):
            s["profile"] = _profile(e, lambda: torch.randint(0, vocab, (batch, seq_len + 1), generator=gen),
                                    one_step, cycle_len)
    return {"kind": "looptime", "config": {"preset": preset, "layers": cfg.layers, "width": cfg.width,
                                           "vocab": vocab, "batch": batch, "seq_len": seq_len,
                                           "cycles": cycles, "cycle_len": cycle_len, "warmup": warmup, "lr": lr,
                                           "weight_decay": weight_decay, "seed": seed,
                                           "compile_backend": compile_backend,
                                           "recompile_limit": (torch._dynamo.config.recompile_limit
                                                               if compile_backend else None),
                                           "threads": torch.get_num_threads()},
            "summaries": summaries}


def _unguarded(step):
    """``step`` called under ``set_stance(skip_guard_eval_unsafe=True)`` (``run_looptime``'s
    ``skip_guards`` row)."""
    def run():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return step()
    return run


def top_level_ops(events) -> int:
    """The aten operators a step calls itself (each a dispatch from Python or from a non-aten op):
    ``aten`` events whose parent is not an ``aten`` event, so ``to`` -> ``_to_copy`` -> ``copy_`` counts
    once."""
    return sum(1 for e, top, _ in _charged(events) if e is top)


def _profile(e, batch_fn, one_step, steps: int) -> dict:
    """Shares of one cycle's ``step()`` time; forward/backward run outside the profiled region. Also,
    per step of the cycle (``"steps"``): whether it refreshed, its wall, matmul/QR, element-wise and
    overhead milliseconds under the profiler, the aten operators it called (``top_level_ops``) and its
    dearest non-product calls (``non_product_ops``)."""
    from torch.profiler import profile

    agg: dict[str, list[float]] = {"matmul_qr": [], "elementwise": [], "overhead": [], "wall_ms": []}
    opt = e["opt"]
    per_step = []
    for _ in range(steps):
        x = batch_fn()
        refresh = bool(getattr(opt, "is_refresh_step", lambda: False)())
        opt.zero_grad(set_to_none=True)
        _, loss = e["model"](x[:, :-1], x[:, 1:])
        loss.backward()
        with profile(record_shapes=True) as prof:
            t0 = time.perf_counter()
            e["timed_step"]()
            wall = 1e6 * (time.perf_counter() - t0)
        events = prof.events()
        split = classify_profile(events, wall)
        for k, v in split.items():
            agg[k].append(v)
        per_step.append({"refresh": refresh, "wall_ms": split["wall_ms"],
                         **{f"{k}_ms": split[k] * split["wall_ms"] for k in ("matmul_qr", "elementwise", "overhead")},
                         "aten_ops": top_level_ops(events), "non_product_ops": non_product_ops(events)})
    walls = agg["wall_ms"]
    out = {k: (sum(w * x for w, x in zip(walls, v)) / sum(walls) if k != "wall_ms" else statistics.mean(v))
           for k, v in agg.items()}
    out["steps"] = per_step
    return out


def steps_markdown(rec: dict) -> str:
    """Per row with a per-step profile: the steps that refresh and the plain steps apart (means over
    the profiled cycle, milliseconds under the profiler), and the aten operators per step."""
    out = ["| optimizer | steps refreshing / plain | refresh: wall, non-product ms | plain: wall, non-product ms | "
           "aten ops per step, refresh / plain |", "|---|---|---|---|---|"]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    for s in rec["summaries"]:
        steps = (s.get("profile") or {}).get("steps")
        if not steps:
            continue
        cells = []
        for kind in (True, False):
            sel = [t for t in steps if t["refresh"] == kind]
            cells.append((len(sel), mean([t["wall_ms"] for t in sel]),
                          mean([t["elementwise_ms"] + t["overhead_ms"] for t in sel]),
                          mean([t["aten_ops"] for t in sel])))
        (nr, wr, er, opr), (npl, wp, ep, opp) = cells
        fmt = lambda v, d=2: "–" if v != v else f"{v:.{d}f}"
        out.append(f"| {s['spec']} | {nr} / {npl} | {fmt(wr)}, {fmt(er)} | {fmt(wp)}, {fmt(ep)} | "
                   f"{fmt(opr, 0)} / {fmt(opp, 0)} |")
    return "\n".join(out) + "\n" if len(out) > 2 else ""


def products_floor(summary: dict, adamw: dict) -> float | None:
    """The step's matmul/QR time alone (its profiled share of the amortized median) over torch
    AdamW's amortized median: a floor on the ratio that no cut of Python or element-wise work can
    go under, since the products and factorizations are the algorithm's own FLOPs."""
    p = summary.get("profile") or {}
    if "matmul_qr" not in p:
        return None
    return p["matmul_qr"] * summary["amortized_ms"]["median"] / adamw["amortized_ms"]["median"]


def looptime_markdown(rec: dict) -> str:
    out = ["| optimizer | amortized ms [IQR] | x torch AdamW [IQR] | x fused AdamW [IQR] | max/median | "
           "state B/param measured | derived | matmul/QR | element-wise | overhead | matmul/QR alone, x AdamW |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = rec["summaries"][0]
    for s in rec["summaries"]:
        a, r, mm = s["amortized_ms"], s["ratio_to_adamw"], s["max_over_median"]
        d = s.get("derived")
        p = s.get("profile") or {}
        share = [f"{100 * p[k]:.0f}%" if k in p else "–" for k in ("matmul_qr", "elementwise", "overhead")]
        floor = products_floor(s, ref)
        share.append("–" if floor is None else f"{floor:.2f}")
        derived = f"{d['state_bytes'] / d['params']:.3f}" if d else "–"
        f = s.get("ratio_to_fused_adamw")  # records from before the fused reference have none
        fcell = "–" if f is None else f"{f['median']:.2f} [{f['q25']:.2f}, {f['q75']:.2f}]"
        out.append(f"| {s['spec']} | {a['median']:.2f} [{a['q25']:.2f}, {a['q75']:.2f}] | "
                   f"{r['median']:.2f} [{r['q25']:.2f}, {r['q75']:.2f}] | {fcell} | {mm['median']:.2f} | "
                   f"{s['state_bytes_measured'] / s['params']:.3f} | {derived} | " + " | ".join(share) + " |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- command
def cmd_looptime(args) -> int:
    from dobb_bench.errors import CliError

    if args.cycles < 2 or args.cycle_len < 1:
        raise CliError("--cycles must be >= 2 and --cycle-len >= 1")
    torch.set_num_threads(args.threads)
    rec = run_looptime(args.optimizers, preset=args.preset, vocab=args.vocab, batch=args.batch,
                       seq_len=args.seq_len, layers=args.layers, cycles=args.cycles, cycle_len=args.cycle_len, warmup=args.warmup,
                       seed=args.seed, profile=args.profile, compile_backend=args.compile,
                       skip_guards=args.skip_guards)
    rec["provenance"] = provenance()
    out = Path(args.out)
    write_record(out / "looptime.json", rec)
    steps = steps_markdown(rec)
    (out / "looptime.md").write_text(looptime_markdown(rec) + ("\n" + steps if steps else ""))
    print((out / "looptime.md").read_text())
    return 0


def add_parsers(sub) -> None:
    lt = sub.add_parser("looptime", help="optimizer.step() time inside the training loop, interleaved")
    lt.add_argument("--optimizers", nargs="+", default=["torch-adamw", "dobb:blocks=16", "dobb:blocks=4",
                                                        "dobb:blocks=16:stagger=false", "muon", "dion:rank_fraction=1/16"],
                    help="specs NAME[:key=value...] (dobb_bench.specs), timed in turn")
    lt.add_argument("--preset", default="small-cpu", help="bench model preset (default: the compare default)")
    lt.add_argument("--layers", type=int, help="layers (default: the preset's; the loss records use 2)")
    lt.add_argument("--vocab", type=int, default=4096, help="vocabulary size of the model (default 4096)")
    lt.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    lt.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    lt.add_argument("--cycles", type=int, default=5, help="measured cycles (repeats)")
    lt.add_argument("--cycle-len", type=int, default=9, help="steps per cycle (Dobb's refresh period)")
    lt.add_argument("--warmup", type=int, default=None,
                    help="steps before the timing (default: --cycle-len, one more with --compile)")
    lt.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default 0)")
    lt.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    lt.add_argument("--profile", action="store_true", help="also split one cycle by operator class")
    lt.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="also time each optimizer's step compiled, torch.compile(opt.step) (default backend "
                         "inductor); give each optimizer nonfinite=off or nonfinite=skip: the default "
                         "raise reads a flag on the host, which breaks the graph")
    lt.add_argument("--skip-guards", action="store_true",
                    help="with --compile, a third row per optimizer: its compiled step timed with Dynamo's guard "
                         "checks skipped (set_stance skip_guard_eval_unsafe), to measure what the guards cost; "
                         "a diagnostic, unsafe for training")
    lt.add_argument("--out", default="runs/looptime", help="output folder (default runs/looptime)")
    lt.set_defaults(func=cmd_looptime)
