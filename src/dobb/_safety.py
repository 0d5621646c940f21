"""What every ``MatrixOptimizer`` does with a non-finite gradient, and which saved state it refuses.

Non-finite gradients (the ``nonfinite`` option of every group, ``dobb._hparams.Options``):

- ``"raise"`` (default): before any weight or state changes, the finiteness flags of the gradients
  of every ``"raise"`` group are summed over the ranks that share the step (``step_group``) and read
  on the host once; a NaN/Inf anywhere is a ``ValueError`` naming the first such parameter, raised
  by every rank. Cost: one all-reduce of one float per parameter and one host read per step (Dobb
  folds both into the reduction of its statistics, ``core.statistics.agree``).
- ``"skip"``: one flag ("some gradient of a ``"skip"`` group is non-finite on some rank"), summed over
  the same ranks on the device, never read inside the step. The step runs on gradients masked to
  zero where the flag is set (in place: a skipped step leaves every gradient zero, so no NaN reaches
  a solver that would raise on it), and every weight and state tensor on the flag's device is put
  back with ``torch.where(flag, before, after)``. Cost: a copy of every weight and state tensor per
  step, one ``where`` per tensor and one all-reduce of one float. Host-side state (Python step and
  capture counts, tensors on another device than the flag) cannot follow a flag the host never read:
  it is kept aside (``Skipped``) and put back when the flag is next read, at the start of the next
  step, in ``state_dict`` and in ``load_state_dict`` (a CUDA flag through a pinned copy made without
  blocking, so that read waits for the flag only, computed a whole step earlier).
- ``"off"``: no check.

Foreign state (``check_saved_optimizer``): ``MatrixOptimizer.state_dict`` records in every saved
param group the optimizer that saved it (``RECORD_LABEL``: its registry label, ``RECORD_CLASS``: its
class). ``load_state_dict`` refuses, before anything loads and with a ``ValueError`` naming the saved
and the current optimizer, a state dict of another class or registry name (another preset, e.g.
Dobb and Dobb-Muon, ``norm``), of another ``algorithm``, one without ``algorithm`` (torch's own
optimizers), and one whose saved group values (which torch's load restores: a state saved with
``blocks=2`` resumes with ``blocks=2``) the parameters here cannot take (a block count that must fit
the shards, saved on another number of ranks): those are checked on a trial group, by the class' own
checks and plans. An older checkpoint of this package (no record) is told apart by its groups' options.
The state tensors' shapes are checked next by ``MatrixOptimizer._check_saved_shapes``.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._torch_private import disable_dynamo
from .layout import is_dtensor, local_nonfinite, to_local

RECORD_LABEL = "optimizer"
RECORD_CLASS = "optimizer_class"
RECORD_KEYS = (RECORD_LABEL, RECORD_CLASS)



# ----------------------------------------------------------------------------- non-finite: "skip"
@dataclass
class Skipped:
    """A step that ran under ``"skip"``: its flag (on the device; a pinned host copy for CUDA) and the
    host-side state before it, put back when the flag, read later, says the step was skipped."""

    flag: torch.Tensor
    host: dict = field(default_factory=dict)  # param -> {key: value before} (host values, other tensors)
    keys: dict = field(default_factory=dict)  # param -> keys its state had before (None: no state)
    event: Any = None

    def was_skipped(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # the flag's copy only: computed a step ago
        return bool(self.flag)

    def restore(self, state) -> None:
        for p, keys in self.keys.items():
            if keys is None:
                state.pop(p, None)
                continue
            st = state[p]
            for k in [k for k in st if k not in keys]:
                del st[k]
            st.update(self.host.get(p, {}))


def skip_flag(params: list[torch.Tensor], group) -> torch.Tensor:
    """1-element bool tensor: some gradient of ``params`` holds NaN/Inf on some rank of ``group``
    (summed on the device, no host read)."""
    from . import collectives

    flags = local_nonfinite(params)
    total = flags.sum().reshape(1)
    if group is not None:
        collectives.all_reduce_sum_(total, group, "finite")
    return total.gt(0).reshape(())


def mask_grads_(params: list[torch.Tensor], flag: torch.Tensor) -> None:
    """Zero every gradient of ``params`` where ``flag`` is set, in place (no host read)."""
    for p in params:
        if p.grad is not None and p.grad.layout == torch.strided:
            g = to_local(p.grad)
            if g.device == flag.device:
                g.masked_fill_(flag, 0)


def snapshot(params: list[torch.Tensor], state, flag: torch.Tensor):
    """What ``restore_where`` and ``Skipped`` need: clones of every weight and state tensor on the
    flag's device (restored by ``where``), and the host-side state (restored when the flag is read)."""
    device = flag.device
    weights = [(to_local(p), to_local(p).clone()) for p in params if to_local(p).device == device]
    tensors: dict = {}
    host: dict = {}
    keys: dict = {}
    for p in params:
        if p not in state:
            keys[p] = None
            continue
        st = state[p]
        keys[p] = set(st)
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and to_local(v).device == device:
                tensors[(p, k)] = v.clone()  # a DTensor stays one: put back whole if the step replaced it
            elif isinstance(v, torch.Tensor):
                host.setdefault(p, {})[k] = v.clone()
            else:
                host.setdefault(p, {})[k] = copy.deepcopy(v)
    return weights, tensors, Skipped(flag, host, keys)


def restore_where(flag: torch.Tensor, weights, tensors, state, skipped: Skipped) -> None:
    """Every weight and device state tensor back to its snapshot where ``flag`` is set (on the device).
    A state tensor the step replaced by one of another shape or device is put back with the host
    state, when the flag is read."""
    for live, before in weights:
        live.copy_(torch.where(flag, before, live))
    for (p, k), before in tensors.items():
        now = state[p].get(k) if p in state else None
        loc = to_local(now) if isinstance(now, torch.Tensor) else None
        old = to_local(before)
        if (loc is not None and loc.shape == old.shape and loc.dtype == old.dtype and loc.device == old.device
                and is_dtensor(now) == is_dtensor(before)):
            loc.copy_(torch.where(flag, old, loc))
        else:  # replaced by another kind of tensor: put back whole once the flag is read
            skipped.host.setdefault(p, {})[k] = before


def defer(skipped: Skipped) -> Skipped:
    """The flag made readable later without waiting for the stream (CUDA: a pinned copy and an event)."""
    flag = skipped.flag
    if flag.device.type == "cuda" and not torch.compiler.is_compiling():
        host = torch.empty((), dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        skipped.flag, skipped.event = host, event
    return skipped


# ----------------------------------------------------------------------------- foreign state
def _guess(group: Mapping) -> str:
    keys = set(group) - {"params"}
    if {"betas", "amsgrad"} <= keys:
        return "torch.optim.Adam/AdamW"
    if {"momentum", "dampening"} <= keys:
        return "torch.optim.SGD"
    return "an optimizer that is not of dobb"


# The registry's entries (``dobb.registry.OPTIMIZERS``), handed over by the registry when it loads
# (``use_registry``), which ``import dobb`` does before any optimizer can exist. Handed over, not
# imported: the registry imports every optimizer class, and with them this module.
_REGISTRY: Mapping = {}


def use_registry(entries: Mapping) -> None:
    """Read the registry's ``entries`` (name -> ``registry.Entry``) for labels and preset keys."""
    global _REGISTRY
    _REGISTRY = entries


def label_of(cls: type, group: Mapping | None) -> str:
    """The registry label of an optimizer of class ``cls`` whose matrix group is ``group`` (the entry
    whose preset it matches most closely; the class name for a class not registered)."""
    best, score = cls.__name__, -1
    for entry in _REGISTRY.values():
        if entry.cls is cls and all(group is not None and _same(group.get(k), v) for k, v in entry.preset.items()):
            if len(entry.preset) > score:
                best, score = entry.label, len(entry.preset)
    return best


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def check_saved_optimizer(opt, saved_groups: list[Mapping], where: str = "this state dict", *,
                          trial: bool = True) -> None:
    """Raise ``ValueError`` naming both optimizers when ``saved_groups`` (a state dict's param groups,
    or those of a distributed checkpoint) were not saved by an optimizer like ``opt``: see the module
    docstring. Reads the groups' values only. ``trial=False``: which optimizer saved them only, not
    whether the parameters here take the saved values."""
    cls = type(opt)
    mine_group = next((g for g in opt.param_groups if g.get("algorithm") != "adamw"), None)
    mine = label_of(cls, mine_group)
    me = f"{mine} ({cls.__name__}, algorithm {opt.algorithm!r})"
    saved_matrix = next((g for g in saved_groups if g.get("algorithm") not in (None, "adamw")), None)
    for i, g in enumerate(saved_groups):
        if "algorithm" not in g:
            raise ValueError(
                f"{mine} cannot load {where}: saved param group {i} has no 'algorithm', so it was saved by "
                f"{_guess(g)} (group keys {sorted(k for k in g if k != 'params')}), not by {me}; its state "
                f"cannot be loaded into {mine}: load the model's weights alone and start a new {mine} state")
    rec_label = next((g[RECORD_LABEL] for g in saved_groups if RECORD_LABEL in g), None)
    rec_class = next((g[RECORD_CLASS] for g in saved_groups if RECORD_CLASS in g), None)
    if rec_class is not None and rec_class != cls.__name__ or rec_label is not None and rec_label != mine:
        raise ValueError(
            f"{mine} cannot load {where}: it was saved by {rec_label} ({rec_class}), this optimizer is {me}; "
            f"the state of one optimizer is not the state of another: build {rec_label} to resume it, or load "
            f"the model's weights alone and start a new {mine} state")
    for i, g in enumerate(saved_groups):
        algo = g["algorithm"]
        if algo not in ("adamw", opt.algorithm):
            saved = rec_label or f"an optimizer of algorithm {algo!r}"
            raise ValueError(
                f"{mine} cannot load {where}: saved param group {i} has algorithm {algo!r} (saved by {saved}), "
                f"this optimizer is {me}: build the optimizer that saved it, or load the model's weights alone")
    if rec_label is None and saved_matrix is not None:  # an older checkpoint: told apart by its options
        old = label_of(cls, saved_matrix)
        if old != mine:
            raise ValueError(
                f"{mine} cannot load {where}: it was saved by {old} ({cls.__name__} with "
                f"{', '.join(f'{k}={saved_matrix.get(k)!r}' for k in _preset_keys(cls))}), this optimizer is "
                f"{me}: build {old} to resume it")
    if len(saved_groups) != len(opt.param_groups) or not trial:
        return  # torch's own load names the group counts
    for i, (g, cur) in enumerate(zip(saved_groups, opt.param_groups)):
        if g["algorithm"] != cur.get("algorithm"):
            raise ValueError(
                f"{mine} cannot load {where}: saved param group {i} is an {g['algorithm']!r} group, this "
                f"optimizer's group {i} is {cur.get('algorithm')!r} (saved with other param groups)")
        if cur.get("algorithm") == "adamw" or not hasattr(opt, "_check_group"):
            continue
        # torch's load takes the saved group values: the parameters here must take them (a block count
        # that follows the shards, e.g.), checked on a trial group before anything loads
        values = {k: v for k, v in g.items() if k != "params" and k not in RECORD_KEYS and k in cur}
        trial = {**cur, **values}
        try:
            opt._check_group(trial)
            with opt._logical(trial) as logical:
                opt._group_plans(logical)
        except ValueError as exc:
            diff = [k for k in values if not _same(_plain(values[k]), _plain(cur[k]))]
            saved = ", ".join(f"{k}={values[k]!r}" for k in diff) or "its options"
            now = ", ".join(f"{k}={cur[k]!r}" for k in diff)
            raise ValueError(
                f"{mine} cannot load {where}: param group {i} was saved with {saved}"
                f"{f' (this optimizer has {now})' if now else ''}, which its parameters here cannot take "
                f"(torch's load would restore the saved values): {exc}. Resume with the saved layout (the "
                f"saved number of ranks), or load the model's weights alone and start a new {mine} state") from None


def _preset_keys(cls) -> list[str]:
    return sorted({k for e in _REGISTRY.values() if e.cls is cls for k in e.preset})


_UNSET = object()  # no attribute (``NonfiniteGuard._finite_group``)


class NonfiniteGuard:
    """The ``nonfinite`` option of every ``MatrixOptimizer`` (a mixin of it, as ``Copies`` is):
    ``"raise"`` refuses a step with a non-finite gradient before anything changes, all ranks
    agreeing; ``"skip"`` undoes it on the device (the functions above). ``MatrixOptimizer.step``
    calls ``_refuse_nonfinite``, ``_skip_setup``/``_skip_finish`` and ``_settle_skipped``."""

    # Whether the subclass takes the "raise" decision itself, in its own collectives (Dobb: agree).
    _agrees_finiteness = False

    def _nonfinite_params(self, mode: str) -> list[torch.Tensor]:
        """Every parameter of the groups whose ``nonfinite`` is ``mode`` (the same list on every rank)."""
        return [p for g in self.param_groups if g.get("nonfinite", "raise") == mode for p in g["params"]]

    def _finite_group(self):
        """The ranks that share this optimizer's step and decide finiteness together: the meshes of its
        DTensor parameters (None: plain parameters, whose gradients a DDP-like wrapper already averaged)."""
        group = getattr(self, "_step_group", _UNSET)  # Dobb's (core.optimizer: with its statistic groups)
        if group is _UNSET:  # not cached: a process group would make the optimizer uncopyable
            meshes = {id(p.device_mesh): p.device_mesh for g in self.param_groups for p in g["params"]
                      if is_dtensor(p)}
            group = None
            if meshes:  # DTensor parameters: sharding (and torch.distributed.tensor) is loaded already
                from .collectives import common_group
                from .sharding import mesh_group

                group = common_group([mesh_group(m) for m in meshes.values()])
        return group

    def _refuse_nonfinite(self) -> None:
        """``nonfinite="raise"``: a ``ValueError`` naming the first parameter with a NaN/Inf gradient on
        any rank, before any weight or state changes (one all-reduce of the flags, one host read)."""
        params = self._nonfinite_params("raise")
        if not params:
            return
        from . import collectives

        flags = local_nonfinite(params)
        group = self._finite_group()
        if group is not None:
            collectives.all_reduce_sum_(flags, group, "finite")
        values = flags.tolist()  # the one host read
        bad = [i for i, v in enumerate(values) if v > 0]
        if bad:
            self._raise_nonfinite(params, bad[0], int(values[bad[0]]))

    def _raise_nonfinite(self, params: list[torch.Tensor], index: int, ranks: int) -> None:
        from .collectives import group_ranks

        p = params[index]
        i = next(i for g in self.param_groups for i, q in enumerate(g["params"]) if q is p)
        group = self._finite_group()
        where = "" if group is None else f" on {ranks} of {len(group_ranks(group))} ranks"
        raise ValueError(
            f"non-finite gradient (NaN or Inf) in {self._param_label(p, i)}{where}; "
            f"{type(self).__name__} changed no weight or optimizer state on any rank (nonfinite='skip' "
            f"skips such steps, nonfinite='off' turns this check off)")

    def _skip_setup(self):
        """``nonfinite="skip"``: the flag (on the device), the gradients masked by it and a snapshot of
        every weight and state (``dobb._safety``); None when no group skips."""
        params = self._nonfinite_params("skip")
        if not params:
            return None
        flag = skip_flag(params, self._finite_group())
        everything = [p for g in self.param_groups for p in g["params"]]
        mask_grads_(everything, flag)
        return (flag, *snapshot(everything, self.state, flag))

    def _skip_finish(self, flag, weights, tensors, skipped) -> None:
        restore_where(flag, weights, tensors, self.state, skipped)
        self._skipped = defer(skipped)

    @disable_dynamo
    def _settle_skipped(self) -> None:
        """Read the flag of the last step run under ``"skip"`` (long computed by now) and, if it was
        skipped, put its host-side state back (``dobb.Skipped``)."""
        skipped = self._skipped
        if skipped is None:
            return
        self._skipped = None
        if skipped.was_skipped():
            skipped.restore(self.state)
            self._after_skip()

    def _after_skip(self) -> None:
        """Run when a skipped step's host-side state was put back (a subclass' host caches that follow
        it; Dobb arms its capture hooks for both outcomes in ``_skip_finish`` instead)."""


# ----------------------------------------------------------------------------- loading a state dict
# Earlier releases kept the Muon family's and RMNP's momentum under torch's key.
_LEGACY_KEYS = {"momentum_buffer": "momentum"}


def saved_state_by_param(opt: torch.optim.Optimizer, state_dict: dict, key: str) -> dict:
    """``{param: state_dict value of key}``, mapping saved ids (ints, or the FQNs
    ``torch.distributed.checkpoint`` passes) to parameters by position, as torch does."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    if len(saved_ids) != len(params):
        return {}  # torch's own load raises the precise error
    out = {}
    for i, p in zip(saved_ids, params):
        value = state_dict["state"].get(i, {}).get(key)
        if isinstance(value, torch.Tensor):
            out[p] = value
    return out


def _ints(value):
    """``value`` with every number (a tensor from a distributed checkpoint) an int, nested lists kept."""
    if isinstance(value, (list, tuple)):
        return [_ints(v) for v in value]
    return int(value)


def _rename_legacy_keys(state_dict: dict) -> dict:
    if not any(old in st for st in state_dict["state"].values() for old in _LEGACY_KEYS):
        return state_dict
    state = {}
    for pid, st in state_dict["state"].items():
        state[pid] = {_LEGACY_KEYS.get(k, k) if k in _LEGACY_KEYS and _LEGACY_KEYS[k] not in st else k: v
                      for k, v in st.items()}
    return {**state_dict, "state": state}
