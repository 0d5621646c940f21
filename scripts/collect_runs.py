"""Collects a long-horizon runs folder into the committed records: every finished run with
`dobb-bench report --collect RUN --study long-horizon`, and every common-window re-evaluation the
driver wrote to RUNS/reeval-scratch.jsonl that the committed reeval record lacks.

Usage: python scripts/collect_runs.py RUNS_DIR [--study long-horizon] [--new]

`--new` collects only the runs finished since the last collection of RUNS_DIR (the stamp file
RUNS/collected.stamp, touched after each collection): a collection of every run takes about 25 s a
run; the records are keyed, so collecting a run again changes nothing.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REEVAL = ROOT / "docs" / "results" / "checks" / "reeval-windows" / "reeval.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs")
    ap.add_argument("--study", default="long-horizon")
    ap.add_argument("--new", action="store_true", help="only runs finished since the last collection")
    a = ap.parse_args(argv)
    stamp = Path(a.runs) / "collected.stamp"
    since = stamp.stat().st_mtime if a.new and stamp.exists() else None
    started = time.time()  # the stamp's time: a run that finishes during this collection is new next time
    # a row label with "/" (Dion2 1/4 per shard) nests its run folder one level deeper
    for f in sorted(glob.glob(os.path.join(a.runs, "**", "results.jsonl"), recursive=True)):
        d = os.path.dirname(f) + os.sep
        if os.path.basename(os.path.dirname(d)) == "runs":
            continue
        if since is not None and os.path.getmtime(f) < since:
            continue
        done = any("final_val_loss" in json.loads(line) for line in open(os.path.join(d, "results.jsonl")))
        if done:
            subprocess.run(["dobb-bench", "report", "--collect", d, "--study", a.study], check=True)
    # a run is its folder and its hyperparameters: the same folder name rerun with other ones (fp32
    # products after bf16) is another run
    def key(line):
        r = json.loads(line)
        return r["run_dir"], json.dumps(r.get("hparams"), sort_keys=True)
    have = {key(line) for line in REEVAL.read_text().splitlines() if line.strip()}
    scratch = Path(a.runs) / "reeval-scratch.jsonl"
    new = [line for line in (scratch.read_text().splitlines() if scratch.exists() else [])
           if line.strip() and key(line) not in have]
    with open(REEVAL, "a") as f:
        f.writelines(line + "\n" for line in new)
    print(f"collect_runs: {len(new)} re-evaluation(s) added to {REEVAL.relative_to(ROOT)}")
    stamp.touch()
    os.utime(stamp, (started, started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
