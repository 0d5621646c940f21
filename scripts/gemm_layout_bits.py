"""Does this host's ``bmm`` give the same bits whatever the layout of its operands?

A refactor that keeps the numbers bit for bit (``scripts/numerics_digest.py``) may move a transpose
from memory into a product only where the product's bits do not depend on its operands' layout. This
script compares, per dtype and shape, the row-side product of the two-sided update as
``functional.rotate`` computes it, ``(Y^T Q)^T`` (``Y`` read through a transposed view, the result
transposed back), with the same product in ``Y``'s own layout, ``Q^T Y``, over batches of ``count``
blocks of ``s`` rows and ``k`` columns, and writes which shapes differ:

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/gemm_layout_bits.py --out docs/results/checks/gemm-layout/HOST.json

The answer is the host's and its BLAS's, not torch's: records say which machine (``provenance``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dobb_bench.provenance import provenance  # noqa: E402

COUNTS = (1, 2, 4, 8)
SIZES = (3, 4, 5, 6, 8, 16, 32, 64, 128, 384, 512)
WIDTHS = (5, 6, 16, 20, 24, 128, 512)


def differs(count: int, s: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> bool:
    """Whether ``(Y^T Q)^T`` and ``Q^T Y`` differ in any bit for one draw of ``count`` blocks."""
    q = torch.randn(count, s, s, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(count * s, k, generator=gen, dtype=torch.float64).to(dtype)
    as_rotate = torch.matmul(y.t().unflatten(-1, (count, s)).transpose(-3, -2), q)  # (count, k, s)
    own_layout = torch.matmul(q.transpose(-1, -2), y.view(count, s, k))  # (count, s, k)
    return not torch.equal(as_rotate.transpose(-1, -2), own_layout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the record (JSON)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        diff = [[c, s, k] for c in COUNTS for s in SIZES for k in WIDTHS if differs(c, s, k, dtype, gen)]
        rows[str(dtype).removeprefix("torch.")] = {"shapes": len(COUNTS) * len(SIZES) * len(WIDTHS),
                                                  "differ": len(diff), "differing": diff}
        print(f"{dtype}: {len(diff)} of {rows[str(dtype).removeprefix('torch.')]['shapes']} shapes differ")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "gemm-layout-bits", "counts": COUNTS, "sizes": SIZES, "widths": WIDTHS,
                               "seed": args.seed, "results": rows, "provenance": provenance(argv)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
