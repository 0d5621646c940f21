"""Kernels each method's ``optimizer.step()`` launches and the HBM bytes its element-wise passes move,
from one trace of the step on this machine.

A GPU step this size is bound by launch and dispatch and by memory traffic as much as by FLOPs, so
the projection (``dobb_bench.cost.projection``) charges a per-kernel cost times the kernels a step
launches, and the bytes of every element-wise pass over the HBM bandwidth. Both come from a
``TorchDispatchMode`` trace of the library's own step (``dobb_bench.cost.trace``: its rules for a
kernel and for the bytes of a kernel), on the path a GPU step takes, with decoupled weight decay on
(``WEIGHT_DECAY``: the paper's protocol, this library's default grouping and torch's AdamW default
all decay; the value does not change the ops):

- **per matrix / per group / per extra shape** (kernels): banks of ``2, 3, 4`` equal-shape matrices
  give ``K(N) = per_matrix N + per_group`` (the three points must be collinear, else the count is
  refused) and ``per_shape`` (the extra kernels of a second distinct shape: shape-batched code runs
  once per shape).
- **QR factorizations**: the matrices ``linalg_qr`` factors per matrix (a batched call of ``b``
  blocks is ``b``): cuSOLVER's Householder QR is a sequence of panel kernels, so the model charges
  it apart from the generic kernel cost.
- **bytes per entry** (``bytes_per_entry``, and ``bytes_per_stat_entry`` where a method keeps
  statistics or factors beside the weight): the element-wise bytes of one matrix's step,
  ``b(m, n) = bytes_per_entry m n + bytes_per_stat_entry S(m, n)``, solved from two bank shapes
  (``BYTE_SHAPES``; ``S``: ``stat_entries``, e.g. Dobb's ``n^2 / B`` entries of the block
  statistic and basis) and checked on a third (``bytes_fit_error``: vectors and scalars, which the
  two terms leave out, and which vanish at real shapes).

How grouping changes the count: a ``_foreach_`` op is one op for the whole list, so it lands in
``per_group``, not ``per_matrix`` (on a GPU it launches one multi-tensor kernel per chunk of
tensors; the count here is one per op). Its bytes are the same as the per-tensor loop's: the same
passes over the same tensors. A fused kernel (torch's ``fused=True`` AdamW) is one kernel a group
that reads and writes each tensor once. ``torch.compile`` of the step fuses each element-wise chain
into one generated kernel and leaves matrix products and ``linalg`` calls as they are: the compiled
count is the products plus one per fused chain (``compiled_estimate``) and the compiled bytes read
each input of a chain once and write only what outlives it (``trace.compiled_bytes``); both are
estimates beside the eager trace of the same two-matrix step.

``count_all()`` is deterministic (same torch, same counts); the projection's inputs hold its
result, and ``tests/bench/cost/test_kernels.py`` recounts and compares.
"""
from __future__ import annotations

import collections
import torch
from torch import nn

from dobb_bench.cost import trace as TR

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

WEIGHT_DECAY = 0.1  # nonzero: every traced step runs its decoupled weight-decay pass
# (label, registry name, hyperparameters): the methods the projection charges. Dobb's products run
# in its basis dtype (bf16) on a GPU, as traced; the "-fp32" entries multiply in fp32 (the paper's
# Dobb). "torch-muon-bf16": torch.optim.Muon on a bf16 model (MatrixFSDP's benchmark: both its rows
# step the matrices with torch.optim.Muon).
METHODS: dict[str, tuple[str, dict]] = {
    "adamw": ("adamw", {"foreach": False}),
    "adamw-foreach": ("adamw", {"foreach": True}),
    "adamw-fused": ("adamw", {"fused": True}),
    "muon": ("muon", {}),
    "row-block-muon": ("block-muon", {"axis": 0, "blocks": 4}),
    "muonbp": ("muonbp", {"period": 5}),
    "dion2": ("dion2", {"fraction": 0.25, "select": "shard"}),
    "dion": ("dion", {"rank_fraction": 0.25}),
    "dobb-b1": ("dobb", {"blocks": 1, "refresh_every": 3, "stagger": False}),
    "dobb-b4": ("dobb", {"blocks": 4, "refresh_every": 3, "stagger": False}),
    "dobb-both": ("dobb", {"blocks": 1, "side": "both", "out_blocks": 4, "refresh_every": 3, "stagger": False}),
    "dobb-g-l2": ("dobb-g-l2", {"blocks": 4, "refresh_every": 3, "stagger": False}),
    "dobb-b4-fp32": ("dobb", {"blocks": 4, "refresh_every": 3, "stagger": False, "product_dtype": torch.float32}),
    "dobb-g-l2-fp32": ("dobb-g-l2", {"blocks": 4, "refresh_every": 3, "stagger": False,
                                     "product_dtype": torch.float32}),
    "torch-muon-bf16": ("torch.optim.Muon", {"ns_steps": 2}),
    # Dobb-Muon (Adam in Dobb's input-side bases, Newton-Schulz per row block) and SOAP, whose
    # "-refresh" trace refreshes its bases on the traced step (precondition_frequency=1): the
    # refresh's own bytes and kernels are the difference from the steady trace
    "dobb-muon": ("dobb-muon", {"blocks": 4, "out_blocks": 4, "refresh_every": 3, "stagger": False}),
    "soap": ("soap", {}),
    "soap-refresh": ("soap", {"precondition_frequency": 1}),
}
# traced on the CPU path: torch refuses fused=True on a device without its kernel, and the one
# fused op (``_fused_adamw_``) is the same op on every device
CPU_PATH = frozenset({"adamw-fused"})
BANK_DTYPE = {"torch-muon-bf16": torch.bfloat16}
SHAPE = (48, 32)  # rows x columns of the counted matrices (divisible by every block count above)
OTHER_SHAPE = (64, 32)
BYTE_SHAPES = (SHAPE, OTHER_SHAPE, (48, 64))  # bytes: solved on the first two, checked on the third


class Bank(nn.Module):
    """Bias-free linear layers (one hidden matrix each) with synthetic gradients; ``on_device``:
    ``OnDevice`` tensors (build and step it inside ``trace.tracing()``)."""

    def __init__(self, shapes, device=None, on_device: bool = False, dtype=torch.float32):
        super().__init__()
        self.device = torch.device(device or "cpu")
        self.on_device = on_device
        self.layers = nn.ModuleList(nn.Linear(n, m, bias=False, device=self.device, dtype=dtype) for m, n in shapes)
        if on_device:
            TR.module_to_device(self)
        self.refill()

    def _randn(self, shape, g, dtype):
        if self.on_device:
            return TR.OnDevice(torch.randn(shape, generator=g, dtype=dtype))
        return torch.randn(shape, generator=g, device=self.device, dtype=dtype)

    def refill(self) -> None:
        g = torch.Generator(device="cpu" if self.on_device else self.device).manual_seed(1)
        for lin in self.layers:
            lin.weight.grad = self._randn(tuple(lin.weight.shape), g, lin.weight.dtype) * 1e-3

    def capture(self, rows: int = 8) -> None:  # the forward/backward that Dobb's hooks read statistics from
        g = torch.Generator(device="cpu" if self.on_device else self.device).manual_seed(2)
        with torch.enable_grad():
            for lin in self.layers:
                out = lin(self._randn((rows, lin.in_features), g, lin.weight.dtype))
                out.square().sum().backward()
        self.refill()


# ----------------------------------------------------------------------------- the CPU profiler count
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
    """Kernels, matmuls and QR factorizations of one call of ``fn`` on CPU tensors, from a
    ``torch.profiler`` trace: top-level ``aten::`` ops (no ``aten::`` ancestor) that run compute
    (the op or one of its descendants is not in ``METADATA``) and not on 0-d tensors only. The
    check on the dispatch trace's rule (``tests/bench/cost/test_kernels.py``): on the CPU path both
    count the same kernels."""
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


def profiler_counts(label: str, shapes) -> dict:
    """``trace_counts`` of a steady step (and a refresh step) of ``label`` on plain CPU tensors: the
    CPU path, the check on the dispatch trace's kernel rule."""
    name, hp = METHODS[label]
    torch.manual_seed(0)
    bank = Bank(shapes, dtype=BANK_DTYPE.get(label, torch.float32))
    return each_step_kind(_build(name, hp, bank), bank, trace_counts)


def each_step_kind(opt, bank: Bank, record) -> dict:
    """``record(opt.step)`` of the first steady step and (Dobb) the first refresh step after the
    first step, which initialises state; the other steps run plainly. Returns ``{"steady": ...,
    "refresh": ...}`` (no ``"refresh"`` for an optimizer without one)."""
    is_refresh = getattr(opt, "is_refresh_step", None)
    out: dict = {}
    for i in range(12):
        refresh = bool(is_refresh()) if is_refresh else False
        if refresh:
            bank.capture()
        key = "refresh" if refresh else "steady"
        if i == 0 or key in out:
            opt.step()
        else:
            out[key] = record(opt.step)
        if "steady" in out and ("refresh" in out or is_refresh is None):
            break
    return out


# ----------------------------------------------------------------------------- the dispatch trace
def _build(name: str, hp: dict, bank: Bank):
    if name == "torch.optim.Muon":
        return torch.optim.Muon(bank.parameters(), lr=1e-3, weight_decay=WEIGHT_DECAY, **hp)
    from dobb.factory import build_optimizer

    from dobb_bench.specs import recorded_adamw_part

    return build_optimizer(name, bank, lr=1e-3, weight_decay=WEIGHT_DECAY, **hp, **recorded_adamw_part(name, bank, hp))


def step_ops(label: str, shapes, on_device: bool | None = None, **override) -> dict[str, list]:
    """The ops (``trace.Op``) of a steady step and (Dobb) a refresh step of ``label`` (hyperparameters
    ``override`` changed) on a bank of ``shapes``: the first step initialises state, then one step
    of each kind is traced."""
    name, hp = METHODS[label]
    hp = {**hp, **override}
    on_device = label not in CPU_PATH if on_device is None else on_device
    with TR.tracing(on_device) as tr:
        torch.manual_seed(0)
        bank = Bank(shapes, on_device=on_device, dtype=BANK_DTYPE.get(label, torch.float32))

        def record(step):
            tr.ops, tr.recording = [], True
            step()
            tr.recording = False
            return tr.ops

        out = each_step_kind(_build(name, hp, bank), bank, record)
    return out


def ns_ops(shapes, on_device: bool = True) -> list:
    """The ops of the library's Newton-Schulz call (``orthogonalize``: stack by shape, NS5 in bf16)
    on fp32 matrices of ``shapes``: the owner's work in owner-compute Muon."""
    from dobb.newton_schulz import orthogonalize

    with TR.tracing(on_device) as tr:
        g = torch.Generator().manual_seed(0)
        xs = [TR.to_device(torch.randn(m, n, generator=g), on_device) for m, n in shapes]
        orthogonalize(xs)  # warm: the same path twice
        tr.ops, tr.recording = [], True
        orthogonalize(xs)
        tr.recording = False
        return tr.ops


def stat_entries(label: str, m: float, n: float, **override) -> float:
    """Entries of the tensors beside the weight that a method's element-wise passes sweep, per
    ``m x n`` matrix: Dobb's block statistic and basis (``n^2 / B`` on the input side, ``m^2 / B``
    on the output side, both for two-sided), Dion's factor (``max(m, n) r``), SOAP's factors and
    bases (``m^2 + n^2``); 0 for the others."""
    from dobb.baselines.dion_family.dion import dion_rank

    name, hp = METHODS[label]
    hp = {**hp, **override}
    if name == "dion":
        return max(m, n) * dion_rank(int(m), int(n), hp["rank_fraction"])
    if name == "soap":  # L and QL (m x m), R and QR (n x n): both sides at the traced shapes
        return m * m + n * n
    if name.startswith("dobb"):
        side = hp.get("side", "output" if name.startswith("dobb-g") else "input")
        s = 0.0
        if side in ("input", "both"):
            s += n * n / hp["blocks"]
        if side == "output":
            s += m * m / hp["blocks"]
        if side == "both":
            s += m * m / hp["out_blocks"]
        return s
    return 0.0


def _bytes(ops) -> int:
    return TR.summary(ops)["bytes"]


def bytes_fit(per_matrix: list[float], label: str | None, cases=None) -> dict:
    """``bytes_per_entry`` and ``bytes_per_stat_entry`` solved from one matrix's bytes in the first
    two ``cases`` (``per_matrix``; a case: a shape and the hyperparameters changed), and the relative
    error of the fit in the third."""
    cases = cases or byte_cases(label)
    e = [m * n for (m, n), _ in cases]
    s = [stat_entries(label, m, n, **hp) if label else 0.0 for (m, n), hp in cases]
    if s[0] == 0 and s[1] == 0:
        a, b = per_matrix[0] / e[0], 0.0
    else:
        det = e[0] * s[1] - e[1] * s[0]
        a = (per_matrix[0] * s[1] - per_matrix[1] * s[0]) / det
        b = (e[0] * per_matrix[1] - e[1] * per_matrix[0]) / det
    err = max(abs(a * e[i] + b * s[i] - per_matrix[i]) / per_matrix[i] for i in range(3)) if all(per_matrix) else 0.0
    return {"bytes_per_entry": a, "bytes_per_stat_entry": b, "bytes_fit_error": err}


def byte_cases(label: str | None) -> list[tuple]:
    """The three (shape, hyperparameters changed) whose bytes give ``bytes_fit``: ``BYTE_SHAPES``;
    Dion's factor is ``rank_fraction`` of the weight at every shape, so its cases change the rank
    fraction instead (1/4, 1/8 on the first shape; 1/4 on the third)."""
    if label is not None and METHODS[label][0] == "dion":
        return [(BYTE_SHAPES[0], {}), (BYTE_SHAPES[0], {"rank_fraction": 0.125}), (BYTE_SHAPES[2], {})]
    return [(shape, {}) for shape in BYTE_SHAPES]


def _per_matrix_bytes(fn, shape, **override) -> dict:
    """One matrix's bytes (the slope from a bank of 2 to a bank of 3 of ``shape``), per part."""
    two, three = fn([shape] * 2, **override), fn([shape] * 3, **override)
    return {part: _bytes(three[part]) - _bytes(two[part]) for part in two}


def compiled_estimate(part: dict) -> int:
    """Kernels of the two-matrix step under ``torch.compile`` (an estimate, at most): products and
    ``linalg`` calls stay, and the element-wise ops around them fuse into one generated kernel
    before, between and after them (``keep + keep + 1``)."""
    ops = part["ops_two_matrices"]
    keep = sum(v for k, v in ops.items() if k in MATMUL or k in QR or k.startswith("aten::linalg"))
    return 2 * keep + 1


def _fit(label: str) -> dict:
    """Kernels per matrix, per group and per extra shape, from banks of 2, 3, 4 equal-shape matrices
    (one matrix alone can take a shortcut path, so it is not used) and one of two shapes; bytes
    per entry from ``BYTE_SHAPES``."""
    eager = step_ops(label, [SHAPE] * 2)
    k = {n: {p: TR.summary(o) for p, o in (eager if n == 2 else step_ops(label, [SHAPE] * n)).items()}
         for n in (2, 4)}
    two = {p: TR.summary(o) for p, o in step_ops(label, [SHAPE, OTHER_SHAPE]).items()}
    three = step_ops(label, [SHAPE] * 3)
    k[3] = {p: TR.summary(o) for p, o in three.items()}
    per_shape = [{p: _bytes(three[p]) - _bytes(eager[p]) for p in eager} if (shape, hp) == (SHAPE, {}) else
                 _per_matrix_bytes(lambda sh, **o: step_ops(label, sh, **o), shape, **hp)
                 for shape, hp in byte_cases(label)]
    res = {}
    for part in k[2]:
        a = {f: k[3][part][f] - k[2][part][f] for f in ("kernels", "matmuls", "qr")}
        for f in a:
            if k[4][part][f] - k[3][part][f] != a[f]:
                raise ValueError(f"{label} {part}: {f} not linear in the matrix count "
                                 f"({k[2][part][f]}, {k[3][part][f]}, {k[4][part][f]})")
        e2 = 2 * SHAPE[0] * SHAPE[1]
        res[part] = {"per_matrix": a["kernels"], "per_group": k[2][part]["kernels"] - 2 * a["kernels"],
                     "per_shape": two[part]["kernels"] - k[2][part]["kernels"],
                     "matmuls_per_matrix": a["matmuls"], "qr_per_matrix": a["qr"],
                     "ops_two_matrices": k[2][part]["ops"],
                     **bytes_fit([p[part] for p in per_shape], label),
                     "compiled_bytes_per_entry_estimate": TR.compiled_bytes(eager[part]) / e2,
                     "eager_bytes_per_entry_two_matrices": _bytes(eager[part]) / e2}
    return res


def ns_fit() -> dict:
    """Kernels and bytes per entry of the library's Newton-Schulz call (``ns_ops``)."""
    k = {n: TR.summary(ns_ops([SHAPE] * n)) for n in (2, 3)}
    per = [_bytes(ns_ops([s] * 3)) - _bytes(ns_ops([s] * 2)) for s in BYTE_SHAPES]
    return {"per_matrix": k[3]["kernels"] - k[2]["kernels"], "per_group": 2 * k[2]["kernels"] - k[3]["kernels"],
            "ops_two_matrices": k[2]["ops"], **bytes_fit(per, None)}


def count_all() -> dict:
    out = {"torch": torch.__version__.split("+")[0], "shape": list(SHAPE), "other_shape": list(OTHER_SHAPE),
           "byte_shapes": [list(s) for s in BYTE_SHAPES], "weight_decay": WEIGHT_DECAY, "ns": ns_fit(),
           "methods": {}}
    for label, (name, hp) in METHODS.items():
        fit = _fit(label)
        for part in fit.values():
            part["eager_two_matrices"] = sum(part["ops_two_matrices"].values())
            part["compiled_two_matrices_estimate"] = min(compiled_estimate(part), part["eager_two_matrices"])
        out["methods"][label] = {"optimizer": name, "hparams": {k: str(v).removeprefix("torch.")
                                                                if isinstance(v, torch.dtype) else v
                                                                for k, v in hp.items()},
                                 "path": "cpu" if label in CPU_PATH else "device", **fit}
    # Muon's step calls orthogonalize once: its bytes an entry split into the NS call and the rest
    out["methods"]["muon"]["steady"]["ns_bytes_per_entry"] = out["ns"]["bytes_per_entry"]
    return out


SOURCE = ("dobb_bench.cost.kernels.count_all(): a TorchDispatchMode trace (dobb_bench.cost.trace) of the library's "
          "own step on this machine, on the path a GPU step takes, weight decay on "
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
