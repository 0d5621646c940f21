"""bf16 against fp32 matrix-product speed on this host: the measurement behind compare's product-dtype
rule (``dobb_bench.training.row_settings.product_dtype``: bf16 where the device runs it natively).

Times ``a @ b`` for square ``n x n`` operands at each size, in fp32 and in bf16, on the CPU with
``--threads`` torch threads: each repeat runs enough products to last ``--min-seconds`` and
keeps the time per product; the record holds every repeat, their median and minimum, and the
fp32 / bf16 ratio of the medians. It also records what the ratio depends on: the CPU model and
its flags (lscpu), oneDNN's answer on native bf16 (``dobb.functional.cpu_native``), the torch
version and thread count, the load average before and after, and the git revision (run it from a
clean checkout so that the revision names the code).

    PYTHONPATH=src python scripts/product_dtype_speed.py --out docs/results/checks/product-dtype/NAME.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dobb.functional import cpu_native
from dobb_bench.provenance import provenance

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8", "fma")


def lscpu() -> dict:
    """lscpu's model name and the flags that decide bf16 products (all flags kept as well)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = fields.get("Flags", "").split()
    return {"model_name": fields.get("Model name"), "cpus": fields.get("CPU(s)"),
            "flags_of_interest": {f: f in flags for f in FLAGS_OF_INTEREST}, "flags": flags}


def time_product(n: int, dtype: torch.dtype, repeats: int, min_seconds: float) -> list[float]:
    """Seconds per ``n x n @ n x n`` product, one value per repeat."""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    for _ in range(3):  # warm-up: oneDNN picks and caches its kernel on first use
        a @ b
    out = []
    for _ in range(repeats):
        count, t0 = 0, time.perf_counter()
        while True:
            a @ b
            count += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        out.append(elapsed / count)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="128,512,768,2048")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-seconds", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        print(f"product_dtype_speed: error: malformed --sizes {args.sizes!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for n in sizes:
        f32 = time_product(n, torch.float32, args.repeats, args.min_seconds)
        b16 = time_product(n, torch.bfloat16, args.repeats, args.min_seconds)
        mf, mb = statistics.median(f32), statistics.median(b16)
        rows.append({"n": n, "fp32_ms": [x * 1e3 for x in f32], "bf16_ms": [x * 1e3 for x in b16],
                     "fp32_ms_median": mf * 1e3, "bf16_ms_median": mb * 1e3,
                     "fp32_ms_min": min(f32) * 1e3, "bf16_ms_min": min(b16) * 1e3,
                     "fp32_over_bf16_median": mf / mb, "fp32_over_bf16_min": min(f32) / min(b16)})
        print(f"n={n}: fp32 {mf * 1e3:.3f} ms, bf16 {mb * 1e3:.3f} ms, fp32/bf16 {mf / mb:.2f}x", flush=True)
    record = {"kind": "product-dtype-speed", "sizes": sizes, "repeats": args.repeats,
              "min_seconds": args.min_seconds, "threads": torch.get_num_threads(),
              "native_bf16": cpu_native(torch.bfloat16), "lscpu": lscpu(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "provenance": provenance(["scripts/product_dtype_speed.py", *(argv if argv is not None else sys.argv[1:])]),
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"product_dtype_speed: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
