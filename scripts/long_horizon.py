"""The long-horizon grids: 8,300 steps (about 20 tokens per parameter) and width 256 (3,200 steps).

Resumable: every run has its own --out; compare reuses finished runs and resumes checkpoints.
Usage: python scripts/long_horizon.py WORKTREE RUNS_DIR [lh|w256|seed1]: WORKTREE is a clean
`git worktree add --detach` of the revision to measure (records name it), RUNS_DIR the
output folder; collect finished runs with `dobb-bench report --collect RUN --study long-horizon`.
`seed1`: seed 1 at each row's best finished seed-0 lr (run it once the grid is done).
`bracket`: the rest of the issue's grid at 20 tokens (one lr either side of the 800-step
optimum), then, taking turns, the next lr out for each 20-tokens row whose best finished lr is
at an edge of its finished ones and the width-256 neighbours; then the same outward step at
width 256, then a second width-256 seed at each row's best lr. Two workers pull the next task
when one finishes, so each choice sees every run finished by then.
`close`: what the issue still asks first (see next_close), then the same outward steps and seeds.
`frontier`: table:frontier-20's rows not yet run at 20 tokens (FR; see next_frontier).
`noise-first`: the width-256 rows at seed 0, then the 20-tokens rows at seed 1 (their 800-step
lr unless a neighbour already beat it), then the neighbouring lrs: the order used once the
compute left in a session could not cover the whole grid and the seed spread mattered most.
The first runs used a worktree of 197e872.
"""
import json, os, subprocess, sys, glob, time, concurrent.futures as cf, threading
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
# table:frontier-20's rows never run at 20 tokens per parameter (issue 39) and the new Dobb forms;
# the 800-step grid index is where the shard-local study found each best. Products are fp32 on
# every row (ns_dtype=float32): the earlier long-horizon rows ran on a host whose "auto" meant fp32.
FR = [
    ("Dobb B=4", "dobb:blocks=4", -1),
    ("Two-sided B=4 Bo=4", "dobb:side=both:blocks=4:out_blocks=4", -1),
    ("DASH 32", "dash:block_size=32", 1),
    ("Dion2 1/4 per shard R=4", "dion2:select=shard:blocks=4:ns_dtype=float32", 4),
    ("MuonBP R=4 P=10", "muonbp:blocks=4:period=10:ns_dtype=float32", 6),
    # as its authors run it: b2=0.95, and its AdamW part at lr/8, which puts it at 0.01 where
    # SPlus's 800-step best lr (0.08) is, the lr of the other rows' AdamW parts there
    ("SPlus Bo=4 authors", "splus:out_blocks=4:b2=0.95:adamw_lr_ratio=0.125", 8),
]
LH_SEED2 = (("Row-block Muon R=4", 0), ("MuonBP R=4 P=5", 0), ("Dobb B=1", -1), ("AdamW", -2))
SHIFT = 2  # the 20-tokens best lrs sat one to three grid steps below the 800-step ones
W256 = [r for r in LH if r[0] in ("AdamW", "Muon", "Row-block Muon R=4", "Dobb B=1", "Two-sided B=1 Bo=4")]
BASE = "dobb-bench compare --jobs 1 --layers 2 --context 64 --no-progress --checkpoint-every 500".split()
LHA = BASE + ["--steps", "8300", "--eval-every", "250"]
WA = BASE + ["--width", "256", "--steps", "3200", "--eval-every", "200"]
WT, RUNS = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("/work/exp6", "/work/runs/lh")
RE = os.environ.get("REEVAL_WORKTREE", WT)  # a clean worktree holding scripts/reeval_windows.py
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

running = set()

REEVAL = [f"{os.path.dirname(os.path.abspath(__file__))}/../docs/results/checks/reeval-windows/reeval.jsonl",
          f"{RUNS}/reeval-scratch.jsonl"]

def common(kind, label, j, seed):
    """A finished run's loss on the 2,048 common windows (scripts/reeval_windows.py), if measured."""
    name = os.path.basename(out_dir(kind, label, j, seed))
    for f in REEVAL:
        if os.path.exists(f):
            for l in open(f):
                r = json.loads(l)
                if r.get("run_dir") == name:
                    return r["common_val_loss"]
    return None

def best_j(kind, r, seed=0):
    """A row's finished lr indices and the best of them, judged on the common windows when every
    finished lr has been re-evaluated there (a 64-window eval moves lr differences by about 0.01),
    else on the logged losses; None when none has finished."""
    js = [j for j in range(r[2] - 6, r[2] + 7) if loss(kind, r[0], j, seed) is not None]
    if not js:
        return None
    c = [common(kind, r[0], j, seed) for j in js]
    v = c if None not in c else [loss(kind, r[0], j, seed) for j in js]
    return js, js[v.index(min(v))]

def edge(kind, r, seed=0):
    """The next lr index out from a row's best finished lr when that lr is at an edge."""
    got = best_j(kind, r, seed)
    if got is None:
        return None
    js, best = got
    return best - 1 if best == min(js) else best + 1 if best == max(js) else None

def _pending(tasks):
    for t in tasks:
        key = out_dir(t[0], t[1][0], t[2], t[3])
        if key not in running and loss(t[0], t[1][0], t[2], t[3]) is None:
            return t, key
    return None

started = {"lh": 0, "w256": 0}

def next_task(lock):
    """The issue's 20-tokens grid first; then the 20-tokens outward steps and the width-256 grid,
    taking turns (rows whose best lr keeps moving would otherwise starve the width-256 grid); then
    the width-256 outward steps and second seeds."""
    with lock:
        grid = (("lh", r, j, 0) for r in LH for j in (r[2] - 1, r[2], r[2] + 1))
        # AdamW last: it is far behind every matrix row, so its bracket decides no ordering
        lh_out = [("lh", r, edge("lh", r), 0) for r in LH[1:] + LH[:1] if edge("lh", r) is not None]
        # width 256: the lower neighbours, then outward steps, then the higher neighbours (every
        # 20-tokens row's higher neighbour lost; three lrs per row either way)
        w_out = [("w256", r, edge("w256", r), 0) for r in W256[1:] + W256[:1] if edge("w256", r) is not None]
        w_grid = [("w256", r, r[2] - 1, 0) for r in W256] + w_out + [("w256", r, r[2] + 1, 0) for r in W256]
        seeds = [("w256", r, best_j("w256", r)[1], 1) for r in W256 if best_j("w256", r) is not None]
        pick = _pending(grid)
        if pick is None:
            a, b = _pending(lh_out), _pending(w_grid)
            pick = (a if b is None or (a is not None and started["lh"] < started["w256"]) else b)
        pick = pick or _pending(w_out) or _pending(seeds)
        if pick is None:
            return None
        running.add(pick[1])
        started[pick[0][0]] += 1
        return pick[0]

def _leads(seeds=(0, 1), margin=-0.01):
    """Muon and the 20-tokens rows that lead it at every one of ``seeds`` (each row at its seed-0 best
    lr, paired on the common windows) by ``margin`` on average: the leads a third seed should test.
    Empty until every such run has been re-evaluated."""
    muon = next(r for r in LH if r[0] == "Muon")
    mj = (best_j("lh", muon) or (None, None))[1]
    ref = [common("lh", "Muon", mj, sd) for sd in seeds]
    if mj is None or None in ref:
        return []
    out = []
    for r in LH:
        got = best_j("lh", r)
        if r is muon or got is None or edge("lh", r) is not None:
            continue
        mine = [common("lh", r[0], got[1], sd) for sd in seeds]
        if None not in mine:
            gaps = [a - b for a, b in zip(mine, ref)]
            if max(gaps) < 0 and sum(gaps) / len(gaps) <= margin:
                out.append((r, got[1]))
    return [(muon, mj)] + out if out else []

def next_close(lock):
    """`close`: what the issue still asks first. Taking turns between the two settings: the third
    width-256 lr of each row that has fewer than three, and a second 20-tokens seed at each
    bracketed row's best lr (the first second seeds ran at the 800-step lrs, which moved); then a
    third seed for Muon and each row that leads it at both seeds (`_leads`); then the outward steps
    of the matrix rows at either setting; then the second seeds of the rows bracketed by then, at
    20 tokens and at width 256; AdamW's outward steps last (its bracket decides no ordering)."""
    with lock:
        def n_lrs(kind, r):
            got = best_j(kind, r)
            return 0 if got is None else len(got[0])
        def seed_at_best(kind, rows, bracketed):
            out = []
            for r in rows:
                got = best_j(kind, r)
                if got is not None and (edge(kind, r) is None) == bracketed:
                    out.append((kind, r, got[1], 1))
            return out
        w_third = [("w256", r, edge("w256", r), 0) for r in W256
                   if n_lrs("w256", r) < 3 and edge("w256", r) is not None]
        lh_seed = seed_at_best("lh", LH, True)
        lh_out = [("lh", r, edge("lh", r), 0) for r in LH[1:] if edge("lh", r) is not None]
        w_out = [("w256", r, edge("w256", r), 0) for r in W256 if r[0] != "AdamW" and edge("w256", r) is not None]
        adamw = [(k, r, edge(k, r), 0) for k, rows in (("lh", LH), ("w256", W256)) for r in rows
                 if r[0] == "AdamW" and edge(k, r) is not None]
        # AdamW's outward steps after the width-256 second seeds: its bracket decides no ordering
        late = (seed_at_best("lh", LH, False) + seed_at_best("w256", W256, True) + adamw
                + seed_at_best("w256", W256, False))
        third = [("lh", r, j, 2) for r, j in _leads()]
        pick = None
        for a, b in ((lh_seed, w_third), (third, []), (lh_out, w_out)):
            a, b = _pending(a), _pending(b)
            pick = a if b is None or (a is not None and started["lh"] <= started["w256"]) else b
            if pick is not None:
                break
        pick = pick or _pending(late)
        if pick is None:
            return None
        running.add(pick[1])
        started[pick[0][0]] += 1
        return pick[0]

def _fp32(row):
    """The row with fp32 Newton-Schulz products, as its earlier runs had on a host without native
    bf16 (there "auto" meant fp32; on a host with AVX512-BF16 it means bf16)."""
    label, spec, j = row
    if spec.split(":")[0] in ("muon", "muonbp", "block-muon") and "ns_dtype" not in spec:
        spec += ":ns_dtype=float32"
    return label, spec, j


def next_frontier(lock, rows=None):
    """`frontier`: the rows of FR at 20 tokens. Each row's centre lr (800-step best less SHIFT
    grid steps) at seed 0, then both neighbours, then outward steps until bracketed (judged on
    the common windows), then seeds 1 and 2 at each bracketed row's best lr."""
    rows = FR if rows is None else rows
    with lock:
        c = lambda r: r[2] - SHIFT
        centre = [("lh", r, c(r), 0) for r in rows]
        near = [("lh", r, c(r) + d, 0) for d in (-1, 1) for r in rows]
        out = [("lh", r, edge("lh", r), 0) for r in rows if edge("lh", r) is not None]
        seeds = [("lh", r, best_j("lh", r)[1], sd) for sd in (1, 2) for r in rows
                 if best_j("lh", r) is not None and edge("lh", r) is None]
        # the earlier rows with two seeds get a third at their bracketed best lr (their runs are in
        # another runs folder, so the lr is named here; table:long-horizon-best gives it)
        third = [("lh", _fp32(r), j, 2) for label, j in LH_SEED2 for r in LH if r[0] == label]
        pick = _pending(centre) or _pending(third) or _pending(near) or _pending(out) or _pending(seeds)
        if pick is None:
            return None
        running.add(pick[1])
        started["lh"] += 1
        return pick[0]


def _alive(d):
    return subprocess.run(["pgrep", "-f", "--", f"--out {d} "], capture_output=True).returncode == 0

def reeval(d):
    if os.path.exists(d + "/results.jsonl"):
        subprocess.run([sys.executable, "scripts/reeval_windows.py", d, "--out", f"{RUNS}/reeval-scratch.jsonl"],
                       cwd=RE, env=dict(env, PYTHONPATH=f"{RE}/src"))

def worker(lock, adopt=None, pick=next_task):
    # a run left by an earlier driver: wait for it (it holds this worker's core), then re-evaluate it
    if adopt is not None:
        while _alive(adopt):
            time.sleep(30)
        reeval(adopt)
    while (t := pick(lock)) is not None:
        run(*t)
        # re-evaluate on the common windows at once, so the next outward step is judged there
        reeval(out_dir(t[0], t[1][0], t[2], t[3]))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] in ("bracket", "close", "frontier"):
        pick = {"bracket": next_task, "close": next_close, "frontier": next_frontier}[sys.argv[3]]
        lock = threading.Lock()
        # adopt the runs an earlier driver left running, so a restart neither kills nor doubles them
        ps = subprocess.run(["pgrep", "-af", "--", f"--out {RUNS}/"], capture_output=True, text=True).stdout
        left = sorted({w.split()[0] for w in ps.split("--out ")[1:]})
        running.update(left)
        n = int(os.environ.get("WORKERS", "2"))
        ts = [threading.Thread(target=worker, args=(lock, left[i] if i < len(left) else None, pick)) for i in range(n)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("DRIVER_DONE", flush=True)
        sys.exit(0)
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
