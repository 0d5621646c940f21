"""What a run reports about itself: state size, peak memory, optimizer options, JSON lines.

Split from ``train.py`` (the loop) so the loop file stays readable; ``train`` re-exports these.
"""
from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path

import torch

import dobb
from dobb.meter import state_bytes


# the one definition of optimizer state size (dobb.meter.state_bytes), under the name train.py uses
optimizer_state_bytes = state_bytes


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _clean(value):
    """JSON-safe: non-finite floats become null (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(_clean(r)) + "\n")
    os.replace(tmp, path)


def optimizer_options(optimizer) -> list[dict]:
    """Every param group's options after defaults (JSON-ready), one entry per distinct group."""
    out = []
    for g in optimizer.param_groups:
        opts = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (tuple, list)):
                v = [x for x in v if isinstance(x, (int, float, str, bool)) or x is None]
            elif not (isinstance(v, (int, float, str, bool)) or v is None):
                v = str(v)
            opts[k] = v
        opts["n_params"] = len(g["params"])
        if "product_dtype" in g and "basis_dtype" in g and g["params"]:
            # the dtype Dobb's products actually ran in on this device (records name it)
            dev = g["params"][0].device
            opts["product_dtype_resolved"] = str(dobb.functional.matmul_dtype(g["basis_dtype"], dev, g["product_dtype"]))
        if "ns_dtype" in g and g["params"]:
            # the dtype the Muon family's Newton-Schulz actually ran in ("auto" resolves per device)
            opts["ns_dtype_resolved"] = str(dobb.baselines.resolve_ns_dtype(g["ns_dtype"], g["params"][0].device))
        if opts not in out:
            out.append(opts)
    return out
