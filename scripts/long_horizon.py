"""The long-horizon grids: 8,300 steps (about 20 tokens per parameter) and width 256 (3,200 steps).

A thin call into ``dobb_bench.studies.long_horizon_runs`` (the rows, settings and orders) and
``dobb_bench.studies.define`` (the bracket-and-seed rule, the runs folder and the driver); the
driver code is this checkout's, the runs are WORKTREE's.

Usage: python scripts/long_horizon.py WORKTREE RUNS_DIR [MODE]: WORKTREE is a clean
`git worktree add --detach` of the revision to measure (records name it), RUNS_DIR the output
folder, one `--out` per run (`{RUNS_DIR}/{kind}-{slug}-j{j}-s{seed}`): a finished run is skipped,
a killed one resumes from its checkpoint. MODE: `frontier` (the rule over table:frontier-20's
rows), `bracket` or `close` (the orders the 20-tokens and width-256 grids were run in), pulled one
run at a time by WORKERS (2) workers, each run re-evaluated on the common windows when done
(scripts/reeval_windows.py of REEVAL_WORKTREE, default WORKTREE); or the static lists `seed1`,
`noise-first`, `lh`, `w256`, or none for all of the first grid. A restart adopts the runs an
earlier driver left running. Collect finished runs with `dobb-bench study NAME collect --runs
RUNS_DIR` or `dobb-bench report --collect RUN --study long-horizon`.
Runs the committed re-evaluation record holds count as finished (RECORDS_REPO, default this
checkout, names where it is read), so a new session's empty RUNS_DIR resumes the grid.
The first runs used a worktree of 197e872.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from dobb_bench.studies import long_horizon_runs as H  # noqa: E402

if __name__ == "__main__":
    WT, RUNS = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("/work/exp6", "/work/runs/lh")
    sys.exit(H.main(WT, RUNS, sys.argv[3] if len(sys.argv) > 3 else None, repo=os.environ.get("RECORDS_REPO", f"{HERE}/.."),
                    reeval_worktree=os.environ.get("REEVAL_WORKTREE", WT), workers=int(os.environ.get("WORKERS", "2"))))
