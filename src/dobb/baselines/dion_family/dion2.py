"""Dion2-style row-subset Muon: orthogonalize only the heaviest ``fraction`` of momentum rows.

Our exact rule (Dion's error feedback with "keep a row subset" as the compression, after the
row-selection update of Amsel et al.'s Dion2/Dion3):

    B = M + G                                  # error-feedback buffer, as in Dion
    K = the k = max(1, round(fraction * m)) rows of B with the largest ell1 norms (ascending order)
    O[K] = NS5(B[K]);  O[rows not in K] = 0    # unselected rows get no update this step
    M = B;  M[K] <- mu * B[K]                  # selected rows decay (consumed), the rest accumulate
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(k, n)) * O

The scale is the shared protocol applied to the ``k x n`` matrix that was orthogonalized, so the
updated rows move with RMS ``tau``, as a Muon step does (``||O||_F^2 ~ min(k, n)``); weight decay
acts on the whole matrix every step. With ``fraction=1`` this is Muon without Nesterov (the buffer
is ``(1 - mu)^-1`` times Muon's EMA, a factor NS5 removes). Ties in the ell1 norms are broken by
``torch.topk``.

Where the rows are selected (``select``):

- ``None`` (the default): ``"shard"`` with one block per shard for a DTensor whose rows are cut
  into shards and whose columns are whole (FSDP2 ``Shard(0)``, column-parallel TP), ``"global"``
  for every other matrix (plain tensors among them).
- ``"global"``: the ``k`` rows are chosen over the whole matrix; sharded weights are
  gathered for it.
- ``"shard"``: the matrix is cut into ``blocks`` contiguous row blocks (``dobb.functional.block_sizes``,
  cut at the row shards' boundaries first, the partition Block Muon and Dobb use) that stand for
  the row shards, and the rule above runs on each block on its own: ``k_b = max(1, round(fraction *
  m_b))`` rows of block ``b``, ``O_b = NS5`` of them, moved with ``tau*sqrt(max(k_b, n))``. Under
  FSDP2's ``Shard(0)`` (column-parallel TP too) every block lies in one rank's shard and whole rows
  are local, so the step needs no communication; with ``blocks`` equal to the shard count each
  rank's shard is one block. A weight whose columns are sharded is gathered first (rows span
  shards). ``blocks=1`` is the global selection exactly. This orthogonalizes each shard's rows
  alone; the authors' FSDP code selects rows per shard too, but then orthogonalizes the selected
  rows of all shards together on one owner rank (``k n`` entries exchanged), which is not this.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._base import MatrixOptimizer, _name_of
from ...layout import is_dtensor, to_local
from ...placement import follow_layout, layout_for, shard_counts
from .. import _common as C
from ..._hparams import ScaledOptions, integer, layout_option, one_of, option, unit_interval
from ..._hparams import fraction as fraction_rule
from ...newton_schulz import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, NSOptions, ns_options, orthogonalize,
                              widening_dtype)

SELECT = ("global", "shard")


def selected_rows(n_rows: int, fraction: float) -> int:
    return max(1, round(fraction * n_rows))


def dion2_step(b: Tensor, k: int, mu: float, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
               eps: float = NS_EPS, method: str = "standard", dtype: torch.dtype = torch.bfloat16,
               compile: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One step on a batch ``b = M + G`` (``(batch, m, n)``). Returns ``(O, M_new, rows)``:
    the raw update (bf16, zero outside the selected rows), the new momentum, the row indices."""
    rows = torch.topk(b.abs().sum(dim=-1, dtype=torch.float32), k, dim=-1).indices.sort(dim=-1).values
    idx = rows.unsqueeze(-1).expand(-1, -1, b.shape[-1])
    sub = torch.gather(b, 1, idx)
    ortho = torch.stack(orthogonalize(list(sub.unbind(0)), coefficients, steps, eps, method=method, dtype=dtype,
                                       compile=compile))
    o = torch.zeros(b.shape, dtype=ortho.dtype, device=b.device).scatter_(1, idx, ortho)
    m_new = b.scatter(1, idx, sub * mu)
    return o, m_new, rows


@dataclass(frozen=True, kw_only=True)
class Dion2Options(ScaledOptions, NSOptions):
    fraction: float = option(0.25, fraction_rule)
    momentum: float = option(0.95, unit_interval)
    select: str = layout_option("global", one_of(*SELECT))
    blocks: int = layout_option(4, integer(1))


class Dion2(MatrixOptimizer):
    """Args: ``lr``, ``weight_decay``, ``tau``, ``fraction`` (0.25), ``momentum`` (0.95),
    ``ns_coefficients``, ``ns_steps`` (5), ``eps``, ``ns_method``, ``ns_dtype`` (as Dion3's),
    ``select`` (``"global"``, or ``"shard"``: within each of ``blocks`` row blocks, default 4; see
    the module docstring), AdamW args."""

    algorithm = "dion2"
    Options = Dion2Options

    def _group_plans(self, group):
        """``select="shard"``: each matrix's row-block layout (``None`` for ``"global"``). ``select``
        and ``blocks`` left ``None`` (the default) follow the placement: a DTensor whose rows are cut
        into shards and whose columns are whole (FSDP2 ``Shard(0)``, column-parallel TP) selects per shard, one block per shard;
        any other matrix selects globally (``blocks`` 4 where ``select="shard"`` is given)."""
        plans = []
        for i, p in enumerate(group["params"]):
            rows, cols = shard_counts(p)
            select = group["select"] or ("shard" if rows > 1 and cols == 1 else "global")
            try:
                plans.append(layout_for(p, "output", follow_layout(group["blocks"], p, 0, 4), None)
                             if select == "shard" else None)
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None
        return plans

    def _init_matrix_state(self, group):
        for p in group["params"]:
            if "momentum" not in self.state[p]:
                self.state[p]["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _matrix_step(self, group, active):
        # per matrix, as planned: a row-block layout selects per shard, None globally
        shard = [p for p in active if self._plans[p] is not None]
        if shard:
            self._shard_step(group, shard)
        active = [p for p in active if self._plans[p] is None]
        if active:
            self._global_step(group, active)

    def _global_step(self, group, active):
        """``select="global"``: the rule on each whole matrix (gathered when sharded)."""
        fulls, batches = gathered_lookahead(self.state, active)
        outs: list[Tensor | None] = [None] * len(active)
        scales = [0.0] * len(active)
        out, dst, src = _out_dtype(group, active), [], []
        for (shape, _, _), idx in batches.items():
            k = selected_rows(shape[0], group["fraction"])
            o, m_new, _ = dion2_step(torch.stack([fulls[i] for i in idx]), k, group["momentum"],
                                     group["ns_coefficients"], group["ns_steps"], group["eps"], **ns_options(group))
            o = o if out is None else o.to(out)
            for j, i in enumerate(idx):
                p = active[i]
                dst.append(to_local(self.state[p]["momentum"]))
                src.append(C.local_slice(m_new[j], p))
                outs[i] = C.local_slice(o[j], p)
                scales[i] = C.update_scale(k, shape[1], group["tau"])
        torch._foreach_copy_(dst, src)  # the new momenta: one pass for the group
        params = [to_local(p) for p in active]
        C.apply_protocol(params, params, outs, scales, group["lr"], group["weight_decay"])

    def _shard_step(self, group, active):
        """``select="shard"``: the rule on each row block alone (blocks of equal shape batched)."""
        frac, tau = group["fraction"], group["tau"]
        work, batches = [], defaultdict(list)  # work: (i, b, rows of b, local); batches by block shape
        full_b: dict[int, Tensor] = {}  # gathered M + G of the matrices whose columns are sharded
        grads = [to_local(p.grad) for p in active]  # before the state: see dobb._base.MatrixOptimizer._matrix_step
        lookahead = torch._foreach_add([to_local(self.state[p]["momentum"]) for p in active], grads)
        for i, p in enumerate(active):
            lay = self._plans[p]
            local = lay.local_shape[1] == lay.shape[1]  # whole rows here: the blocks are local
            b = lookahead[i]
            if not local:
                b = full_b[i] = C.gather_full(b, p)
            start = 0
            for size in (lay.local_sizes if local else lay.global_sizes):
                rows = slice(start, start + size)
                batches[(size, b.shape[1], b.dtype, b.device)].append((len(work), b[rows]))
                work.append((i, b, rows, local))
                start += size
        outs: list = [None] * len(work)
        out, dst, src = _out_dtype(group, active), [], []
        for (size, n, _, _), items in batches.items():
            k = selected_rows(size, frac)
            o, m_new, _ = dion2_step(torch.stack([blk for _, blk in items]), k, group["momentum"],
                                     group["ns_coefficients"], group["ns_steps"], group["eps"], **ns_options(group))
            o = o if out is None else o.to(out)
            for j, (w, _) in enumerate(items):
                outs[w] = (o[j], m_new[j], C.update_scale(k, n, tau))
        params = [to_local(p) for p in active]
        targets, updates, scales = [], [], []
        gathered: dict[int, list] = defaultdict(list)
        for (i, b, rows, local), (o, m_new, s) in zip(work, outs):
            if local:
                dst.append(to_local(self.state[active[i]]["momentum"])[rows])
                src.append(m_new)
                targets.append(params[i][rows])
                updates.append(o)
                scales.append(s)
            else:
                b[rows] = m_new  # b is this rank's gathered copy: the new full momentum, block by block
                gathered[i].append((rows, o, s))
        if dst:  # the new momenta of the local blocks: one pass (none when every block was gathered)
            torch._foreach_copy_(dst, src)
        for i, blocks in gathered.items():  # one full O against the matrix' s, this rank's shard of it
            p, b = active[i], full_b[i]
            to_local(self.state[p]["momentum"]).copy_(C.local_slice(b, p))
            m, n = p.shape
            s_full = C.update_scale(m, n, tau)
            full = torch.zeros((m, n), dtype=C.upcast(blocks[0][1]).dtype, device=b.device)
            for rows, o, s in blocks:
                full[rows] = o.to(full.dtype) * (s / s_full)
            targets.append(params[i])
            updates.append(C.local_slice(full, p))
            scales.append(s_full)
        C.apply_protocol(params, targets, updates, scales, group["lr"], group["weight_decay"])


def _out_dtype(group, active) -> torch.dtype | None:
    """The weights' dtype for a batch's ``O`` when the cast from the NS dtype is exact and no matrix
    is sharded (``widening_dtype``): one cast per batch instead of one per matrix in ``apply_protocol``."""
    if any(is_dtensor(p) for p in active):
        return None
    return widening_dtype(ns_options(group)["dtype"], (p.dtype for p in active))


def gathered_lookahead(state, active):
    """Whole ``momentum + grad`` of each active matrix (gathered when sharded), and the indices of
    equal (shape, dtype, device) matrices, so a row-subset step runs batched over each shape."""
    fulls, batches = [], defaultdict(list)
    grads = [to_local(p.grad) for p in active]  # before the state: see dobb._base.MatrixOptimizer._matrix_step
    lookahead = torch._foreach_add([to_local(state[p]["momentum"]) for p in active], grads)
    for i, p in enumerate(active):
        b = C.gather_full(lookahead[i], p)
        fulls.append(b)
        batches[(tuple(b.shape), b.dtype, b.device)].append(i)
    return fulls, batches
