"""Dion (Ahn et al. 2025, "Dion: Distributed Orthonormalized Updates"), written from its algorithms.

Per matrix with gradient ``G`` and error-feedback momentum ``M`` (rank ``r``):

    B = M + G
    P = orth(B Q)                 # one warm-started power iteration; QR (or randomized Cholesky QR)
    R = B^T P
    M <- B - (1 - mu) P R^T       # error feedback: what the rank-r step did not consume stays
    Q <- colnorm(R)
    O = P Q^T                     # ||O||_F^2 = r exactly (orthonormal P, unit columns of Q)
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O

``r = max(1, round(rank_fraction * min(m, n)))``. Orientation (our convention): the iteration runs
on ``B`` if ``m <= n`` and on ``B^T`` otherwise, so the QR'd factor ``P`` always has ``min(m, n)``
rows (the cheaper QR) and the persistent ``Q`` has ``max(m, n)`` rows. ``Q`` starts as a Gaussian
matrix from ``torch.Generator().manual_seed(seed + k)`` (``k``: the parameter's position among the
optimizer's matrices), column-normalized: identical on every rank. The math runs in fp32 (fp64 for
fp64 weights); ``M`` is stored in the weight's dtype, ``Q`` in fp32. All equal-shape matrices of a
group run as one batch.

Sharded weights (DTensor; ``dobb.sharding.axis_split`` says how each axis is split) run the
distributed algorithm on local blocks. Call the oriented matrix's rows (``min(m, n)``, ``P``'s
axis) and columns (``max(m, n)``, ``Q``'s axis); each rank holds a block ``B_loc`` and the rows
``Q_loc`` of ``Q`` for its columns:

    P_loc  = sum over the column shards of B_loc Q_loc        # s_loc x r
    P_loc  = orth(P) with P's rows spread over the row shards
    R_loc  = sum over the row shards of B_loc^T P_loc          # l_loc x r
    M_loc <- B_loc - (1 - mu) P_loc R_loc^T                    # local
    Q_loc  = R_loc / sqrt(sum over the column shards of the squared column norms)
    O_loc  = P_loc Q_loc^T                                      # local

With the rows split, ``orth`` is Householder QR of the whole ``P`` (completed by one zero-padded
all-reduce of ``s x r``) or randomized Cholesky QR (sums of the ``ceil(1.25 r) x r`` sketch and of
the ``r x r`` Gram). Per matrix and step, logical entries (``s = min(m, n)``, ``l = max(m, n)``):
rows split ``s r + l r`` (Householder; Table 3's ``r(m+n)``) or ``ceil(1.25 r) r + r^2 + l r``
(rcqr); columns split ``s r + r``; both (FSDP x TP) the sum of the pieces. ``Q`` is a DTensor
sharded like the weight's ``l`` axis (``Shard(0)``) or replicated. Layouts the partial sums cannot
serve (``_StridedShard``, an axis split over two mesh dims, ``Partial``) fall back to gathering the
whole matrix (listed in ``Dion.gathered``, with the reason). The math below sees plain tensors only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections import defaultdict

import torch
from torch import Tensor

from ..._base import MatrixOptimizer
from ...layout import is_dtensor, to_local
from .. import _common as C
from ..._hparams import ScaledOptions, fraction, integer, one_of, option, unit_interval
from ...newton_schulz import column_normalize

_QR = ("householder", "rcqr")
_COLUMN_EPS = 1e-30  # column_normalize's floor on the squared norm


def dion_rank(m: int, n: int, rank_fraction: float) -> int:
    return max(1, round(rank_fraction * min(m, n)))


def rcqr_sketch(batch: int, rows: int, r: int, generator: torch.Generator | None, device=None,
                dtype=torch.float32, oversample: float = 1.25) -> Tensor:
    """The Gaussian sketch ``(batch, ceil(oversample*r), rows)`` of randomized Cholesky QR."""
    k = math.ceil(oversample * r)
    return torch.randn(batch, k, rows, generator=generator, device=device, dtype=dtype) / math.sqrt(k)


def _same(t: Tensor) -> Tensor:
    return t


def qr_randomized_cholesky(p: Tensor, generator: torch.Generator | None = None,
                           oversample: float = 1.25, *, sketch: Tensor | None = None,
                           row_sum=None) -> Tensor:
    """Orthonormal factor of a batch ``(b, s, r)`` by randomized Cholesky QR (no host sync).

    A Gaussian sketch ``S`` (``ceil(oversample*r) x s``) gives ``R1`` from a small QR of ``S P``;
    ``P1 = P R1^{-1}`` is well conditioned, and one Cholesky QR of ``P1`` finishes the job. Tiny
    pivots of ``R1`` and the Gram are shifted (shifted Cholesky QR) instead of branching, so a
    rank-deficient ``P`` (e.g. a zero gradient) yields finite, not exactly orthonormal, columns.

    Distributed rows: ``p`` holds this rank's rows, ``sketch`` the matching columns of the whole
    sketch, ``row_sum`` sums a tensor over the ranks holding the other rows (``S P`` and the Gram
    are sums over rows).
    """
    b, s, r = p.shape
    total = row_sum or _same
    if sketch is None:
        sketch = rcqr_sketch(b, s, r, generator, p.device, p.dtype, oversample)
    r1 = torch.linalg.qr(total(sketch @ p), mode="r").R
    tiny, eps = torch.finfo(p.dtype).tiny ** 0.5, torch.finfo(p.dtype).eps
    d = r1.diagonal(dim1=-2, dim2=-1)
    floor = (eps * r * d.abs().amax(-1, keepdim=True)).clamp_min(tiny)
    d_safe = torch.where(d.abs() < floor, torch.where(d < 0, -floor, floor), d)
    r1 = r1 - torch.diag_embed(d) + torch.diag_embed(d_safe)
    p1 = torch.linalg.solve_triangular(r1, p, upper=True, left=False)
    gram = total(p1.mT @ p1)
    shift = (eps * gram.diagonal(dim1=-2, dim2=-1).mean(-1)).clamp_min(tiny)
    gram = gram + shift[:, None, None] * torch.eye(r, dtype=p.dtype, device=p.device)
    r2 = torch.linalg.cholesky_ex(gram, upper=True).L
    return torch.linalg.solve_triangular(r2, p1, upper=True, left=False)


class _Whole:
    """Every row and column of the oriented matrix on this rank: nothing to sum."""

    rows_split = False

    def sum_rows(self, t: Tensor) -> Tensor:
        return t

    sum_cols = sum_rows

    def total_rows(self, p: Tensor) -> int:
        return p.shape[-2]

    def gather_rows(self, t: Tensor) -> Tensor:
        return t

    def narrow_rows(self, t: Tensor, dim: int = -2) -> Tensor:
        return t


_WHOLE = _Whole()


class OrientedSplit:
    """A ``dobb.sharding.AxisSplit`` seen from the oriented matrix: its rows are ``P``'s axis (the
    weight's axis 0, or 1 when ``m > n``), its columns ``Q``'s. ``sum_rows`` sums over the ranks
    holding other rows, ``sum_cols`` over those holding other columns."""

    def __init__(self, split, tall: bool):
        self.split = split
        self.row_axis = 1 if tall else 0
        self.col_axis = 1 - self.row_axis
        self.rows_split = split.groups[self.row_axis] is not None

    def sum_rows(self, t: Tensor) -> Tensor:
        return self.split.all_reduce_sum_(t, self.row_axis)

    def sum_cols(self, t: Tensor) -> Tensor:
        return self.split.all_reduce_sum_(t, self.col_axis)

    def total_rows(self, p: Tensor) -> int:
        return self.split.shape[self.row_axis]

    def gather_rows(self, t: Tensor) -> Tensor:
        return self.split.gather_along(t, self.row_axis, t.dim() - 2)

    def narrow_rows(self, t: Tensor, dim: int = -2) -> Tensor:
        return self.split.narrow_along(t, self.row_axis, dim % t.dim())


def orthonormalize(p: Tensor, qr: str = "householder", generator: torch.Generator | None = None, *,
                   shards=None, sketch: Tensor | None = None) -> Tensor:
    """Orthonormal columns spanning ``p`` (``(b, s, r)``). With ``shards`` whose rows are split,
    ``p`` is this rank's rows of the whole ``P`` and so is the result; ``sketch`` (rcqr) is the
    sketch of the whole ``P`` (drawn from ``generator`` when None)."""
    sh = shards if shards is not None else _WHOLE
    if qr == "householder":
        if not sh.rows_split:
            return torch.linalg.qr(p).Q
        return sh.narrow_rows(torch.linalg.qr(sh.gather_rows(p)).Q)
    if qr == "rcqr":
        if sketch is None:
            sketch = rcqr_sketch(p.shape[0], sh.total_rows(p), p.shape[-1], generator, p.device, p.dtype)
        return qr_randomized_cholesky(p, sketch=sh.narrow_rows(sketch, -1), row_sum=sh.sum_rows)
    raise ValueError(f"qr must be one of {_QR}, got {qr!r}")


def dion_step(b: Tensor, q: Tensor, mu: float, qr: str = "householder",
              generator: torch.Generator | None = None, *, shards=None,
              sketch: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One Dion step on an oriented batch ``b`` (``(batch, s, l)``, ``s <= l``), ``B = M + G``.

    Returns ``(O, M_new, Q_new)``: the raw update ``P Q^T`` (``(batch, s, l)``), the
    error-feedback momentum and the next warm start ``(batch, l, r)``. With ``shards`` (an
    ``OrientedSplit``), ``b`` is this rank's block, ``q`` its rows of ``Q``, and every output is
    this rank's block of the whole step's (module docstring); ``sketch`` as in ``orthonormalize``.
    """
    sh = shards if shards is not None else _WHOLE
    p = sh.sum_cols(b @ q)
    p = orthonormalize(p, qr, generator, shards=sh, sketch=sketch)
    r = sh.sum_rows(b.mT @ p)
    m_new = torch.baddbmm(b, p, r.mT, alpha=-(1.0 - mu))
    # column_normalize(R) with the squared norms summed over the column shards
    q_new = r * torch.rsqrt(sh.sum_cols(r.square().sum(dim=-2, keepdim=True)).clamp_min(_COLUMN_EPS))
    return p @ q_new.mT, m_new, q_new


@dataclass(frozen=True, kw_only=True)
class DionOptions(ScaledOptions):
    rank_fraction: float = option(0.25, fraction)
    momentum: float = option(0.95, unit_interval)
    qr: str = option("householder", one_of(*_QR))
    seed: int = option(0, integer(0))


class Dion(MatrixOptimizer):
    """Args: ``lr``, ``weight_decay``, ``tau``, ``rank_fraction`` (0.25), ``momentum`` (``mu``, 0.95),
    ``qr`` ("householder" or "rcqr": randomized Cholesky QR), ``seed`` (0), AdamW args.

    ``gathered``: ``{parameter name (or index): reason}`` for DTensor weights whose layout the
    distributed step cannot serve and which are therefore gathered whole every step.
    """

    algorithm = "dion"
    Options = DionOptions
    _own_dtype_keys = ("Q",)  # Q stays fp32 when a bf16 model resumes

    def __init__(self, params, *, lr: float, **kwargs):
        self._n_matrices = 0
        super().__init__(params, lr=lr, **kwargs)

    def _group_plans(self, group):
        """Each matrix's split: ``None`` (plain), its ``AxisSplit``, or why it is gathered (a str)."""
        plans = []
        for p in group["params"]:
            split = None
            if is_dtensor(p):
                from ...sharding import axis_split  # only with DTensors: keeps plain imports light

                try:
                    split = axis_split(p)
                except ValueError as exc:
                    split = str(exc)
            plans.append(split)
        return plans

    @property
    def gathered(self) -> dict[str, str]:
        return {self._param_names.get(id(p), f"parameter #{i} (shape {tuple(p.shape)})"): split
                for i, (p, split) in enumerate(self._plans.items()) if isinstance(split, str)}

    def _init_matrix_state(self, group):
        for p in group["params"]:
            split = self._plans[p]
            state = self.state[p]
            if state:
                continue
            m, n = p.shape
            r = dion_rank(m, n, group["rank_fraction"])
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            gen = torch.Generator().manual_seed(group["seed"] + self._n_matrices)
            q0 = column_normalize(torch.randn(max(m, n), r, generator=gen, dtype=dtype)).to(to_local(p).device)
            self._n_matrices += 1
            state["step"] = 0
            state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if split is None:
                state["Q"] = q0
            elif isinstance(split, str):  # gathered every step: Q replicated
                from ...sharding import replicate_like

                state["Q"] = replicate_like(q0, p)
            else:  # Q's rows run along the weight's longer axis (the oriented columns)
                state["Q"] = split.state_along(q0, 0 if m > n else 1)

    def _batch_key(self, p: Tensor) -> tuple:
        """Sub-batch key: the same on every rank (so the collectives come in the same order)."""
        split = self._plans[p]
        if split is None:
            return ("local",)
        if isinstance(split, str):
            return ("gather",)
        return ("split", split.signature, p.shape[0] > p.shape[1])  # orientation: which axis is P's

    def _matrix_step(self, group, active):
        mu, qr = group["momentum"], group["qr"]
        # Batches of one oriented global shape (as a single process forms them, so rcqr draws the
        # same sketches), split into sub-batches of one sharding layout.
        batches: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(active):
            q = to_local(self.state[p]["Q"])
            batches[(min(p.shape), max(p.shape), q.shape[1], q.dtype, q.device)].append(i)
        outs: list[Tensor | None] = [None] * len(active)
        for (s, _, r, dtype, device), idx in batches.items():
            sketch = None
            if qr == "rcqr":  # fresh sketch per step, reproducible on resume and on every rank
                step = self.state[active[idx[0]]]["step"]
                gen = torch.Generator(device=device).manual_seed(group["seed"] * 1_000_003 + step)
                sketch = rcqr_sketch(len(idx), s, r, gen, device, dtype)
            subs: dict[tuple, list[int]] = defaultdict(list)
            for j, i in enumerate(idx):
                subs[self._batch_key(active[i])].append(j)
            for js in subs.values():
                ps = [active[idx[j]] for j in js]
                sk = None if sketch is None else sketch[js]
                for j, o in zip(js, self._step_batch(ps, mu, qr, dtype, sk)):
                    outs[idx[j]] = o
        params = [to_local(p) for p in active]
        scales = [C.update_scale(*p.shape, group["tau"]) for p in active]
        C.apply_protocol(params, params, outs, scales, group["lr"], group["weight_decay"])
        for p in active:
            self.state[p]["step"] += 1

    def _step_batch(self, ps: list[Tensor], mu: float, qr: str, dtype: torch.dtype,
                    sketch: Tensor | None) -> list[Tensor]:
        """One Dion step on matrices of one shape and layout; returns each local raw update."""
        split = self._plans[ps[0]]
        gather = isinstance(split, str)
        # Whole matrices may mix orientations (equal oriented shapes); a split sub-batch has one.
        talls = [p.shape[0] > p.shape[1] for p in ps]
        bs = []
        for p, tall in zip(ps, talls):
            b = to_local(self.state[p]["momentum"]).to(dtype) + to_local(p.grad).to(dtype)
            if gather:
                b = C.gather_full(b, p)
            bs.append(b.mT if tall else b)
        qs = [to_local(self.state[p]["Q"]) for p in ps]
        shards = OrientedSplit(split, talls[0]) if split is not None and not gather else None
        o, m_new, q_new = dion_step(torch.stack(bs), torch.stack(qs), mu, qr, shards=shards, sketch=sketch)
        outs = []
        for j, (p, tall) in enumerate(zip(ps, talls)):
            st = self.state[p]
            to_local(st["Q"]).copy_(q_new[j])
            mj, oj = (m_new[j].mT, o[j].mT) if tall else (m_new[j], o[j])
            if gather:
                mj, oj = C.local_slice(mj, p), C.local_slice(oj, p)
            to_local(st["momentum"]).copy_(mj)
            outs.append(oj)
        return outs
