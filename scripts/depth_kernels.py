"""Kernels of one Dobb step against depth (issue 54 item 3): the dispatch trace (``dobb_bench.cost.kernels``,
the path a GPU step takes) of a steady and a refresh step on banks in a GPT-2 block's pattern (fused qkv
``3d x d``, attention out ``d x d``, MLP ``4d x d`` and ``d x 4d``, small ``d``: the count depends on the
shapes' pattern, not their size) of 24 and 48 layers, for each Dobb form of the projection.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/depth_kernels.py --out docs/results/cost/depth-kernels/NAME.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dobb_bench.cost import kernels as K
from dobb_bench.cost import trace as TR
from dobb_bench.provenance import provenance

LABELS = ("dobb-b1", "dobb-b4", "dobb-both", "dobb-muon", "muon", "row-block-muon", "muonbp", "dion2")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="24,48")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--labels", default=",".join(LABELS))
    args = ap.parse_args(argv)
    d, layers = args.width, [int(x) for x in args.layers.split(",")]
    rows = {}
    for label in args.labels.split(","):
        counts = {n: {p: TR.summary(o)["kernels"] for p, o in K.step_ops(label, [(3 * d, d), (d, d), (4 * d, d),
                                                                                  (d, 4 * d)] * n).items()}
                  for n in layers}
        rows[label] = {"hparams": {k: str(v) for k, v in K.METHODS[label][1].items()},
                       "kernels": {str(n): c for n, c in counts.items()},
                       "ratio": {p: counts[layers[1]][p] / counts[layers[0]][p] for p in counts[layers[0]]}}
        print(label, rows[label]["kernels"], rows[label]["ratio"], flush=True)
    rec = {"width": d, "layers": layers, "rows": rows, "provenance": provenance(sys.argv if argv is None else argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return rec


if __name__ == "__main__":
    main()
