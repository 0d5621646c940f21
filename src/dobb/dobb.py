"""The Dobb optimizer: orchestration of state, capture hooks and the refresh schedule.

The math lives in ``functional`` (pure functions), placement in ``layout``/``sharding`` (chosen by
``placement.layout_for``), communication in ``collectives``, capture in ``capture``. Per matrix ``W`` (``m x n``) with gradient ``G`` the step is

1. ``M <- mu M + G``; ``U = G + mu M`` (Nesterov) or ``U = M``;
2. on refresh steps: block statistics ``A_b`` (EMA over captures) and bases
   ``Q_b <- qr(A_b Q_b)`` (``ortho_steps`` times) or ``eigh(A_b)``;
3. ``O[:, b] = normalize(U[:, b] Q_b) Q_b^T`` (sign: ``sign(.)/sqrt(m)``, or unit ell2 columns);
4. ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``.

All equal-size blocks of all matrices of a param group go through one batched ``bmm``/QR call.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from . import functional as F
from ._apply import DirectionKernels
from ._two_sided import TwoSidedKernels, two_sided_layouts
from ._decide import HOOK_SOURCES as _HOOK_SOURCES, StepDecisions
from ._base import MatrixOptimizer, _name_of
from ._dtensor import is_dtensor
from .capture import CaptureHooks, gram_statistic
from .collectives import common_group, plain_stat_group
from .experts import ExpertLayout, expert_layout, expert_parts, refresh_stack, stack_gram_statistic
from .layout import MatrixLayout
from .placement import layout_for

_CHOICES = {
    "basis": ("orthogonal_iteration", "eigh"),
    "qr": ("householder", "cholesky"),
    "norm": ("sign", "l2", "adam"),
    "side": ("input", "output", "both"),
    "source": ("activation", "output_grad", "grad_gram"),
    "capture": ("first", "all"),
    "init_basis": ("eigh", "identity"),
}
_FLIP = {"input": "output", "output": "input"}
_UNRESOLVED = object()


class Dobb(DirectionKernels, TwoSidedKernels, StepDecisions, MatrixOptimizer):
    """Distributed Optimizer with Block-diagonal Eigenbases (see README and docs/algorithm.md for every option).

    Args (beyond ``torch.optim`` conventions; every one may be overridden per param group):
        model: the module whose layers own the matrices; needed for ``source="activation"`` and
            ``"output_grad"`` (capture hooks are registered on it).
        blocks: number of diagonal blocks ``B`` of the blocked axis (contiguous, nearly equal,
            first ``size % B`` blocks one longer; under sharding, cut at shard boundaries first).
            Choosing it (docs/results.md, "Operating point"; bench model, 800 steps, medians of 3
            seeds; GPT-2 Small layer 0 under FSDP2 on 4 gloo ranks): fewer blocks give lower loss,
            more blocks a cheaper step. ``blocks=1`` closes 62% of the AdamW-Muon loss gap, 2 48%,
            4 34%, 8 13%, 16 none. Sharded, where the step matters: ``blocks=4`` (FSDP2 step 0.13x
            owner-compute Muon's on a CPU without native bf16; 0.49x on one with it, issue 23's
            figure). At ``blocks=1`` on GPT-2 shapes the step costs as much as owner-compute Muon,
            which has the better loss. Unsharded, block Muon at the same ``blocks`` has the lower
            loss: Dobb's advantage is a step that stays shard-local under FSDP2/TP. For Muon's loss
            with Dobb's collectives use ``side="both"`` (``out_blocks=1``: 1.649 against Muon's 1.671
            at the shared lr, 3 seeds; about 2x one-sided Dobb's optimizer time; "Two-sided Dobb").
        refresh_every: refresh period ``T`` (the first step always refreshes).
        basis: ``"orthogonal_iteration"`` (``ortho_steps`` rounds of ``Q <- qr(A Q)``, warm-started)
            or ``"eigh"`` (exact eigendecomposition at every refresh).
        qr: ``"householder"`` or ``"cholesky"`` (Cholesky QR; failed blocks redone by Householder).
        norm: ``"sign"`` (Dobb), ``"l2"`` (Dobb-ell2: unit-norm coefficient columns) or, with
            ``side="both"``, ``"adam"`` (SOAP's second-moment rule on the two-sided coefficients).
        side: ``"input"`` (column blocks, basis over ``n``), ``"output"`` (row blocks, Dobb-G) or
            ``"both"`` (two-sided Dobb: ``C_bc = Q_out_b^T U_bc Q_in_c``, see ``_two_sided``).
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
            True: measured loss unchanged over 3 seeds, spike cut (docs/timing.md, "Refresh spike").
        check_finite: raise ``ValueError`` naming the parameter when a gradient holds NaN/Inf,
            before any state changes. The decision is taken by all ranks that share the step
            together (one flag all-reduce, folded into the statistic reduction on refresh steps), so
            every rank raises the same error. Costs one host synchronisation per step; False skips it.
        stat_group: process group over which statistics are averaged (token-weighted). ``"default"``:
            DTensor parameters take the data-parallel dims of their mesh; plain parameters the
            process group of the ``DistributedDataParallel`` module passed as ``model``, and raise a
            ``ValueError`` under an initialized process group of several ranks without one (pass a
            ``ProcessGroup``, or None for this rank's data alone). Mesh dim names/indices select
            DTensor mesh dims.
        product_dtype: dtype of the projection products ``U_b Q_b`` and ``C_b Q_b^T``: ``"auto"``
            (the basis dtype on accelerators, fp32 on every CPU: faster there, measured on hosts
            with and without native bf16; see ``functional.matmul_dtype``) or a dtype that forces it.
        transposed: the group's weights are stored ``(in, out)`` (Hugging Face ``Conv1D``;
            ``dobb.param_groups`` sets it): blocks, statistics and sharding follow the input axis.

    A group may hold 3-D expert stacks ``(E, out, in)``: each is optimized as ``E`` matrices with
    their own blocks, statistics and bases (``experts``); their statistics come from
    ``capture(weight, [x_0, ..., x_{E-1}])`` or ``source="grad_gram"``.
    """

    algorithm = "dobb"
    _native_transposed = True  # transposed groups flip the layout's blocked axis (see _init_matrix_state)
    _expert_stacks = True  # 3-D (E, out, in) parameters are E matrices (see experts)
    matrix_defaults: dict[str, Any] = dict(
        blocks=1, refresh_every=9, basis="orthogonal_iteration", ortho_steps=1, qr="householder",
        norm="sign", side="input", source="activation", capture="first", stat_decay=0.9,
        momentum=0.95, nesterov=False, basis_dtype=torch.bfloat16, stat_dtype=torch.float32,
        init_basis="eigh", stagger=True, product_dtype="auto", out_blocks=1, beta2=0.95, eps=1e-8,
    )

    def __init__(self, params, model: nn.Module | None = None, *, lr: float, weight_decay: float = 0.0,
                 check_finite: bool = True, stat_group="default", **kwargs):
        self.model = model
        self.check_finite = check_finite
        self._stat_group = stat_group
        self._layouts: dict[torch.Tensor, MatrixLayout] = {}
        self._out_layouts: dict[torch.Tensor, MatrixLayout] = {}  # side="both": the output side's
        self._offsets: dict[torch.Tensor, int] = {}
        self._hooks: CaptureHooks | None = None
        self._plain_group = _UNRESOLVED
        self._reduced: dict[torch.Tensor, torch.Tensor | None] = {}
        self._reduced_out: dict[torch.Tensor, torch.Tensor | None] = {}  # side="both": output-side means
        self._idle: list[tuple[dict, torch.Tensor]] = []  # (group, param): shared statistic, no grad here
        self._constructed = False
        super().__init__(params, lr=lr, weight_decay=weight_decay, **kwargs)
        self._constructed = True
        self._install_hooks()
        self._step_group = self._find_step_group()

    # ------------------------------------------------------------------ set-up
    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        for key, options in _CHOICES.items():
            if group[key] not in options:
                raise ValueError(f"{key} must be one of {options}, got {group[key]!r}")
        for key in ("blocks", "refresh_every", "ortho_steps", "out_blocks"):
            value = group[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        for key in ("stat_decay", "momentum", "beta2"):
            if not 0.0 <= group[key] < 1.0:
                raise ValueError(f"{key} must lie in [0, 1), got {group[key]}")
        if not group["eps"] > 0:
            raise ValueError(f"eps must be > 0, got {group['eps']}")
        if group["source"] == "activation" and group["side"] == "output":
            raise ValueError("source='activation' gives an n x n statistic: it needs side='input' (or 'both')")
        if group["side"] == "both":
            if group["norm"] == "l2":
                raise ValueError("norm='l2' normalizes one side's coefficient columns; side='both' takes norm='sign' or 'adam'")
            if group["source"] == "output_grad":
                raise ValueError("side='both' takes source='activation' (activations for the input side, output "
                                 "gradients for the output side) or source='grad_gram' (G^T G and G G^T blocks)")
        elif group["norm"] == "adam":
            raise ValueError("norm='adam' is the second moment of the two-sided coefficients: it needs side='both'")
        if group["source"] == "output_grad" and group["side"] != "output":
            raise ValueError("source='output_grad' gives an m x m statistic: it needs side='output' (Dobb-G)")
        for key in ("basis_dtype", "stat_dtype"):
            if not (isinstance(group[key], torch.dtype) and group[key].is_floating_point):
                raise ValueError(f"{key} must be a floating torch.dtype, got {group[key]!r}")
        if group["product_dtype"] not in F.PRODUCT_DTYPES:
            raise ValueError(f"product_dtype must be one of {F.PRODUCT_DTYPES}, got {group['product_dtype']!r}")
        for i, p in enumerate(group["params"]):
            if p.dim() == 3 and group["side"] == "both":
                raise ValueError(
                    f"{_name_of(p, self._param_names, i)} is an expert stack (E, out, in): side='both' is not "
                    f"implemented for stacks; use side='input' for it (its own param group), or store each expert "
                    f"as a 2-D parameter"
                )
            if p.dim() == 3 and group["source"] == "output_grad":
                raise ValueError(
                    f"{_name_of(p, self._param_names, i)} is an expert stack (E, out, in): its output gradients are "
                    f"routed, which hooks cannot see; use source='grad_gram' for side='output'"
                )
        if group["source"] in _HOOK_SOURCES and self.model is None:
            raise ValueError(
                f"source={group['source']!r} captures statistics with hooks: pass model=<the nn.Module> "
                f"to Dobb(...), or use source='grad_gram'"
            )

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        cost = defaultdict(int)  # stagger: greedy balance of refresh work over the T offsets
        for i, p in enumerate(group["params"]):
            try:
                if is_dtensor(p):
                    stat_group = self._stat_group
                elif group["source"] in _HOOK_SOURCES:
                    stat_group = self._plain_stat_group()
                else:  # grad_gram: the gradient is already averaged, the statistic needs no group
                    stat_group = None
                # a transposed weight, stored (in, out): its input axis is dim 0, so the "input" side
                # blocks dim 0 (what "output" blocks on an (out, in) weight) and vice versa
                side = _FLIP.get(group["side"], "both") if group["transposed"] else group["side"]
                if side == "both":
                    layout, self._out_layouts[p] = two_sided_layouts(p, group, stat_group, group["transposed"], layout_for)
                elif p.dim() == 3:
                    layout = expert_layout(p, side, group["blocks"], stat_group)
                else:
                    layout = layout_for(p, side, group["blocks"], stat_group)
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None
            self._layouts[p] = layout
            self.state[p] = self._new_state(p, group, layout)
        if group["stagger"]:
            T = group["refresh_every"]
            # global (rank-invariant) block sizes: every rank must pick the same refresh offsets
            def work(q):  # an expert stack refreshes its E experts together
                lay = self._layouts[q]
                out = sum(s**3 for s in self._out_layouts[q].global_sizes) if q in self._out_layouts else 0
                return sum(s**3 for s in lay.global_sizes) * (lay.experts if isinstance(lay, ExpertLayout) else 1) + out

            for p in sorted(group["params"], key=lambda q: -work(q)):
                off = min(range(T), key=lambda o: cost[o])
                cost[off] += work(p)
                self._offsets[p] = off

    def _new_state(self, p: torch.Tensor, group: dict, layout: MatrixLayout) -> dict[str, Any]:
        # Created eagerly and identically on every rank, so distributed checkpoints see one key set.
        state = {
            "step": 0,
            # per expert of the captured span for a stack (each expert's statistic has its own count)
            "captures": [0] * layout.span_count if isinstance(layout, ExpertLayout) else 0,
            "momentum": torch.zeros_like(p, memory_format=torch.preserve_format),
            "stat": layout.new_block_state(group["stat_dtype"], identity=False, like=p),
            "basis": layout.new_block_state(group["basis_dtype"], identity=True, like=p),
        }
        out = self._out_layouts.get(p)
        if out is not None:  # side="both": the output side's blocks, and a count per side [input, output]
            state.update(captures=[0, 0], out_stat=out.new_block_state(group["stat_dtype"], identity=False, like=p),
                         out_basis=out.new_block_state(group["basis_dtype"], identity=True, like=p))
            if group["norm"] == "adam":  # EMA of the squared rotated gradient, in the statistic dtype
                state["second_moment"] = torch.zeros_like(p, dtype=group["stat_dtype"])
        return state

    def _install_hooks(self) -> None:
        hooked = {p: g for g in self._dobb_groups() for p in g["params"] if g["source"] in _HOOK_SOURCES}
        if self._hooks is not None:
            self._hooks.remove()
        self._hooks = CaptureHooks(self.model, hooked, self._layouts, self._out_layouts) if hooked else None
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
                    from .sharding import mesh_group

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
        layout = self._layouts[weight]
        if not isinstance(layout, ExpertLayout):
            if expert is not None:
                raise ValueError(f"capture: expert={expert} given, but {_name_of(weight, self._param_names, index)} "
                                 f"is a 2-D matrix, not an (E, out, in) expert stack")
            return self._hooks.capture(weight, features)
        E, n = layout.experts, layout.shape[layout.blocked_axis]  # activation: the blocked axis is the input
        parts = expert_parts(features, expert, E, n, _name_of(weight, self._param_names, index))
        return self._hooks.capture_experts(weight, parts)

    # ------------------------------------------------------------------ schedule
    def _is_refresh(self, p: torch.Tensor, group: dict) -> bool:
        # Until a first statistic exists every step is due (a zero-lr step or a forward pass that
        # skipped the layer must not leave the identity basis in place for a whole period).
        step = self.state[p]["step"]
        return step == 0 or self._unseen(p) or (step - self._offsets.get(p, 0)) % group["refresh_every"] == 0

    def _unseen(self, p: torch.Tensor) -> bool:  # no statistic yet (a stack: some expert has none)
        captures = self.state[p]["captures"]
        return 0 in captures if isinstance(captures, list) else captures == 0

    def _due_experts(self, p: torch.Tensor, group: dict) -> list[bool]:
        """Per expert of a stack's captured span: due as a matrix of its own would be."""
        state = self.state[p]
        step = state["step"]
        on = step == 0 or (step - self._offsets.get(p, 0)) % group["refresh_every"] == 0
        return [on or c == 0 for c in state["captures"]]

    def _rearm(self) -> None:
        if self._hooks is None:
            return
        self._hooks.pending.clear()
        self._hooks.pending_out.clear()
        self._hooks.armed = {p for p, g in self._hooks.groups.items() if self._is_refresh(p, g)}

    def is_refresh_step(self) -> bool:
        """Whether the next ``step()`` refreshes any basis (for benchmarks and logging)."""
        return any(self._is_refresh(p, g) for g in self._dobb_groups() for p in g["params"])

    # ------------------------------------------------------------------ the step
    def _after_step(self) -> None:
        # Matrices with a shared statistic but no gradient on this rank: the weight and momentum
        # stay (as torch skips a parameter without grad), but the statistic, basis and schedule
        # advance as on the ranks that stepped them, so every rank keeps issuing the same collectives.
        idle = defaultdict(list)
        for g, p in self._idle:
            if self._is_refresh(p, g) and not _zero_lr(g):
                idle[id(g)].append((g, p))
            self.state[p]["step"] += 1
        for items in idle.values():
            self._refresh(items[0][0], [p for _, p in items], [None] * len(items))
        self._idle.clear()
        self._reduced.clear()
        self._reduced_out.clear()
        self._rearm()

    def _matrix_step(self, group: dict[str, Any], active: list[torch.Tensor]) -> None:
        layouts = [self._layouts[p] for p in active]
        states = [self.state[p] for p in active]
        grads = [lay.local(p.grad) for lay, p in zip(layouts, active)]
        moms = [lay.local(s["momentum"]) for lay, s in zip(layouts, states)]
        mu = group["momentum"]
        # EMA form, one fused pass: M_ema = (1-mu) * M with M = mu M + G of docs/algorithm.md step 1, and the
        # Nesterov lerp is (1-mu) * (G + mu M). Both normalizations are scale-invariant (per
        # coefficient sign, per column l2), so the update is the one docs/algorithm.md defines.
        torch._foreach_lerp_(moms, grads, 1.0 - mu)
        u = torch._foreach_lerp(grads, moms, mu) if group["nesterov"] else moms

        refresh = [] if _zero_lr(group) else [i for i, p in enumerate(active) if self._is_refresh(p, group)]
        if refresh:
            self._refresh(group, [active[i] for i in refresh], [grads[i] for i in refresh])

        params = [lay.local(p) for lay, p in zip(layouts, active)]
        lr, wd = group["lr"], group["weight_decay"]
        # Where the reconstruction runs per matrix in the weight's dtype (CPU), the decay is its
        # baddbmm's beta: one pass over W instead of a multiply pass and a strided add pass.
        fused = [self._decay_in_update(pt, lay, group) for pt, lay in zip(params, layouts)]
        if wd != 0 and not all(fused):
            torch._foreach_mul_([pt for pt, f in zip(params, fused) if not f], 1.0 - lr * wd)
        if group["side"] == "both":
            self._apply_two_sided(group, active, u, grads, params)
        else:
            self._apply_directions(group, active, u, params, [1.0 - lr * wd if f else None for f in fused])
        for s in states:
            s["step"] += 1

    def _refresh(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        batches: dict[tuple, list[tuple]] = defaultdict(list)  # (size, exact) -> [(A blocks, Q blocks, put)]
        gram = group["source"] == "grad_gram"
        dtype = torch.promote_types(group["stat_dtype"], torch.float32)
        for p, g in zip(params, grads):
            layout, state = self._layouts[p], self.state[p]
            if isinstance(layout, ExpertLayout):
                new, has = (stack_gram_statistic(g, layout, dtype), [True] * layout.span_count) if gram else (
                    self._reduced.get(p), None)
                if new is None:
                    continue  # no rank captured it (layer unused in this step's forward): keep the basis
                if isinstance(new, tuple):  # a stack's per-expert flags
                    new, has = new
                refresh_stack(state, layout, new, has, self._due_experts(p, group), group,
                              lambda key, a, q0, put: batches[key].append((a, q0, put)))
                continue
            sides = [(layout, "stat", "basis", self._reduced)]
            if p in self._out_layouts:  # side="both": captures = [input, output]
                sides.append((self._out_layouts[p], "out_stat", "out_basis", self._reduced_out))
            for side, (lay, stat_key, basis_key, reduced) in enumerate(sides):
                new = gram_statistic(g, lay, dtype) if gram else reduced.get(p)
                if new is None:
                    continue  # no rank captured it (layer unused in this step's forward): keep the basis
                has = None
                if isinstance(new, tuple):  # a matrix's device flag
                    new, has = new
                self._fold(group, state, side if len(sides) > 1 else None, lay, state[stat_key], state[basis_key],
                           new, has, batches)
        for (size, exact), items in batches.items():
            a = torch.cat([a for a, _, _ in items])
            a = a.to(torch.promote_types(a.dtype, torch.float32))
            if exact:
                q = F.eigh_basis(a)
            else:
                q0 = torch.cat([q for _, q, _ in items])
                q = F.orthogonal_iteration(a, q0, group["ortho_steps"], group["qr"])
            for (_, _, put), q_new in zip(items, q.split([a_.shape[0] for a_, _, _ in items])):
                put(q_new)

    def _fold(self, group, state, side, layout, stat, basis, new, has, batches) -> None:
        """Fold a new statistic into one side's EMA and queue its blocks for the batched basis
        refresh. ``side``: the index into ``state["captures"]`` of a two-sided matrix, else None."""
        stat, basis = layout.local(stat), layout.local(basis)
        new = new.to(stat.dtype)
        count = state["captures"] if side is None else state["captures"][side]
        if count == 0:
            stat.copy_(new)
        elif has is None:
            stat.lerp_(new, 1.0 - group["stat_decay"])
        else:  # decided on the device: a refresh without a row on any rank keeps the statistic
            stat.copy_(torch.where(has, stat.lerp(new, 1.0 - group["stat_decay"]), stat))
        exact = group["basis"] == "eigh" or (count == 0 and group["init_basis"] == "eigh")
        # on the device path: counted whether or not any rank had a row
        if side is None:
            state["captures"] += 1
        else:
            state["captures"][side] += 1
        for run in F.block_runs(layout.local_sizes):
            q_view = F.block_view(basis, run)
            put = q_view.copy_ if has is None else (lambda q, v=q_view, h=has: v.copy_(torch.where(h, q, v)))
            batches[(run.size, exact)].append((F.block_view(stat, run), q_view, put))

    # ------------------------------------------------------------------ state dict
    # statistics (fp32) and bases (bf16) keep their own precision on load
    _own_dtype_keys = ("stat", "basis", "out_stat", "out_basis", "second_moment")

    def _after_load(self) -> None:
        self._install_hooks()  # torch replaced the group dicts the hooks read


def _zero_lr(group: dict[str, Any]) -> bool:
    # A zero-lr step (torchtitan's state-creation step, a warmup that starts at 0) changes no
    # weight, so it takes no statistic either; the next step then refreshes as a first step would.
    # A tensor lr is never read on the host here (no synchronisation inside step()).
    return not isinstance(group["lr"], torch.Tensor) and group["lr"] == 0
