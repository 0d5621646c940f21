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

**Same numbers** means that difference is at most ``SAME_TOL`` (``same_numbers``); a row above it
has its ratio reported, not claimed. A peer that fails, or drops ``p.grad`` in ``step()`` without
``Pair(regrad=True)`` handing it back, is recorded as an error.

Peers that optimize matrices only (``torch.optim.Muon``, the packages' SOAP/DASH/Shampoo/Muon) get
the matrices, and torch's fused AdamW (betas 0.9/0.95) the LayerNorm, as the AdamW part of ours
does. Weight decay is 0 (the packages apply it at different points). heavyball runs with
``heavyball.utils.compile_mode = None`` (eager: no C++ compiler is assumed on a CPU host).

``shampoo`` is ours matched to pytorch-optimizer's Shampoo (``shampoo_matched``), the peer started at
step 9 so that both refresh at the first step. ``--layers`` and ``--width`` change the model (the
issue's: 2 and 768); ``--table`` renders the Markdown table of records (``docs/timing.md``).

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/peer_speed.py --out /tmp/peer_speed.json --cases soap
    python scripts/peer_speed.py --table rec1.json "rec2.json#adamw" --notes notes.json --write docs/timing.md
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
LAYERS = 2


def shapes(width: int = WIDTH):
    """``(name, out, in)`` of one layer's matrices: GPT-2 Small's at ``width`` 768."""
    return (("qkv", 3 * width, width), ("proj", width, width), ("fc", 4 * width, width), ("fc2", width, 4 * width))


SHAPES = shapes()
LR = 1e-3
ALL_2D = dict(is_matrix=lambda name, mod, p: p.dim() == 2)
# "same numbers": the largest relative difference of a parameter's 3-step weight change at most this.
# fp32 steps that order their sums differently land near 1e-7..1e-4 (pytorch-optimizer's DASH takes
# its Frobenius scale in bf16: 3e-4); a different algorithm or setting lands at 1e-2 and above.
SAME_TOL = 1e-3


class Net(nn.Module):
    def __init__(self, layers: int = LAYERS, seed: int = 0, width: int = WIDTH):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(
            nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, o, i in shapes(width)}) for _ in range(layers))
        self.ln = nn.LayerNorm(width)


def set_grads(model: nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01


def _matrices_and_rest(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return mats, rest


class Pair(torch.optim.Optimizer):
    """A matrix-only peer for the matrices, torch's fused AdamW for the LayerNorm, one ``step()``.

    ``regrad``: the matrix peer sets ``p.grad = None`` after its step (heavyball does), so each step
    hands it the same gradient tensors again (an assignment, nothing copied; heavyball reads them
    and does not write them)."""

    def __init__(self, matrix_opt, rest, regrad: bool = False):
        self.parts = (matrix_opt, torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True))
        super().__init__([p for o in self.parts for g in o.param_groups for p in g["params"]], {})
        self.grads = [(p, p.grad) for g in matrix_opt.param_groups for p in g["params"]] if regrad else []

    def step(self, closure=None):
        for p, g in self.grads:
            p.grad = g
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

    def pair(make, regrad=False):
        def build(m):
            mats, rest = _matrices_and_rest(m)
            return Pair(make(mats), rest, regrad)
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
        return pair(make, regrad=True)

    def shampoo_matched(m):
        """Ours set to pytorch-optimizer's Shampoo (tests/baselines/test_dash.py::
        test_shampoo_matches_pytorch_optimizer): factors summed (``beta_lr=1``), no gradient EMA, no
        grafting, update ``lr * L^{-1/4} G R^{-1/4}`` (``tau = 1/sqrt(max(m, n))``, one group per
        size), ``eps_inv_root`` half the peer's ``matrix_eps`` (our eigh shift adds it twice)."""
        from dobb.baselines.shampoo_family.dash import Shampoo
        from dobb.groups import param_groups

        groups = param_groups(m, algorithm="shampoo", **ALL_2D)
        matrix, rest = groups[0], groups[1:]
        by_size = {}
        for name, p in matrix["params"]:
            by_size.setdefault(max(p.shape), []).append((name, p))
        groups = [{**matrix, "params": ps, "tau": 1 / d ** 0.5} for d, ps in by_size.items()] + rest
        return Shampoo(groups, lr=LR, weight_decay=0.0, graft="none", beta_lr=1.0, beta_g=0.0,
                       precondition_every=10, eps_inv_root=0.5e-6)

    def shampoo_peer(m):
        """pytorch-optimizer's Shampoo (``matrix_eps`` 1e-6, its default) with its roots every 10
        steps, at ``step % 10 == 0``; its inverse roots start at zero, so it is started at step 9
        (its first step is a refresh, as ours is; nothing else reads the count)."""
        import pytorch_optimizer

        mats, rest = _matrices_and_rest(m)
        opt = pytorch_optimizer.Shampoo(mats, lr=LR, weight_decay=0.0, preconditioning_compute_steps=10)
        for g in opt.param_groups:
            g["step"] = 9
        return Pair(opt, rest)

    all_cases = {
        "adamw": (ours("adamw"), {
            "torch AdamW fused=True": lambda m: torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95),
                                                                  weight_decay=0.0, fused=True),
            "torch AdamW default (for-loop on CPU)": lambda m: torch.optim.AdamW(
                m.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)}, 5, ""),
        "muon": (ours("muon"), {
            "torch.optim.Muon": pair(lambda mats: torch.optim.Muon(
                mats, lr=LR, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")),
            "heavyball Muon": hb("Muon", betas=(0.95, 0.95), heavyball_momentum=True, nesterov=True)}, 1, ""),
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
        "shampoo": (shampoo_matched, {
            "pytorch-optimizer Shampoo": shampoo_peer}, 10, ""),
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


def relative_difference(delta_ours: dict, delta_peer: dict) -> float:
    """The largest, over the parameters, ``||dW_ours - dW_peer|| / ||dW_peer||`` of the weight changes."""
    return max(((delta_ours[n] - delta_peer[n]).norm() / delta_peer[n].norm().clamp_min(1e-30)).item()
               for n in delta_peer)


def same_numbers(diff: float) -> bool:
    """Whether a ``relative_difference`` is a same-numbers one (at most ``SAME_TOL``; NaN is not)."""
    return diff <= SAME_TOL


def run_case(label, make_ours, peers, round_steps, rounds, check_steps=3, log=print, make_net=Net):
    base = make_net()
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    entries = {}
    for who, make in [("ours", make_ours), *peers.items()]:
        model = make_net()
        set_grads(model)
        try:
            opt = make(model)
            for _ in range(check_steps):
                opt.step()
        except Exception as err:  # a peer that does not run here: recorded, not fatal
            log(f"  {who}: failed: {type(err).__name__}: {err}")
            entries[who] = {"error": f"{type(err).__name__}: {err}"}
            continue
        regrad = isinstance(opt, Pair) and opt.grads  # hands the gradients back itself
        if not regrad and any(p.grad is None for p in model.parameters()):  # its timed steps would step nothing
            log(f"  {who}: failed: drops p.grad in step()")
            entries[who] = {"error": "drops p.grad in step(): its later steps would have no gradient"}
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
    result["ours_ms_per_step"] = _q([statistics.fmean(x) for x in ours["ms"]]) if rounds else None
    for who in peers:
        e = entries[who]
        if "error" in e:
            result["peers"][who] = {"error": e["error"]}
            continue
        diff = relative_difference(ours["delta"], e["delta"])
        ratio = [sum(a) / sum(b) for a, b in zip(ours["ms"], e["ms"])] if rounds else []
        result["peers"][who] = {"ratio": _q(ratio) if ratio else None,
                                "peer_ms_per_step": _q([statistics.fmean(x) for x in e["ms"]]) if ratio else None,
                                "rel_diff_after_3_steps": diff, "same_numbers": same_numbers(diff), "ratios": ratio}
        if not ratio:
            log(f"  {label} / {who}: rel diff {diff:.2e}, same numbers: {same_numbers(diff)}")
            continue
        log(f"  {label} / {who}: {result['peers'][who]['ratio']['median']:.2f} "
            f"[{result['peers'][who]['ratio']['q25']:.2f}, {result['peers'][who]['ratio']['q75']:.2f}], "
            f"rel diff {diff:.2e}, same numbers: {same_numbers(diff)}")
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
            "amx": sorted(f for f in flags if f.startswith("amx")),
            "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
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


def _fmt_q(q, digits=2):
    return f"{q['median']:.{digits}f} [{q['q25']:.{digits}f}, {q['q75']:.{digits}f}]"


def _fmt_diff(peer: dict) -> str:
    d = peer["rel_diff_after_3_steps"]
    text = "bitwise (0)" if d == 0 else f"{d:.1e}"
    return text if peer.get("same_numbers", same_numbers(d)) else f"**{text}: not the same numbers**"


def table(records: list[tuple[str, dict]], notes: dict) -> str:
    """The peer-speed table in Markdown from ``(path, record)`` pairs and ``notes``
    (``{case: {peer: why}}``: why a ratio is above 1.0x, or why a row is not comparable). A path
    ``file.json#case1,case2`` keeps those cases of the record only."""
    head = ("| ours | peer | layers | ours / peer, median [IQR] (rounds x steps) | ours ms/step | peer ms/step "
            "| same numbers after 3 steps (max rel. diff of the weight change) | record | why above 1.0x, or why "
            "not comparable |")
    rows = [head, "|" + "---|" * 9]
    for path, rec in records:
        path, _, only = str(path).partition("#")
        layers = rec["settings"]["layers"]
        rev = rec.get("provenance", {}).get("git_rev", "")[:7]
        source = f"`{Path(path).name}` ({rev})" if rev else f"`{Path(path).name}`"
        for res in rec["results"]:
            case = res["case"]
            if only and case not in only.split(","):
                continue
            for peer, p in res["peers"].items():
                why = notes.get(case, {}).get(peer, "")
                if "error" in p or "error" in res:
                    cells = ["not measured", "", "", f"failed: {p.get('error') or res.get('error')}"]
                elif p.get("ratio") is None:
                    cells = ["not timed", "", "", _fmt_diff(p)]
                else:
                    cells = [f"{_fmt_q(p['ratio'])} ({res['rounds']} x {res['round_steps']})",
                             f"{res['ours_ms_per_step']['median']:.0f}", f"{p['peer_ms_per_step']['median']:.0f}",
                             _fmt_diff(p)]
                    if not why and p["ratio"]["median"] > 1.0:
                        why = "**above 1.0x, not explained**"
                rows.append(f"| `{case}` | {peer} | {layers} | " + " | ".join(cells)
                            + f" | {source} | {why or '-'} |")
    return "\n".join(rows)


TABLE_START = "<!-- peer-speed table: generated by scripts/peer_speed.py --table; do not edit by hand -->"
TABLE_END = "<!-- end of the peer-speed table -->"


def write_table(doc: Path, text: str) -> None:
    """Replace the text between ``TABLE_START`` and ``TABLE_END`` in ``doc`` by ``text``."""
    body = doc.read_text()
    a, b = body.index(TABLE_START) + len(TABLE_START), body.index(TABLE_END)
    doc.write_text(body[:a] + "\n" + text + "\n" + body[b:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the JSON record")
    ap.add_argument("--cases", nargs="*", help="subset of the cases (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rounds-preconditioned", type=int, default=3,
                    help="rounds for cases whose round is a preconditioner period (10 steps)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of the four matrices (the issue's: 2)")
    ap.add_argument("--width", type=int, default=WIDTH, help="model width (the issue's: 768; others for smoke runs)")
    ap.add_argument("--table", nargs="+", metavar="RECORD",
                    help="print the table of these records (RECORD#case,case: those cases) instead of timing")
    ap.add_argument("--notes", help="with --table: JSON {case: {peer: why}}")
    ap.add_argument("--write", help="with --table: replace the generated table in this Markdown file")
    args = ap.parse_args(argv)
    if args.table:
        notes = json.loads(Path(args.notes).read_text()) if args.notes else {}
        text = table([(p, json.loads(Path(p.partition("#")[0]).read_text())) for p in args.table], notes)
        if args.write:
            write_table(Path(args.write), text)
        print(text)
        return 0
    if not args.out:
        ap.error("--out is required when timing")
    if args.rounds < 2 or args.rounds_preconditioned < 2:
        raise ValueError("--rounds and --rounds-preconditioned must be at least 2 (an IQR needs rounds)")
    torch.set_num_threads(args.threads)
    record = {"kind": "peer_speed", "command": " ".join([sys.executable, *sys.argv]),
              "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH", "MKL_NUM_THREADS")},
              "provenance": git_rev(), "machine": machine(), "packages": versions(),
              "settings": {"layers": args.layers, "shapes": shapes(args.width), "layernorm": args.width,
                           "dtype": "float32", "threads": args.threads, "lr": LR, "weight_decay": 0.0,
                           "grad_scale": 0.01, "check_steps": 3, "same_tol": SAME_TOL, "rounds": args.rounds,
                           "rounds_preconditioned": args.rounds_preconditioned},
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": []}
    make_net = lambda: Net(layers=args.layers, width=args.width)  # noqa: E731
    for label, (make_ours, peers, steps, note) in cases(args.cases).items():
        print(f"{label}:", flush=True)
        rounds = args.rounds if steps < 10 else args.rounds_preconditioned
        res = run_case(label, make_ours, peers, steps, rounds, log=lambda *a: print(*a, flush=True),
                       make_net=make_net)
        record["results"].append(res)
        record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record["machine"]["loadavg_end"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # after every case: partial runs keep theirs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
