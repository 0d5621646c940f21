"""Kernels each method's ``optimizer.step()`` launches, counted from a ``torch.profiler`` trace.

A GPU step this size is bound by launch and dispatch as much as by bytes and FLOPs, so the
projection (``dobb_bench.cost.projection``) charges a per-kernel cost times the number of kernels
a step launches. That number is a property of the code path, not of the device: each top-level
compute op of an eager step is one kernel launch on a GPU, whatever the shape. So it is counted
here, on CPU, from a profiler trace of the library's own step:

- **kernels**: top-level ``aten::`` ops (no ``aten::`` ancestor) that run compute, i.e. the op or
  one of its descendants is not a metadata op (views, reshapes, ``empty``, dtype queries; the
  ``METADATA`` set). ``aten::to`` that copies counts; one that does not, does not.
- **per matrix / per group**: a bank of ``2, 3, 4`` equal-shape matrices (and one of two
  shapes) gives ``K(N) = per_matrix N + per_group`` (the three points must be collinear, else the
  count is refused) and ``per_shape`` (the extra kernels of a second distinct shape: shape-batched
  code runs once per shape).
- **QR factorizations**: the matrices ``aten::linalg_qr`` factors per matrix (a batched call of
  ``b`` blocks is ``b``): cuSOLVER's Householder QR is a sequence of panel kernels, so the model
  charges it apart from the generic kernel cost.

How grouping changes the count: a ``_foreach_`` op is one top-level op for the whole list, so it
lands in ``per_group``, not ``per_matrix`` (on a GPU it launches one multi-tensor kernel per chunk
of tensors; the count here is one per op). ``torch.compile`` of the step fuses each element-wise
chain into one generated kernel and leaves matrix products and ``linalg`` calls as they are: the
compiled count is the ``matmul``/``linalg`` ops of the trace plus one per fused chain
(``compiled_estimate``, beside the eager count of the same two-matrix step), an estimate, not a
trace.

``count_all()`` is deterministic (same torch, same counts); the projection's inputs hold its
result, and ``tests/bench/cost/test_kernels.py`` recounts and compares.
"""
from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

METADATA = frozenset(f"aten::{n}" for n in (
    "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "alias", "detach", "detach_", "t",
    "transpose", "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select", "permute", "empty",
    "empty_strided", "empty_like", "lift_fresh", "promote_types", "resolve_conj", "resolve_neg", "to",
    "result_type", "split", "split_with_sizes", "chunk", "unbind", "narrow", "contiguous", "flatten",
    "view_as", "unflatten", "movedim", "diagonal", "mT", "mH", "matrix_H", "numpy_T", "conj", "real",
    "is_nonzero", "size", "stride", "numel", "dim", "_has_compatible_shallow_copy_type", "set_",
    "item", "_local_scalar_dense", "lift", "unfold", "swapaxes", "transpose_", "t_", "squeeze_", "unsqueeze_", "_conj", "_neg_view"))
QR = frozenset({"aten::linalg_qr", "aten::geqrf"})
MATMUL = frozenset(f"aten::{n}" for n in ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addmm_", "baddbmm_"))

# (label, registry name, hyperparameters): the methods the projection charges
METHODS: dict[str, tuple[str, dict]] = {
    "adamw": ("adamw", {"foreach": False}),
    "adamw-foreach": ("adamw", {"foreach": True}),
    "muon": ("muon", {}),
    "row-block-muon": ("block-muon", {"axis": 0, "blocks": 4}),
    "muonbp": ("muonbp", {"period": 5}),
    "dion2": ("dion2", {"fraction": 0.25, "select": "shard"}),
    "dion": ("dion", {"rank_fraction": 0.25}),
    "dobb-b1": ("dobb", {"blocks": 1, "refresh_every": 3, "stagger": False}),
    "dobb-b4": ("dobb", {"blocks": 4, "refresh_every": 3, "stagger": False}),
    "dobb-both": ("dobb", {"blocks": 1, "side": "both", "out_blocks": 4, "refresh_every": 3, "stagger": False}),
    "dobb-g-l2": ("dobb-g-l2", {"blocks": 4, "refresh_every": 3, "stagger": False}),
}
SHAPE = (48, 32)  # rows x columns of the counted matrices (divisible by every block count above)
OTHER_SHAPE = (64, 32)


class Bank(nn.Module):
    """Bias-free linear layers (one hidden matrix each) with synthetic gradients."""

    def __init__(self, shapes, device=None):
        super().__init__()
        self.device = torch.device(device or "cpu")
        self.layers = nn.ModuleList(nn.Linear(n, m, bias=False, device=self.device) for m, n in shapes)
        self.refill()

    def refill(self) -> None:
        g = torch.Generator(device=self.device).manual_seed(1)
        for lin in self.layers:
            lin.weight.grad = torch.randn(lin.weight.shape, generator=g, device=self.device) * 1e-3

    def capture(self, rows: int = 8) -> None:  # the forward/backward that Dobb's hooks read statistics from
        g = torch.Generator(device=self.device).manual_seed(2)
        with torch.enable_grad():
            for lin in self.layers:
                out = lin(torch.randn(rows, lin.in_features, generator=g, device=self.device))
                out.square().sum().backward()
        self.refill()


def _is_compute(ev) -> bool:
    return ev.name not in METADATA or any(_is_compute(c) for c in ev.cpu_children if c.name.startswith("aten::"))


def _scalar_only(ev) -> bool:
    """Every tensor input 0-d, here and below: host-side bookkeeping (torch keeps step counters on the CPU)."""
    if "_foreach_" in ev.name:  # tensor lists are recorded without shapes
        return False
    shapes = [s for s in (ev.input_shapes or []) if isinstance(s, (list, tuple))]
    return all(len(s) == 0 for s in shapes) and all(_scalar_only(c) for c in ev.cpu_children
                                                    if c.name.startswith("aten::"))


def _ancestor(ev, names) -> bool:
    p = ev.cpu_parent
    while p is not None:
        if p.name in names:
            return True
        p = p.cpu_parent
    return False


def trace_counts(fn) -> dict:
    """Kernels, matmuls and QR factorizations of one call of ``fn`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    kernels = matmuls = qr = 0
    ops: collections.Counter = collections.Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        parent, top = ev.cpu_parent, True
        while parent is not None:
            if parent.name.startswith("aten::"):
                top = False
                break
            parent = parent.cpu_parent
        if ev.name in QR and not _ancestor(ev, QR):
            shape = (ev.input_shapes or [[1, 1]])[0]
            qr += int(torch.Size(shape[:-2]).numel()) if len(shape) >= 2 else 1
        if top and _is_compute(ev) and not _scalar_only(ev):
            kernels += 1
            matmuls += ev.name in MATMUL
            ops[ev.name] += 1
    return {"kernels": kernels, "matmuls": matmuls, "qr": qr, "ops": dict(sorted(ops.items()))}


def _steps(name: str, hp: dict, shapes) -> dict:
    """Counts of a steady step and (Dobb) a refresh step of ``name`` on a bank of ``shapes``."""
    from dobb.factory import build_optimizer

    torch.manual_seed(0)
    bank = Bank(shapes)
    opt = build_optimizer(name, bank, lr=1e-3, **hp)
    is_refresh = getattr(opt, "is_refresh_step", None)
    out: dict[str, Any] = {}
    for i in range(12):  # the first step initialises state; then one step of each kind is traced
        refresh = bool(is_refresh()) if is_refresh else False
        if refresh:
            bank.capture()
        key = "refresh" if refresh else "steady"
        if i == 0 or key in out:
            opt.step()
        else:
            out[key] = trace_counts(opt.step)
        if "steady" in out and ("refresh" in out or is_refresh is None):
            break
    return out


def _fit(name: str, hp: dict) -> dict:
    """Per matrix, per group and per extra shape, from banks of 2, 3, 4 equal-shape matrices (one
    matrix alone can take a shortcut path, so it is not used) and one of two shapes."""
    k = {n: _steps(name, hp, [SHAPE] * n) for n in (2, 3, 4)}
    two = _steps(name, hp, [SHAPE, OTHER_SHAPE])
    res = {}
    for part in k[2]:
        a = {f: k[3][part][f] - k[2][part][f] for f in ("kernels", "matmuls", "qr")}
        for f in a:
            if k[4][part][f] - k[3][part][f] != a[f]:
                raise ValueError(f"{name} {part}: {f} not linear in the matrix count "
                                 f"({k[2][part][f]}, {k[3][part][f]}, {k[4][part][f]})")
        res[part] = {"per_matrix": a["kernels"], "per_group": k[2][part]["kernels"] - 2 * a["kernels"],
                     "per_shape": two[part]["kernels"] - k[2][part]["kernels"],
                     "matmuls_per_matrix": a["matmuls"], "qr_per_matrix": a["qr"],
                     "ops_two_matrices": k[2][part]["ops"]}
    return res


def ns5_counts() -> dict:
    """Kernels of one Newton-Schulz call on one matrix (the owner's work in owner-compute Muon)."""
    from dobb.baselines.muon_family.newton_schulz import newton_schulz

    x = torch.randn(*SHAPE)
    newton_schulz(x)
    c = trace_counts(lambda: newton_schulz(x))
    return {"kernels": c["kernels"], "matmuls": c["matmuls"], "ops": c["ops"]}


def compiled_estimate(part: dict) -> int:
    """Kernels of the two-matrix step under ``torch.compile`` (an estimate, at most): products and
    ``linalg`` calls stay, and the element-wise ops around them fuse into one generated kernel
    before, between and after them (``keep + keep + 1``)."""
    ops = part["ops_two_matrices"]
    keep = sum(v for k, v in ops.items() if k in MATMUL or k in QR or k.startswith("aten::linalg"))
    return 2 * keep + 1


def count_all() -> dict:
    out = {"torch": torch.__version__.split("+")[0], "shape": list(SHAPE), "other_shape": list(OTHER_SHAPE),
           "ns5": ns5_counts(), "methods": {}}
    for label, (name, hp) in METHODS.items():
        fit = _fit(name, hp)
        for part in fit.values():
            part["eager_two_matrices"] = sum(part["ops_two_matrices"].values())
            part["compiled_two_matrices_estimate"] = min(compiled_estimate(part), part["eager_two_matrices"])
        out["methods"][label] = {"optimizer": name, "hparams": hp, **fit}
    return out


SOURCE = ("dobb_bench.cost.kernels.count_all(): torch.profiler trace of the library's own step on CPU "
          "(`python -m dobb_bench.cost.kernels --write` rewrites it; tests/bench/cost/test_kernels.py recounts it)")


def write_inputs(path=None) -> dict:
    """Put a fresh ``count_all()`` into the projection's inputs file (its ``kernels`` entry)."""
    import json
    from pathlib import Path

    from dobb_bench.cost.projection import INPUTS

    path = Path(path or INPUTS)
    inputs = json.loads(path.read_text())
    inputs["kernels"] = {**count_all(), "source": SOURCE}
    path.write_text(json.dumps(inputs, indent=1) + "\n")
    return inputs["kernels"]


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    print(json.dumps(write_inputs() if "--write" in sys.argv else count_all(), indent=1))
