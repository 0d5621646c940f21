"""Do two revisions compute the same numbers for a study's rows on this host? (issue 55)

A run of an earlier revision counts at a later one only where the optimizer's numbers are bitwise
equal at both, on the same host kind (fp32 products round differently on other hosts). The numerics
digest (``scripts/numerics_digest.py``) checks the library on a small model with library defaults;
this script checks the bench path itself: every row's exact ``dobb-bench compare`` command (the
study's flags, fp32 products) run for ``--steps`` steps in each worktree, seed 0, and the train and
held-out losses of every eval compared for equality (a Dobb row refreshes its bases several times
within 40 steps). Writes one JSON record: the two revisions, the host, the command, and per row the
losses and whether they are equal.

    PYTHONPATH=src python scripts/same_numbers.py OLD_WORKTREE NEW_WORKTREE --out record.json

Both worktrees must be clean; ``dobb-bench`` runs from each worktree's ``src``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from dobb_bench.provenance import provenance
from dobb_bench.studies.long_horizon_runs import FR, LH, ONE_REV, TWENTY_TOKENS


def rows() -> list[tuple[str, str]]:
    """``(label, spec)`` of every 20-tokens row (table:frontier-20's and table:one-revision's)."""
    out: dict[str, str] = {}
    for r in (*LH, *FR, *ONE_REV):
        out.setdefault(r.label, r.spec)
    return list(out.items())


def git_rev(worktree: str) -> tuple[str, bool]:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=worktree, capture_output=True, text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=worktree,
                                capture_output=True, text=True, check=True).stdout.strip())
    return rev, dirty


def losses(worktree: str, spec: str, label: str, steps: int, eval_every: int, lr: float, out: str) -> dict:
    """The evals of one short run of ``spec`` in ``worktree``: ``{"train": [...], "val": [...]}``."""
    flags = TWENTY_TOKENS.args()  # the study's flags, with the run's length replaced
    i = flags.index("--steps")
    flags[i + 1] = str(steps)
    i = flags.index("--eval-every")
    flags[i + 1] = str(eval_every)
    cmd = flags + ["--seed", "0", "--lr", repr(lr), "--out", out, "--optimizers", f"{spec}@{label}"]
    env = dict(os.environ, PYTHONPATH=f"{worktree}/src", OMP_NUM_THREADS="1")
    got = subprocess.run(cmd, cwd=worktree, env=env, capture_output=True, text=True)
    if got.returncode != 0:
        return {"error": got.stderr.strip().splitlines()[-1] if got.stderr.strip() else f"exit {got.returncode}"}
    f = glob.glob(f"{out}/runs/*/metrics.jsonl")
    evals = [json.loads(x) for x in open(f[0]) if x.strip()] if f else []
    evals = [e for e in evals if e.get("type") == "eval"]
    return {"train": [e.get("train_loss") for e in evals], "val": [e.get("val_loss") for e in evals],
            "steps": [e.get("step") for e in evals], "command": " ".join(cmd)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="clean worktree of the earlier revision")
    p.add_argument("new", help="clean worktree of the later revision")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--only", help="comma-separated row labels (default: every 20-tokens row)")
    p.add_argument("--out", required=True, help="the JSON record to write")
    args = p.parse_args(argv)
    revs = {}
    for name in ("old", "new"):
        rev, dirty = git_rev(getattr(args, name))
        if dirty:
            print(f"same_numbers: worktree {getattr(args, name)} has changes: a clean tree is needed", file=sys.stderr)
            return 2
        revs[name] = rev
    want = None if not args.only else set(args.only.split(","))
    result = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (label, spec) in enumerate(rows()):
            if want is not None and label not in want:
                continue
            a = losses(args.old, spec, label, args.steps, args.eval_every, args.lr, f"{tmp}/old{k}")
            b = losses(args.new, spec, label, args.steps, args.eval_every, args.lr, f"{tmp}/new{k}")
            equal = "error" not in a and "error" not in b and a["train"] == b["train"] and a["val"] == b["val"] \
                and len(a["val"]) > 1
            result.append({"row": label, "spec": spec, "equal": equal, "old": a, "new": b})
            print(f"{label}: {'equal' if equal else 'DIFFERENT'}", flush=True)
    prov = provenance()
    rec = {"kind": "same-numbers", "old": revs["old"], "new": revs["new"], "steps": args.steps,
           "eval_every": args.eval_every, "lr": args.lr, "seed": 0, "machine": prov.get("machine"),
           "torch": prov.get("torch"), "python": prov.get("python"), "script_rev": prov.get("git_rev"),
           "script_dirty": prov.get("git_dirty"), "rows": result}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    n = sum(r["equal"] for r in result)
    print(f"{n} equal, {len(result) - n} different")
    return 0


if __name__ == "__main__":
    sys.exit(main())
