"""SPlus (Frans, Levine, Abbeel 2025, arXiv 2506.07254): the sign of the momentum in Shampoo's
eigenbases, with a shape-aware scale and an average of the iterates for evaluation.

Per matrix ``W`` (``m x n``, stored ``(out, in)``) with gradient ``G``, step ``t = 1, 2, ...``:

    M <- b1 M + (1 - b1) G                                      # momentum, an EMA (no bias correction)
    U  = Q_L sign(Q_L^T M Q_R) Q_R^T                            # with the bases of the previous steps
    L <- b2 L + (1 - b2) G G^T,   R <- b2 R + (1 - b2) G^T G    # statistics, EMAs
    if t == 1 or t % inverse_every == 0:                         # refresh (after the update)
        Q_L, Q_R <- eigenvectors of L + eps I, R + eps I
    A <- r A + (1 - r) W                                        # the iterate average, of W before this step
    W <- (1 - lr s wd) W - lr s U,   s = 2 / (m + n)

The order follows the authors' JAX code (``optax/splus.py``): the update uses the bases held when
the step begins (the identity on step 1, whose update is therefore ``sign(M)``), the statistics
take this step's gradient and the bases are recomputed from them on step 1 and every
``inverse_every``-th step; the iterate average takes the weights *before* the step; weight decay
is decoupled and scaled by ``lr * s`` as in their chain ``add_decayed_weights -> scale(lr) ->
shape scale``. (Their PyTorch port averages after the sign step and decays after it; the JAX code
is the one of the paper's experiments.) A side of length ``>= max_dim`` keeps no statistic and the
identity basis, and a matrix with such a side is scaled by ``nonstandard_constant`` instead of
``2 / (m + n)``, as theirs. Eigenvector order and signs do not matter: ``U`` is invariant to a
permutation or sign flip of the basis columns.

Evaluation uses the bias-corrected average ``A / (1 - r^t)``: ``opt.eval()`` swaps it into the
weights (keeping the raw weights in the state, key ``"raw"``) and ``opt.train()`` swaps them back,
bitwise. The average covers every parameter of the optimizer: the matrices and the parameters of
its ``"adamw"`` groups (embeddings, head, norms, biases), as the authors average the whole
parameter tree. Those parameters are stepped by AdamW here (this package's convention), where the
authors use ``sign(M)`` scaled by ``nonstandard_constant``. ``step()`` in eval mode is an error.

Shard-local form: ``out_blocks`` cuts ``Q_L`` into that many diagonal blocks (each the eigenbasis
of a diagonal block ``G_b G_b^T`` of the row blocks ``G_b``), ``blocks`` likewise cuts ``Q_R``
(diagonal blocks of ``G^T G`` over column blocks). ``blocks = out_blocks = 1`` is SPlus, the
value both take on a plain tensor; left ``None`` (the default) a side cut by a DTensor's placement
takes one block per shard, so a sharded model steps locally with no options. Under
sharding the blocks of each side are cut at its shard boundaries (``placement.layout_for``), so
the rotation, sign and unrotation of every step use only local rows and columns: the step issues
no collective. The statistic of the *other* side sums over the sharded axis (under FSDP2
``Shard(0)``, ``G^T G = sum_r G_r^T G_r`` over the row shards): each rank keeps the EMA of its own
partial sum, and on a refresh step (step 1 and every ``inverse_every``-th) a copy is all-reduced
over the ranks holding other parts of that axis (the layout's ``l2_group``) before ``eigh``. By
linearity the sum of the partial EMAs is the EMA of the whole statistic, so the bases are exactly
those of the unsharded matrix with the same blocks; that all-reduce (``sum_c s_c^2`` entries per
matrix and sharded side, every ``inverse_every`` steps) is the optimizer's only communication.
For a DTensor weight the statistics and bases are DTensors with one part per shard
(``dobb.sharding.per_shard_state``: each rank's rows, padded to the largest), so
``torch.distributed.checkpoint`` saves every rank's partial statistic; a checkpoint resumes on the
same sharding, and ``dobb.resume.check_resume`` refuses another one before anything loads.

State per matrix: ``momentum`` and ``ema`` (weight-shaped, the weight's dtype as the authors'),
``stat_out``/``basis_out`` and ``stat_in``/``basis_in`` (row-stacked ``(k, s_max)`` blocks, fp32,
fp64 for fp64 weights; ``(0, 0)`` for a side at ``max_dim``), ``step`` and ``ema_step``.
Update scale: ``tau`` is accepted and unused (SPlus's ``2 / (m + n)`` replaces the protocol's).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ... import functional as F
from ...collectives import all_reduce_sum_
from ..._base import MatrixOptimizer, _name_of
from ...layout import to_local
from ..._hparams import Options, integer, layout_option, option, positive, unit_interval
from ...functional import blockwise
from ...placement import follow_layout, layout_for
from .. import _common as C

__all__ = ["SPlus", "splus_direction"]

@dataclass(frozen=True, kw_only=True)
class SPlusOptions(Options):
    """SPlus's options: sign-scaled by ``2/(m+n)``, so no ``tau`` (passing one is an error);
    ``ema_rate`` and ``adamw_lr_ratio`` are read by the ``"adamw"`` groups too."""
    b1: float = option(0.9, unit_interval)
    b2: float = option(0.999, unit_interval)
    ema_rate: float = option(0.999, unit_interval, adamw=True)
    eps: float = option(1e-30, positive)
    inverse_every: int = option(100, integer(1))
    max_dim: int = option(10000, integer(1))
    nonstandard_constant: float = option(0.001, positive)
    blocks: int = layout_option(1, integer(1))
    out_blocks: int = layout_option(1, integer(1))
    adamw_lr_ratio: float = option(1.0, positive, adamw=True)

    @classmethod
    def _check_together(cls, values) -> None:
        super()._check_together(values)
        if values["adamw_lr"] is not None and values["adamw_lr_ratio"] != 1.0:
            raise ValueError(f"adamw_lr={values['adamw_lr']!r} and adamw_lr_ratio={values['adamw_lr_ratio']!r}: "
                             f"give the AdamW part's lr once, as adamw_lr (its own rate) or adamw_lr_ratio "
                             f"(a multiple of lr)")


# ----------------------------------------------------------------------------- pure math
def splus_direction(m: Tensor, out: tuple[Tensor, list[int]] | None, inp: tuple[Tensor, list[int]] | None) -> Tensor:
    """``Q_L sign(Q_L^T M Q_R) Q_R^T`` for block-diagonal bases given as ``(row-stacked basis,
    sizes)``; ``None`` is the identity on that side."""
    c = m
    if inp is not None:
        c = blockwise(c, *inp)  # M Q_R
    if out is not None:
        c = blockwise(c.mT, *out).mT  # Q_L^T (M Q_R)
    d = torch.sign(c)
    if inp is not None:
        d = blockwise(d, *inp, transpose=True)  # D Q_R^T
    if out is not None:
        d = blockwise(d.mT, *out, transpose=True).mT  # Q_L (D Q_R^T)
    return d


def _gram_rows(g: Tensor, sizes: list[int]) -> Tensor:
    """Row-stacked diagonal blocks ``G_b G_b^T`` of the row blocks of ``g`` (``sizes`` over rows)."""
    return F.gram_blocks(g.mT.unsqueeze(0), sizes, g.dtype)[0]


def _gram_cols(g: Tensor, sizes: list[int]) -> Tensor:
    """Row-stacked diagonal blocks ``G_c^T G_c`` of the column blocks of ``g``."""
    return F.gram_blocks(g.unsqueeze(0), sizes, g.dtype)[0]


def _eigh_into_(basis: Tensor, stat: Tensor, sizes: list[int], eps: float) -> None:
    """``basis`` blocks <- eigenvectors of ``stat`` blocks ``+ eps I`` (one batched eigh per run)."""
    for run in F.block_runs(sizes):
        a = F.block_view(stat, run)
        eye = torch.eye(run.size, dtype=a.dtype, device=a.device)
        F.block_view(basis, run).copy_(torch.linalg.eigh(a + eps * eye).eigenvectors)


def _mine(state: Tensor, lay) -> Tensor:
    """This rank's rows of a statistic or basis (a DTensor's local part, less the padding that
    makes every rank's part the same size)."""
    return to_local(state)[: lay.local_blocked_len]


def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


class SPlus(MatrixOptimizer):
    """SPlus for hidden matrices, AdamW for the rest (see the module docstring).

    Args: ``lr`` (SPlus's scale: the step is ``lr * 2/(m+n)`` per sign entry; the authors suggest
    about 0.2), ``weight_decay`` (decoupled, scaled by ``lr * 2/(m+n)`` on matrices), ``b1`` (0.9,
    momentum), ``b2`` (0.999, statistics), ``ema_rate`` (0.999, iterate average), ``eps`` (1e-30,
    added to the statistics' diagonal before ``eigh``), ``inverse_every`` (100), ``max_dim``
    (10000), ``nonstandard_constant`` (0.001), ``blocks`` (1: diagonal blocks of ``Q_R``),
    ``out_blocks`` (1: diagonal blocks of ``Q_L``), ``adamw_betas``, ``adamw_eps``,
    ``adamw_lr_ratio`` (1.0: the ``"adamw"`` groups step with ``lr * adamw_lr_ratio``; SPlus's
    ``lr`` is a per-sign-entry scale over ``(m + n) / 2``, so its good values (about 0.1-0.5) are far
    above AdamW's, and a ratio lets the other parameters keep an AdamW lr; the shared ``adamw_lr``
    gives that rate directly, and the two together are a ``ValueError``); it takes no ``tau``.
    """

    algorithm = "splus"
    Options = SPlusOptions
    # What the bench's evaluation uses: this optimizer's eval() swaps in the iterate average.
    eval_weights = "iterate-ema"
    _own_dtype_keys = ("stat_out", "stat_in", "basis_out", "basis_in")

    # ------------------------------------------------------------------ validation and state
    def _adamw_inputs(self, group: dict[str, Any]) -> tuple[list, dict]:
        lists, kwargs = super()._adamw_inputs(group)
        if group["adamw_lr_ratio"] != 1.0:
            kwargs["lr"] = kwargs["lr"] * group["adamw_lr_ratio"]
        return lists, kwargs

    def _group_plans(self, group: dict[str, Any]) -> list[tuple]:
        """Each matrix's plan: the layouts of its output (``Q_L``) and input (``Q_R``) sides."""
        plans = []
        for i, p in enumerate(group["params"]):
            # None (the default): one block per shard of a sharded side, 1 (SPlus) otherwise
            out_blocks = follow_layout(group["out_blocks"], p, 0, 1)
            blocks = follow_layout(group["blocks"], p, 1, 1)
            try:
                plans.append((layout_for(p, "output", out_blocks, None), layout_for(p, "input", blocks, None)))
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc} (out_blocks="
                                 f"{out_blocks}, blocks={blocks})") from None
        return plans

    def _sides(self, group: dict, p: Tensor) -> tuple[bool, bool]:
        """Whether the output (``Q_L``) and input (``Q_R``) sides keep a basis (length < ``max_dim``)."""
        m, n = p.shape
        return m < group["max_dim"], n < group["max_dim"]

    def _scale(self, group: dict, p: Tensor) -> float:
        m, n = p.shape
        left, right = self._sides(group, p)
        return 2.0 / (m + n) if left and right else float(group["nonstandard_constant"])

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            st = self.state[p]
            if "momentum" in st:
                continue
            out_lay, in_lay = self._plans[p]
            left, right = self._sides(group, p)
            dt, dev = _state_dtype(p), to_local(p).device

            from ...sharding import local_shapes, per_shard_state  # DTensor code loads on use

            def side(lay, axis, on):
                if not on:
                    empty = torch.zeros(0, 0, dtype=dt, device=dev)
                    return per_shard_state(empty, p), per_shard_state(empty.clone(), p)
                # the largest local length on any rank: every rank's rows then stack into one DTensor
                k = max(shape[axis] for shape in local_shapes(p))
                s = max(lay.global_sizes)
                basis = torch.zeros(k, s, dtype=dt, device=dev)
                if lay.local_sizes:
                    eye = F.identity_blocks(lay.local_sizes, dtype=dt, device=dev)
                    basis[: eye.shape[0], : eye.shape[1]] = eye
                return per_shard_state(torch.zeros(k, s, dtype=dt, device=dev), p), per_shard_state(basis, p)

            stat_out, basis_out = side(out_lay, 0, left)
            stat_in, basis_in = side(in_lay, 1, right)
            st.update(step=0, ema_step=0, momentum=torch.zeros_like(p, memory_format=torch.preserve_format),
                      ema=torch.zeros_like(p, memory_format=torch.preserve_format),
                      stat_out=stat_out, basis_out=basis_out, stat_in=stat_in, basis_in=basis_in)

    def _layout_note(self, group) -> str:
        return ("its blocks are cut at the weight's shard boundaries and each rank keeps its partial "
                "statistic of the other side, so its state follows the shards")

    def _init_adamw_state(self, p: Tensor, fused: bool = False) -> dict[str, Any]:
        state = super()._init_adamw_state(p, fused)
        if "ema" not in state:
            state["ema"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["ema_step"] = 0
        return state

    # ------------------------------------------------------------------ the step
    def _in_eval(self) -> bool:
        return any("raw" in self.state[p] for g in self.param_groups for p in g["params"] if p in self.state)

    def _prepare_step(self) -> None:
        if self._in_eval():
            raise RuntimeError("SPlus.step() called in eval mode (the weights hold the iterate average): "
                               "call opt.train() first")
        # the iterate average of the AdamW part, of the weights before this step (as the matrices')
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                continue
            ps = [p for p in group["params"] if p.grad is not None]
            if ps:
                states = [self.state[p] for p in ps]
                torch._foreach_lerp_([s["ema"] for s in states], [p.detach() for p in ps], 1 - group["ema_rate"])
                for s in states:
                    s["ema_step"] += 1

    def _matrix_step(self, group: dict[str, Any], active: list[Tensor]) -> None:
        b1, b2, eps = group["b1"], group["b2"], group["eps"]
        states = [self.state[p] for p in active]
        params = [to_local(p) for p in active]
        torch._foreach_lerp_([to_local(s["ema"]) for s in states], params, 1 - group["ema_rate"])
        moms = [to_local(s["momentum"]) for s in states]
        grads = [to_local(p.grad) for p in active]
        torch._foreach_lerp_(moms, [g.to(m.dtype) for g, m in zip(grads, moms)], 1 - b1)
        by_scale: dict[float, tuple[list, list]] = defaultdict(lambda: ([], []))
        for p, w, st, mom, grad in zip(active, params, states, moms, grads):
            out_lay, in_lay = self._plans[p]
            left, right = self._sides(group, p)
            dt = st["basis_out"].dtype
            out = (_mine(st["basis_out"], out_lay), out_lay.local_sizes) if left and out_lay.local_sizes else None
            inp = (_mine(st["basis_in"], in_lay), in_lay.local_sizes) if right and in_lay.local_sizes else None
            u = splus_direction(mom.to(dt), out, inp) if w.numel() else mom.to(dt)
            ws, us = by_scale[self._scale(group, p)]
            ws.append(w)
            us.append(u)
            st["step"] += 1
            st["ema_step"] += 1
            g = grad.to(dt)
            refresh = st["step"] == 1 or st["step"] % group["inverse_every"] == 0
            for on, lay, key, gram in ((left, out_lay, "out", _gram_rows), (right, in_lay, "in", _gram_cols)):
                if not on or not lay.local_sizes:
                    continue
                stat = _mine(st[f"stat_{key}"], lay)
                if g.numel():
                    stat.lerp_(lay.pad_state_cols(gram(g, lay.local_sizes)), 1 - b2)
                else:
                    stat.mul_(b2)
                if refresh:
                    total = stat
                    if lay.l2_group is not None:  # partial sums over the other axis' shards
                        total = all_reduce_sum_(stat.clone(), lay.l2_group, "norm")
                    _eigh_into_(_mine(st[f"basis_{key}"], lay), total, lay.local_sizes, eps)
        for s, (ws, us) in by_scale.items():
            wd = group["weight_decay"]
            C.apply_protocol(ws, ws, us, [s] * len(ws), group["lr"], wd * s)

    # ------------------------------------------------------------------ the iterate average
    @torch.no_grad()
    def eval(self) -> None:
        """Swap the bias-corrected iterate average ``A / (1 - r^t)`` into every parameter that has
        been stepped (the raw weights are kept in the state, ``"raw"``). A no-op when already in
        eval mode; a parameter never stepped keeps its weights."""
        if self._in_eval():
            return
        for group in self.param_groups:
            with self._logical(group) as logical:
                for p in logical["params"]:
                    st = self.state.get(p, {})
                    t = int(st.get("ema_step", 0))
                    if t == 0:
                        continue
                    st["raw"] = p.detach().clone()
                    p.copy_(st["ema"] / (1.0 - group["ema_rate"] ** t))

    @torch.no_grad()
    def train(self) -> None:
        """Swap the raw weights back (bitwise); a no-op in train mode."""
        for group in self.param_groups:
            with self._logical(group) as logical:
                for p in logical["params"]:
                    st = self.state.get(p, {})
                    if "raw" in st:
                        p.copy_(st.pop("raw"))

    def _after_load(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p, {})
                if "ema_step" in st:
                    st["ema_step"] = int(st["ema_step"])
