"""The long-horizon grids: 8,300 steps (about 20 tokens per parameter) and width 256 (3,200 steps).

Resumable: every run has its own --out; compare reuses finished runs and resumes checkpoints.
Usage: python scripts/long_horizon.py WORKTREE RUNS_DIR [lh|w256|seed1]: WORKTREE is a clean
`git worktree add --detach` of the revision to measure (records name it), RUNS_DIR the
output folder; collect finished runs with `dobb-bench report --collect RUN --study long-horizon`.
`seed1`: seed 1 at each row's best finished seed-0 lr (run it once the grid is done).
`noise-first`: the width-256 rows at seed 0, then the 20-tokens rows at seed 1 (their 800-step
lr unless a neighbour already beat it), then the neighbouring lrs: the order used once the
compute left in a session could not cover the whole grid and the seed spread mattered most.
The first runs used a worktree of 197e872.
"""
import json, os, subprocess, sys, glob, concurrent.futures as cf, threading
G = lambda j: 5e-3 * 2 ** (j / 2)
# label, spec, 800-step best grid index j
LH = [
    ("AdamW", "adamw", -1),
    ("Muon", "muon", 2),
    ("SOAP", "soap", 2),
    ("MuonBP R=4 P=5", "muonbp:blocks=4:period=5", 3),
    ("Row-block Muon R=4", "block-muon:axis=0:blocks=4", 2),
    ("Dobb B=1", "dobb:blocks=1", 0),
    ("Two-sided B=1 Bo=1", "dobb:side=both", 0),
    ("Two-sided B=1 Bo=4", "dobb:side=both:blocks=1:out_blocks=4", 0),
]
W256 = [r for r in LH if r[0] in ("AdamW", "Muon", "Row-block Muon R=4", "Dobb B=1", "Two-sided B=1 Bo=4")]
BASE = "dobb-bench compare --jobs 1 --layers 2 --context 64 --no-progress --checkpoint-every 500".split()
LHA = BASE + ["--steps", "8300", "--eval-every", "250"]
WA = BASE + ["--width", "256", "--steps", "3200", "--eval-every", "200"]
WT, RUNS = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("/work/exp6", "/work/runs/lh")
env = dict(os.environ, PYTHONPATH=f"{WT}/src", OMP_NUM_THREADS="1")

def out_dir(kind, label, j, seed):
    slug = label.replace(" ", "").replace("=", "").replace("-", "")
    return f"{RUNS}/{kind}-{slug}-j{j}-s{seed}"

def loss(kind, label, j, seed):
    for f in glob.glob(out_dir(kind, label, j, seed) + "/results.jsonl"):
        for l in open(f):
            r = json.loads(l)
            if "final_val_loss" in r:
                return float("inf") if r.get("diverged") else r["final_val_loss"]
    return None

def run(kind, row, j, seed):
    label, spec, _ = row
    if loss(kind, label, j, seed) is not None:
        return
    args = (LHA if kind == "lh" else WA) + ["--seed", str(seed), "--lr", repr(G(j)),
            "--out", out_dir(kind, label, j, seed), "--optimizers", f"{spec}@{label}"]
    print(" ".join(args), flush=True)
    subprocess.run(args, cwd=WT, env=env)
    print("done", kind, label, j, seed, loss(kind, label, j, seed), flush=True)

def tasks():
    # phase 1: each row at its 800-step best; then neighbours below, above; then extend edges; then seed 1
    yield from (("lh", r, r[2], 0) for r in LH)
    yield from (("w256", r, r[2], 0) for r in W256)
    yield from (("lh", r, r[2] - 1, 0) for r in LH)
    yield from (("lh", r, r[2] + 1, 0) for r in LH)
    yield from (("w256", r, r[2] - 1, 0) for r in W256)
    yield from (("w256", r, r[2] + 1, 0) for r in W256)

def seed1():
    for kind, rows in (("lh", LH), ("w256", W256)):
        for r in rows:
            done = [(loss(kind, r[0], j, 0), j) for j in range(r[2] - 3, r[2] + 4)]
            done = [(v, j) for v, j in done if v is not None]
            if done:
                yield kind, r, min(done)[1], 1


if __name__ == "__main__":
    only = sys.argv[3] if len(sys.argv) > 3 else None
    if only == "seed1":
        todo = list(seed1())
    elif only == "noise-first":
        todo = [("w256", r, r[2], 0) for r in W256]
        todo += [t for t in seed1() if t[0] == "lh"] + list(tasks())
    else:
        todo = [t for t in tasks() if only is None or t[0] == only]
    with cf.ThreadPoolExecutor(int(os.environ.get("WORKERS", "2"))) as ex:
        list(ex.map(lambda t: run(*t), todo))
    print("DRIVER_DONE", flush=True)
