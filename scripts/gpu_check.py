"""One-GPU optimizer-step check on GPT-2 XL matrix shapes (issue 12, item 4); see gpu_check.sh.

Every optimizer updates the same bank of bias-free ``nn.Linear`` weights (GPT-2 XL: 48 layers of
q, k, v, o ``d x d``, fc ``4d x d``, proj ``d x 4d``, d = 1600; 288 matrices, 1.47G entries, fp32)
with synthetic gradients set once; ``optimizer.step()`` is timed with CUDA events, interleaved step
by step across optimizers (rotated order), over whole Dobb cycles (T = 9). Dobb's statistics are
captured by an untimed forward of 16 random rows per layer before each refresh step, by the
library's own hooks. Reported, with goals:

- Dobb B=16 amortized / torch AdamW (fused=True) <= 1.1;
- torch.optim.Muon / Dobb >= 20; Dion rho=1/16 / Dobb >= 10;
- Dobb with its non-refresh step replayed from a CUDA graph (the element-wise chains and products
  of a shape-static step, captured once; refresh steps stay eager);
- optimizer-state bytes measured (``optimizer.state``) and peak step memory against the derived
  state (``dobb_bench.cost.roofline.set_cost``), and each step's fraction of the roofline bound measured
  on the same GPU (bandwidth: triad; matmul: 4096^3 fp32/bf16).

``--cpu-smoke`` runs the same code on CPU on two tiny layers (no CUDA graph) in seconds, which is
how it is tested without a GPU. Writes ``gpu_check.json`` (with provenance) and ``gpu_check.md``.

``--model-check`` instead measures what the step projection (``dobb-bench project``,
``dobb_bench.cost.projection``) is built from, each next to the model's prediction from the
committed inputs (H100 SXM, with its two fitted constants):

- the per-kernel cost (back-to-back one-element kernels) and the per-QR cost (a batch of blocks);
- a step (steady and, for Dobb, refresh) of each method on GPT-2 XL layer shapes (``--layers``,
  default the first two layers), predicted for one rank with no collective;
- one matrix shape at a time: NS5 in bf16 on a whole matrix (the owner's work), Dobb's bf16
  projections on a row shard, its fp32 refresh (``A Q`` and QR of one block; ``eigh`` beside it)
  and one element-wise pass. Shapes: GPT-2 XL's and Llama-3-8B's.

With ``--cpu-smoke`` the same code runs on tiny shapes on CPU (the predictions are still the
H100's). Writes ``model_check.json`` (a record, with provenance) and ``model_check.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import dobb
from dobb.meter import state_bytes
from dobb_bench.cost import roofline as R
from dobb_bench.cost.shapes import matrix_shapes
from dobb_bench.provenance import provenance


class Bank(nn.Module):
    def __init__(self, shapes, device):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(n, m, bias=False, device=device) for m, n in shapes)
        g = torch.Generator(device=device).manual_seed(1)
        for lin in self.layers:
            lin.weight.grad = torch.randn(lin.weight.shape, generator=g, device=device) * 1e-3

    def capture(self, rows: int = 16) -> None:
        with torch.enable_grad():
            for lin in self.layers:
                lin(torch.randn(rows, lin.in_features, device=lin.weight.device))


def make(name: str, bank: Bank, lr: float = 1e-3, wd: float = 0.1):
    ws = [lin.weight for lin in bank.layers]
    if name == "torch-adamw":
        return torch.optim.AdamW(ws, lr=lr, weight_decay=wd, betas=(0.9, 0.95),
                                 **({"fused": True} if ws[0].is_cuda else {"foreach": True}))
    if name == "torch-muon":
        return torch.optim.Muon(ws, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
    if name == "dion":
        return dobb.Dion(ws, lr=lr, weight_decay=wd, rank_fraction=1 / 16)
    if name in ("dobb", "dobb-graph"):
        return dobb.Dobb(ws, bank, lr=lr, weight_decay=wd, blocks=16, refresh_every=9, check_finite=False)
    raise ValueError(name)


def _cost_name(name):
    return {"torch-muon": "muon", "dobb-graph": "dobb"}.get(name, name)


class Entry:
    def __init__(self, name, bank, device):
        self.name, self.bank, self.device = name, bank, device
        base = _allocated(device)
        self.opt = make(name, bank)
        self.graph = None
        self.graph_error = None
        self.ms: list[float] = []
        self.refresh: list[bool] = []
        self.step()  # state exists after the first step (torch AdamW/Muon create it lazily)
        self.state_alloc = _allocated(device) - base

    def is_refresh(self) -> bool:
        return bool(getattr(self.opt, "is_refresh_step", lambda: False)())

    def step(self) -> float:
        refresh = self.is_refresh()
        if refresh:
            self.bank.capture()
        if self.name == "dobb-graph" and not refresh and self.device.type == "cuda":
            if self.graph is None and self.graph_error is None:
                try:
                    self._capture_graph()
                except RuntimeError as exc:  # reported in the record; the step then runs eagerly
                    self.graph_error = f"{type(exc).__name__}: {exc}"[:300]
            if self.graph is not None:
                ms = _timed(self.graph.replay, self.device)
                self._advance()
                return ms, refresh
        return _timed(self.opt.step, self.device), refresh

    def _advance(self) -> None:
        # a replay redoes the GPU work only: advance the schedule as step() does
        for st in self.opt.state.values():
            st["step"] += 1
        self.opt._rearm()

    def _capture_graph(self) -> None:
        # capture the non-refresh step once; replays redo its GPU work (lr fixed, no host sync)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.opt.step()
        torch.cuda.current_stream().wait_stream(side)
        if self.opt.is_refresh_step():  # the step to capture must be a non-refresh one: next time
            return
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.opt.step()


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def gpu_peaks(device, size: int) -> dict:
    if device.type != "cuda":
        return R.measure_peaks(mb=4, size=128, repeats=3)  # smoke only: the figures mean nothing
    n = 1 << 28  # 1 GiB per fp32 array
    a, b, c = (torch.empty(n, device=device), torch.rand(n, device=device), torch.rand(n, device=device))
    bw = max(12 * n / (_timed(lambda: torch.add(b, c, alpha=0.5, out=a), device) / 1e3) for _ in range(5)) / 1e9
    del a, b, c
    out = {"bandwidth_gbs": bw, "matmul_gflops": {}, "matmul_size": size}
    for dt in (torch.float32, torch.bfloat16):
        x, y = torch.randn(size, size, device=device, dtype=dt), torch.randn(size, size, device=device, dtype=dt)
        out["matmul_gflops"][str(dt).removeprefix("torch.")] = max(
            2 * size ** 3 / (_timed(lambda: x @ y, device) / 1e3) for _ in range(5)) / 1e9
    return out


# ----------------------------------------------------------------------------- --model-check
MODEL_SHAPES = {  # (m, n, block width s): whole-matrix NS5, row shard of FS=8, one Dobb block of width s
    "gpt2-xl q": (1600, 1600, 1600), "gpt2-xl fc": (6400, 1600, 1600), "gpt2-xl proj": (1600, 6400, 1600),
    "llama3-8b q": (4096, 4096, 1024), "llama3-8b up": (14336, 4096, 1024), "llama3-8b down": (4096, 14336, 3584),
}
SMOKE_SHAPES = {"tiny square": (64, 64, 32), "tiny tall": (128, 32, 16)}
# (label, registry name, hyperparameters, the projection's method): each method's step on one device
STEP_METHODS = [
    ("AdamW (single-tensor)", "adamw", {"foreach": False}, {"kind": "adamw"}),
    ("Muon", "muon", {}, {"kind": "gather-muon"}),
    ("Row-block Muon R=4", "block-muon", {"axis": 0, "blocks": 4}, {"kind": "row-block-muon", "blocks": 4}),
    ("MuonBP P=5", "muonbp", {"period": 5}, {"kind": "muonbp", "period": 5}),
    ("Dion2 1/4 per shard", "dion2", {"fraction": 0.25, "select": "shard"}, {"kind": "dion2-shard", "fraction": 0.25}),
    ("Dobb B=1", "dobb", {"blocks": 1, "refresh_every": 9, "stagger": False},
     {"kind": "dobb", "blocks": 1, "refresh_every": 9, "kernels": "dobb-b1"}),
    ("Dobb B=4", "dobb", {"blocks": 4, "refresh_every": 9, "stagger": False},
     {"kind": "dobb", "blocks": 4, "refresh_every": 9, "kernels": "dobb-b4"}),
    ("Two-sided Dobb B=1 Bo=4", "dobb", {"blocks": 1, "side": "both", "out_blocks": 4, "refresh_every": 9, "stagger": False},
     {"kind": "dobb-both", "blocks": 1, "out_blocks": 4, "refresh_every": 9, "kernels": "dobb-both"}),
]


def _median_ms(fn, device, repeats: int) -> float:
    fn()
    return statistics.median(_timed(fn, device) for _ in range(repeats))


def _hardware():
    from dobb_bench.cost import projection as PJ

    inputs = PJ.load_inputs()
    return PJ.Hardware.from_inputs(inputs["hardware"]["h100-sxm"], PJ.fit_constants(inputs)), inputs


def kernel_cost(device, launches: int) -> dict:
    """Per-kernel cost: ``launches`` back-to-back one-element ``add_`` calls (host dispatch and
    launch, no work), and one batched QR per factorization, each beside the fitted constant."""
    hw, _ = _hardware()
    x = torch.zeros(1, device=device)

    def many():
        for _ in range(launches):
            x.add_(1.0)

    per_kernel = _median_ms(many, device, 3) / launches
    blocks = torch.randn(16, 100, 100, device=device)
    per_qr = _median_ms(lambda: torch.geqrf(blocks), device, 3) / 16
    return {"launches": launches, "kernel_ms": per_kernel, "kernel_model_ms": 1e3 * hw.kernel_s,
            "qr_block": [100, 100], "qr_ms": per_qr, "qr_model_ms": 1e3 * hw.qr_s}


def method_steps(device, shapes, steps: int) -> list[dict]:
    """Each method's steady (and refresh) step on a bank of ``shapes`` on one device, beside the
    projection of the same step (one rank, no collective) with the committed inputs."""
    from dobb.factory import build_optimizer
    from dobb_bench.cost import projection as PJ
    from dobb_bench.cost.kernels import WEIGHT_DECAY, Bank

    hw, inputs = _hardware()
    counts = inputs["kernels"]["methods"]
    mats = [PJ.Matrix(f"m{i}", m, n, True) for i, (m, n) in enumerate(shapes)]
    rows = []
    for label, name, hp, method in STEP_METHODS:
        torch.manual_seed(0)
        bank = Bank(shapes, device)
        opt = build_optimizer(name, bank, lr=1e-3, weight_decay=WEIGHT_DECAY, **hp)  # the traced steps decay
        is_refresh = getattr(opt, "is_refresh_step", lambda: False)
        steady, refresh = [], []
        for i in range(steps):
            r = bool(is_refresh())
            if r:
                bank.capture()
            ms = _timed(opt.step, device)
            if i:  # the first step initialises state
                (refresh if r else steady).append(ms)
        model = PJ.project(method, mats, 0, PJ.Layout(fs=1), hw, False, counts, 0)
        period = name == "muonbp"  # MuonBP's full step every P: its mean step is the amortized one
        rows.append({"method": label, "steady_ms": statistics.median(steady) if steady else None,
                     "mean_ms": statistics.mean(steady) if steady else None,
                     "refresh_ms": statistics.median(refresh) if refresh else None,
                     "model_steady_ms": model["amortized_ms"] if period else model["steady_ms"],
                     "model_refresh_ms": None if period else model["periodic_ms"],
                     "model_kernels": model["kernels"], "model_terms": {k: model[k] for k in PJ.TERM_KEYS}})
    return rows


def model_check(device, shapes: dict, fs: int = 8, repeats: int = 5) -> list[dict]:
    """Measured and modelled ms of each per-matrix quantity of the projection, per shape."""
    from dobb.newton_schulz import newton_schulz
    from dobb_bench.cost import projection as PJ

    hw, _ = _hardware()
    rows = []
    for label, (m, n, s) in shapes.items():
        r = m // fs
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
        u = torch.randn(r, n, generator=g, device=device).to(torch.bfloat16)
        q = torch.linalg.qr(torch.randn(n, s, generator=g, device=device))[0].to(torch.bfloat16)
        a = torch.randn(s, s, generator=g, device=device)
        a = a @ a.T / s + torch.eye(s, device=device)
        qb = torch.linalg.qr(torch.randn(s, s, generator=g, device=device))[0]
        w, gr, mo = (torch.randn(r, n, generator=g, device=device) for _ in range(3))
        # the model's counts: roofline.step_cost via the projection's helpers, at the stated efficiencies
        bf16 = hw.bf16_eff * hw.bf16_flops
        fp32 = hw.fp32_eff * hw.fp32_flops
        ns_flops = PJ.ns_flops(m, n)
        proj_flops = 4 * r * n * s  # one block's width s over all n columns: r x n x s twice, x 2 FLOPs
        refresh_flops = 2 * s ** 3 + (4 / 3) * s ** 3  # A Q and Householder QR of one s x s block
        quantities = [
            ("NS5 bf16, whole matrix", lambda: newton_schulz(x), ns_flops / bf16),
            ("Dobb projections bf16, row shard", lambda: ((u @ q) @ q.T), proj_flops / bf16),
            ("Dobb refresh fp32: A Q + QR, one block", lambda: torch.linalg.qr(a @ qb), refresh_flops / fp32 + hw.qr_s),
            ("eigh fp32, one block (first step)", lambda: torch.linalg.eigh(a), None),
            # three in-place passes, each reading its inputs and writing its output in full (the
            # projection's rule, dobb_bench.cost.trace): mul_ 8, add_ 12, add_ 12 = 32 B an entry
            ("element-wise passes, row shard (model: 32 B an entry)", lambda: (mo.mul_(0.95).add_(gr), w.add_(mo, alpha=-1e-3)),
             32 * r * n / hw.hbm),
        ]
        for what, fn, model_s in quantities:
            rows.append({"shape": label, "m": m, "n": n, "block": s, "rows_local": r, "quantity": what,
                         "measured_ms": _median_ms(fn, device, repeats),
                         "model_ms": None if model_s is None else 1e3 * model_s})
    return rows


def _r(a, b) -> str:
    return "" if a is None or not b else f"{a / b:.2f}"


def _f(x) -> str:
    return "—" if x is None else f"{x:.4g}"


def model_check_markdown(rows, device, kernel=None, steps=None, step_shapes=None) -> str:
    md = [f"Measured on {device} against the projection's H100 SXM prediction (dobb_bench.cost.projection):", ""]
    if kernel:
        md += ["| quantity | measured ms | model ms | measured / model |", "|---|---|---|---|",
               f"| one kernel (1-element add_, {kernel['launches']} back to back) | {_f(kernel['kernel_ms'])} | "
               f"{_f(kernel['kernel_model_ms'])} | {_r(kernel['kernel_ms'], kernel['kernel_model_ms'])} |",
               f"| one QR factorization (batch of 16, 100 x 100, geqrf) | {_f(kernel['qr_ms'])} | "
               f"{_f(kernel['qr_model_ms'])} | {_r(kernel['qr_ms'], kernel['qr_model_ms'])} |", ""]
    if steps:
        md += [f"A step of each method on {len(step_shapes)} matrices ({', '.join(f'{m}x{n}' for m, n in dict.fromkeys(map(tuple, step_shapes)))}), one device:", "",
               "| method | steady ms | model | measured / model | refresh ms | model | measured / model | model kernels |",
               "|---|---|---|---|---|---|---|---|"]
        for s in steps:
            md.append(f"| {s['method']} | {_f(s['steady_ms'])} | {_f(s['model_steady_ms'])} | "
                      f"{_r(s['steady_ms'], s['model_steady_ms'])} | {_f(s['refresh_ms'])} | {_f(s['model_refresh_ms'])} | "
                      f"{_r(s['refresh_ms'], s['model_refresh_ms'])} | {s['model_kernels']:.0f} |")
        md.append("")
    md += ["| shape (m x n, block s, local rows) | quantity | measured ms | model ms | measured / model |",
           "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['shape']} ({r['m']} x {r['n']}, s {r['block']}, {r['rows_local']}) | {r['quantity']} | "
                  f"{r['measured_ms']:.4g} | {_f(r['model_ms'])} | {_r(r['measured_ms'], r['model_ms'])} |")
    return "\n".join(md) + "\n"


def run_model_check(args, device) -> int:
    cpu = device.type == "cpu"
    shapes = SMOKE_SHAPES if cpu else MODEL_SHAPES
    step_shapes = [s for _, s in matrix_shapes("tiny" if cpu else "xl", "0:1" if cpu else args.layers or "0:2")]
    kernel = kernel_cost(device, 50 if cpu else 2000)
    steps = method_steps(device, step_shapes, 11 if cpu else 20)
    rows = model_check(device, shapes, repeats=2 if cpu else 5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = {"kind": "model_check", "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "kernel": kernel, "step_shapes": step_shapes, "steps": steps,
           "rows": rows, "provenance": provenance(sys.argv)}
    (out / "model_check.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    text = model_check_markdown(rows, rec["device_name"], kernel, steps, step_shapes)
    (out / "model_check.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run of the same code (for tests)")
    ap.add_argument("--model-check", action="store_true",
                    help="measure the per-matrix quantities of dobb-bench project next to its predictions")
    ap.add_argument("--layers", default=None, help="GPT-2 XL layers (default all 48; e.g. 0:4)")
    ap.add_argument("--cycles", type=int, default=3, help="measured Dobb cycles of 9 steps")
    ap.add_argument("--slow-steps", type=int, default=3, help="steps measured for Muon and Dion")
    ap.add_argument("--out", default="gpu_out")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, preset, layers = torch.device("cpu"), "tiny", args.layers
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --cpu-smoke to test the script on CPU)", file=sys.stderr)
            return 2
        device, preset, layers = torch.device("cuda"), "xl", args.layers
    if args.model_check:
        return run_model_check(args, device)
    shapes = [s for _, s in matrix_shapes(preset, layers)]
    t_start = time.time()
    bank = Bank(shapes, device)
    base = _allocated(device)
    fast = ["torch-adamw", "dobb", "dobb-graph"]
    slow = ["torch-muon", "dion"]
    entries = {name: Entry(name, bank, device) for name in fast + slow}
    T = 9
    for e in entries.values():  # align every Dobb at the start of a cycle
        while e.is_refresh() is False and e.name.startswith("dobb"):
            e.step()
    for step in range(args.cycles * T):
        names = fast[step % 3:] + fast[:step % 3]
        if step < args.slow_steps:
            names += slow
        for name in names:
            ms, refresh = entries[name].step()
            entries[name].ms.append(ms)
            entries[name].refresh.append(refresh)
        print(f"step {step + 1}/{args.cycles * T} at {time.time() - t_start:.0f} s", flush=True)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    peaks = gpu_peaks(device, 4096)
    adamw = statistics.mean(entries["torch-adamw"].ms)
    rows = []
    for name, e in entries.items():
        amort = statistics.mean(e.ms)
        cost = R.set_cost(_cost_name(name), shapes, {"blocks": 16, "refresh_every": T, "rank_fraction": 1 / 16})
        rows.append({"optimizer": name, "amortized_ms": amort, "steps": len(e.ms),
                     "refresh_ms": statistics.mean([m for m, r in zip(e.ms, e.refresh) if r] or [float("nan")]),
                     "x_adamw": amort / adamw, "graph_error": e.graph_error, "state_bytes_measured": state_bytes(e.opt),
                     "state_alloc_bytes": e.state_alloc, "state_bytes_derived": cost["state_bytes"],
                     **{k: v for k, v in R.roofline_fraction(cost, amort, peaks).items() if k != "measured_ms"}})
    by = {r["optimizer"]: r["amortized_ms"] for r in rows}
    goals = {"dobb / fused adamw <= 1.1": by["dobb"] / by["torch-adamw"],
             "dobb-graph / fused adamw <= 1.1": by["dobb-graph"] / by["torch-adamw"],
             "torch muon / dobb >= 20": by["torch-muon"] / by["dobb"],
             "dion 1/16 / dobb >= 10": by["dion"] / by["dobb"]}
    rec = {"kind": "gpu_check", "device": str(device), "preset": preset, "layers": layers, "matrices": len(shapes),
           "entries": sum(m * n for m, n in shapes), "peaks": peaks, "rows": rows, "goals": goals,
           "peak_step_memory_bytes_all_optimizers": peak, "wall_s": time.time() - t_start,
           "provenance": provenance(sys.argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    md = [f"{device} {preset} ({len(shapes)} matrices); bandwidth {peaks['bandwidth_gbs']:.0f} GB/s, "
          f"matmul fp32 {peaks['matmul_gflops']['float32']:.0f} / bf16 {peaks['matmul_gflops']['bfloat16']:.0f} GFLOP/s",
          "", "| optimizer | amortized ms | refresh ms | x fused AdamW | state MB measured | derived | "
          "roofline bound | achieved fraction |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['optimizer']} | {r['amortized_ms']:.2f} | {r['refresh_ms']:.2f} | {r['x_adamw']:.2f} | "
                  f"{r['state_bytes_measured'] / 1e6:.1f} | {r['state_bytes_derived'] / 1e6:.1f} | {r['bound']} | "
                  f"{r['fraction']:.2f} |")
    md += ["", "| goal | measured |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in goals.items()]
    (out / "gpu_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
