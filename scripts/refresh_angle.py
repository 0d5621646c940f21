"""How far Dobb's warm-refreshed basis is from the exact eigenbasis of its statistic (issue 40, 1.3).

Trains the bench's model (2 layers, width 128, context 64, batch 16, the stdlib corpus, seed 0) with
Dobb (``blocks=1``) at a fixed lr, once per refresh rule, and after every refresh of a matrix compares
its stored basis ``Q`` with ``E = eigh(A)`` of its stored statistic ``A`` (descending):

- ``top{k}_deg``: the largest principal angle (degrees) between ``span(Q[:, :k])`` and ``span(E[:, :k])``;
- ``offdiag``: ``||offdiag(Q^T A Q)||_F / ||A||_F``, the part of ``A`` the basis leaves off its diagonal.

One JSON line per (rule, step, matrix) to ``--out``; a summary per rule (median and max over the
matrices, by refresh index) to stdout. Usage:

    python scripts/refresh_angle.py --steps 180 --out docs/results/records/refresh-angle.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess

import torch

import dobb
from dobb_bench.training.data import BatchSampler, load_corpus
from dobb_bench.training.model import GPT, ModelConfig

RULES = {"warm qr (default)": {}, "warm qr, eigh every 4": {"eigh_every": 4}, "eigh every refresh": {"basis": "eigh"}}


def principal_angle(q: torch.Tensor, e: torch.Tensor, k: int) -> float:
    s = torch.linalg.svdvals(q[:, :k].T @ e[:, :k]).clamp(max=1.0)
    return math.degrees(math.acos(float(s.min())))


def measure(opt, names) -> list[dict]:
    out = []
    for p, plan in opt._plans.items():
        st = opt.state[p]
        n = plan.layout.global_sizes[0]
        a = st["stat"][:n, :n].double()
        q = st["basis"][:n, :n].double()
        e = torch.linalg.eigh(a).eigenvectors.flip(-1)
        c = q.T @ a @ q
        off = (c - torch.diag(torch.diagonal(c))).norm() / a.norm()
        row = {"matrix": names[id(p)], "n": n, "offdiag": float(off)}
        for k in (1, 8, 32):
            row[f"top{k}_deg"] = principal_angle(q, e, k)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    corpus = load_corpus()
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    with open(args.out, "w") as f:
        for rule, extra in RULES.items():
            torch.manual_seed(0)
            cfg = ModelConfig(vocab_size=256, width=128, heads=4, layers=2, seq_len=64, fused_qkv=True, bias=False,
                              tied=True)
            model = GPT(cfg)
            names = {id(p): n for n, p in model.named_parameters()}
            opt = dobb.build_optimizer("dobb", model, lr=args.lr, weight_decay=0.1, blocks=1, stagger=False, **extra)
            sampler = BatchSampler(corpus.train, 64, 16, seed=0)
            summary = []
            for step in range(args.steps):
                refresh = opt.is_refresh_step()
                x, y = sampler.micro_batch(step, 0, 1)
                _, loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if refresh and step > 0:
                    rows = measure(opt, names)
                    for r in rows:
                        f.write(json.dumps({"rule": rule, "step": step, "lr": args.lr, "git_rev": rev,
                                            "git_dirty": dirty, **r}) + "\n")
                    summary.append((step, rows))
            print(f"== {rule}")
            for step, rows in summary:
                top8 = [r["top8_deg"] for r in rows]
                off = [r["offdiag"] for r in rows]
                print(f"step {step:4d}  top8 median {statistics.median(top8):6.2f} max {max(top8):6.2f} deg   "
                      f"offdiag median {statistics.median(off):.4f} max {max(off):.4f}")


if __name__ == "__main__":
    main()
