"""Peer-speed table: each of our optimizers that has a released peer, timed against that peer.

Setup (issue 44): GPT-2-Small-shaped matrices, 2 layers of ``qkv`` 2304x768, ``proj`` 768x768,
``fc`` 3072x768, ``fc2`` 768x3072 (bias-free), plus one LayerNorm(768); fp32, one thread
(``torch.set_num_threads(1)``), fixed Gaussian gradients set once. For every case, ours and each
peer start from the same weights and see the same gradients:

1. **same numbers**: 3 steps each (they are also the warm-up: the first preconditioner refresh is
   in them); reported per peer as the largest, over the parameters, relative difference of the
   3-step weight change, ``||dW_ours - dW_peer|| / ||dW_peer||``;
2. **speed**: ``--rounds`` rounds; in a round every optimizer of the case takes ``--round-steps``
   steps (a preconditioner period, 10, for the preconditioned ones, so each round holds one
   refresh; 5 for AdamW; 1 for Muon, whose every step is the same work),
   interleaved step by step, the order rotated every step; the ratio of a round is
   ``sum(ours) / sum(peer)``; reported: median and IQR over rounds, and each side's median ms
   per step.

Peers that optimize matrices only (``torch.optim.Muon``, the packages' SOAP/DASH/Shampoo/Muon) get
the matrices, and torch's fused AdamW (betas 0.9/0.95) the LayerNorm, as the AdamW part of ours
does. Weight decay is 0 (the packages apply it at different points). heavyball runs with
``heavyball.utils.compile_mode = None`` (eager: no C++ compiler is assumed on a CPU host).

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/peer_speed.py --out docs/results/peers/peer_speed.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import dobb

WIDTH = 768
SHAPES = (("qkv", 3 * WIDTH, WIDTH), ("proj", WIDTH, WIDTH), ("fc", 4 * WIDTH, WIDTH), ("fc2", WIDTH, 4 * WIDTH))
LR = 1e-3
ALL_2D = dict(is_matrix=lambda name, mod, p: p.dim() == 2)


class Net(nn.Module):
    def __init__(self, layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(
            nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, o, i in SHAPES}) for _ in range(layers))
        self.ln = nn.LayerNorm(WIDTH)


def set_grads(model: nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01


def _matrices_and_rest(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return mats, rest


class Pair(torch.optim.Optimizer):
    """A matrix-only peer for the matrices, torch's fused AdamW for the LayerNorm, one ``step()``."""

    def __init__(self, matrix_opt, rest):
        self.parts = (matrix_opt, torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True))
        super().__init__([p for o in self.parts for g in o.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        for o in self.parts:
            o.step()


# ----------------------------------------------------------------------------- peers
def _ista_dash():
    """ista-daslab's ``dash`` module, loaded once (``load_dash_package`` replaces the package in
    ``sys.modules``; a second call could not find it again)."""
    loaded = sys.modules.get("ista_daslab_optimizers.dash")
    if loaded is not None:
        return loaded
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_dash import load_dash_package

    return load_dash_package()


def _heavyball():
    import heavyball
    import heavyball.utils

    heavyball.utils.compile_mode = None
    return heavyball


def cases(names):
    """``{case: (ours_factory, {peer_label: peer_factory}, round_steps, note)}``."""
    def ours(name, **hp):
        grouping = ALL_2D if dobb.registry.get(name).is_matrix else {}
        return lambda m: dobb.build_optimizer(name, m, lr=LR, weight_decay=0.0, **grouping, **hp)

    def pair(make):
        def build(m):
            mats, rest = _matrices_and_rest(m)
            return Pair(make(mats), rest)
        return build

    def po(name, **kw):
        def make(mats):
            import pytorch_optimizer
            return getattr(pytorch_optimizer, name)(mats, lr=LR, weight_decay=0.0, **kw)
        return pair(make)

    def ista(**cfg):
        def make(mats):
            D = _ista_dash()
            kinds = {"NDB": D.DashInverseRootMethodType.NDB, "EVD": D.DashInverseRootMethodType.EVD}
            scaling = {"FRO": D.DashMatrixScalingType.FRO, "POWER_ITER": D.DashMatrixScalingType.POWER_ITER}
            cfg2 = dict(cfg)
            cfg2["inv_root_method"] = kinds[cfg2.get("inv_root_method", "EVD")]
            if "matrix_scaling_type" in cfg2:
                cfg2["matrix_scaling_type"] = scaling[cfg2["matrix_scaling_type"]]
            return D.DashGpu([{"params": mats}], lr=LR, weight_decay=0.0, config=D.DashConfig(**cfg2))
        return pair(make)

    def hb(name, **kw):
        def make(mats):
            return getattr(_heavyball(), name)(mats, lr=LR, weight_decay=0.0, **kw)
        return pair(make)

    all_cases = {
        "adamw": (ours("adamw"), {
            "torch AdamW fused=True": lambda m: torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95),
                                                                  weight_decay=0.0, fused=True),
            "torch AdamW default (for-loop on CPU)": lambda m: torch.optim.AdamW(
                m.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)}, 5, ""),
        "muon": (ours("muon"), {
            "torch.optim.Muon": pair(lambda mats: torch.optim.Muon(
                mats, lr=LR, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")),
            "heavyball Muon": hb("Muon")}, 1, ""),
        "dash eigh B=128": (ours("dash", block_size=128, inverse_root="eigh"), {
            "ista-daslab DASH (EVD)": ista(block_size=128, inv_root_method="EVD"),
            "pytorch-optimizer DASH (eigh)": po("DASH", block_size=128, inverse_root_method="eigh")}, 10, ""),
        "dash newton-db x10 B=128": (ours("dash", block_size=128, inverse_root="newton-db", newton_steps=10,
                                          newton_tol=0.0), {
            "ista-daslab DASH (NDB, Frobenius)": ista(block_size=128, inv_root_method="NDB", newton_steps=10,
                                                     matrix_scaling_type="FRO"),
            "pytorch-optimizer DASH (newton_db, Frobenius)": po(
                "DASH", block_size=128, inverse_root_method="newton_db", newton_steps=10,
                matrix_scaling="frobenius")}, 10, ""),
        "soap": (ours("soap"), {
            "pytorch-optimizer SOAP": po("SOAP"),
            "heavyball SOAP": hb("SOAP", precondition_frequency=10, max_precond_dim=10000)}, 10, ""),
        "shampoo": (ours("shampoo"), {
            "pytorch-optimizer Shampoo": po("Shampoo", preconditioning_compute_steps=10)}, 10, ""),
    }
    unknown = set(names or ()) - set(all_cases)
    if unknown:
        raise ValueError(f"unknown case(s) {sorted(unknown)}; valid: {list(all_cases)}")
    return {k: all_cases[k] for k in names} if names else all_cases  # in the order asked for


# ----------------------------------------------------------------------------- measuring
def _q(v):
    v = sorted(v)
    if len(v) == 1:
        return {"median": v[0], "q25": v[0], "q75": v[0], "n": 1}
    q = statistics.quantiles(v, n=4, method="inclusive")
    return {"median": statistics.median(v), "q25": q[0], "q75": q[2], "n": len(v)}


def run_case(label, make_ours, peers, round_steps, rounds, check_steps=3, log=print):
    base = Net()
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    entries = {}
    for who, make in [("ours", make_ours), *peers.items()]:
        model = Net()
        set_grads(model)
        try:
            opt = make(model)
            for _ in range(check_steps):
                opt.step()
        except Exception as err:  # a peer that does not run here: recorded, not fatal
            log(f"  {who}: failed: {type(err).__name__}: {err}")
            entries[who] = {"error": f"{type(err).__name__}: {err}"}
            continue
        delta = {n: p.detach() - start[n] for n, p in model.named_parameters()}
        entries[who] = {"model": model, "opt": opt, "delta": delta, "ms": []}
    ours = entries["ours"]
    result = {"case": label, "round_steps": round_steps, "rounds": rounds, "peers": {}}
    if "error" in ours:
        result["error"] = ours["error"]
        return result
    live = [w for w, e in entries.items() if "error" not in e]
    for r in range(rounds):
        for e in live:
            entries[e]["ms"].append([])
        for s in range(round_steps):
            k = (r * round_steps + s) % len(live)
            for who in live[k:] + live[:k]:
                e = entries[who]
                t0 = time.perf_counter()
                e["opt"].step()
                e["ms"][-1].append(1e3 * (time.perf_counter() - t0))
        log(f"  round {r}: " + ", ".join(f"{w} {statistics.fmean(entries[w]['ms'][-1]):.1f} ms" for w in live))
    result["ours_ms_per_step"] = _q([statistics.fmean(x) for x in ours["ms"]])
    for who in peers:
        e = entries[who]
        if "error" in e:
            result["peers"][who] = {"error": e["error"]}
            continue
        diff = max(((ours["delta"][n] - e["delta"][n]).norm() / e["delta"][n].norm().clamp_min(1e-30)).item()
                   for n in e["delta"])
        ratio = [sum(a) / sum(b) for a, b in zip(ours["ms"], e["ms"])]
        result["peers"][who] = {"ratio": _q(ratio), "peer_ms_per_step": _q([statistics.fmean(x) for x in e["ms"]]),
                                "rel_diff_after_3_steps": diff, "ratios": ratio}
        log(f"  {label} / {who}: {result['peers'][who]['ratio']['median']:.2f} "
            f"[{result['peers'][who]['ratio']['q25']:.2f}, {result['peers'][who]['ratio']['q75']:.2f}], "
            f"rel diff {diff:.2e}")
    return result


def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    lscpu = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in sh(["lscpu"]).splitlines() if ":" in ln)}
    keep = ("Architecture", "Model name", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache")
    flags = lscpu.get("Flags", "").split()
    return {**{k: lscpu.get(k) for k in keep}, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "loadavg_start": os.getloadavg(),
            "python": platform.python_version(), "torch": torch.__version__}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("pytorch-optimizer", "ista-daslab-optimizers", "heavyball"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def git_rev() -> dict:
    root = Path(__file__).resolve().parents[1]
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True).stdout
    return {"git_rev": rev, "clean_tree": not dirty.strip(), "root": str(root)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON record")
    ap.add_argument("--cases", nargs="*", help="subset of the cases (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rounds-preconditioned", type=int, default=3,
                    help="rounds for cases whose round is a preconditioner period (10 steps)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.rounds_preconditioned < 2:
        raise ValueError("--rounds and --rounds-preconditioned must be at least 2 (an IQR needs rounds)")
    torch.set_num_threads(args.threads)
    record = {"kind": "peer_speed", "command": " ".join([sys.executable, *sys.argv]),
              "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH", "MKL_NUM_THREADS")},
              "provenance": git_rev(), "machine": machine(), "packages": versions(),
              "settings": {"layers": 2, "shapes": SHAPES, "layernorm": WIDTH, "dtype": "float32",
                           "threads": args.threads, "lr": LR, "weight_decay": 0.0, "grad_scale": 0.01,
                           "check_steps": 3, "rounds": args.rounds, "rounds_preconditioned": args.rounds_preconditioned},
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": []}
    for label, (make_ours, peers, steps, note) in cases(args.cases).items():
        print(f"{label}:", flush=True)
        rounds = args.rounds if steps < 10 else args.rounds_preconditioned
        res = run_case(label, make_ours, peers, steps, rounds, log=lambda *a: print(*a, flush=True))
        record["results"].append(res)
        record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record["machine"]["loadavg_end"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # after every case: partial runs keep theirs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
