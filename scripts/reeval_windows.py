"""How much of a seed's spread is its held-out windows: re-evaluate saved checkpoints on one large
common window set.

A bench seed draws the initial weights, the data order and the 64 held-out windows (64 tokens
each) that every eval of the run uses. Losses of different seeds therefore differ by their windows
as well as by their training. This script loads each run's last checkpoint (the long-horizon runs
save every 500 steps; the last one of an 8,300-step run is step 8,000) and evaluates its weights
on (a) the run's own windows, which must give the loss the run logged at that step (the check
that the right weights and windows were loaded), and (b) ``--windows`` windows drawn from
``--window-seed``, the same for every run, also as the mean loss of each of 32 random groups of
those windows (the spread of a group is what an eval of that many windows varies by; paired
group differences give a standard error for a gap between two runs).

Usage: python scripts/reeval_windows.py RUN_DIR [RUN_DIR ...] --out RECORD.jsonl
(each RUN_DIR a ``dobb-bench compare --out`` folder with ``runs/<label>/checkpoint.pt`` and
``results.jsonl``). One JSON line per run: its label, lr, seed, checkpoint step, the logged loss,
the loss on its own windows, the loss on the common windows, and the provenance.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dobb_bench.provenance import provenance
from dobb_bench.training.data import eval_batches, eval_offsets, load_corpus
from dobb_bench.training.dist_env import DistEnv
from dobb_bench.training.evaluate import evaluate
from dobb_bench.training.model import GPT, ModelConfig


def _final(run_dir: str) -> dict:
    for line in open(os.path.join(run_dir, "results.jsonl")):
        r = json.loads(line)
        if "final_val_loss" in r:
            return r
    raise ValueError(f"{run_dir}: no finished run in results.jsonl")


GROUPS = 32


@torch.no_grad()
def window_losses(model, corpus, offsets, seq_len: int, batch_size: int) -> torch.Tensor:
    """Mean loss (nats/token) of every window, float64, in ``offsets``' order."""
    model.eval()
    out = []
    for x, y in eval_batches(corpus.val, offsets, seq_len, batch_size):
        logits, _ = model(x)
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        out.append(ce.view(y.shape).double().mean(1))
    return torch.cat(out)


def reeval(run_dir: str, corpus, windows: int, window_seed: int, env) -> dict:
    final = _final(run_dir)
    (ckpt,) = glob.glob(os.path.join(run_dir, "runs", "*", "checkpoint.pt"))
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    cfg = ModelConfig(**final["model"])
    model = GPT(cfg, seed=0)
    model.load_state_dict(state["model"])
    seed, seq_len = final["train"]["seed"], cfg.seq_len
    logged = [e for e in state["evals"] if e["step"] == state["step"]]
    raw = None
    offsets = eval_offsets(corpus.val, seq_len, windows, window_seed)
    if final.get("eval_weights", "raw") != "raw":
        # an optimizer that validates its iterate average (SPlus): rebuild it, load its state and
        # let it swap the average in, as the run's own evals did; the raw weights are scored too
        raw = evaluate(model, corpus, offsets, seq_len, final["train"]["eval_batch_size"], env)
        opt = _optimizer(final, model)
        opt.load_state_dict(state["optimizer"])
        opt.eval()
    own = evaluate(model, corpus, eval_offsets(corpus.val, seq_len, final["train"]["eval_seqs"], seed),
                   seq_len, final["train"]["eval_batch_size"], env)
    common = evaluate(model, corpus, offsets, seq_len, final["train"]["eval_batch_size"], env)
    per_window = window_losses(model, corpus, offsets, seq_len, final["train"]["eval_batch_size"])
    if not math.isclose(float(per_window.mean()), common, rel_tol=0, abs_tol=1e-5):
        raise ValueError(f"{run_dir}: per-window losses average {float(per_window.mean()):.6f}, not {common:.6f}")
    # GROUPS random groups of windows (a fixed permutation, the same for every run): the spread of
    # one group's loss is what an eval of that many windows varies by, and paired differences of
    # group losses give a standard error for a gap measured on all the windows
    perm = np.random.default_rng([window_seed, 0x6E0]).permutation(windows)
    groups = [float(per_window[perm[g::GROUPS]].mean()) for g in range(GROUPS)]
    return {"run": final["run"], "optimizer": final.get("optimizer"), "hparams": final.get("hparams"),
            "lr": final["lr"], "seed": seed, "steps": final["steps"], "checkpoint_step": state["step"],
            "model": final["model"], "logged_val_loss": logged[0]["val_loss"] if logged else None,
            "own_windows": final["train"]["eval_seqs"], "own_val_loss": own,
            "common_windows": windows, "window_seed": window_seed, "common_val_loss": common,
            "common_groups": groups, "eval_weights": final.get("eval_weights", "raw"),
            "common_val_loss_raw": common if raw is None else raw,
            "final_val_loss": final["final_val_loss"], "run_dir": os.path.basename(run_dir.rstrip("/")),
            "run_git_rev": (final.get("provenance") or {}).get("git_rev")}


def _optimizer(final: dict, model):
    """The run's optimizer, built as ``dobb-bench compare`` built it (its spec's hyperparameters)."""
    from dobb_bench.specs import parse_spec
    from dobb_bench.training.commands_train import make_optimizer

    body = ":".join([final["optimizer"]] + [f"{k}={v}" for k, v in (final.get("hparams") or {}).items()])
    spec = parse_spec(body)
    return make_optimizer(spec.name, spec.hparams, final["lr"], final["train"]["weight_decay"], model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--windows", type=int, default=2048)
    ap.add_argument("--window-seed", type=int, default=12345)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", help="the runs' corpus, as given to dobb-bench (default: the stdlib sources)")
    ap.add_argument("--cache-dir", help="token cache, as given to dobb-bench")
    ap.add_argument("--val-fraction", type=float, default=0.02)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    corpus = load_corpus(args.data, cache_dir=args.cache_dir, val_fraction=args.val_fraction)
    env = DistEnv()
    prov = provenance()
    done = set()
    if Path(args.out).exists():
        done = {json.loads(l)["run_dir"] for l in open(args.out)}
    with open(args.out, "a") as f:
        for run_dir in args.runs:
            if os.path.basename(run_dir.rstrip("/")) in done:
                continue
            rec = reeval(run_dir, corpus, args.windows, args.window_seed, env)
            if rec["logged_val_loss"] is not None and not math.isclose(rec["own_val_loss"], rec["logged_val_loss"],
                                                                         rel_tol=0, abs_tol=1e-5):
                print(f"{run_dir}: own-window loss {rec['own_val_loss']:.6f} differs from the logged "
                      f"{rec['logged_val_loss']:.6f}: wrong weights or windows", file=sys.stderr)
                return 1
            rec["provenance"] = prov
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"{rec['run']:22s} seed {rec['seed']} step {rec['checkpoint_step']}: own {rec['own_val_loss']:.4f} "
                  f"(logged {rec['logged_val_loss']}), common {rec['common_val_loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
