"""Shared machinery of every matrix optimizer in this package.

A ``MatrixOptimizer`` holds two kinds of param groups, told apart by ``group["algorithm"]``:
``"adamw"`` groups run ``torch.optim.AdamW``'s own functional kernel (same state keys, same
numbers), every other group runs the subclass' matrix update under the shared update-scale
protocol ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O`` (paper Table 9).

Subclasses set ``algorithm`` (the name of their matrix groups) and ``Options`` (their typed
options: a frozen dataclass of fields with defaults and value rules, ``dobb._hparams``; every
group is filled from its defaults and checked by it; ``matrix_defaults`` is read from it) and
implement

- ``_check_matrix_group(group)``: raise ``ValueError`` naming a bad hyperparameter;
- ``_init_matrix_state(group)``: create every matrix's state, eagerly and identically on every
  rank (``torch.distributed.checkpoint`` loads only into state that exists);
- ``_matrix_step(group, active)``: update the matrices of ``group`` that have a gradient;

and may override ``_prepare_step()`` (before any update: raising there leaves every weight and
state untouched), ``_after_step()`` and ``_after_load()``. Every optimizer keeps its momentum under the state key ``"momentum"``.

Shared by every subclass (``dobb._safety``): the ``nonfinite`` group option ("raise": a NaN/Inf
gradient refuses the step with a ``ValueError`` naming the parameter, all ranks agreeing; "skip":
the step is undone on the device; "off"), and ``state_dict``/``load_state_dict``'s record of the
optimizer that saved a state, so that another optimizer's or preset's state is refused at load.

What a subclass reads of each matrix at every step and that the group and the parameter fix (its
layouts, its tiles, its route to an owner rank) is its *plan*, built once by ``_group_plans(group)``
when the matrix's group is added (before ``_init_matrix_state``, which may read it) and kept in
``self._plans`` (matrix as the update sees it -> plan). Plans are derived state (``_derived``):
never saved nor copied, rebuilt from the param groups after ``load_state_dict`` and in a copy
(``_rebuild``), so a plan always follows the groups it is read with.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from . import _safety
from ._safety import _ints, _rename_legacy_keys, saved_state_by_param  # noqa: F401 (re-exported)
from ._copies import Copies
from .layout import is_dtensor, to_local
from ._hparams import ScaledOptions, _check_rate
from ._torch_private import adamw_init_group, fused_adamw_devices

# Keys that builders add to every group (torch schedulers: initial_lr; torchtitan: param_names).
_BUILDER_KEYS = frozenset({"params", "param_names", "initial_lr"})

# State keys kept as Python ints (a distributed checkpoint may hand them back as tensors).
_INT_STATE_KEYS = ("step", "captures")


def _adamw_kernel(lists: list, kwargs: dict) -> None:
    """torch's AdamW kernel with ``capturable`` decided in this frame. Under ``torch.compile`` Dynamo
    may run ``step()`` eagerly (a graph break under a context manager it cannot resume in) and still
    compile the functions it calls: this frame is then compiled, and must trace torch's capturable
    form, while an eager call must not ask for it (torch refuses capturable=True on a CPU). Read in
    ``step()`` itself, the flag was False in that case and the compiled kernel failed."""
    _torch_adamw(*lists, **dict(kwargs, capturable=torch.compiler.is_compiling()))


def _kernel_unset(group: dict[str, Any]) -> bool:
    """Neither ``fused`` nor ``foreach`` set: the group takes torch's fastest AdamW kernel."""
    return group.get("fused") is None and group.get("foreach") is None


def _fusable(p: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel runs on ``p``: a floating, non-DTensor parameter on a
    device type with the kernel (CPU and CUDA in the pinned torch)."""
    return p.is_floating_point() and not is_dtensor(p) and p.device.type in fused_adamw_devices()


def adamw_kernel_flags(group: dict[str, Any], params: list[torch.Tensor]) -> tuple[bool, bool]:
    """``(fused, foreach)`` with which an ``"adamw"`` group steps ``params`` (see
    ``MatrixOptimizer._adamw_inputs``). An explicit flag is honoured; with both unset, fused where
    every parameter is ``_fusable``, the lr a number and the step not being compiled."""
    lr = group["lr"]
    if group.get("fused"):
        return True, False
    foreach = group.get("foreach")
    if foreach is not None:
        return False, bool(foreach)
    if (group.get("fused") is None and params and not isinstance(lr, torch.Tensor)
            and not torch.compiler.is_compiling() and all(_fusable(p) for p in params)):
        return True, False
    return False, not any(is_dtensor(p) for p in params) and not isinstance(lr, torch.Tensor)


def _adamw_group_lr(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """An ``"adamw"`` group that sets no ``lr`` of its own starts at ``adamw_lr`` (the group's, else
    the optimizer's) when that is given; ``None`` leaves it the matrix ``lr`` (torch fills it from
    the defaults). The AdamW part's rate is then the group's own ``lr``, the one key every torch
    scheduler reads and writes: ``LambdaLR`` records it as the group's ``initial_lr`` and scales it
    by the same factor as the matrix groups', so the ratio ``adamw_lr / lr`` stays fixed."""
    if group.get("algorithm") != "adamw" or "lr" in group:
        return
    adamw_lr = group.get("adamw_lr", defaults.get("adamw_lr"))
    if adamw_lr is not None:
        _check_rate("adamw_lr", adamw_lr)
        group["lr"] = adamw_lr


def _name_of(param: torch.Tensor, names: dict[int, str] | None, index: int) -> str:
    if names and id(param) in names:
        return names[id(param)]
    return f"parameter #{index} (shape {tuple(param.shape)})"


class MatrixOptimizer(_safety.NonfiniteGuard, Copies, torch.optim.Optimizer):
    algorithm: str = "matrix"
    # The typed options of this optimizer's groups (one frozen dataclass, see dobb._hparams): their
    # defaults fill every group, their rules check it. Subclasses set their own.
    Options: type = ScaledOptions
    # The last step run under nonfinite="skip" whose flag is unread (``dobb._safety.Skipped``); set per
    # instance, the class' None serves copies pickled before it existed.
    _skipped = None
    # The defaults of the options ``Options`` adds to the shared ones, read from it (never written).
    matrix_defaults: dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.matrix_defaults = cls.Options.own_defaults()

    def __init__(self, params, *, lr: float, weight_decay: float = 0.0, param_names=None, **hparams):
        accepted = self.Options.hparam_defaults()
        unknown = set(hparams) - set(accepted)
        if unknown:
            raise ValueError(
                f"{type(self).__name__} got unknown argument(s) {sorted(unknown)}{self._why_unknown(unknown)}; "
                f"valid: {sorted(['lr', 'weight_decay', *accepted])}"
            )
        defaults = self.Options.defaults()
        defaults.update(hparams)
        defaults.update(lr=lr, weight_decay=weight_decay, algorithm=self.algorithm)
        self._param_names: dict[int, str] = dict(param_names or {})
        self._views: dict[torch.Tensor, torch.Tensor] = {}
        # one plan per matrix (derived state, see the module docstring): built with its group
        self._plans: dict[torch.Tensor, Any] = {}
        self._skipped: _safety.Skipped | None = None  # the last step run under nonfinite="skip", unread
        super().__init__(params, defaults)

    def _param_label(self, p: torch.Tensor, index: int) -> str:
        """``p``'s name in messages (``index``: its place in its group, for unnamed parameters)."""
        return _name_of(p, self._param_names, index)

    def _why_unknown(self, unknown: set[str]) -> str:
        if "tau" in unknown and "tau" not in self.Options.names():
            return (f" ({type(self).__name__}'s step is not under the update-scale protocol "
                    f"lr * tau*sqrt(max(m, n)): it takes no tau)")
        return ""

    # ------------------------------------------------------------------ validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = dict(param_group)
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        # Named parameters ((name, tensor) pairs) are accepted and remembered for error messages.
        if params and isinstance(params[0], tuple):
            for name, p in params:
                self._param_names[id(p)] = name
            params = [p for _, p in params]
        param_group["params"] = params
        _adamw_group_lr(param_group, self.defaults)
        unknown = set(param_group) - set(self.defaults) - _BUILDER_KEYS
        if unknown:
            raise ValueError(f"param group has unknown key(s) {sorted(unknown)}{self._why_unknown(unknown)}; "
                             f"valid: {sorted(self.defaults)}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_group(group)
        # State is created here, eagerly and identically on every rank: torch.distributed.checkpoint
        # loads only into state that exists, and every rank must hold the same keys.
        if group["algorithm"] == "adamw":
            for p in group["params"]:
                self._init_adamw_state(p, fused=group["fused"] is True or (
                    _kernel_unset(group) and _fusable(p)))
        else:
            with self._logical(group) as logical:
                self._plan_group(logical)
                self._init_matrix_state(logical)

    def _check_group(self, group: dict[str, Any]) -> None:
        algo = group["algorithm"]
        if algo not in ("adamw", self.algorithm):
            raise ValueError(f"algorithm must be 'adamw' or {self.algorithm!r}, got {algo!r}")
        # kinds, ranges and choices, from the one declaration (an AdamW group: the options it reads)
        self.Options.check(group, matrix=algo == self.algorithm)
        if algo == "adamw":
            if group["fused"]:
                for i, p in enumerate(group["params"]):
                    if not (p.is_floating_point() and p.device.type in fused_adamw_devices()):
                        raise ValueError(
                            f"fused=True: {_name_of(p, self._param_names, i)} ({p.dtype} on {p.device.type}) has "
                            f"no fused AdamW kernel (floating parameters on {fused_adamw_devices()}); use fused=None"
                        )
            return
        for i, p in enumerate(group["params"]):
            if p.is_complex():  # the matrix updates are real: the imaginary part would be dropped
                raise ValueError(
                    f"{_name_of(p, self._param_names, i)} is complex ({p.dtype}); {type(self).__name__} "
                    f"updates real matrices only: put it in an 'adamw' group (torch's AdamW handles complex "
                    f"parameters), or store its real and imaginary parts as real parameters"
                )
            if p.dim() == 3 and not self._expert_stacks:
                raise ValueError(
                    f"{_name_of(p, self._param_names, i)} is a 3-D expert stack (E, out, in) = {tuple(p.shape)}; "
                    f"{type(self).__name__} updates 2-D matrices only: optimize the stack with Dobb (algorithm "
                    f"'dobb', E matrices with their own bases), put it in an 'adamw' group, or store each "
                    f"expert as its own 2-D parameter"
                )
            if p.dim() not in (2, 3):
                raise ValueError(
                    f"{_name_of(p, self._param_names, i)} is {p.dim()}-D; {type(self).__name__} "
                    f"updates 2-D matrices only: put it in an 'adamw' group (dobb.param_groups does this)"
                )
        with self._logical(group) as logical:
            self._check_matrix_group(logical)

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        """Subclasses check their own hyperparameters here (raise ValueError naming the argument)."""

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        """Subclasses create the state of every matrix of ``group`` here."""

    def _init_adamw_state(self, p: torch.Tensor, fused: bool = False) -> dict[str, Any]:
        state = self.state[p]
        if not state:  # torch.optim.AdamW's keys and initial values (fused: the step on the device)
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    # ------------------------------------------------------------------ per-matrix plans (derived state)
    def _group_plans(self, group: dict[str, Any]) -> list | None:
        """The plan of every matrix of ``group`` (in ``group["params"]`` order, the matrices as the
        update sees them), from the group and the parameters alone; a ``ValueError`` naming the
        parameter whose plan cannot be built. ``None``: this optimizer keeps no plans."""
        return None

    def _plan_group(self, group: dict[str, Any]) -> None:
        plans = self._group_plans(group)
        if plans is not None:
            self._plans.update(zip(group["params"], plans))

    # Attributes that are caches derived from the param groups (never copied: ``_rebuild`` makes them).
    # Subclasses that keep more list them with ``"_plans"``.
    _derived: tuple[str, ...] = ("_plans",)

    def _rebuild(self) -> None:
        """Rebuild the ``_derived`` caches from the param groups (in a copy, and after a load): every
        plan, group by group in order. Subclasses with more caches reset them, then call this."""
        self._plans = {}
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                with self._logical(group) as logical:
                    self._plan_group(logical)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A step called inside an autocast region (a whole loop under autocast) must not run its
        # statistics, QR, eigh or projections in bf16: the update is computed in the state dtypes.
        with torch.autocast(device_type=self._device_type(), enabled=False):
            # Every group is checked before any weight changes (torch.optim.AdamW checks group by
            # group, so its earlier groups are already stepped when a later one fails).
            if self._skipped is not None:  # a step run under nonfinite="skip": read its flag (a graph
                self._settle_skipped()  # break under torch.compile) and put its host-side state back if skipped
            adamw_work = [self._adamw_inputs(g) for g in self.param_groups if g["algorithm"] == "adamw"]
            self._check_matrix_grads()
            if not self._agrees_finiteness:  # Dobb decides it with its statistics (_prepare_step)
                self._refuse_nonfinite()
            skip = self._skip_setup()
            self._prepare_step()
            for lists, kwargs in adamw_work:
                if lists[0]:
                    _adamw_kernel(lists, kwargs)
            for group in self.param_groups:
                if group["algorithm"] != "adamw":
                    active = [p for p in group["params"] if p.grad is not None]
                    if active:
                        with self._logical(group) as logical:
                            self._matrix_step(logical, [self._views.get(p, p) for p in active])
            self._after_step()
            if skip is not None:
                self._skip_finish(*skip)
        return loss

    # Whether the subclass handles transposed=True groups itself (Dobb flips its layout's axis).
    _native_transposed = False
    # Whether the subclass optimizes 3-D expert stacks (E, out, in) as E matrices (Dobb); the others
    # refuse them at construction, naming the parameter.
    _expert_stacks = False

    @contextlib.contextmanager
    def _logical(self, group: dict[str, Any]):
        """The group as the matrix update sees it.

        A ``transposed=True`` group holds weights stored ``(in, out)`` (Hugging Face ``Conv1D``):
        the matrix is their transpose. Unless the subclass handles that itself, it is given a copy
        of the group whose params are transposed views of the weights (kept, one per weight, so
        everything keyed by parameter stays keyed), each with its gradient's transposed view and,
        for the duration, the weight's state (created through the view, so shaped like the
        matrix). In-place updates of a view update the weight. State rests under the weight, so
        checkpoints map it by parameter as usual.
        """
        if not group.get("transposed") or self._native_transposed:
            yield group
            return
        params = group["params"]
        views = []
        for p in params:
            v = self._views.get(p)
            if v is None:
                v = self._views[p] = p.detach().t()
            v.grad = None if p.grad is None else p.grad.t()
            if p in self.state:
                self.state[v] = self.state.pop(p)
            views.append(v)
        try:
            yield dict(group, params=views)
        finally:
            for p, v in zip(params, views):
                v.grad = None
                if v in self.state:
                    self.state[p] = self.state.pop(v)

    def _device_type(self) -> str:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device.type
        return "cpu"

    def _prepare_step(self) -> None:
        """Run before any update: raise here to leave every weight and state untouched."""

    def _matrix_step(self, group: dict[str, Any], active: list[torch.Tensor]) -> None:
        """Update ``active`` (the matrices of ``group`` with a gradient). Read every ``p.grad``
        before looking ``p`` up in ``self.state``: when ``torch.compile`` compiles this frame on its
        own (after a graph break in ``step()``), a gradient first reached through a state key is
        guarded by its identity, and ``zero_grad()`` (``set_to_none=True``) makes a new gradient
        every step, so each step recompiled it until Dynamo's limit (tests/integrations/test_compile.py)."""
        raise NotImplementedError

    def _after_step(self) -> None:
        """Run after every group has been updated."""

    def _adamw_inputs(self, group: dict[str, Any]) -> tuple[list, dict]:
        """Arguments of ``torch.optim.adamw.adamw`` for an ``"adamw"`` group, gathered by
        ``torch.optim.AdamW``'s own ``_init_group``: its checks (sparse gradients refused with its
        ``RuntimeError``) and its ``has_complex`` flag (complex parameters stepped as real pairs).
        Traced by ``torch.compile``, the same lists and checks are gathered here (Dynamo disables
        ``_init_group``: calling it broke the compiled step in two).

        The group's ``fused``/``foreach`` are honoured as ``torch.optim.AdamW`` honours them. With
        both ``None`` (the default) the group takes torch's fastest kernel: the fused one where
        torch has it for every parameter's device and dtype (``_fusable``), else the foreach one;
        DTensor parameters, a tensor lr (a scheduler holding tensors) and a step being traced by
        ``torch.compile`` keep the paths they took before (single-tensor; foreach under compile),
        as ``torch.optim.AdamW`` does. ``fused=False`` alone keeps torch's foreach default."""
        lr = group["lr"]
        with_grad = [p for p in group["params"] if p.grad is not None]
        fused, foreach = adamw_kernel_flags(group, with_grad)
        if fused:  # a counter loaded for another kernel (a checkpoint of foreach) moves to the device
            for p in with_grad:
                step = self.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    self.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
        # compiled (torch.compile(opt.step)): bias corrections as tensors, as Dynamo makes
        # torch.optim.AdamW do; eager: torch's default host-side path
        capturable = torch.compiler.is_compiling()
        flags = dict(amsgrad=False, maximize=False, foreach=foreach, capturable=capturable,
                     differentiable=False, fused=fused)
        # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        lists: tuple[list, ...] = ([], [], [], [], [], [])
        states = [self._init_adamw_state(p, fused=fused) for p in with_grad]
        if capturable:  # traced: Dynamo disables torch's _init_group (a graph break), so its lists are
            # gathered here, from the state it would read (created above), with its check
            if any(p.grad.is_sparse for p in with_grad):
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            lists = (with_grad, [p.grad for p in with_grad], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states])
            has_complex = any(torch.is_complex(p) for p in with_grad)
        else:
            has_complex = adamw_init_group(self, dict(group, **flags), *lists)
        beta1, beta2 = group["adamw_betas"]
        return list(lists), dict(flags, has_complex=has_complex, beta1=beta1, beta2=beta2, lr=lr,
                                 weight_decay=group["weight_decay"], eps=group["adamw_eps"])

    def _check_matrix_grads(self) -> None:
        # torch.optim.Muon refuses sparse gradients too; here before any weight changes
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.layout != torch.strided:
                    name = _name_of(p, self._param_names, i)
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients ({name} has a {p.grad.layout} "
                        f"gradient): give the matrix a dense gradient, or put it in an 'adamw' group"
                    )

    def iter_matrix_params(self) -> Iterable[torch.Tensor]:
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                yield from group["params"]

    def __getstate__(self) -> dict[str, Any]:
        self._settle_skipped()  # a copy starts from settled state
        return super().__getstate__()

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, every param group recording the optimizer that saved it
        (``dobb._safety.RECORD_KEYS``: its registry label and class), read by ``load_state_dict``."""
        self._settle_skipped()
        sd = super().state_dict()
        record = {_safety.RECORD_LABEL: _safety.label_of(type(self), next(
            (g for g in self.param_groups if g["algorithm"] != "adamw"), None)),
            _safety.RECORD_CLASS: type(self).__name__}
        sd["param_groups"] = [dict(g, **record) for g in sd["param_groups"]]
        return sd

    # State tensors that keep their own dtype on load (torch casts floating state to the
    # parameter's dtype, e.g. a bf16 model would otherwise resume with a bf16 basis).
    _own_dtype_keys: tuple[str, ...] = ()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._settle_skipped()
        # checked before anything loads (torch loads group values unchecked): a bad rate refused here
        # leaves this optimizer as it was
        for i, saved in enumerate(state_dict["param_groups"]):
            for key in ("lr", "weight_decay"):
                if key in saved:
                    _check_rate(f"{key} of saved param group {i}", saved[key])
        # another optimizer's, preset's or layout's state: refused, naming both, before anything loads
        _safety.check_saved_optimizer(self, state_dict["param_groups"])
        state_dict = {**state_dict, "param_groups": [{k: v for k, v in g.items() if k not in _safety.RECORD_KEYS}
                                                     for g in state_dict["param_groups"]]}
        state_dict = _rename_legacy_keys(state_dict)
        self._check_saved_shapes(state_dict)
        own = {key: saved_state_by_param(self, state_dict, key) for key in self._own_dtype_keys}
        layouts = {(p, key): self.state[p][key] for key, saved in own.items() for p in saved
                   if is_dtensor(self.state[p].get(key))}
        super().load_state_dict(state_dict)
        for key, saved in own.items():
            for p, value in saved.items():
                value = value.to(device=to_local(p).device, copy=True)
                mine = layouts.get((p, key))
                if mine is not None and is_dtensor(value) and tuple(value.placements) != tuple(mine.placements):
                    value = value.redistribute(mine.device_mesh, mine.placements)  # keep this run's layout
                self.state[p][key] = value
        for p in self.iter_matrix_params():
            st = self.state[p]
            for key in _INT_STATE_KEYS:
                if key in st:
                    st[key] = _ints(st[key])
        self._rebuild()  # the plans follow the loaded groups
        self._after_load()

    def _check_saved_shapes(self, state_dict: dict) -> None:
        """Every saved state tensor must have the shape this optimizer's layout gives it (a state
        saved with other ``blocks``, ``side``, rank or weight shape would load and then fail, or
        silently misbehave, steps later)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [(p, j) for g in self.param_groups for j, p in enumerate(g["params"])]
        if len(saved_ids) != len(params):
            return  # torch's own load raises the precise error
        for i, (p, j) in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                mine = self.state[p].get(key) if p in self.state else None
                if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and value.shape != mine.shape:
                    raise ValueError(
                        f"{_name_of(p, self._param_names, j)}: saved state {key!r} has shape {tuple(value.shape)}, "
                        f"but this optimizer's layout needs {tuple(mine.shape)} (saved with other blocks, side, "
                        f"rank or weight shape?)"
                    )

    def _after_load(self) -> None:
        """Run after ``load_state_dict`` (torch has replaced the param group dicts by then)."""
