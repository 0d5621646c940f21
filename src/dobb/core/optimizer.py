"""The Dobb optimizer: its class, one plan per matrix with the refresh rule, and the update.

The class owns the state (everything a checkpoint needs) and one ``Plan`` per matrix (its sides'
layouts and state keys, refresh period and offset: a cache built from the param groups, rebuilt after
a load or a copy). Which matrices refresh is ``due``, read both by the capture hooks' arming and by
the statistic fold. A step (``_base.MatrixOptimizer.step``) calls, in order:

1. ``Dobb._prepare_step``: ``statistics.agree`` (what the ranks decide together: the statistics of
   the due matrices, the finiteness of the gradients), then ``Dobb._refresh_all``: the statistic
   fold (``statistics.fold_side``; ``statistics.gram_statistic`` for ``source="grad_gram"``) and the
   batched basis solve (``statistics.solve`` over ``functional.refresh_bases``);
2. ``Dobb._matrix_step`` per param group: the momentum, then ``apply_directions`` (one-sided: the
   direction via ``functional.add_directions_``) or ``apply_two_sided`` (``side="both"``:
   ``functional.two_sided_update_``), which choose the kernel and batch equal blocks.

The math on plain tensors is in ``dobb.functional``; where blocks live in ``dobb.layout`` (DTensors:
``dobb.sharding``; expert stacks: ``core.experts``; chosen by ``placement.layout_for``); the capture
hooks in ``dobb.capture``; the options and their rules in ``core.options``. Every matrix is a stack
(a 2-D parameter a stack of one, an expert stack one of ``E``, see ``layout``): one statistic,
refresh and apply path serves both. Per matrix ``W`` (``m x n``) with gradient ``G`` the step is

1. ``M <- mu M + G``; ``U = G + mu M`` (Nesterov) or ``U = M``;
2. on refresh steps: block statistics ``A_b`` (EMA over captures) and bases
   ``Q_b <- qr(A_b Q_b)`` (``ortho_steps`` times) or ``eigh(A_b)``;
3. ``O[:, b] = normalize(U[:, b] Q_b) Q_b^T`` (sign: ``sign(.)/sqrt(m)``, or unit ell2 columns);
4. ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``.

All equal-size blocks of all matrices of a param group go through one batched ``bmm``/QR call.

The plan and schedule: a matrix refreshes on its first step and then every ``period`` steps after its
``offset``. With ``refresh_width`` unset the period is ``refresh_every`` for every matrix; with
``refresh_width = w`` a matrix whose widest block is ``s`` wide refreshes every
``refresh_every * max(1, round(s / w))`` steps: a refresh costs ``O(s^3)`` per block, so the wide
blocks (an MLP's wide input block at B=1) that dominate the refresh step refresh less often. Both
rules read global (rank-invariant) block sizes only, so every rank of a sharded run picks the same
periods and offsets (the refresh steps, and with them the collectives, must agree). ``captures`` is
the one form of a state's capture counts: one list per side, one count per matrix of the captured
span (a checkpoint keeps a one-sided matrix's single count as an int: ``saved_captures``).
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import functional as F
from .._base import MatrixOptimizer, _name_of
from ..capture import CaptureHooks
from ..collectives import common_group, group_ranks, plain_stat_group
from ..functional import BlockBasis, two_sided_update_
from ..layout import MatrixLayout, ReducedStat, is_dtensor
from ..placement import layout_for
from .experts import expert_layout, expert_parts
from .heads import head_blocks
from .options import HOOK_SOURCES as _HOOK_SOURCES
from .options import DobbOptions, check_params
from .statistics import (DueStat, RefreshBatch, agree, all_reduce_sum_, fold_side, gram_statistic, shared_group,
                         solve)

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
        blocks: number of diagonal blocks ``B`` of the blocked axis (contiguous, nearly equal,
            first ``size % B`` blocks one longer; under sharding, cut at shard boundaries first).
            It trades loss against step cost: each block's basis sees only its own diagonal block
            of the statistic, and a smaller block is cheaper to refresh and fits within a shard (the
            measured trade-off, and how Dobb compares with block Muon at equal ``blocks``:
            docs/results.md, "Operating point"; docs/timing.md). At ``blocks=1`` on wide matrices
            ``split_refresh=True`` and ``refresh_width`` cut the refresh (docs/timing.md, "A refresh
            that scales"). ``side="both"`` orthogonalizes on both sides with Dobb's collectives
            (docs/results.md, "Two-sided Dobb").
        refresh_every: refresh period ``T`` (the first step always refreshes).
        refresh_width: None (default: every matrix refreshes every ``T`` steps) or a block width
            ``w``: a matrix whose widest block (either side, global size) is ``s`` wide refreshes
            every ``T * max(1, round(s / w))`` steps, so the wide blocks that dominate the refresh
            (``s^3``) refresh less often ("A refresh that scales" in docs/timing.md; ``refresh_period``).
        basis: ``"orthogonal_iteration"`` (``ortho_steps`` rounds of ``Q <- qr(A Q)``, warm-started)
            or ``"eigh"`` (exact eigendecomposition at every refresh).
        qr: ``"householder"`` or ``"cholesky"`` (Cholesky QR; failed blocks redone by Householder).
        norm: ``"sign"`` (Dobb), ``"l2"`` (Dobb-ell2: unit-norm coefficient columns) or, with
            ``side="both"``, ``"adam"`` (SOAP's second-moment rule on the two-sided coefficients).
        side: ``"input"`` (column blocks, basis over ``n``), ``"output"`` (row blocks, Dobb-G) or
            ``"both"`` (two-sided Dobb: ``C_bc = Q_out_b^T U_bc Q_in_c``, see ``functional.two_sided_update_``).
        out_blocks: row blocks of the output side of ``side="both"`` (``blocks`` stays the input side's).
        beta2, eps: ``norm="adam"``'s second-moment decay and denominator epsilon.
        source: ``"activation"`` (input side; with ``side="both"`` activations for the input side and
            output gradients for the output side), ``"output_grad"`` (output side) or ``"grad_gram"``
            (``G^T G`` / ``G G^T`` blocks; no hooks).
        capture: ``"first"`` micro-batch after the previous step, or ``"all"`` micro-batches.
        stat_decay: EMA decay of the statistic across captures, ``A <- d A + (1-d) A_new``; the
            first capture initialises ``A`` (our choice; the paper does not pin it down).
        init_basis: first basis from exact ``"eigh"`` of the first capture (default) or the
            ``"identity"`` followed by orthogonal iteration.
        stagger: spread refreshes over the cycle (each step refreshes about ``1/T`` of the
            matrices' work, same per-matrix period) to flatten the refresh-step spike. Default
            True: only the phase of each matrix's refresh moves, not its period (its effect on the
            loss and the spike: docs/timing.md, "Refresh spike").
        check_finite: raise ``ValueError`` naming the parameter when a gradient holds NaN/Inf,
            before any state changes. The decision is taken by all ranks that share the step
            together (one flag all-reduce, folded into the statistic reduction on refresh steps), so
            every rank raises the same error. Costs one host synchronisation per step; False skips it.
        split_refresh: True: where ranks hold the same statistic and bases (FSDP2, DDP, HSDP), each
            block's refresh runs on one of them and is broadcast in the basis dtype (bitwise the same
            bases, ``n^2/B`` entries per matrix per refresh; ``core.statistics``). False (default):
            every rank computes every refresh; ``step()`` issues no collective of its own.
        stat_group: process group over which statistics are averaged (token-weighted). ``"default"``:
            DTensor parameters take the data-parallel dims of their mesh; plain parameters the
            process group of the ``DistributedDataParallel`` module passed as ``model``, and raise a
            ``ValueError`` under an initialized process group of several ranks without one (pass a
            ``ProcessGroup``, or None for this rank's data alone). Mesh dim names/indices select
            DTensor mesh dims.
        product_dtype: dtype of the projection products ``U_b Q_b`` and ``C_b Q_b^T``: ``"auto"``
            (the basis dtype on accelerators, fp32 on every CPU; why: ``functional.matmul_dtype``)
            or a dtype that forces it.
        transposed: the group's weights are stored ``(in, out)`` (Hugging Face ``Conv1D``;
            ``dobb.param_groups`` sets it): blocks, statistics and sharding follow the input axis.

    A group may hold 3-D expert stacks ``(E, out, in)``: each is optimized as ``E`` matrices with
    their own blocks, statistics and bases (``core.experts``); their statistics come from
    ``capture(weight, [x_0, ..., x_{E-1}])`` or ``source="grad_gram"``.
    """

    algorithm = "dobb"
    _native_transposed = True  # transposed groups flip the layout's blocked axis (see _init_matrix_state)
    _expert_stacks = True  # 3-D (E, out, in) parameters are E matrices (see core.experts)
    Options = DobbOptions  # the options, their defaults and value rules (core.options)

    def __init__(self, params, model: nn.Module | None = None, *, lr: float, weight_decay: float = 0.0,
                 check_finite: bool = True, stat_group="default", split_refresh: bool = False, **kwargs):
        if not isinstance(split_refresh, bool):
            raise ValueError(f"split_refresh must be True or False, got {split_refresh!r}")
        self.model = model
        self.check_finite = check_finite
        self.split_refresh = split_refresh
        self._stat_group = stat_group
        # one plan per matrix (sides, layouts, period, offset): a cache derived from the param groups,
        # rebuilt after load_state_dict and copies (_rebuild), never saved or copied
        self._plans: dict[torch.Tensor, Plan] = {}
        self._hooks: CaptureHooks | None = None
        self._plain_group = _UNRESOLVED
        # the statistics agreed on by _prepare_step: [side][param] (side 1: the output side of side="both")
        self._agreed: tuple[dict[torch.Tensor, ReducedStat], dict[torch.Tensor, ReducedStat]] = ({}, {})
        self._idle: list[tuple[dict, torch.Tensor]] = []  # (group, param): shared statistic, no grad here
        self._constructed = False
        super().__init__(params, lr=lr, weight_decay=weight_decay, **kwargs)
        self._constructed = True
        self._install_hooks()
        self._step_group = self._find_step_group()

    # ------------------------------------------------------------------ set-up
    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        check_params(group, lambda p, i: _name_of(p, self._param_names, i), has_model=self.model is not None)

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p, plan in zip(group["params"], self._group_plans(group)):
            self._plans[p] = plan
            self.state[p] = self._new_state(p, group, plan)

    def _group_plans(self, group: dict[str, Any]) -> list[Plan]:
        """The plan of every matrix of ``group``, from the group and the parameters alone."""
        sides, counts = [], []
        for i, p in enumerate(group["params"]):
            try:
                # heads: per-matrix block counts (core.heads); the group's counts otherwise
                blocks, out_blocks = head_blocks(self._matrix_name(p, group), tuple(p.shape[-2:]), group["heads"],
                                                 group["blocks"], group["out_blocks"])
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
        # global (rank-invariant) block sizes: every rank must pick the same periods and offsets
        periods = [refresh_period(group["refresh_every"], group["refresh_width"],
                                  max(s for side in ss for s in side.layout.global_sizes)) for ss in sides]
        offsets = [0] * len(sides)
        if group["stagger"]:  # a stack refreshes all its matrices together
            works = [sum(sum(s**3 for s in side.layout.global_sizes) * side.layout.stack_size for side in ss)
                     for ss in sides]
            offsets = stagger_offsets(works, periods)
        rows = [self._ns_rows(group, p, i, ob) for i, (p, (_, ob)) in enumerate(zip(group["params"], counts))]
        return [Plan(ss, period, offset, r) for ss, period, offset, r in zip(sides, periods, offsets, rows)]

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

    def _ns_rows(self, group: dict, p: torch.Tensor, i: int, out_blocks: int):
        """``norm="muon"``: the layout of ``p``'s ``out_blocks`` row blocks (cut at shard boundaries),
        which must hold whole rows on this rank (a ``ValueError`` otherwise); None for other norms."""
        if group["norm"] != "muon":
            return None
        try:
            # the output axis: dim 0, or dim 1 of a transposed (in, out) weight
            rows = layout_for(p, "input" if group["transposed"] else "output", out_blocks, None)
        except ValueError as exc:
            raise ValueError(f"{_name_of(p, self._param_names, i)}: norm='muon' row blocks: "
                             f"{str(exc).replace('blocks=', 'out_blocks=', 1)}") from None
        other = 1 - rows.blocked_axis  # the input axis: each rank must hold all of it
        if rows.local_shape[other] != rows.shape[other]:
            raise ValueError(f"{_name_of(p, self._param_names, i)}: norm='muon' orthogonalises row blocks on the "
                             f"rank that holds them, so each rank needs whole rows (the input axis unsharded: "
                             f"FSDP2 Shard(0) of an (out, in) weight); this rank holds {rows.local_shape[other]} of "
                             f"{rows.shape[other]} entries of the input axis")
        return rows

    _derived = ("_plans", "_names_from_model", "_owner")

    def _rebuild(self) -> None:
        """Every plan, from the param groups (after ``load_state_dict``, in a copy)."""
        self._names_from_model = None
        self._plans = {p: plan for g in self._dobb_groups() for p, plan in zip(g["params"], self._group_plans(g))}

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
        leading shape). Counted like a hooked forward pass: only when the next ``step()``
        refreshes ``weight`` (otherwise nothing is recorded and False is returned), with grad
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
    def _due(self, p: torch.Tensor) -> list[bool]:
        """Per matrix of ``p``'s captured span: due for a refresh at the next step (``due``)."""
        st = self.state[p]
        return due(st["step"], st["captures"], self._plans[p])

    def _is_refresh(self, p: torch.Tensor) -> bool:
        return any(self._due(p))

    def _rearm(self) -> None:
        if self._hooks is None:
            return
        self._hooks.pending.clear()
        self._hooks.pending_out.clear()
        self._hooks.armed = {p for p in self._hooks.groups if self._is_refresh(p)}

    def is_refresh_step(self) -> bool:
        """Whether the next ``step()`` refreshes any basis (for benchmarks and logging)."""
        return any(self._is_refresh(p) for g in self._dobb_groups() for p in g["params"])

    def refresh_cycle(self) -> int:
        """Steps after which the refresh schedule repeats: the lcm of the matrices' periods
        (``refresh_every`` unless ``refresh_width`` lengthens some) and of the groups' ``whole_every``.
        For benchmarks that time whole cycles."""
        wholes = [g["whole_every"] for g in self._dobb_groups() if g["whole_every"]]
        return cycle([*(plan.period for plan in self._plans.values()), *wholes])

    # ------------------------------------------------------------------ the step
    def _prepare_step(self) -> None:
        """What the ranks must decide together before any state changes (``statistics.agree``): the
        statistics of every matrix due for a refresh, whether or not its layer ran here, and the
        finiteness of all gradients. Raising here leaves every weight and state untouched."""
        params = [p for g in self.param_groups for p in g["params"]]
        self._idle.clear()
        wanted = []
        for g in self._dobb_groups():
            if g["source"] not in _HOOK_SOURCES or self._hooks is None:
                continue
            dtype = torch.promote_types(g["stat_dtype"], torch.float32)
            for p in g["params"]:
                plan = self._plans[p]
                if p.grad is None and plan.layout.stat_group is not None:
                    # a shared statistic is shared state: its schedule and collectives cannot depend on
                    # whether this rank got a gradient (no gradient sync, a layer unused here only)
                    self._idle.append((g, p))
                elif p.grad is None:
                    continue
                if not self._is_refresh(p):
                    continue
                unseen = any(0 in side for side in self.state[p]["captures"])
                for i, (side, pending) in enumerate(zip(plan.sides, (self._hooks.pending, self._hooks.pending_out))):
                    wanted.append(DueStat(p, i, side.layout, pending.get(p), dtype, unseen))
        agreed = agree(wanted, params, self._step_group, self.check_finite)
        if agreed.nonfinite is not None:
            self._rearm()  # the next forward passes capture afresh
            index, ranks = agreed.nonfinite
            i = next(i for g in self.param_groups for i, q in enumerate(g["params"]) if q is params[index])
            where = "" if self._step_group is None else f" on {ranks} of {len(group_ranks(self._step_group))} ranks"
            raise ValueError(f"non-finite gradient (NaN or Inf) in {_name_of(params[index], self._param_names, i)}{where}; "
                             f"no weight or optimizer state was changed on any rank (pass check_finite=False to skip "
                             f"this check)")
        # filled in place, not rebound: under torch.compile (graph breaks in step) a rebinding was
        # lost and no refresh saw its statistic (tests/integrations/test_compile.py)
        for mine, theirs in zip(self._agreed, agreed.stats):
            mine.clear()
            mine.update(theirs)
        self._refresh_all()

    def _refresh_all(self) -> None:
        """Every refresh of the step before any update (due matrices with a gradient here, idle ones
        sharing a statistic), all groups in one solve: the split's broadcasts are then the same on every
        rank whoever holds which gradient. A refresh reads no weight or momentum: no number changes."""
        idle = {id(p) for _, p in self._idle}
        batches, puts = [], []
        for g in self._dobb_groups():
            if _zero_lr(g):
                continue
            ps = [p for p in g["params"] if (p.grad is not None or id(p) in idle) and self._is_refresh(p)]
            if not ps:
                continue
            grads = [None if p.grad is None else self._plans[p].layout.local(p.grad) for p in ps]
            requests, shared = self._queue_refresh(g, ps, grads)
            batches.append(RefreshBatch(
                ortho_steps=g["ortho_steps"], qr=g["qr"], basis_dtype=g["basis_dtype"], blocks=[r[:3] for r in requests],
                groups=shared if self.split_refresh else [None] * len(shared)))
            puts.append([r[3] for r in requests])
        for put_list, bases in zip(puts, solve(batches)):
            for put, q in zip(put_list, bases):
                put(q)

    def _after_step(self) -> None:
        # Matrices with a shared statistic but no gradient on this rank: the weight and momentum
        # stay (as torch skips a parameter without grad), but the statistic, basis and schedule
        # advance as on the ranks that stepped them, so every rank keeps issuing the same collectives.
        # (refreshed in _refresh_all, before their step count advances: the due rule reads it)
        for _, p in self._idle:
            self.state[p]["step"] += 1
        self._idle.clear()
        for mine in self._agreed:
            mine.clear()
        self._rearm()

    def _matrix_step(self, group: dict[str, Any], active: list[torch.Tensor]) -> None:
        plans = [self._plans[p] for p in active]
        layouts = [plan.layout for plan in plans]
        states = [self.state[p] for p in active]
        grads = [lay.local(p.grad) for lay, p in zip(layouts, active)]
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
        # Where the reconstruction runs per matrix in the weight's dtype (CPU), the decay is its
        # baddbmm's beta: one pass over W instead of a multiply pass and a strided add pass.
        fused = [not two_sided and group["norm"] != "muon" and decay_in_update(pt, lay, lr=lr, basis_dtype=group["basis_dtype"],
                                                   product_dtype=group["product_dtype"])
                 for pt, lay in zip(params, layouts)]
        if wd != 0 and not all(fused):
            torch._foreach_mul_([pt for pt, f in zip(params, fused) if not f], 1.0 - lr * wd)
        every = group["whole_every"]
        whole = [i for i, s in enumerate(states) if every and s["step"] % every == 0]
        if whole:  # whole-matrix steps (every rank of a sharded matrix takes them together: same step count)
            self._whole_steps(group, [active[i] for i in whole], [plans[i] for i in whole], [states[i] for i in whole],
                              [u[i] for i in whole], [grads[i] for i in whole], [params[i] for i in whole])
            keep = [i for i in range(len(active)) if i not in set(whole)]
            plans, states, u, grads, params = ([xs[i] for i in keep] for xs in (plans, states, u, grads, params))
            layouts = [plan.layout for plan in plans]
            fused = [fused[i] for i in keep]
        if two_sided:
            apply_two_sided([TwoSided(plan, s, ut, gt, pt) for plan, s, ut, gt, pt in zip(plans, states, u, grads, params)],
                            norm=group["norm"], lr=lr, tau=group["tau"], basis_dtype=group["basis_dtype"],
                            product_dtype=group["product_dtype"], momentum=mu, beta2=group["beta2"], eps=group["eps"])
        elif group["norm"] == "muon":
            apply_preconditioned_muon(
                [TwoSided(plan, s, ut, gt, pt) for plan, s, ut, gt, pt in zip(plans, states, u, grads, params)],
                lr=lr, tau=group["tau"], basis_dtype=group["basis_dtype"], product_dtype=group["product_dtype"],
                momentum=mu, beta2=group["beta2"], eps=group["eps"], ns_dtype=group["ns_dtype"])
        else:
            apply_directions([OneSided(lay, lay.local(s["basis"]), ut, pt, 1.0 - lr * wd if f else None)
                              for lay, s, ut, pt, f in zip(layouts, states, u, params, fused)],
                             norm=group["norm"], lr=lr, tau=group["tau"], product_dtype=group["product_dtype"])
        for s in (self.state[p] for p in active):
            s["step"] += 1

    def _whole_steps(self, group, active, plans, states, u, grads, params) -> None:
        """``whole_every``: ``W <- W - lr * tau * sqrt(max(m, n)) * NS5(X)`` of the whole matrix, computed
        by its owner as ``OwnerMuon`` does (two all-to-alls under FSDP2; local unsharded), with ``X``
        the Dobb-preconditioned ``P`` (``norm="muon"``, whose second moment advances as on any step)
        or the momentum (two-sided sign): MuonBP's periodic full step on Dobb's forms."""
        from ..baselines.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS
        from ..baselines.owner_muon import OwnerMuon

        if group["norm"] == "muon":  # P in the storage orientation (transposed weights: (in, out))
            xs = [precondition(plan, st, ut, gt, basis_dtype=group["basis_dtype"], product_dtype=group["product_dtype"],
                               momentum=group["momentum"], beta2=group["beta2"], eps=group["eps"])
                  for plan, st, ut, gt in zip(plans, states, u, grads)]
            xs = [x.T if plan.layout.blocked_axis == 0 else x for x, plan in zip(xs, plans)]
        else:
            xs = list(u)
        if getattr(self, "_owner", None) is None:  # OwnerMuon's routing and all-to-alls, without its state
            owner = OwnerMuon.__new__(OwnerMuon)
            owner._replicated_group, owner.owners, owner.gathered = "default", {}, {}
            self._owner = owner
        ns_group = {"params": active, "ns_coefficients": NS_COEFFICIENTS, "ns_steps": NS_STEPS, "eps": NS_EPS,
                    "ns_method": "standard", "ns_dtype": group["ns_dtype"]}
        outs = self._owner._orthogonalize(ns_group, active, xs)
        for p, pt, o in zip(active, params, outs):
            m, n = p.shape
            pt.add_(o.to(pt.dtype).mul_(-group["lr"] * F.update_scale(m, n, group["tau"])))

    def _queue_refresh(self, group: dict, params: list[torch.Tensor], grads: list) -> tuple[list, list]:
        """Fold the new statistics of ``params`` (agreed in ``_prepare_step``, or their gradient
        Gram) into their EMAs and queue the blocks that take a new basis: ``(A, Q0, exact, put)``
        requests and, per request, the group of ranks that hold it identically (``statistics.shared_group``)."""
        requests: list[tuple] = []  # (A blocks, Q blocks, exact, put)
        shared: list = []
        dtype = torch.promote_types(group["stat_dtype"], torch.float32)
        for p, g in zip(params, grads):
            st, plan = self.state[p], self._plans[p]
            now = self._due(p)
            # new lists, not the state's in place: a state_dict taken before keeps its counts
            st["captures"] = [list(side) for side in st["captures"]]
            for i, (side, counts) in enumerate(zip(plan.sides, st["captures"])):
                new = (gram_statistic(g, side.layout, dtype) if group["source"] == "grad_gram"
                       else self._agreed[i].get(p))
                if new is not None:
                    fold_side(new, layout=side.layout, stat=st[side.stat], basis=st[side.basis], counts=counts,
                              due=now, stat_decay=group["stat_decay"], eigh=group["basis"] == "eigh",
                              eigh_every=group["eigh_every"], init_eigh=group["init_basis"] == "eigh",
                              requests=requests)
                    shared += [shared_group(side.layout)] * (len(requests) - len(shared))
        return requests, shared

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
        return (f"blocks={group['blocks']} on the {group['side']} side are cut at the weight's shard "
                f"boundaries, so the block partition follows the shards")

    def _after_load(self) -> None:
        self._rebuild()
        for p, plan in self._plans.items():  # older checkpoints kept other forms of the counts
            self.state[p]["captures"] = captures(self.state[p]["captures"], plan)
        self._install_hooks()  # torch replaced the group dicts the hooks read


def _zero_lr(group: dict[str, Any]) -> bool:
    # A zero-lr step (torchtitan's state-creation step, a warmup that starts at 0) changes no
    # weight, so it takes no statistic either; the next step then refreshes as a first step would.
    # A tensor lr is never read on the host here (no synchronisation inside step()).
    return not isinstance(group["lr"], torch.Tensor) and group["lr"] == 0


# ----------------------------------------------------------------------------- plan and schedule
# Past this many steps in the common cycle of all periods, the stagger balances over the longest
# period instead (an approximation: a matrix is charged at its offsets within that window only).
# Real models have a few distinct widths (d, 4d), whose cycle is tiny; the cap only bounds the
# set-up time of a pathological mix of widths.
MAX_CYCLE = 4096


@dataclass(frozen=True, eq=False)
class Side:
    """One statistic/basis side of a matrix: its layout (``layout.MatrixLayout``) and the state keys
    of its statistic and bases."""

    layout: Any
    stat: str = "stat"
    basis: str = "basis"


@dataclass(frozen=True, eq=False)
class Plan:
    """One matrix parameter's plan: its ``sides`` (one, or input then output for ``side="both"``),
    refresh ``period`` and stagger ``offset`` (``0 <= offset < period``)."""

    sides: tuple[Side, ...]
    period: int
    offset: int = 0
    # norm="muon": the layout of the out_blocks row blocks that Newton-Schulz orthogonalises (None otherwise)
    ns_rows: Any = None

    @property
    def layout(self):
        """The first side's layout (the one side, or the input side of ``side="both"``)."""
        return self.sides[0].layout

    @property
    def two_sided(self) -> bool:
        return len(self.sides) == 2

    def new_captures(self) -> list[list[int]]:
        """Capture counts before any capture: one zero per side and matrix of the captured span."""
        return [[0] * side.layout.stack_span for side in self.sides]


def due(step: int, captures: list[list[int]], plan: Plan) -> list[bool]:
    """Per matrix of the captured span: whether the step numbered ``step`` refreshes it. The first
    step and every ``period``-th after the offset refresh; and, until a first statistic exists on
    every side (``captures``: counts per side, per matrix), every step does (a zero-lr step or a
    forward pass that skipped the layer must not leave the identity basis for a whole period)."""
    on = step == 0 or (step - plan.offset) % plan.period == 0
    return [on or 0 in member for member in zip(*captures)]


def captures(value, plan: Plan) -> list[list[int]]:
    """A state's capture counts in the one form (per side, per matrix of the captured span), from
    that form or a checkpoint's older ones: an int (a 2-D matrix), a flat list (one count per expert
    of a stack, or ``[input, output]`` of a two-sided matrix); ints given as tensors (distributed
    checkpoints) become ints. A count list that fits no side of ``plan`` is a ``ValueError``."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, (list, tuple)) for v in value):
        out = [[int(c) for c in side] for side in value]
    elif isinstance(value, (list, tuple)):
        flat = [int(c) for c in value]
        out = [[c] for c in flat] if plan.two_sided and plan.layout.stack_span == 1 else [flat]
    else:
        out = [[int(value)]]
    want = [side.layout.stack_span for side in plan.sides]
    if [len(side) for side in out] != want:
        raise ValueError(f"saved capture counts {value!r} do not fit this matrix: it has {len(want)} side(s) of "
                         f"{want[0]} matrix/matrices (saved with another side or expert stack?)")
    return out


def saved_captures(value: list[list[int]]):
    """The form a checkpoint stores ``captures`` in: a one-sided 2-D matrix's single count as an int
    (``torch.distributed.checkpoint``'s flattened optimizer state takes ints, not lists), every
    other matrix's counts as they are. ``captures`` reads it back."""
    return value[0][0] if len(value) == 1 and len(value[0]) == 1 else value


def refresh_period(refresh_every: int, refresh_width: int | None, widest: int) -> int:
    """The refresh period of a matrix whose widest block (global size, any side) is ``widest``.
    ``round`` is Python's (half to even): 2.5 -> 2, 3.5 -> 4."""
    if refresh_width is None:
        return refresh_every
    return refresh_every * max(1, round(widest / refresh_width))


def cycle(periods) -> int:
    """The number of steps after which the whole schedule repeats (lcm of the periods; 1 if none)."""
    return math.lcm(1, *periods)


def stagger_offsets(works: list[int], periods: list[int]) -> list[int]:
    """One offset per matrix (``0 <= offset < period``) that spreads refresh work over the steps.

    Greedy, largest work first: each matrix takes the offset whose steps (within the common cycle
    of all periods) carry the least work so far (the least of their maximum, then of their sum,
    then the lowest offset). With equal periods ``T`` this is the original rule: the offset in
    ``range(T)`` with the least accumulated work, lowest first on ties. Deterministic given
    ``works`` and ``periods`` (stable sort), so rank-invariant when they are."""
    if len(works) != len(periods):
        raise ValueError(f"works and periods must have one entry per matrix, got {len(works)} and {len(periods)}")
    length = cycle(periods)
    if length > MAX_CYCLE:
        length = max(periods)
    cost = [0] * length
    offsets = [0] * len(works)
    for i in sorted(range(len(works)), key=lambda j: -works[j]):
        period = periods[i]
        best = min(range(period), key=lambda o: _load(cost, o, period) + (o,))
        for t in range(best, length, period):
            cost[t] += works[i]
        offsets[i] = best
    return offsets


def _load(cost: list[int], offset: int, period: int) -> tuple[int, int]:
    hits = cost[offset::period]
    return (max(hits), sum(hits)) if hits else (0, 0)


# ----------------------------------------------------------------------------- two-sided layouts
# Shard-local by construction: each side's blocks come from ``placement.layout_for`` on its own axis,
# which cuts the axis at its shard boundaries (FSDP2 ``Shard(0)`` rows, tensor parallel
# ``Shard(0)``/``Shard(1)``), so every block pair is either wholly on a rank or wholly absent, and the
# two-sided step issues no collective. A placement that would split a block (a strided shard, one axis
# over two mesh dims, a block count that does not divide the non-empty shards) is the ``ValueError``
# of that layout, prefixed here with the way out.
_WAY_OUT = ("side='both' blocks both axes, so each must be cut at its own shard boundaries: shard each axis "
            "with a plain Shard over at most one mesh dim and give each side a block count that divides its "
            "non-empty shards (or use side='input' / side='output')")


def two_sided_layouts(p: Tensor, group: dict, stat_group, transposed: bool, layout_for):
    """``(input-side layout, output-side layout)`` of a matrix or expert stack; a ``ValueError`` with
    the way out when either axis cannot be blocked locally. ``layout_for(p, side, blocks,
    stat_group)`` makes one side's layout (``placement.layout_for``, ``experts.expert_layout``)."""
    in_side, out_side = ("output", "input") if transposed else ("input", "output")
    try:
        lin = layout_for(p, in_side, group["blocks"], stat_group)
    except ValueError as exc:
        raise ValueError(f"input side: {exc}. {_WAY_OUT}") from None
    try:
        lout = layout_for(p, out_side, group["out_blocks"], stat_group)
    except ValueError as exc:
        raise ValueError(f"output side: {str(exc).replace('blocks=', 'out_blocks=', 1)}. {_WAY_OUT}") from None
    return lin, lout


# ----------------------------------------------------------------------------- the update
# ``W <- (1 - lr wd) W - lr * s * O`` for every matrix of a param group, with the direction ``O`` from
# ``functional.add_directions_`` (one-sided) or ``functional.two_sided_update_`` (``side="both"``).
# This part decides which kernel runs where and batches equal blocks; ``Dobb._matrix_step`` hands it
# plain local tensors. Every matrix is a stack: its blocks join the batch of their shape whatever the
# stack size.
# torch runs baddbmm_ into a strided weight view as one addmm_ per block: a win (one pass over
# W, no update temporary) for large blocks, launch-bound for small ones (docs/timing.md)
FUSE_MIN_BLOCK_WORK = 1 << 18


class OneSided(NamedTuple):
    """One matrix (stack) of a one-sided group, local tensors: its ``layout``, ``basis`` (row-stacked
    blocks), update ``u`` and weight ``w``; ``decay`` is the weight decay folded into its
    reconstruction (``decay_in_update``), or None when ``w`` is already decayed."""

    layout: MatrixLayout
    basis: Tensor
    u: Tensor
    w: Tensor
    decay: float | None = None


class TwoSided(NamedTuple):
    """One matrix (stack) of a ``side="both"`` group: its ``plan`` (``Plan``: both sides'
    layouts and state keys), its optimizer ``state`` (bases, ``second_moment``, ``step``) and the
    local update ``u``, gradient ``g`` and weight ``w``."""

    plan: Any
    state: dict
    u: Tensor
    g: Tensor
    w: Tensor


def decay_in_update(w: Tensor, layout: MatrixLayout, *, lr, basis_dtype: torch.dtype, product_dtype) -> bool:
    """Whether the weight decay of ``w`` (local, one-sided) is the ``beta`` of its reconstruction
    ``baddbmm`` (one pass over ``W`` instead of a multiply pass and a strided add pass): on CPU, for
    a stack of one whose products run in the weight's dtype and whose smallest block is large enough."""
    if layout.stack_local != 1:
        return False  # decayed by one foreach pass: the fused baddbmm writes one matrix's strided view
    if torch.compiler.is_compiling():
        # Inductor cannot functionalize an in-place baddbmm into a strided view of W; the compiler
        # fuses the separate decay pass anyway
        return False
    rows = w.shape[-1 - layout.blocked_axis]  # the axis that is not blocked
    # a list, not min(..., default=): Dynamo cannot trace the keyword, and a graph break here split
    # every compiled step in two
    return (w.device.type == "cpu" and not isinstance(lr, torch.Tensor)
            and w.dtype == F.matmul_dtype(basis_dtype, w.device, product_dtype)
            and min([rows * s * s for s in layout.local_sizes if s > 0] or [0]) >= FUSE_MIN_BLOCK_WORK)


def _oriented(t: Tensor, layout: MatrixLayout) -> Tensor:
    """A stack ``(E, m, n)`` with the blocked axis last."""
    return t if layout.blocked_axis == 1 else t.transpose(1, 2)


def apply_directions(mats: list[OneSided], *, norm: str, lr, tau: float, product_dtype) -> None:
    """``W -= lr * s * O`` with ``O`` from batched project -> normalize -> reconstruct, for every
    matrix of ``mats``.

    All equal-shape blocks of the group go through one ``add_directions_`` call on accelerators
    (stacked to save kernel launches); on CPU, where a strided block view feeds ``bmm`` at no cost
    while stacking matrices costs a transposing copy, one call per matrix. The constant
    ``-lr * s`` (and sign's ``1/sqrt(rows)``) is the kernel's ``factor``, so no update-sized
    temporary is written besides the coefficients.
    """
    batches: dict[tuple, list] = defaultdict(list)
    for layout, basis, ut, pt, beta in mats:
        factor = -lr * F.update_scale(*layout.shape, tau) / (math.sqrt(layout.rows) if norm == "sign" else 1.0)
        dtype = F.matmul_dtype(basis.dtype, basis.device, product_dtype)
        u3, w3, b3 = _oriented(layout.stacked(ut), layout), _oriented(layout.stacked(pt), layout), layout.stacked(basis)
        # l2 with sharded rows: one batch per matrix, so every rank of the l2 group issues the same
        # norm reductions in the same order (local row counts may differ across ranks)
        l2_key = (id(layout.l2_group), id(pt) if layout.l2_group is not None else None) if norm == "l2" else None
        for run in F.block_runs(layout.local_sizes):
            cols = slice(run.start, run.stop)
            key = (u3.shape[1], run.size, dtype, layout.rows, l2_key)
            batches[key].append((F.Blocks(w=w3[:, :, cols], u=u3[:, :, cols], q=F.stack_block_view(b3, run),
                                          factor=factor, beta=beta), layout.l2_group))
    for (_, _, dtype, _, _), items in batches.items():
        l2_group = items[0][1]
        col_sq_sum = (lambda sq: all_reduce_sum_(sq, l2_group)) if l2_group is not None else None
        if items[0][0].w.device.type == "cpu":
            for it, _ in items:
                F.add_directions_([it], norm=norm, dtype=dtype, col_sq_sum=col_sq_sum)
        else:
            F.add_directions_([it for it, _ in items], norm=norm, dtype=dtype, col_sq_sum=col_sq_sum)


def apply_two_sided(mats: list[TwoSided], *, norm: str, lr, tau: float, basis_dtype: torch.dtype, product_dtype,
                    momentum: float, beta2: float, eps: float) -> None:
    """``side="both"``: ``W += factor * Q_rows D Q_cols^T`` (``functional.two_sided_update_``) for
    every matrix of every stack of ``mats`` (an expert stack: each expert with its own bases and
    ``second_moment``)."""
    for plan, state, ut, gt, pt in mats:
        lin = plan.layout
        dtype = F.matmul_dtype(basis_dtype, pt.device, product_dtype)
        sides = sorted(plan.sides, key=lambda side: side.layout.blocked_axis)  # (rows side, cols side)
        bases = [side.layout.stacked(state[side.basis]) for side in sides]
        # sign's 1/sqrt(m) with m = the global output axis (lin.rows), as one-sided Dobb
        factor = -lr * F.update_scale(*lin.shape, tau) / math.sqrt(lin.rows)
        v = lin.stacked(state["second_moment"]) if norm == "adam" else None
        w, u, g = lin.stacked(pt), lin.stacked(ut), lin.stacked(gt)
        for e in range(w.shape[0]):
            two_sided_update_(w=w[e], u=u[e], g=g[e], rows=BlockBasis(bases[0][e], sides[0].layout.local_sizes),
                              cols=BlockBasis(bases[1][e], sides[1].layout.local_sizes), factor=factor, dtype=dtype,
                              norm=norm, v=None if v is None else v[e], step=state["step"] + 1, momentum=momentum,
                              beta2=beta2, eps=eps)


def apply_preconditioned_muon(mats: list[TwoSided], *, lr, tau: float, basis_dtype: torch.dtype, product_dtype,
                              momentum: float, beta2: float, eps: float, ns_dtype) -> None:
    """``norm="muon"`` (Dobb-preconditioned Muon), per matrix (local rows, whole columns):

    1. ``C = U Q`` and ``Gq = G Q`` with ``Q`` the block-diagonal input-side basis;
    2. ``V <- beta2 V + (1 - beta2) Gq^2`` and ``R = (C / (1 - mu^t)) / (sqrt(V / (1 - beta2^t)) + eps)``
       (SOAP's rule on one side, ``functional.adam_direction``);
    3. ``P = R Q^T``, cut into the ``out_blocks`` row blocks of ``plan.ns_rows`` (whole on this rank);
    4. ``W_b -= lr * tau * sqrt(max(m_b, n)) * NS5(P_b)``: each row block moves as a Muon update of
       its own shape, as row-block Muon's blocks do.

    ``TwoSided`` carries the plan, the state (``basis``, ``second_moment``, ``step``), the update
    ``u``, the gradient ``g`` and the weight ``w`` (local tensors)."""
    from ..baselines.muon import resolve_ns_dtype
    from ..baselines.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalize

    for plan, state, ut, gt, pt in mats:
        lay = plan.layout
        pre = precondition(plan, state, ut, gt, basis_dtype=basis_dtype, product_dtype=product_dtype,
                           momentum=momentum, beta2=beta2, eps=eps)
        sizes = [s for s in plan.ns_rows.local_sizes if s > 0]
        parts = list(pre.split(sizes, dim=0))
        outs = orthogonalize(parts, NS_COEFFICIENTS, NS_STEPS, NS_EPS,
                             dtype=resolve_ns_dtype(ns_dtype, pt.device))
        n = lay.shape[lay.blocked_axis]  # the input axis (global)
        w = pt.T if lay.blocked_axis == 0 else pt  # (out, in) view
        start = 0
        for size, o in zip(sizes, outs):
            w[start : start + size].add_(o.to(pt.dtype).mul_(-lr * F.update_scale(size, n, tau)))
            start += size


def precondition(plan, state: dict, ut: Tensor, gt: Tensor, *, basis_dtype: torch.dtype, product_dtype, momentum: float,
                 beta2: float, eps: float) -> Tensor:
    """``norm="muon"``'s ``P = R Q^T`` of one matrix (local rows), advancing its ``second_moment``:
    steps 1-3 of ``apply_preconditioned_muon``. Oriented ``(out, in)``: a transposed weight's tensors
    (stored ``(in, out)``, input axis blocked on dim 0) are read through their transposes."""
    lay = plan.layout
    dtype = F.matmul_dtype(basis_dtype, ut.device, product_dtype)
    basis = lay.local(state["basis"])
    v = lay.local(state["second_moment"])
    if lay.blocked_axis == 0:
        ut, gt, v = ut.T, gt.T, v.T
    c, gq = F.blockwise(torch.stack([ut, gt]).to(dtype), basis, lay.local_sizes).unbind(0)
    gq = gq.to(v.dtype)
    v.mul_(beta2).addcmul_(gq, gq, value=1.0 - beta2)
    r = F.adam_direction(c.to(v.dtype), v, step=state["step"] + 1, momentum=momentum, beta2=beta2, eps=eps)
    return F.blockwise(r.to(dtype), basis, lay.local_sizes, transpose=True)
