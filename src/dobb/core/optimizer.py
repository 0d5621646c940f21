"""The Dobb optimizer class: its state, capture API and the step's order.

The class owns the state (everything a checkpoint needs) and one ``Plan`` per matrix
(``core.schedule``: its sides' layouts and state keys, refresh period and offset; a cache built from
the param groups, rebuilt after a load or a copy). Which matrices refresh is ``core.schedule.due``,
which capture and fold a statistic ``core.schedule.captured`` (read by the hooks' arming and the fold). A step
(``_base.MatrixOptimizer.step``) calls, in order:

1. ``Dobb._prepare_step``: ``statistics.agree`` (what the ranks decide together: the statistics of
   the due matrices, the finiteness of the gradients), then ``Dobb._refresh_all``: the statistic
   fold (``statistics.fold_side``; ``statistics.gram_statistic`` for ``source="grad_gram"``) and the
   batched basis solve (``statistics.solve`` over ``functional.refresh_bases``);
2. ``Dobb._matrix_step`` per param group: the momentum, then ``core.update``: ``apply_directions``
   (one-sided: ``functional.add_directions_``, its items built once per matrix on a CPU: ``DirectionCache``)
   or ``apply_two_sided`` (``side="both"``: ``functional.two_sided_update_``), which choose the kernel.

The math on plain tensors is in ``dobb.functional``; where blocks live in ``dobb.layout`` (DTensors:
``dobb.sharding``; expert stacks: ``core.experts``; chosen by ``placement.layout_for``); the capture
hooks in ``dobb.capture``; the options and their rules in ``core.options``; the step per matrix in
``core.update``'s docstring. The plan and the refresh rule are in ``core.schedule`` (``Plan``, ``due``,
periods, staggered offsets, two-sided layouts); the update's kernel choice and batching in
``core.update`` (``compile=True``: ``core.kernels``). Their public names are re-exported here. One
step's data (the agreed statistics, the idle matrices) is passed between the step's methods as
arguments, never kept on the instance.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .._base import MatrixOptimizer, _name_of
from ..capture import CaptureHooks
from ..collectives import common_group, group_ranks, plain_stat_group
from ..layout import ReducedStat, is_dtensor
from ..placement import layout_for
from .experts import expert_layout, expert_parts
from ..attention_heads import check_heads_apply
from .options import HOOK_SOURCES as _HOOK_SOURCES
from .options import DobbOptions, check_params
from .schedule import (Plan, Side, block_counts, captured, captures, cycle, due, ns_rows, plans_of, queue_refresh,
                       refresh_period, saved_captures, stagger_offsets, two_sided_layouts)
from .statistics import DueStat, RefreshBatch, agree, solve, split_by_default, store_bases
from .update import (FUSE_MIN_BLOCK_WORK, DirectionCache, OneSided, TwoSided, apply_directions,
                     apply_preconditioned_muon, apply_prepared, apply_two_sided, apply_whole_steps, decay_in_update,
                     fused_decays, precondition, prepared_directions, whole_step_owner)

__all__ = ["Dobb", "Side", "Plan", "due", "captures", "saved_captures", "refresh_period",
           "cycle", "stagger_offsets", "two_sided_layouts", "FUSE_MIN_BLOCK_WORK", "OneSided", "TwoSided",
           "decay_in_update", "apply_directions", "apply_two_sided", "apply_preconditioned_muon", "precondition"]


_FLIP = {"input": "output", "output": "input"}
_UNRESOLVED = object()


class Dobb(MatrixOptimizer):
    """Distributed Optimizer with Block-diagonal Eigenbases (see README and docs/algorithm.md for every option).

    Args (beyond ``torch.optim`` conventions; every one may be overridden per param group):
        model: the module whose layers own the matrices; needed for ``source="activation"`` and
            ``"output_grad"`` (capture hooks are registered on it).
        blocks: number of diagonal blocks ``B`` of the blocked axis (contiguous, nearly equal; under
            sharding cut at shard boundaries first; None: one per shard of a sharded axis, else 1).
            It trades loss against step cost (docs/results.md, "Operating point"; docs/timing.md,
            "A refresh that scales" for ``split_refresh`` and ``refresh_width`` at ``blocks=1``).
        refresh_every: refresh period ``T`` (the first step always refreshes).
        capture_every: None (capture and fold the statistic on refresh steps only) or ``k``: also every
            ``k``-th step (``step % k == 0``), folded into the EMA with no new basis (hook sources only).
        refresh_width: None (every matrix every ``T`` steps) or a width ``w``: a matrix whose widest
            block is ``s`` wide refreshes every ``T * max(1, round(s / w))`` steps (``refresh_period``).
        basis: ``"orthogonal_iteration"`` (``ortho_steps`` warm-started ``Q <- qr(A Q)``) or ``"eigh"``.
        qr: ``"householder"`` or ``"cholesky"`` (failed blocks redone by Householder).
        norm: ``"sign"`` (Dobb), ``"l2"`` (Dobb-ell2: unit-norm coefficient columns) or, with
            ``side="both"``, ``"adam"`` (SOAP's second-moment rule on the two-sided coefficients).
        side: ``"input"`` (column blocks, basis over ``n``), ``"output"`` (row blocks, Dobb-G) or
            ``"both"`` (two-sided Dobb: ``C_bc = Q_out_b^T U_bc Q_in_c``, see ``functional.two_sided_update_``).
        out_blocks: row blocks of the output side of ``side="both"`` (``blocks`` stays the input side's).
        beta2, eps: ``norm="adam"``'s second-moment decay and denominator epsilon.
        source: ``"activation"`` (input side; two-sided: output gradients for the output side),
            ``"output_grad"`` (output side) or ``"grad_gram"`` (``G^T G`` / ``G G^T``; no hooks).
        capture: ``"first"`` micro-batch after the previous step, or ``"all"``. stat_decay: EMA
            decay ``A <- d A + (1-d) A_new`` (the first capture initialises ``A``). init_basis:
            exact ``"eigh"`` of the first capture (default) or ``"identity"``.
        stagger: spread refreshes over the cycle (same per-matrix period, only its phase moves) to
            flatten the refresh-step spike (docs/timing.md, "Refresh spike"). Default True.
        check_finite: False is the older spelling of ``nonfinite="off"`` (every optimizer's group
            option, ``dobb._safety``). True (default): a NaN/Inf gradient is a ``ValueError`` naming
            the parameter before any state changes, all ranks deciding together (one flag
            all-reduce, folded into the statistic reduction on refresh steps; one host read a step).
        split_refresh: where ranks share a statistic (FSDP2, DDP, HSDP), each even-sized block's
            refresh runs on one of them and is broadcast in the basis dtype (bitwise the same bases),
            dividing the refresh work by the group size. None (default): split where that is bitwise
            by construction, a hook statistic (``statistics.split_by_default``), on any device; True:
            every shared request; False: every rank computes every refresh, in the batches the split's
            owners would solve (so the same bits where a device rounds a block by its batch).
        stat_group: process group over which statistics are averaged (token-weighted). ``"default"``:
            a DTensor's data-parallel mesh dims; plain parameters the process group of the DDP module
            passed as ``model`` (a ``ValueError`` under several ranks without one: pass a
            ``ProcessGroup``, or None for this rank's data alone); mesh dim names/indices.
        product_dtype: dtype of the products ``U_b Q_b``, ``C_b Q_b^T``: ``"auto"`` (the basis dtype
            on accelerators, fp32 on CPUs: ``functional.matmul_dtype``) or a dtype that forces it.
        transposed: weights stored ``(in, out)`` (``Conv1D``; ``dobb.param_groups`` sets it).
        compile: the update's pure kernels compiled by Inductor (``core.kernels``, ``dobb._compiled``).

    A group may hold 3-D expert stacks ``(E, out, in)``, each ``E`` matrices (``core.experts``).
    """

    algorithm = "dobb"
    _agrees_finiteness = True  # nonfinite="raise" rides on the statistics' reduction (_prepare_step)
    _native_transposed = True  # transposed groups flip the layout's blocked axis (see _init_matrix_state)
    _expert_stacks = True  # 3-D (E, out, in) parameters are E matrices (see core.experts)
    Options = DobbOptions  # the options, their defaults and value rules (core.options)

    def __init__(self, params, model: nn.Module | None = None, *, lr: float, weight_decay: float = 0.0,
                 check_finite: bool = True, stat_group="default", split_refresh: bool | None = None, **kwargs):
        if split_refresh is not None and not isinstance(split_refresh, bool):
            raise ValueError(f"split_refresh must be True or False (or None: split where bitwise), "
                             f"got {split_refresh!r}")
        self.model = model
        self.check_finite = check_finite
        self.split_refresh = split_refresh
        self._stat_group = stat_group
        # one plan per matrix (sides, layouts, period, offset) lives in self._plans: derived state of
        # MatrixOptimizer, built by _group_plans with each group, rebuilt after load_state_dict and copies
        self._directions = DirectionCache()  # per matrix, its direction's views (core.update): derived too
        self._hooks: CaptureHooks | None = None
        self._plain_group = _UNRESOLVED
        self._constructed = False
        super().__init__(params, lr=lr, weight_decay=weight_decay, **kwargs)
        self._constructed = True
        for heads in {g["heads"] for g in self._dobb_groups()} - {None}:  # heads must cut some matrix
            check_heads_apply(heads, [self._matrix_name(p, g) for g in self._dobb_groups() if g["heads"] == heads
                                      for p in g["params"]])
        self._install_hooks()
        self._step_group = self._find_step_group()

    # ------------------------------------------------------------------ set-up
    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        check_params(group, lambda p, i: _name_of(p, self._param_names, i), has_model=self.model is not None)

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            self.state[p] = self._new_state(p, group, self._plans[p])

    def _group_plans(self, group: dict[str, Any]) -> list[Plan]:
        """The plan of every matrix of ``group``, from the group and the parameters alone."""
        sides, counts = [], []
        for i, p in enumerate(group["params"]):
            try:
                blocks, out_blocks = block_counts(p, group, self._matrix_name(p, group))
                counts.append((blocks, out_blocks))
                mgroup = group if (blocks, out_blocks) == (group["blocks"], group["out_blocks"]) else \
                    {**group, "blocks": blocks, "out_blocks": out_blocks}
                if is_dtensor(p):
                    stat_group = self._stat_group
                elif group["source"] in _HOOK_SOURCES:
                    stat_group = self._plain_stat_group()
                else:  # grad_gram: the gradient is already averaged, the statistic needs no group
                    stat_group = None
                layout_of = expert_layout if p.dim() == 3 else layout_for
                # a transposed weight, stored (in, out): its input axis is dim 0, so the "input" side
                # blocks dim 0 (what "output" blocks on an (out, in) weight) and vice versa
                side = _FLIP.get(group["side"], "both") if group["transposed"] else group["side"]
                if side == "both":
                    lin, lout = two_sided_layouts(p, mgroup, stat_group, group["transposed"], layout_of)
                    sides.append((Side(lin), Side(lout, "out_stat", "out_basis")))
                else:
                    sides.append((Side(layout_of(p, side, blocks, stat_group)),))
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None
        rows = [ns_rows(p, group, ob, _name_of(p, self._param_names, i), layout_for)
                for i, (p, (_, ob)) in enumerate(zip(group["params"], counts))]
        return plans_of(sides, group, rows)

    def _matrix_name(self, p: torch.Tensor, group: dict) -> str | None:
        """``p``'s name (named params, else the model's ``named_parameters``), read only with ``heads``."""
        if group["heads"] is None:
            return None
        if id(p) in self._param_names:
            return self._param_names[id(p)]
        if self.model is not None:
            if getattr(self, "_names_from_model", None) is None:
                self._names_from_model = {id(q): n for n, q in self.model.named_parameters()}
            if id(p) in self._names_from_model:
                return self._names_from_model[id(p)]
        raise ValueError(f"heads={group['heads']} finds attention matrices by name: pass model=<the nn.Module> "
                         f"or named parameters ((name, tensor) pairs); {_name_of(p, self._param_names, 0)} has none")

    _derived = ("_plans", "_names_from_model", "_owner", "_directions")

    def _rebuild(self) -> None:
        """Every plan, from the param groups (after ``load_state_dict``, in a copy)."""
        self._names_from_model = None
        self._directions = DirectionCache()
        super()._rebuild()

    def _new_state(self, p: torch.Tensor, group: dict, plan: Plan) -> dict[str, Any]:
        # Created eagerly and identically on every rank, so distributed checkpoints see one key set.
        state: dict[str, Any] = {"step": 0, "captures": plan.new_captures(),
                                 "momentum": torch.zeros_like(p, memory_format=torch.preserve_format)}
        for side in plan.sides:
            state[side.stat] = side.layout.new_block_state(group["stat_dtype"], identity=False, like=p)
            state[side.basis] = side.layout.new_block_state(group["basis_dtype"], identity=True, like=p)
        if group["norm"] in ("adam", "muon"):  # EMA of the squared rotated gradient, in the statistic dtype
            state["second_moment"] = torch.zeros_like(p, dtype=group["stat_dtype"])
        return state

    def _install_hooks(self) -> None:
        hooked = {p: g for g in self._dobb_groups() for p in g["params"] if g["source"] in _HOOK_SOURCES}
        if self._hooks is not None:
            self._hooks.remove()
        sides = {p: tuple(side.layout for side in self._plans[p].sides) for p in hooked}
        self._hooks = CaptureHooks(self.model, hooked, sides) if hooked else None
        self._rearm()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_constructed", False):  # a group added after construction
            self._install_hooks()
            self._step_group = self._find_step_group()

    def _plain_stat_group(self):
        if self._plain_group is _UNRESOLVED:
            self._plain_group = plain_stat_group(self.model, self._stat_group)
        return self._plain_group

    def _find_step_group(self):
        """The ranks that share this optimizer's step (they decide finiteness together): the meshes
        of DTensor parameters, the statistic group of plain ones."""
        groups = []
        for g in self.param_groups:
            for p in g["params"]:
                if is_dtensor(p):
                    from ..sharding import mesh_group

                    groups.append(mesh_group(p.device_mesh))
                elif self._plain_group is not _UNRESOLVED:
                    groups.append(self._plain_group)
                else:
                    try:
                        groups.append(plain_stat_group(self.model, self._stat_group))
                    except ValueError:  # no hook source needed it: gradients are this rank's own
                        pass
        return common_group(groups)

    def _dobb_groups(self):
        return [g for g in self.param_groups if g["algorithm"] == self.algorithm]

    def remove_hooks(self) -> None:
        """Detach the capture hooks from the model (the optimizer then behaves as grad_gram-less)."""
        if self._hooks is not None:
            self._hooks.remove()

    @contextlib.contextmanager
    def capture_paused(self):
        """No statistic is captured by this optimizer inside the block (e.g. an extra forward pass of
        another optimizer on the same model, a probe batch); what is armed stays armed."""
        if self._hooks is None:
            yield
            return
        self._hooks.paused += 1
        try:
            yield
        finally:
            self._hooks.paused -= 1

    def capture(self, weight: torch.Tensor, features, expert: int | None = None) -> bool:
        """Record input features of ``weight``'s layer for its statistic, for layers the hooks
        cannot read: custom layers, experts that see only the tokens routed to them.

        ``features``: rows of the layer's input, last dimension the weight's input axis (any
        leading shape). Counted like a hooked forward pass: only when the next ``step()`` captures
        ``weight`` (a refresh or ``capture_every``; else nothing is recorded, False returned), with grad
        enabled, outside ``capture_paused()`` and activation-checkpoint recomputation, and with
        ``capture="first"`` only the first time after a step. Give the owning module
        ``dobb_capture = False`` so that its forward hook does not capture its first input as
        well. The weight must be in a group with ``source="activation"``.

        An expert stack ``weight`` ``(E, out, in)`` takes the rows routed to each expert: a list of
        ``E`` tensors (``features[e]``: expert ``e``'s rows, last dim ``in``; an expert without rows
        gets an empty one), or one tensor with ``expert=e``. Each expert's statistic is the mean over
        its own rows; with ``capture="first"`` each expert records its first rows after a step. Under
        FSDP2 pass the sharded parameter (the optimizer's), e.g. after the forward pass.
        """
        where = next(((g, i) for g in self._dobb_groups() for i, q in enumerate(g["params"]) if q is weight), None)
        if where is None:
            raise ValueError(f"capture: the tensor of shape {tuple(weight.shape)} is not a matrix of this Dobb")
        group, index = where
        if group["source"] != "activation":
            raise ValueError(f"capture records layer inputs: the weight's group has source={group['source']!r}, "
                             f"it needs source='activation'")
        layout = self._plans[weight].layout
        name = _name_of(weight, self._param_names, index)
        if not layout.routed:
            if expert is not None:
                raise ValueError(f"capture: expert={expert} given, but {name} is a 2-D matrix, not an (E, out, in) "
                                 f"expert stack")
            return self._hooks.capture(weight, features)
        n = layout.shape[layout.blocked_axis]  # activation: the blocked axis is the input
        return self._hooks.capture_experts(weight, expert_parts(features, expert, layout.stack_size, n, name))

    # ------------------------------------------------------------------ schedule
    def _due(self, p: torch.Tensor, rule=due) -> bool:
        """Whether the next step refreshes (``due``) or captures (``captured``) some matrix of ``p``."""
        st = self.state[p]
        return any(rule(st["step"], st["captures"], self._plans[p]))

    def _rearm(self) -> None:
        if self._hooks is None:
            return
        self._hooks.pending.clear()
        self._hooks.pending_out.clear()
        self._hooks.armed = {p for p in self._hooks.groups if self._due(p, captured)}

    def is_refresh_step(self) -> bool:
        """Whether the next ``step()`` refreshes any basis (for benchmarks and logging)."""
        return any(self._due(p) for g in self._dobb_groups() for p in g["params"])

    def refresh_cycle(self) -> int:
        """Steps after which the refresh schedule repeats: the lcm of the matrices' periods
        (``refresh_every`` unless ``refresh_width`` lengthens some) and of the groups' ``whole_every``.
        For benchmarks that time whole cycles."""
        wholes = [g["whole_every"] for g in self._dobb_groups() if g["whole_every"]]
        return cycle([*(plan.period for plan in self._plans.values()), *wholes])

    # ------------------------------------------------------------------ the step
    def _prepare_step(self) -> None:
        """What the ranks must decide together before any state changes (``statistics.agree``): the
        statistics of every matrix due for a capture (``captured``), whether or not its layer ran here, and the
        finiteness of all gradients. Raising here leaves every weight and state untouched."""
        params = self._nonfinite_params("raise")  # nonfinite="raise" groups (skip and off: MatrixOptimizer)
        idle = {id(p) for p in self._idle_matrices()}
        wanted = []
        for g in self._dobb_groups():
            if g["source"] not in _HOOK_SOURCES or self._hooks is None:
                continue
            dtype = torch.promote_types(g["stat_dtype"], torch.float32)
            for p in g["params"]:
                plan = self._plans[p]
                if p.grad is None and id(p) not in idle:
                    continue
                if not self._due(p, captured):
                    continue
                unseen = any(0 in side for side in self.state[p]["captures"])
                for i, (side, pending) in enumerate(zip(plan.sides, (self._hooks.pending, self._hooks.pending_out))):
                    wanted.append(DueStat(p, i, side.layout, pending.get(p), dtype, unseen))
        agreed = agree(wanted, params, self._step_group, self.check_finite and bool(params))
        if agreed.nonfinite is not None:
            self._rearm()  # the next forward passes capture afresh
            index, ranks = agreed.nonfinite
            i = next(i for g in self.param_groups for i, q in enumerate(g["params"]) if q is params[index])
            where = "" if self._step_group is None else f" on {ranks} of {len(group_ranks(self._step_group))} ranks"
            raise ValueError(f"non-finite gradient (NaN or Inf) in {_name_of(params[index], self._param_names, i)}{where}; "
                             f"no weight or optimizer state was changed on any rank (pass check_finite=False to skip "
                             f"this check)")
        self._refresh_all(agreed.stats, idle)

    def _skip_finish(self, flag, weights, tensors, skipped) -> None:
        """``nonfinite="skip"``: whether this step counts is read only at the next one, after the forward
        passes in between; so the hooks are armed for both outcomes: also where the counts before this
        step say a refresh is due (a capture nobody needs is dropped by the next step's ``_rearm``)."""
        super()._skip_finish(flag, weights, tensors, skipped)
        if self._hooks is not None:
            for p in self._hooks.groups:
                old = skipped.host.get(p, {})
                if "step" in old and "captures" in old and any(captured(old["step"], old["captures"], self._plans[p])):
                    self._hooks.armed.add(p)

    def _idle_matrices(self) -> list[torch.Tensor]:
        """Matrices with a statistic shared across ranks (hook sources) but no gradient on this rank: a
        shared statistic is shared state, so its schedule and collectives cannot depend on whether this
        rank got a gradient (no gradient sync, a layer unused here only). Read from the groups and the
        gradients, which a step does not change, by ``_prepare_step`` and ``_after_step``."""
        if self._hooks is None:
            return []
        return [p for g in self._dobb_groups() if g["source"] in _HOOK_SOURCES for p in g["params"]
                if p.grad is None and self._plans[p].layout.stat_group is not None]

    def _refresh_all(self, agreed: tuple[dict[torch.Tensor, ReducedStat], ...], idle: set[int]) -> None:
        """Every refresh of the step before any update (due matrices with a gradient here, idle ones
        sharing a statistic: ``idle``, their ids), all groups in one solve: the split's broadcasts are
        then the same on every rank whoever holds which gradient. ``agreed``: the statistics agreed in
        ``_prepare_step``, ``[side][param]`` (side 1: the output side of ``side="both"``). A refresh
        reads no weight or momentum: no number changes."""
        batches, puts = [], []
        for g in self._dobb_groups():
            if _zero_lr(g):
                continue
            ps = [p for p in g["params"] if (p.grad is not None or id(p) in idle) and self._due(p, captured)]
            if not ps:
                continue
            grads = [None if p.grad is None else self._plans[p].layout.local(p.grad) for p in ps]
            requests, shared = queue_refresh(g, ps, grads, [self.state[p] for p in ps], [self._plans[p] for p in ps],
                                             agreed)
            mirror: list = []
            if self.split_refresh is None:  # the default: split where bitwise (rank-invariant facts only)
                shared = [s if split_by_default(g["source"]) else None for s in shared]
            elif not self.split_refresh:  # every rank solves every block, in the batches the owners would
                shared, mirror = [None] * len(shared), shared
            batches.append(RefreshBatch(
                ortho_steps=g["ortho_steps"], qr=g["qr"], basis_dtype=g["basis_dtype"], blocks=[r[:3] for r in requests],
                groups=shared, mirror=mirror))
            puts.append([r[3] for r in requests])
        store_bases(puts, solve(batches))

    def _after_step(self) -> None:
        # Matrices with a shared statistic but no gradient on this rank: the weight and momentum
        # stay (as torch skips a parameter without grad), but the statistic, basis and schedule
        # advance as on the ranks that stepped them, so every rank keeps issuing the same collectives.
        # (refreshed in _refresh_all, before their step count advances: the due rule reads it)
        for p in self._idle_matrices():
            self.state[p]["step"] += 1
        self._rearm()

    def _matrix_step(self, group: dict[str, Any], active: list[torch.Tensor]) -> None:
        raw = [p.grad for p in active]  # before the plans and state: see dobb._base.MatrixOptimizer._matrix_step
        plans = [self._plans[p] for p in active]
        layouts = [plan.layout for plan in plans]
        states = [self.state[p] for p in active]
        grads = [lay.local(g) for lay, g in zip(layouts, raw)]
        moms = [lay.local(s["momentum"]) for lay, s in zip(layouts, states)]
        mu = group["momentum"]
        # EMA form, one fused pass: M_ema = (1-mu) * M with M = mu M + G of docs/algorithm.md step 1, and the
        # Nesterov lerp is (1-mu) * (G + mu M). Both normalizations are scale-invariant (per
        # coefficient sign, per column l2), so the update is the one docs/algorithm.md defines.
        torch._foreach_lerp_(moms, grads, 1.0 - mu)
        u = torch._foreach_lerp(grads, moms, mu) if group["nesterov"] else moms

        # (this step's refreshes ran in _refresh_all)
        params = [lay.local(p) for lay, p in zip(layouts, active)]
        lr, wd = group["lr"], group["weight_decay"]
        two_sided = group["side"] == "both"
        every = group["whole_every"]
        preps = (None if two_sided or group["norm"] == "muon" or every else  # one-sided, eager, on a CPU
                 prepared_directions(self._directions, group, active, layouts, states, u, params))
        fused = fused_decays(group, preps, params, layouts)
        if wd != 0 and not all(fused):
            torch._foreach_mul_([pt for pt, f in zip(params, fused) if not f], 1.0 - lr * wd)
        whole = [i for i, s in enumerate(states) if every and s["step"] % every == 0]
        if whole:  # whole-matrix steps (every rank of a sharded matrix takes them together: same step count)
            if getattr(self, "_owner", None) is None:  # the distribution layer's owner compute (derived)
                self._owner = whole_step_owner()
            apply_whole_steps(self._owner, group, *([xs[i] for i in whole] for xs in (active, plans, states, u, grads, params)))
            keep = [i for i in range(len(active)) if i not in set(whole)]
            plans, states, u, grads, params = ([xs[i] for i in keep] for xs in (plans, states, u, grads, params))
            layouts = [plan.layout for plan in plans]
            fused = [fused[i] for i in keep]
        if two_sided:
            apply_two_sided([TwoSided(plan, s, ut, gt, pt) for plan, s, ut, gt, pt in zip(plans, states, u, grads, params)],
                            norm=group["norm"], lr=lr, tau=group["tau"], basis_dtype=group["basis_dtype"],
                            product_dtype=group["product_dtype"], momentum=mu, beta2=group["beta2"], eps=group["eps"],
                            cache=self._directions, compile=group["compile"])
        elif group["norm"] == "muon":
            apply_preconditioned_muon(
                [TwoSided(plan, s, ut, gt, pt) for plan, s, ut, gt, pt in zip(plans, states, u, grads, params)],
                lr=lr, tau=group["tau"], basis_dtype=group["basis_dtype"], product_dtype=group["product_dtype"],
                momentum=mu, beta2=group["beta2"], eps=group["eps"], ns_dtype=group["ns_dtype"], compile=group["compile"])
        elif preps is not None:
            apply_prepared(preps, [1.0 - lr * wd if f else None for f in fused], norm=group["norm"], lr=lr)
        else:
            apply_directions([OneSided(lay, lay.local(s["basis"]), ut, pt, 1.0 - lr * wd if f else None)
                              for lay, s, ut, pt, f in zip(layouts, states, u, params, fused)],
                             norm=group["norm"], lr=lr, tau=group["tau"], product_dtype=group["product_dtype"],
                             compile=group["compile"])
        for s in (self.state[p] for p in active):
            s["step"] += 1

    # ------------------------------------------------------------------ state dict
    # statistics (fp32) and bases (bf16) keep their own precision on load
    _own_dtype_keys = ("stat", "basis", "out_stat", "out_basis", "second_moment")

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # new per-parameter dicts: torch's hold the live state's values
        sd["state"] = {k: dict(st, captures=saved_captures(st["captures"])) if "captures" in st else st
                       for k, st in sd["state"].items()}
        return sd

    def _layout_note(self, group) -> str:
        blocks = "the default blocks" if group["blocks"] is None else f"blocks={group['blocks']}"
        return (f"{blocks} on the {group['side']} side are cut at the weight's shard "
                f"boundaries, so the block partition follows the shards")

    def _after_load(self) -> None:  # the plans are rebuilt by now (MatrixOptimizer.load_state_dict)
        for p, plan in self._plans.items():  # older checkpoints kept other forms of the counts
            self.state[p]["captures"] = captures(self.state[p]["captures"], plan)
        self._install_hooks()  # torch replaced the group dicts the hooks read


def _zero_lr(group: dict[str, Any]) -> bool:
    # A zero-lr step (torchtitan's state-creation step, a warmup that starts at 0) changes no
    # weight, so it takes no statistic either; the next step then refreshes as a first step would.
    # A tensor lr is never read on the host here (no synchronisation inside step()).
    return not isinstance(group["lr"], torch.Tensor) and group["lr"] == 0
