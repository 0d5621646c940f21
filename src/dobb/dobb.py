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
import math
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from . import functional as F
from ._base import MatrixOptimizer, _name_of
from ._dtensor import is_dtensor, to_local
from .capture import CaptureHooks, gram_statistic
from .collectives import SumBucket, all_reduce_sum_, common_group, group_ranks, plain_stat_group
from .layout import MatrixLayout
from .placement import layout_for

_CHOICES = {
    "basis": ("orthogonal_iteration", "eigh"),
    "qr": ("householder", "cholesky"),
    "norm": ("sign", "l2"),
    "side": ("input", "output"),
    "source": ("activation", "output_grad", "grad_gram"),
    "capture": ("first", "all"),
    "init_basis": ("eigh", "identity"),
}
_HOOK_SOURCES = ("activation", "output_grad")
_FLIP = {"input": "output", "output": "input"}
_UNRESOLVED = object()


class Dobb(MatrixOptimizer):
    """Distributed Optimizer with Block-diagonal Eigenbases (see README and SPEC for every option).

    Args (beyond ``torch.optim`` conventions; every one may be overridden per param group):
        model: the module whose layers own the matrices; needed for ``source="activation"`` and
            ``"output_grad"`` (capture hooks are registered on it).
        blocks: number of diagonal blocks ``B`` of the blocked axis (contiguous, nearly equal,
            first ``size % B`` blocks one longer; under sharding, cut at shard boundaries first).
        refresh_every: refresh period ``T`` (the first step always refreshes).
        basis: ``"orthogonal_iteration"`` (``ortho_steps`` rounds of ``Q <- qr(A Q)``, warm-started)
            or ``"eigh"`` (exact eigendecomposition at every refresh).
        qr: ``"householder"`` or ``"cholesky"`` (Cholesky QR; failed blocks redone by Householder).
        norm: ``"sign"`` (Dobb) or ``"l2"`` (Dobb-ell2: unit-norm coefficient columns).
        side: ``"input"`` (column blocks, basis over ``n``) or ``"output"`` (row blocks, Dobb-G).
        source: ``"activation"`` (input side), ``"output_grad"`` (output side) or ``"grad_gram"``
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
        transposed: the group's weights are stored ``(in, out)`` (Hugging Face ``Conv1D``;
            ``dobb.param_groups`` sets it): blocks, statistics and sharding follow the input axis.
    """

    algorithm = "dobb"
    _native_transposed = True  # transposed groups flip the layout's blocked axis (see _init_matrix_state)
    matrix_defaults: dict[str, Any] = dict(
        blocks=1, refresh_every=9, basis="orthogonal_iteration", ortho_steps=1, qr="householder",
        norm="sign", side="input", source="activation", capture="first", stat_decay=0.9,
        momentum=0.95, nesterov=False, basis_dtype=torch.bfloat16, stat_dtype=torch.float32,
        init_basis="eigh", stagger=True,
    )

    def __init__(self, params, model: nn.Module | None = None, *, lr: float, weight_decay: float = 0.0,
                 check_finite: bool = True, stat_group="default", **kwargs):
        self.model = model
        self.check_finite = check_finite
        self._stat_group = stat_group
        self._layouts: dict[torch.Tensor, MatrixLayout] = {}
        self._offsets: dict[torch.Tensor, int] = {}
        self._hooks: CaptureHooks | None = None
        self._plain_group = _UNRESOLVED
        self._reduced: dict[torch.Tensor, torch.Tensor | None] = {}
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
        for key in ("blocks", "refresh_every", "ortho_steps"):
            value = group[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        for key in ("stat_decay", "momentum"):
            if not 0.0 <= group[key] < 1.0:
                raise ValueError(f"{key} must lie in [0, 1), got {group[key]}")
        if group["source"] == "activation" and group["side"] != "input":
            raise ValueError("source='activation' gives an n x n statistic: it needs side='input'")
        if group["source"] == "output_grad" and group["side"] != "output":
            raise ValueError("source='output_grad' gives an m x m statistic: it needs side='output' (Dobb-G)")
        for key in ("basis_dtype", "stat_dtype"):
            if not (isinstance(group[key], torch.dtype) and group[key].is_floating_point):
                raise ValueError(f"{key} must be a floating torch.dtype, got {group[key]!r}")
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
                side = _FLIP[group["side"]] if group["transposed"] else group["side"]
                layout = layout_for(p, side, group["blocks"], stat_group)
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None
            self._layouts[p] = layout
            self.state[p] = self._new_state(p, group, layout)
        if group["stagger"]:
            T = group["refresh_every"]
            # global (rank-invariant) block sizes: every rank must pick the same refresh offsets
            order = sorted(group["params"], key=lambda q: -sum(s**3 for s in self._layouts[q].global_sizes))
            for p in order:
                off = min(range(T), key=lambda o: cost[o])
                cost[off] += sum(s**3 for s in self._layouts[p].global_sizes)
                self._offsets[p] = off

    def _new_state(self, p: torch.Tensor, group: dict, layout: MatrixLayout) -> dict[str, Any]:
        # Created eagerly and identically on every rank, so distributed checkpoints see one key set.
        return {
            "step": 0,
            "captures": 0,
            "momentum": torch.zeros_like(p, memory_format=torch.preserve_format),
            "stat": layout.new_block_state(group["stat_dtype"], identity=False, like=p),
            "basis": layout.new_block_state(group["basis_dtype"], identity=True, like=p),
        }

    def _install_hooks(self) -> None:
        hooked = {p: g for g in self._dobb_groups() for p in g["params"] if g["source"] in _HOOK_SOURCES}
        if self._hooks is not None:
            self._hooks.remove()
        self._hooks = CaptureHooks(self.model, hooked, self._layouts) if hooked else None
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

    def capture(self, weight: torch.Tensor, features: torch.Tensor) -> bool:
        """Record input features of ``weight``'s layer for its statistic, for layers the hooks
        cannot read: custom layers, experts that see only the tokens routed to them.

        ``features``: rows of the layer's input, last dimension the weight's input axis (any
        leading shape). Counted like a hooked forward pass: only when the next ``step()``
        refreshes ``weight`` (otherwise nothing is recorded and False is returned), with grad
        enabled, outside ``capture_paused()`` and activation-checkpoint recomputation, and with
        ``capture="first"`` only the first time after a step. Give the owning module
        ``dobb_capture = False`` so that its forward hook does not capture its first input as
        well. The weight must be in a group with ``source="activation"``.
        """
        group = next((g for g in self._dobb_groups() if any(q is weight for q in g["params"])), None)
        if group is None:
            raise ValueError(f"capture: the tensor of shape {tuple(weight.shape)} is not a matrix of this Dobb")
        if group["source"] != "activation":
            raise ValueError(f"capture records layer inputs: the weight's group has source={group['source']!r}, "
                             f"it needs source='activation'")
        return self._hooks.capture(weight, features)

    # ------------------------------------------------------------------ schedule
    def _is_refresh(self, p: torch.Tensor, group: dict) -> bool:
        # Until a first statistic exists every step is due (a zero-lr step or a forward pass that
        # skipped the layer must not leave the identity basis in place for a whole period).
        state = self.state[p]
        step = state["step"]
        return step == 0 or state["captures"] == 0 or (step - self._offsets.get(p, 0)) % group["refresh_every"] == 0

    def _rearm(self) -> None:
        if self._hooks is None:
            return
        self._hooks.pending.clear()
        self._hooks.armed = {p for p, g in self._hooks.groups.items() if self._is_refresh(p, g)}

    def is_refresh_step(self) -> bool:
        """Whether the next ``step()`` refreshes any basis (for benchmarks and logging)."""
        return any(self._is_refresh(p, g) for g in self._dobb_groups() for p in g["params"])

    # ------------------------------------------------------------------ the step
    def _prepare_step(self) -> None:
        """Everything the ranks must decide together before any state changes, in one pass of
        collectives issued identically on every rank: the statistics of every parameter due for a
        refresh (token-weighted sums, zero with zero weight where a layer did not run here) and the
        finiteness flags of all gradients (folded into a statistic reduction over the same ranks)."""
        params = [p for g in self.param_groups for p in g["params"]]
        self._idle.clear()
        buckets: dict[tuple, SumBucket] = {}
        slots = []  # (param, layout, bucket, index of sums, index of count, local row count) per due matrix
        for g in self._dobb_groups():
            if g["source"] not in _HOOK_SOURCES or self._hooks is None:
                continue
            dtype = torch.promote_types(g["stat_dtype"], torch.float32)
            for p in g["params"]:
                layout = self._layouts[p]
                if p.grad is None and layout.stat_group is not None:
                    # a shared statistic is shared state: its schedule and collectives cannot depend on
                    # whether this rank got a gradient (no gradient sync, a layer unused here only)
                    self._idle.append((g, p))
                elif p.grad is None:
                    continue
                if not self._is_refresh(p, g):
                    continue
                pending = self._hooks.pending.get(p)
                device = layout.local(p).device
                sums = pending.sums if pending is not None else torch.zeros(layout.capture_shape, dtype=dtype, device=device)
                count = torch.tensor([pending.count if pending is not None else 0], dtype=dtype, device=device)
                key = (id(layout.stat_group), dtype, device)
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = SumBucket(layout.stat_group, dtype, device)
                slots.append((p, layout, bucket, bucket.add(sums), bucket.add(count),
                              pending.count if pending is not None else 0))
        flags = self._local_nonfinite(params) if self.check_finite else None
        flag_slot = None
        if flags is not None and self._step_group is not None:
            ranks = group_ranks(self._step_group)
            shared = next((b for b in buckets.values() if b.group is not None and group_ranks(b.group) == ranks), None)
            if shared is None:
                shared = SumBucket(self._step_group, flags.dtype, flags.device)
                buckets[("finite",)] = shared
            flag_slot = (shared, shared.add(flags))
        reduced = {id(b): b.reduce("finite" if k == ("finite",) else "stat") for k, b in buckets.items()}
        if flags is not None:
            if flag_slot is not None:
                flags = reduced[id(flag_slot[0])][flag_slot[1]]
            bad = [i for i, v in enumerate(flags.tolist()) if v > 0]
            if bad:
                self._rearm()  # the next forward passes capture afresh
                self._raise_nonfinite(params[bad[0]], int(flags[bad[0]].item()))
        if all(b.group is None for _, _, b, _, _, _ in slots):
            # no statistic group (one process): the totals are this rank's row counts, known on the
            # host, so a step with check_finite=False reads no tensor value
            totals = [n for *_, n in slots]
        else:
            counts = [reduced[id(b)][c] for _, _, b, _, c, _ in slots]
            totals = torch.cat(counts).tolist() if counts else []
        self._reduced.clear()
        for (p, layout, b, i, _, _), total in zip(slots, totals):
            # no rank saw a token for this layer: keep its statistic and basis
            self._reduced[p] = None if total == 0 else layout.stat_to_state(reduced[id(b)][i] / total)

    @staticmethod
    def _local_nonfinite(params: list[torch.Tensor]) -> torch.Tensor | None:
        """1.0 for every parameter whose local gradient holds NaN/Inf, else 0.0 (no host sync).

        All zeros when this rank holds no gradient at all: the flags still take part in the step's
        collective, so a rank whose layers all went unused issues the same reductions as the others."""
        with_grad = [i for i, p in enumerate(params) if p.grad is not None]
        if not params:
            return None
        if not with_grad:
            return torch.zeros(len(params), dtype=torch.float32, device=to_local(params[0]).device)
        norms = torch.stack(torch._foreach_norm([to_local(params[i].grad) for i in with_grad]))
        flags = torch.zeros(len(params), dtype=torch.float32, device=norms.device)
        flags[with_grad] = (~torch.isfinite(norms)).to(torch.float32)
        return flags

    def _raise_nonfinite(self, p: torch.Tensor, ranks: int) -> None:
        index = next(i for g in self.param_groups for i, q in enumerate(g["params"]) if q is p)
        where = "" if self._step_group is None else f" on {ranks} of {len(group_ranks(self._step_group))} ranks"
        raise ValueError(
            f"non-finite gradient (NaN or Inf) in {_name_of(p, self._param_names, index)}{where}; no weight or "
            f"optimizer state was changed on any rank (pass check_finite=False to skip this check)"
        )

    def _after_step(self) -> None:
        # Matrices with a shared statistic but no gradient on this rank: the weight and momentum
        # stay (as torch skips a parameter without grad), but the statistic, basis and schedule
        # advance as on the ranks that stepped them, so every rank keeps issuing the same collectives.
        idle = defaultdict(list)
        for g, p in self._idle:
            if self._is_refresh(p, g) and not (not isinstance(g["lr"], torch.Tensor) and g["lr"] == 0):
                idle[id(g)].append((g, p))
            self.state[p]["step"] += 1
        for items in idle.values():
            self._refresh(items[0][0], [p for _, p in items], [None] * len(items))
        self._idle.clear()
        self._reduced.clear()
        self._rearm()

    def _matrix_step(self, group: dict[str, Any], active: list[torch.Tensor]) -> None:
        layouts = [self._layouts[p] for p in active]
        states = [self.state[p] for p in active]
        grads = [lay.local(p.grad) for lay, p in zip(layouts, active)]
        moms = [lay.local(s["momentum"]) for lay, s in zip(layouts, states)]
        mu = group["momentum"]
        # EMA form, one fused pass: M_ema = (1-mu) * M with M = mu M + G of SPEC step 1, and the
        # Nesterov lerp is (1-mu) * (G + mu M). Both normalizations are scale-invariant (per
        # coefficient sign, per column l2), so the update is the one SPEC defines.
        torch._foreach_lerp_(moms, grads, 1.0 - mu)
        u = torch._foreach_lerp(grads, moms, mu) if group["nesterov"] else moms

        # A zero-lr step (torchtitan's state-creation step, a warmup that starts at 0) changes no
        # weight, so it takes no statistic either; the next step then refreshes as a first step would.
        zero_lr = not isinstance(group["lr"], torch.Tensor) and group["lr"] == 0
        refresh = [] if zero_lr else [i for i, p in enumerate(active) if self._is_refresh(p, group)]
        if refresh:
            self._refresh(group, [active[i] for i in refresh], [grads[i] for i in refresh])

        params = [lay.local(p) for lay, p in zip(layouts, active)]
        lr, wd = group["lr"], group["weight_decay"]
        # Where the reconstruction runs per matrix in the weight's dtype (CPU), the decay is its
        # baddbmm's beta: one pass over W instead of a multiply pass and a strided add pass.
        fused = [self._decay_in_update(pt, lay, group) for pt, lay in zip(params, layouts)]
        if wd != 0 and not all(fused):
            torch._foreach_mul_([pt for pt, f in zip(params, fused) if not f], 1.0 - lr * wd)
        self._apply_directions(group, active, u, params, [1.0 - lr * wd if f else None for f in fused])
        for s in states:
            s["step"] += 1

    def _refresh(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        decay = group["stat_decay"]
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p, g in zip(params, grads):
            layout, state = self._layouts[p], self.state[p]
            if group["source"] == "grad_gram":
                new = gram_statistic(g, layout, torch.promote_types(group["stat_dtype"], torch.float32))
            else:
                new = self._reduced.get(p)
                if new is None:
                    continue  # no rank captured it (layer unused in this step's forward): keep the basis
            stat = layout.local(state["stat"])
            basis = layout.local(state["basis"])
            new = new.to(stat.dtype)
            if state["captures"] == 0:
                stat.copy_(new)
            else:
                stat.lerp_(new, 1.0 - decay)
            exact = group["basis"] == "eigh" or (state["captures"] == 0 and group["init_basis"] == "eigh")
            state["captures"] += 1
            for run in F.block_runs(layout.local_sizes):
                batches[(run.size, exact)].append((F.block_view(stat, run), F.block_view(basis, run)))
        for (size, exact), items in batches.items():
            a = torch.cat([a for a, _ in items])
            a = a.to(torch.promote_types(a.dtype, torch.float32))
            if exact:
                q = F.eigh_basis(a)
            else:
                q0 = torch.cat([q for _, q in items])
                q = F.orthogonal_iteration(a, q0, group["ortho_steps"], group["qr"])
            for (_, q_view), q_new in zip(items, q.split([a_.shape[0] for a_, _ in items])):
                q_view.copy_(q_new)

    # torch runs baddbmm_ into a strided weight view as one addmm_ per block: a win (one pass over
    # W, no update temporary) for large blocks, launch-bound for small ones (docs/timing.md)
    _FUSE_MIN_BLOCK_WORK = 1 << 18
    _SMALL_BLOCK = 16  # CPU: blocks up to this size use the transposed products (_project_and_add)

    @classmethod
    def _decay_in_update(cls, pt: torch.Tensor, layout: MatrixLayout, group: dict) -> bool:
        rows = pt.shape[1 - layout.blocked_axis]
        return (pt.device.type == "cpu" and not isinstance(group["lr"], torch.Tensor)
                and pt.dtype == F.matmul_dtype(group["basis_dtype"], pt.device)
                and min((rows * s * s for s in layout.local_sizes if s > 0), default=0) >= cls._FUSE_MIN_BLOCK_WORK)

    def _apply_directions(self, group: dict, active: list, u: list, params: list, betas: list) -> None:
        """``W -= lr * s * O`` with ``O`` from batched project -> normalize -> reconstruct.

        All equal-shape blocks of the group go through one pair of ``bmm`` calls, computed in the
        basis dtype (bf16 by default: half the memory traffic, bf16 matrix units). The constant
        ``-lr * s`` (and sign's ``1/sqrt(rows)``) is folded into the final in-place add, so no
        update-sized temporary is written besides the coefficients. ``betas[i]``: the decay factor
        folded into that matrix's reconstruction (``baddbmm``), or None (already decayed).
        """
        norm, lr, tau = group["norm"], group["lr"], group["tau"]
        batches: dict[tuple, list] = defaultdict(list)
        for p, ut, pt, beta in zip(active, u, params, betas):
            layout = self._layouts[p]
            basis = layout.local(self.state[p]["basis"])
            uo, po = (ut, pt) if layout.blocked_axis == 1 else (ut.transpose(0, 1), pt.transpose(0, 1))
            r = uo.shape[0]
            factor = -lr * F.update_scale(*layout.shape, tau) / (math.sqrt(layout.rows) if norm == "sign" else 1.0)
            for run in F.block_runs(layout.local_sizes):
                # l2 with sharded rows: one batch per matrix, so every rank of the l2 group issues the
                # same norm reductions in the same order (local row counts may differ across ranks)
                l2_key = (id(layout.l2_group), id(p) if layout.l2_group is not None else None)
                key = (r, run.size, F.matmul_dtype(basis.dtype, basis.device), layout.rows, l2_key if norm == "l2" else None)
                batches[key].append((uo[:, run.start : run.stop], F.block_view(basis, run), po, run, layout, factor, beta))
        for (r, size, dtype, _, _), items in batches.items():
            # One bmm pair per batch of equal blocks. On CPU a strided block view feeds bmm at no
            # cost while stacking matrices costs a transposing copy, so CPU batches per matrix;
            # accelerators stack all matrices to save kernel launches.
            if items[0][0].device.type == "cpu":
                for it in items:
                    self._project_and_add([it], r, size, dtype, norm)
            else:
                self._project_and_add(items, r, size, dtype, norm)

    @classmethod
    def _project_and_add(cls, items: list, r: int, size: int, dtype: torch.dtype, norm: str) -> None:
        if len(items) == 1 and norm == "sign" and size <= cls._SMALL_BLOCK and items[0][6] is None:
            # Small blocks: MKL's batched GEMM is far faster with the long row axis as the product's
            # N (C_b^T = Q_b^T U_b^T, (s x s)(s x r)) than as its M (3-7x at s = 8, docs/timing.md).
            ut, q, po, run, _, factor, _ = items[0]
            ct = torch.bmm(q.to(dtype).transpose(1, 2), ut.to(dtype).t().reshape(run.count, size, r)).sign_()
            po[:, run.start : run.stop].t().view(run.count, size, r).add_(torch.bmm(q.to(dtype), ct), alpha=factor)
            return
        counts = [it[3].count for it in items]
        views = [it[0].to(dtype).reshape(r, it[3].count, size).transpose(0, 1) for it in items]
        ub = views[0] if len(items) == 1 else torch.cat(views)
        q = (items[0][1] if len(items) == 1 else torch.cat([it[1] for it in items])).to(dtype)
        l2_group = items[0][4].l2_group
        c = F.block_coefficients(ub, q, norm, col_sq_sum=lambda sq: all_reduce_sum_(sq, l2_group))
        if len(items) == 1 and items[0][6] is not None:  # W_b <- beta W_b + factor C_b Q_b^T, one pass
            _, _, po, run, _, factor, beta = items[0]
            po[:, run.start : run.stop].view(r, run.count, size).transpose(0, 1).baddbmm_(
                c, q.transpose(1, 2), beta=beta, alpha=factor)
            return
        o = torch.bmm(c, q.transpose(1, 2))
        for ob, (_, _, po, run, _, factor, _) in zip(o.split(counts), items):
            po[:, run.start : run.stop].view(r, run.count, size).add_(ob.transpose(0, 1), alpha=factor)

    # ------------------------------------------------------------------ state dict
    # statistics (fp32) and bases (bf16) keep their own precision on load
    _own_dtype_keys = ("stat", "basis")

    def _after_load(self) -> None:
        self._install_hooks()  # torch replaced the group dicts the hooks read
