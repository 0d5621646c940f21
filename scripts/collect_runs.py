"""Collects a long-horizon runs folder into the committed records: every finished run with
`dobb-bench report --collect RUN --study long-horizon`, and every common-window re-evaluation the
driver wrote to RUNS/reeval-scratch.jsonl that the committed reeval record lacks.

Usage: python scripts/collect_runs.py RUNS_DIR [--study long-horizon]
"""
import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REEVAL = ROOT / "docs" / "results" / "checks" / "reeval-windows" / "reeval.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs")
    ap.add_argument("--study", default="long-horizon")
    a = ap.parse_args(argv)
    for d in sorted(glob.glob(os.path.join(a.runs, "*", ""))):
        if not os.path.exists(os.path.join(d, "results.jsonl")):
            continue
        done = any("final_val_loss" in json.loads(line) for line in open(os.path.join(d, "results.jsonl")))
        if done:
            subprocess.run(["dobb-bench", "report", "--collect", d, "--study", a.study], check=True)
    have = {json.loads(line)["run_dir"] for line in REEVAL.read_text().splitlines() if line.strip()}
    scratch = Path(a.runs) / "reeval-scratch.jsonl"
    new = [line for line in (scratch.read_text().splitlines() if scratch.exists() else [])
           if line.strip() and json.loads(line)["run_dir"] not in have]
    with open(REEVAL, "a") as f:
        f.writelines(line + "\n" for line in new)
    print(f"collect_runs: {len(new)} re-evaluation(s) added to {REEVAL.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
