"""Payload meter: which collectives a region of code issues, and how many bytes they move.

Why: the paper's claims (Tables 3 and 7) are about communication, so the benchmarks measure it
instead of trusting the derivation. ``PayloadMeter`` is a ``TorchDispatchMode`` (the mechanism of
``torch.distributed.tensor.debug.CommDebugMode``): every collective reaches the dispatcher as a
``c10d`` op (plain ``torch.distributed.all_reduce`` and friends, sync or async, FSDP2's
all-gathers / reduce-scatters) or a ``_c10d_functional`` op (DTensor redistributions, functional
collectives), so it sees all of them, including those DTensor issues while dispatching an op
(the mode steps aside for DTensor operands, as CommDebugMode does). Unlike CommDebugMode it also
records sizes. The library issues every collective of its own through ``dobb.collectives``, tagged
with its kind (``collectives.KINDS``: ``"stat"`` for the data-parallel statistic mean, ``"norm"``
for ell2 column norms / gradient-Gram sums, ``"owner"`` for owner-compute exchanges, ...), so the
statistic reductions launched by capture hooks during forward/backward, and each optimizer's own
traffic, can be told apart from FSDP's and DTensor's (untagged, kind ``None``).

Size convention: ``numel``/``bytes`` of a collective is its *logical* tensor, the same on every
rank: the reduced tensor (all-reduce, broadcast, reduce), the gathered output (all-gather), the
full input (reduce-scatter, scatter, all-to-all). Per-rank wire traffic is a constant factor of it
(e.g. ring all-reduce sends ``2 (P-1)/P`` of it), which Tables 3/7 omit too.

Usage::

    with PayloadMeter() as meter:
        opt.step()
    meter.collectives, meter.bytes, meter.by_op, meter.kind("stat").bytes
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .layout import is_dtensor_type, to_local
from ._torch_private import HigherOrderOperator, TorchDispatchMode, tree_flatten
from .collectives import current_kind

__all__ = ["PayloadMeter", "Collective", "Totals", "state_bytes"]


def state_bytes(state) -> int:
    """The one measure of optimizer state size in this package and its bench.

    Bytes of the storages behind this rank's tensors in the state (a DTensor counts its local
    shard), each storage once: a view and its base, or two entries sharing one buffer, count once,
    and a view counts its whole storage (the memory it keeps alive). Scalar tensors (step
    counters) count; Python numbers do not. ``state``: an optimizer, its ``.state``, or
    ``state_dict()["state"]`` (the same tensors, so the same number).
    """
    if isinstance(state, torch.optim.Optimizer):
        state = state.state
    seen, total = set(), 0
    for leaf in tree_flatten(list(state.values()))[0]:
        if isinstance(leaf, torch.Tensor):
            storage = to_local(leaf).untyped_storage()
            key = (leaf.device, storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


@dataclass(frozen=True)
class Collective:
    """One collective call: normalized ``op`` name, raw dispatcher ``func``, ``kind`` tag (or None),
    logical ``numel`` and ``bytes`` (see the module docstring)."""

    op: str
    func: str
    kind: str | None
    numel: int
    bytes: int


@dataclass(frozen=True)
class Totals:
    count: int = 0
    numel: int = 0
    bytes: int = 0


# c10d op name -> (normalized name, index of the argument holding the logical tensor(s))
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "gather_": ("gather", 0), "scatter_": ("scatter", 1),
    "reduce_": ("reduce", 0),
}
# functional op name prefix -> normalized name; the logical tensor is the input, except for
# all-gathers (the output)
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
_FUNCTIONAL_NS = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _classify(func, args, out) -> tuple[str, list[torch.Tensor]] | None:
    ns, name = func.namespace, func._overloadpacket.__name__
    if ns == "c10d" and name in _C10D:
        op, i = _C10D[name]
        return op, _tensors(args[i])
    if ns in _FUNCTIONAL_NS:
        for prefix, op in _FUNCTIONAL.items():
            if name.startswith(prefix):
                return op, _tensors(out if op == "all_gather" else args[0])
    return None


class _CollectiveMode(TorchDispatchMode):
    def __init__(self, meter: PayloadMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if any(is_dtensor_type(t) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops and collectives first
        out = func(*args, **kwargs)
        found = _classify(func, args, out)
        if found is not None:
            op, tensors = found
            numel = sum(t.numel() for t in tensors)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.meter.records.append(Collective(op, str(func), current_kind(), numel, nbytes))
        return out


class PayloadMeter:
    """Records every collective issued (on this rank) while the context is active.

    Attributes: ``records`` (list of ``Collective``); ``collectives``, ``numel``, ``bytes`` (totals);
    ``by_op`` (normalized op -> ``Totals``); ``kind(k)`` totals of the library's tagged collectives
    (``collectives.KINDS``; ``None`` = untagged, e.g. FSDP or DTensor traffic).
    """

    def __init__(self):
        self.records: list[Collective] = []
        self._mode: _CollectiveMode | None = None

    def __enter__(self) -> PayloadMeter:
        self._mode = _CollectiveMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    @staticmethod
    def _totals(records) -> Totals:
        records = list(records)
        return Totals(len(records), sum(r.numel for r in records), sum(r.bytes for r in records))

    @property
    def collectives(self) -> int:
        return len(self.records)

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.records)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def by_op(self) -> dict[str, Totals]:
        groups = defaultdict(list)
        for r in self.records:
            groups[r.op].append(r)
        return {op: self._totals(rs) for op, rs in groups.items()}

    def kind(self, kind: str | None) -> Totals:
        return self._totals(r for r in self.records if r.kind == kind)
