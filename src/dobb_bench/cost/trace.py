"""Every op of a traced call: the kernels it launches and the HBM bytes it moves.

``dobb_bench.cost.kernels`` traces each method's ``optimizer.step()`` with ``trace``, and the
projection (``dobb_bench.cost.projection``) charges a per-kernel cost times the kernels and the
element-wise bytes over the HBM bandwidth. The trace is a ``TorchDispatchMode``: it sees every
``aten`` op after autograd and composite decomposition, with its tensors.

**The path a GPU step takes** (``on_device=True``). The library picks some code paths by device
type (``device.type == "cpu"``): on a CPU, Dobb runs one call per matrix, folds weight decay into a
product and factors blocks with ``geqrf``; elsewhere it stacks equal blocks across matrices and
calls ``linalg.qr`` (``dobb.core.update``, ``dobb.functional``). A GPU runs the second path. So the
traced call's tensors are ``OnDevice``: a wrapper whose device, as the traced code sees it, is not
the CPU (``meta``, the one such device every torch build can index), holding a CPU tensor that
every op runs on. The step runs with real numbers (its refresh decisions and finiteness checks
read them), and takes the path a GPU step takes. Ops on plain CPU tensors (torch's step counters)
stay on the host: no kernel, no bytes.

**A kernel** is an op that reads or writes a device tensor and is not a view, an allocation
(``empty``), a read of one scalar to the host (``_local_scalar_dense``) or another metadata op
(``METADATA``). ``_foreach_`` ops are one kernel for the whole list (on a GPU, one multi-tensor
kernel a chunk of tensors). Every ``aten`` op runs as one kernel on a GPU.

**Bytes.** Each kernel reads its input tensors and writes its output tensors in full (the issue's
rule): an in-place op reads and writes its destination; an op that only overwrites a destination
(``copy_``, ``fill_``, ``zero_``, an ``out=`` argument) writes it without reading it; a tensor read
twice by one kernel (``addcmul_(v, g, g)``) is read once; a broadcast operand counts its stored
entries. Matrix products and ``linalg`` factorizations are kept apart (``kind`` "product"): their
time is the projection's FLOPs and per-QR terms, so their operands are not element-wise bytes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")  # not the CPU, as the traced code sees it; indexable on every build

METADATA = frozenset({"_unsafe_view", "_reshape_alias", "empty", "empty_like", "empty_strided", "new_empty",
                      "new_empty_strided", "_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "detach",
                      "alias", "set_", "_has_compatible_shallow_copy_type", "resolve_conj", "resolve_neg",
                      "_conj", "_neg_view", "is_nonzero", "item", "size", "stride", "sym_size", "sym_stride",
                      "sym_numel", "sym_storage_offset", "_to_copy_noop"})
PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "_scaled_mm", "matmul",
                      "linear", "addmm_", "baddbmm_", "addbmm_", "addr"})
QR = frozenset({"linalg_qr", "geqrf"})
OVERWRITES = frozenset({"copy_", "_foreach_copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "index_fill_"})
READ_ONLY = {"_fused_adamw_": {"grads"}, "_fused_adam_": {"grads"}}  # marked mutable for grad scaling


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def is_product(name: str) -> bool:
    return name in PRODUCTS or name in QR or name.startswith("linalg_") and name != "linalg_vector_norm" \
        or name in ("geqrf", "orgqr", "ormqr", "cholesky", "triangular_solve", "_linalg_eigh", "_linalg_svd",
                    "_linalg_solve_ex", "linalg_householder_product")


class OnDevice(torch.Tensor):
    """A tensor on ``DEVICE`` as the traced code sees it, whose data is the CPU tensor ``inner``
    (every op on it runs on ``inner``, inside ``Trace``)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=DEVICE, requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"OnDevice({self.inner!r})"

    def tolist(self):  # a host read, as on a GPU
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: an OnDevice tensor outside dobb_bench.cost.trace.Trace")


@dataclass
class Op:
    name: str
    kind: str  # "kernel" (element-wise, reduction, copy), "product" (matmul, linalg), "host" (CPU only)
    read: int  # bytes read
    written: int  # bytes written
    qr: int = 0  # matrices factored (a batched call of b matrices: b)
    tensors: list = field(default_factory=list)  # (role, shape, dtype) of each device tensor
    reads: dict = field(default_factory=dict, repr=False)  # tensor identity -> bytes
    writes: dict = field(default_factory=dict, repr=False)
    fresh: frozenset = frozenset()  # storages this op allocated (its outputs)

    @property
    def bytes(self) -> int:
        return self.read + self.written


def _stored(t: torch.Tensor) -> int:
    """Bytes of the entries a tensor stores (a broadcast, stride-0 axis counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Trace(TorchDispatchMode):
    """Runs every op on ``OnDevice`` tensors on their CPU data and, while ``recording``, logs it as an
    ``Op``. ``on_device=False`` traces plain CPU tensors instead (the CPU path), logging every op
    except those whose tensors are all 0-d (host bookkeeping, as ``kernels.trace_counts`` skips)."""

    def __init__(self, on_device: bool = True):
        super().__init__()
        self.on_device = on_device
        self.ops: list[Op] = []
        self.recording = False
        self._keep: list = []  # every output while recording, so no storage is reused within a trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        device = any(isinstance(a, OnDevice) for a in flat) or any(
            isinstance(a, torch.device) and a.type == DEVICE.type for a in flat)

        def unwrap(x):
            if isinstance(x, OnDevice):
                return x.inner
            if isinstance(x, torch.device) and x.type == DEVICE.type:
                return torch.device("cpu")
            return x

        uargs, ukw = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        out = func(*uargs, **ukw)
        if self.recording and (device or not self.on_device):
            op = self._op(func, uargs, ukw, out)
            if op is not None:
                self.ops.append(op)
        if not device:
            return out
        inputs = [a for a in flat if isinstance(a, OnDevice)]

        def wrap(o):
            if isinstance(o, torch.Tensor) and not isinstance(o, OnDevice):
                for a in inputs:
                    if a.inner is o:
                        return a  # an in-place op returns its own (wrapped) destination
                return OnDevice(o)
            return o

        return tree_map(wrap, out)

    def _op(self, func, args, kwargs, out) -> Op | None:
        name = _name(func)
        if not func._schema.name.startswith("aten::") or func.is_view or name in METADATA or name.startswith("sym_"):
            return None  # the profiler's own ops, views, allocations, metadata
        schema = func._schema
        bound = dict(zip((a.name for a in schema.arguments), args))
        bound.update(kwargs)
        reads, writes, tensors, fresh = {}, {}, [], set()
        for a in schema.arguments:
            value = bound.get(a.name)
            ts = [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)] \
                if isinstance(value, (list, tuple)) else []
            write = a.alias_info is not None and a.alias_info.is_write and a.name not in READ_ONLY.get(name, ())
            for t in ts:
                tensors.append(("written" if write else "read", tuple(t.shape), str(t.dtype).removeprefix("torch.")))
                if write:
                    writes[_key(t)] = _stored(t)
                if not write or not (name in OVERWRITES or a.kwarg_only):
                    reads[_key(t)] = _stored(t)
        for r, o in zip(schema.returns, out if isinstance(out, (tuple, list)) and len(schema.returns) > 1 else [out]):
            if r.alias_info is None:
                for t in ([o] if isinstance(o, torch.Tensor) else
                          [x for x in o if isinstance(x, torch.Tensor)] if isinstance(o, (list, tuple)) else []):
                    writes[_key(t)] = _stored(t)
                    fresh.add(t.untyped_storage().data_ptr())
                    self._keep.append(t)
                    tensors.append(("out", tuple(t.shape), str(t.dtype).removeprefix("torch.")))
        if not self.on_device and all(len(s) == 0 for _, s, _ in tensors):
            return None  # 0-d bookkeeping on the CPU path (a GPU step keeps it on the host)
        qr = 0
        if name in QR:
            shape = args[0].shape
            qr = int(torch.Size(shape[:-2]).numel()) if len(shape) >= 2 else 1
        kind = "product" if is_product(name) else "kernel"
        return Op(name, kind, sum(reads.values()), sum(writes.values()), qr, tensors, reads, writes, frozenset(fresh))


@contextlib.contextmanager
def _autocast_on_device():
    """``torch.autocast(DEVICE.type, enabled=False)`` (the library turns autocast off in its step, on
    its parameters' device type) as the CPU's: torch has no autocast state for ``meta``."""
    real = torch.autocast

    class Autocast(real):
        def __init__(self, device_type, *a, **k):
            super().__init__("cpu" if device_type == DEVICE.type else device_type, *a, **k)

    torch.autocast = Autocast
    try:
        yield
    finally:
        torch.autocast = real


@contextlib.contextmanager
def tracing(on_device: bool = True):
    """A ``Trace`` to build tensors and run a step under (``with tracing() as t:``); set
    ``t.recording`` around the call to log."""
    mode = Trace(on_device)
    with _autocast_on_device() if on_device else contextlib.nullcontext(), mode:
        yield mode


def to_device(t: torch.Tensor, on_device: bool = True) -> torch.Tensor:
    return OnDevice(t) if on_device else t


def module_to_device(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of ``module`` as an ``OnDevice`` parameter (call inside ``tracing()``)."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and not isinstance(p, OnDevice):
                mod._parameters[name] = torch.nn.Parameter(OnDevice(p.detach()), requires_grad=p.requires_grad)
    return module


def compiled_bytes(ops: list[Op]) -> int:
    """Element-wise bytes of the same call under ``torch.compile`` (an estimate, at most): the
    element-wise ops between two products fuse into one generated kernel, which reads each tensor it
    takes from outside once and writes a tensor only if it outlives the kernel (a parameter, a
    state, a gradient, or a tensor a later kernel reads); its temporaries stay in registers."""
    made = set().union(*(o.fresh for o in ops)) if ops else set()
    segments, seg = [], []
    for o in ops:
        if o.kind == "product":
            segments.append(seg)
            seg = []
        elif o.kind == "kernel":
            seg.append(o)
    segments.append(seg)
    later_reads = []  # per segment: the tensors every later op reads
    seen: set = set()
    for seg_ops in reversed(segments):
        later_reads.append(set(seen))
        for o in seg_ops:
            seen.update(key[0] for key in o.reads)
    later_reads.reverse()
    # products read and write tensors too: a tensor a later product reads must be written
    product_reads = [set() for _ in segments]
    i = 0
    for o in ops:
        if o.kind == "product":
            for j in range(i + 1):
                product_reads[j].update(key[0] for key in o.reads)
            i += 1
    total = 0
    for k, seg_ops in enumerate(segments):
        written: dict = {}
        read: dict = {}
        for o in seg_ops:
            inside = {key[0] for key in written}
            for key, b in o.reads.items():
                if key[0] not in inside:
                    read[key] = b
            written.update(o.writes)
        total += sum(read.values())
        for key, b in written.items():
            if key[0] not in made or key[0] in later_reads[k] or key[0] in product_reads[k]:
                total += b
    return total


def summary(ops: list[Op]) -> dict:
    """Kernels, matrix products, QR factorizations, element-wise bytes and the kernels by op name."""
    kernels = [o for o in ops if o.kind in ("kernel", "product")]
    by: dict[str, int] = {}
    for o in kernels:
        by[f"aten::{o.name}"] = by.get(f"aten::{o.name}", 0) + 1
    return {"kernels": len(kernels), "matmuls": sum(o.name in PRODUCTS for o in kernels),
            "qr": sum(o.qr for o in ops), "bytes": sum(o.bytes for o in ops if o.kind == "kernel"),
            "ops": dict(sorted(by.items()))}
