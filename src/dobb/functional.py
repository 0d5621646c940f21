"""Dobb's math as pure functions on plain tensors (never DTensors, never optimizer state).

Storage convention for one matrix's blocks ("row-stacked"): the ``B`` square blocks of a
block-diagonal ``k x k`` matrix over an axis of length ``k`` are stored as one ``(k, s_max)`` tensor
whose rows ``[start_b, start_b + s_b)`` hold block ``b`` in columns ``[:s_b]``. It costs ``k^2 / B``
entries (the paper's ``n^2 / B``, Table 18), it is a zero-copy view ``(B, s, s)`` when blocks are
equal, and it shards along dim 0 exactly like the blocked axis of the weight, so a distributed
checkpoint reshards it with the weight.

Blocks are contiguous. ``block_sizes`` (``dobb.partition``, re-exported here) defines the partition:
the axis is cut at its shard boundaries first (so no block straddles two shards), then every
non-empty shard is split into the same number of nearly equal blocks (``torch.tensor_split``
sizes: the first ``s % k`` blocks are one longer).

The step's kernels take *stacks* of matrices with the same blocks: weights and updates ``(E, r, k)``,
block state ``(E, k, s_max)`` (``stack_block_view``); a 2-D matrix is the stack of one (``E = 1``,
for which every block of a run stays a strided view of the matrix, no copy). In the step's order:
``gram_blocks`` (statistic), ``fold_statistic_`` (EMA), ``refresh_bases`` (the batched basis
solve), ``add_directions_`` (direction and update; ``direction`` is it on a zero matrix), and for
two-sided Dobb (``side="both"``) ``two_sided_update_`` (``rotate``/``unrotate`` over both axes'
block-diagonal bases, ``blockwise``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from ._torch_private import mkldnn_native
from .partition import block_sizes, valid_block_counts  # noqa: F401 (the partition, re-exported)

__all__ = [
    "block_sizes", "valid_block_counts", "BlockRun", "block_runs", "block_view", "identity_blocks",
    "stack_block_view", "second_moment_blocks", "gram_blocks", "fold_statistic_", "refresh_bases",
    "qr_householder", "qr_cholesky", "orthogonal_iteration", "eigh_basis", "normalize_l2", "Blocks",
    "add_directions_", "direction_input", "direction", "update_scale", "matmul_dtype", "cpu_native",
    "block_coefficients", "BlockBasis", "blockwise", "rotate", "unrotate", "adam_direction", "block_pair_rms_",
    "two_sided_update_",
]


# ----------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class BlockRun:
    """A maximal run of ``count`` consecutive blocks of equal ``size`` starting at ``start``."""

    start: int
    count: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.count * self.size


def block_runs(sizes: Sequence[int]) -> list[BlockRun]:
    """Group consecutive equal-size blocks, so each run is processed as one batch."""
    return list(_block_runs(tuple(sizes)))


@lru_cache(maxsize=4096)
def _block_runs(sizes: tuple[int, ...]) -> tuple[BlockRun, ...]:
    # cached: the optimizer asks for every matrix's runs on every step
    runs: list[BlockRun] = []
    start = 0
    for s in sizes:
        if runs and runs[-1].size == s and runs[-1].stop == start:
            last = runs[-1]
            runs[-1] = BlockRun(last.start, last.count + 1, s)
        else:
            runs.append(BlockRun(start, 1, s))
        start += s
    return tuple(runs)


def block_view(stacked: Tensor, run: BlockRun) -> Tensor:
    """``(count, size, size)`` view of a run inside a row-stacked ``(..., k, s_max)`` tensor."""
    return stacked[..., run.start : run.stop, : run.size].unflatten(-2, (run.count, run.size))


def identity_blocks(sizes: Sequence[int], dtype=torch.float32, device=None) -> Tensor:
    """Row-stacked identity bases for the given block sizes."""
    out = torch.zeros(sum(sizes), max(sizes), dtype=dtype, device=device)
    for run in block_runs(sizes):
        block_view(out, run).copy_(torch.eye(run.size, dtype=dtype, device=device).expand(run.count, -1, -1))
    return out


def stack_block_view(stacked: Tensor, run: BlockRun) -> Tensor:
    """``(E, count, size, size)`` view of a run inside a stack ``(E, k, s_max)`` of row-stacked blocks."""
    return stacked[:, run.start : run.stop, : run.size].reshape(stacked.shape[0], run.count, run.size, run.size)


# ----------------------------------------------------------------------------- statistics
def gram_blocks(x: Tensor, sizes: Sequence[int], dtype=torch.float32) -> Tensor:
    """Unnormalized diagonal blocks of ``X_e^T X_e`` for a stack ``x`` of ``E`` matrices ``(E, r, k)``:
    ``(E, k, s_max)`` row-stacked sums, every run of equal blocks of every matrix in one ``bmm``.

    Only the diagonal blocks are formed: ``k^2 / B`` work per row, not ``k^2``. Computed in
    ``dtype`` even inside an autocast region (capture hooks run in the model's forward, where
    autocast would turn the ``bmm`` into a bf16 product). For ``E = 1`` every block of a run is a
    strided view of ``x`` (no copy); wider stacks copy each run once to batch all their blocks.
    """
    E, r, k = x.shape
    x = x.to(dtype)
    out = x.new_zeros(E, k, max(sizes))
    with torch.autocast(device_type=x.device.type, enabled=False):
        for run in block_runs(sizes):
            c, s = run.count, run.size
            xs = x[:, :, run.start : run.stop].reshape(E, r, c, s).transpose(1, 2).reshape(E * c, r, s)
            out[:, run.start : run.stop, :s].view(E, c, s, s).copy_(torch.bmm(xs.transpose(1, 2), xs).view(E, c, s, s))
    return out


def second_moment_blocks(x: Tensor, sizes: Sequence[int], dtype=torch.float32) -> tuple[Tensor, int]:
    """Unnormalized diagonal blocks of ``sum_i x_i x_i^T`` over the rows of ``x`` (``(..., k)``).

    Returns the row-stacked ``(k, s_max)`` sums and the number of rows ``N``; the second moment is
    ``sums / N`` (``gram_blocks`` of the rows as one matrix).
    """
    k = sum(sizes)
    x = x.reshape(1, -1, k)
    return gram_blocks(x, sizes, dtype)[0], x.shape[1]


def fold_statistic_(stat: Tensor, new: Tensor, first: Sequence[bool], chosen: Sequence[int], decay: float,
                    keep: Tensor | None = None) -> None:
    """Fold new statistics into a stack of EMAs ``stat`` ``(E, k, s)``, in place: matrix ``e`` of
    ``chosen`` takes ``new[e]`` on its ``first`` capture, else ``A <- decay A + (1 - decay) A_new``;
    the others keep theirs. ``keep`` (optional, bool ``(E,)`` on the device): matrices whose flag
    is False keep their statistic whatever ``chosen`` says (decided without a host read)."""
    E = stat.shape[0]
    if not chosen:
        return
    new = new.to(stat.dtype)
    if keep is None and len(chosen) == E and not any(first):
        stat.lerp_(new, 1.0 - decay)  # the common case: one pass, no temporary
        return
    if all(first):
        merged = new
    elif not any(first):
        merged = stat.lerp(new, 1.0 - decay)
    else:
        merged = torch.where(torch.tensor(list(first), device=stat.device).view(-1, 1, 1), new,
                             stat.lerp(new, 1.0 - decay))
    if keep is not None:
        merged = torch.where(keep.view(-1, 1, 1), merged, stat)
    if len(chosen) == E:
        stat.copy_(merged)
    else:
        idx = torch.tensor(list(chosen), device=stat.device)
        stat.index_copy_(0, idx, merged.index_select(0, idx))


# ----------------------------------------------------------------------------- QR and bases
def qr_householder(p: Tensor) -> Tensor:
    """Orthonormal factor of a batch of square matrices (LAPACK Householder QR).

    On CPU ``Q`` is formed from ``geqrf``'s reflectors directly: the LAPACK calls of ``linalg.qr``
    (bitwise the same ``Q``) without the triangular ``R`` it also builds and a refresh never reads
    (what that saves: docs/timing.md, "A refresh that scales"). Elsewhere ``linalg.qr``.
    """
    if p.device.type == "cpu":
        return torch.linalg.householder_product(*torch.geqrf(p))
    return torch.linalg.qr(p).Q


def qr_cholesky(p: Tensor, rtol: float = 1e-3) -> tuple[Tensor, Tensor]:
    """Cholesky QR: ``R = chol(P^T P)``, ``Q = P R^{-1}``. Returns ``(Q, ok)``.

    ``ok[i]`` is False where the factorization failed or ``P`` is too ill-conditioned for it
    (smallest diagonal of ``R`` below ``rtol`` times the largest): Cholesky QR squares the
    condition number, so those entries must be redone by Householder (see ``orthogonal_iteration``).
    """
    gram = p.transpose(-1, -2) @ p
    r, info = torch.linalg.cholesky_ex(gram, upper=True)
    diag = r.diagonal(dim1=-2, dim2=-1)
    ok = (info == 0) & (diag.amin(-1) > rtol * diag.amax(-1)) & torch.isfinite(diag).all(-1)
    # Solve with a safe R where the factorization failed, so no NaN leaks into ``q``.
    eye = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
    r_safe = torch.where(ok[..., None, None], r, eye)
    q = torch.linalg.solve_triangular(r_safe, p, upper=True, left=False)
    return q, ok


def orthogonal_iteration(a: Tensor, q: Tensor, steps: int = 1, qr: str = "householder") -> Tensor:
    """``steps`` rounds of ``Q <- qr(A Q)`` on a batch ``(b, s, s)``, in ``a``'s dtype.

    With ``qr="cholesky"`` the entries where Cholesky QR fails (dead units, rank-deficient blocks)
    are redone by Householder. Deciding whether any failed is the one host synchronisation of a
    refresh; Householder QR never needs it.
    """
    q = q.to(a.dtype)
    for _ in range(steps):
        p = a @ q
        if qr == "householder":
            q = qr_householder(p)
        elif qr == "cholesky":
            qc, ok = qr_cholesky(p)
            if bool(ok.all()):
                q = qc
            else:
                q = torch.where(ok[:, None, None], qc, qr_householder(p))
        else:
            raise ValueError(f"qr must be 'householder' or 'cholesky', got {qr!r}")
    return q


def eigh_basis(a: Tensor) -> Tensor:
    """Exact eigenvectors of a batch of symmetric matrices, columns by *descending* eigenvalue.

    The order matters for the warm-started orthogonal iteration that follows: ``qr(A Q)`` keeps
    column ``j`` in the span of the first ``j`` columns of ``A Q``, so it is stable only when the
    columns already run from the largest eigenvalue down. With ``eigh``'s ascending order a single
    ``qr(A Q)`` step mixes the leading eigenvectors into every column and scrambles the basis.
    """
    a = 0.5 * (a + a.transpose(-1, -2))
    return torch.linalg.eigh(a).eigenvectors.flip(-1)


def refresh_bases(blocks: Sequence[tuple[Tensor, Tensor, bool]], ortho_steps: int = 1,
                  qr: str = "householder") -> list[Tensor]:
    """The basis refresh of a list of block batches: for each ``(A, Q0, exact)`` (``(b, s, s)``
    statistic and current basis blocks), new bases ``(b, s, s)``: ``eigh_basis(A)`` when ``exact``,
    else ``orthogonal_iteration(A, Q0, ortho_steps, qr)``. Entries of equal block size and rule are
    solved in one batched call (in fp32 at least); the results come back in the order given."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (a, _, exact) in enumerate(blocks):
        groups.setdefault((a.shape[-1], exact), []).append(i)
    out: list[Tensor] = [None] * len(blocks)  # type: ignore[list-item]
    for (_, exact), idx in groups.items():
        a = torch.cat([blocks[i][0] for i in idx])
        a = a.to(torch.promote_types(a.dtype, torch.float32))
        if exact:
            q = eigh_basis(a)
        else:
            q = orthogonal_iteration(a, torch.cat([blocks[i][1] for i in idx]), ortho_steps, qr)
        for i, q_i in zip(idx, q.split([blocks[i][0].shape[0] for i in idx])):
            out[i] = q_i
    return out


# ----------------------------------------------------------------------------- the direction
def normalize_l2(c: Tensor, col_sq_norms: Tensor | None = None, eps: float = 1e-30) -> Tensor:
    """Dobb-ell2: every coefficient column scaled to unit ell2 norm (zero columns stay zero).

    ``col_sq_norms`` lets a caller pass column norms summed over row shards (``O(n)`` entries).
    """
    if col_sq_norms is None:
        col_sq_norms = c.square().sum(dim=-2)
    return c * torch.rsqrt(col_sq_norms.clamp_min(eps)).unsqueeze(-2)


def block_coefficients(ub: Tensor, q: Tensor, norm: str = "sign", col_sq_sum=None) -> Tensor:
    """The normalized coefficients ``normalize(U_b Q_b)`` of a batch of blocks; callers fuse the
    reconstruction ``C_b Q_b^T`` into their update (``baddbmm``).

    ``ub`` is ``(batch, rows, s)``, ``q`` the bases ``(batch, s, s)``, both in the compute dtype.
    Sign normalization is returned unscaled: callers fold ``1/sqrt(rows)`` into the step size, so no
    update-sized temporary is scaled. ell2 column norms are taken in fp32 at least; ``col_sq_sum``
    (optional) sums the squared norms over the ranks holding other rows.
    """
    c = torch.bmm(ub, q)
    if norm == "sign":
        c.sign_()
    elif norm == "l2":
        cf = c.to(torch.promote_types(c.dtype, torch.float32))
        sq = cf.square().sum(dim=-2)
        c = normalize_l2(cf, sq if col_sq_sum is None else col_sq_sum(sq)).to(c.dtype)
    else:
        raise ValueError(f"norm must be 'sign' or 'l2', got {norm!r}")
    return c


# CPU: blocks up to this size, sign-normalized, take the transposed products in ``add_directions_``
SMALL_BLOCK = 16


class Blocks(NamedTuple):
    """One run of equal blocks of one stack of matrices, the unit of ``add_directions_``."""

    w: Tensor
    u: Tensor
    q: Tensor
    factor: float
    beta: float | None = None


def add_directions_(items: Sequence[Blocks], *, norm: str, dtype: torch.dtype, col_sq_sum=None) -> None:
    """``W_b <- beta W_b + factor * normalize(U_b Q_b) Q_b^T`` for a batch of equal blocks, in place.

    ``items``: one ``Blocks`` per stack of matrices: ``w`` and ``u`` ``(E, r, c * s)``
    (the weight and the update over one run of ``c`` blocks of size ``s`` of the blocked, last,
    axis; ``w`` may be a strided view of the weight), ``q`` their bases ``(E, c, s, s)``, ``beta`` the
    decay folded into the reconstruction or None (``w`` already decayed). The products run in
    ``dtype``; every item has the same ``r``, ``s``. Sign is returned unscaled: callers fold
    ``1/sqrt(rows)`` into ``factor``, so no update-sized temporary is scaled. ``col_sq_sum``
    (optional) sums the ell2 column norms over the ranks holding other rows.

    Three kernels, chosen by shape (``docs/timing.md``): a stack of one with sign and small blocks
    (``SMALL_BLOCK``) multiplies with the long row axis as the product's N (``C_b^T = Q_b^T U_b^T``:
    MKL's batched GEMM is much faster so at small ``s``); a stack of one with a ``beta`` writes
    ``W_b <- beta W_b + factor C_b Q_b^T`` as one ``baddbmm`` into the weight's strided view (one
    pass over ``W``); otherwise one ``bmm`` pair over all blocks of all items and a strided add.
    """
    w0, u0, q0, factor0, beta0 = items[0]
    E0, r, k = u0.shape
    size = q0.shape[-1]
    if len(items) == 1 and E0 == 1 and norm == "sign" and size <= SMALL_BLOCK and beta0 is None:
        count, factor = q0.shape[1], factor0
        q = q0[0].to(dtype)
        ct = torch.bmm(q.transpose(1, 2), u0[0].to(dtype).t().reshape(count, size, r)).sign_()
        w0[0].t().view(count, size, r).add_(torch.bmm(q, ct), alpha=factor)
        return
    counts = [it.q.shape[0] * it.q.shape[1] for it in items]
    if len(items) == 1:
        ub = u0.to(dtype).reshape(E0, r, q0.shape[1], size).transpose(1, 2).reshape(counts[0], r, size)
    else:  # every item's blocks converted into one buffer by one foreach copy (exact: the same values)
        ub = u0.new_empty(sum(counts), r, size, dtype=dtype)
        torch._foreach_copy_([b.view(*it.q.shape[:2], r, size) for b, it in zip(ub.split(counts), items)],
                             [it.u.unflatten(-1, (it.q.shape[1], size)).transpose(1, 2) for it in items])
    qs = [it.q.reshape(n, size, size) for it, n in zip(items, counts)]
    q = (qs[0] if len(items) == 1 else torch.cat(qs)).to(dtype)
    c = block_coefficients(ub, q, norm, col_sq_sum)
    if len(items) == 1 and E0 == 1 and beta0 is not None:  # W_b <- beta W_b + factor C_b Q_b^T, one pass
        w0[0].view(r, counts[0], size).transpose(0, 1).baddbmm_(c, q.transpose(1, 2), beta=beta0, alpha=factor0)
        return
    o = torch.bmm(c, q.transpose(1, 2))
    adds: dict = {}  # W_b += factor O_b: one foreach add per factor (equal shapes share one), bitwise add_
    for ob, it in zip(o.split(counts), items):
        E, cnt = it.q.shape[0], it.q.shape[1]
        adds.setdefault(it.factor, []).append((it.w.view(E, r, cnt, size), ob.view(E, cnt, r, size).transpose(1, 2)))
    for factor, pairs in adds.items():
        torch._foreach_add_(*map(list, zip(*pairs)), alpha=factor)


def direction_input(
    u: Tensor,
    basis: Tensor,
    sizes: Sequence[int],
    norm: str = "sign",
    rows: int | None = None,
) -> Tensor:
    """Raw update ``O`` for column blocks: ``O[:, b] = normalize(U[:, b] Q_b) Q_b^T``.

    ``u`` is ``m x n``, ``basis`` the row-stacked ``(n, s_max)`` bases. ``rows`` is the global row
    count used by sign normalization (differs from ``u.shape[0]`` when rows are sharded).
    ``||O||_F^2 = n`` when no coefficient is zero (Table 9). The optimizer's kernel
    (``add_directions_``) applied to a zero matrix, in ``u``'s dtype.
    """
    m = u.shape[0]
    scale = 1.0 / math.sqrt(m if rows is None else rows) if norm == "sign" else 1.0
    out = torch.zeros_like(u)
    u3, o3, b3 = u.unsqueeze(0), out.unsqueeze(0), basis.unsqueeze(0)
    for run in block_runs(sizes):
        cols = slice(run.start, run.stop)
        add_directions_([Blocks(o3[:, :, cols], u3[:, :, cols], stack_block_view(b3, run), scale)], norm=norm,
                        dtype=u.dtype)
    return out


def direction(u: Tensor, basis: Tensor, sizes: Sequence[int], norm: str = "sign", side: str = "input") -> Tensor:
    """Raw update for either side. The output side (Dobb-G) is the input side of ``U^T``:
    row blocks, ``C_b = Q_b^T U[b, :]``, sign scaled by ``1/sqrt(n)``, ell2 per coefficient row."""
    if side == "input":
        return direction_input(u, basis, sizes, norm)
    if side == "output":
        return direction_input(u.transpose(0, 1), basis, sizes, norm).transpose(0, 1)
    raise ValueError(f"side must be 'input' or 'output', got {side!r}")


def update_scale(m: int, n: int, tau: float = 0.2) -> float:
    """The shared update-scale protocol's ``s = tau * sqrt(max(m, n))`` (Table 9)."""
    return tau * math.sqrt(max(m, n))


@lru_cache(maxsize=None)
def cpu_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has native instructions for ``dtype`` products (AVX512-BF16/AMX for bf16,
    AVX512-FP16/AMX-FP16 for fp16), as oneDNN reports it. Records name it (``provenance``)."""
    if dtype in (torch.bfloat16, torch.float16):
        return mkldnn_native(dtype)
    return True


PRODUCT_DTYPES = ("auto", torch.float32, torch.bfloat16, torch.float16, torch.float64)


def matmul_dtype(dtype: torch.dtype, device: torch.device, product: "str | torch.dtype" = "auto") -> torch.dtype:
    """The dtype the projection products run in (``product_dtype`` of a Dobb group).

    ``product`` a dtype: that dtype, on every device (so a test or a user can force either path on
    any host). ``"auto"``: the basis dtype on accelerators; fp32 on every CPU for a sub-fp32 basis.
    On a CPU without native bf16 torch's bf16 products are a scalar loop; with AVX512-BF16/AMX,
    at these block sizes the casts to and from bf16 cost more than the products save (both
    measured in ``docs/timing.md``). One CPU rule also gives every host the numerics of the
    committed records. The stored basis, and so Table 18's memory, is unchanged.
    """
    if product != "auto":
        return product
    if dtype.itemsize < 4 and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


# ----------------------------------------------------------------------------- two-sided (side="both")
# Per matrix ``W`` (``m x n``, stored ``(out, in)``) with input-side bases ``Q_in_c`` (column blocks)
# and output-side bases ``Q_out_b`` (row blocks), the coefficients of block pair ``(b, c)`` are
# ``C_bc = Q_out_b^T U_bc Q_in_c``: with ``Q_in``/``Q_out`` the block-diagonal matrices of the bases
# that is ``C = Q_out^T U Q_in``, two one-sided projections, each batched over the runs of equal
# blocks of its axis (``bmm``), never a dense ``m x m`` or ``n x n``. The direction is
# ``O = Q_out D Q_in^T / sqrt(m)`` with
#
# - ``norm="sign"``: ``D = sign(C)``. The ``1/sqrt(m)`` is one-sided Dobb's, so ``||O||_F^2 = n`` (no
#   zero coefficient) and the shared protocol's ``tau * sqrt(max(m, n))`` applies unchanged;
# - ``norm="adam"`` (SOAP's rule in Dobb's bases): ``V <- beta2 V + (1 - beta2) (Q_out^T G Q_in)^2``
#   (the rotated *gradient*), ``R = C_hat / (sqrt(V_hat) + eps)`` with both bias corrections
#   (``C_hat = C / (1 - mu^t)``: the momentum is kept in EMA form; ``V_hat = V / (1 - beta2^t)``), and
#   ``D_bc = R_bc / rms(R_bc)`` per block pair: every block pair gets sign's RMS of 1, so the shared
#   protocol's scale means the same step size. Why: ``R`` alone has ``|R_ij| <= 1`` (Cauchy-Schwarz on
#   the two EMAs when ``beta2 = momentum``) and an RMS far below 1 on noisy gradients, so an unscaled
#   ``R`` takes much smaller steps than sign (docs/results.md, "Two-sided Dobb"). The rescale is per
#   block pair, which is always whole on one rank, so it stays shard-local with no collective. Over a
#   basis refresh ``V`` is carried unchanged, as SOAP does: the warm-started orthogonal iteration keeps
#   column ``j`` near the previous ``j``-th eigenvector, so ``V_ij`` keeps describing the same coefficient.
class BlockBasis(NamedTuple):
    """The block-diagonal basis of one axis: row-stacked blocks ``(k, s_max)`` (``functional``) and their sizes."""

    basis: Tensor
    sizes: Sequence[int]


def blockwise(x: Tensor, basis: Tensor, sizes: Sequence[int], transpose: bool = False) -> Tensor:
    """``x @ blockdiag(Q_c)`` (or ``Q_c^T``) over the last axis of ``x`` (``(..., r, k)``), one
    batched product per run of equal blocks. ``basis`` is row-stacked ``(k, s_max)`` (``functional``)."""
    out = torch.empty_like(x)
    for run in block_runs(sizes):
        q = block_view(basis, run).to(x.dtype)
        if transpose:
            q = q.transpose(-1, -2)
        xs = x[..., run.start : run.stop].unflatten(-1, (run.count, run.size)).transpose(-3, -2)
        out[..., run.start : run.stop].unflatten(-1, (run.count, run.size)).transpose(-3, -2).copy_(torch.matmul(xs, q))
    return out


def rotate(u: Tensor, rows: BlockBasis, cols: BlockBasis) -> Tensor:
    """``C = Q_rows^T U Q_cols`` for block-diagonal bases;
    ``u`` may carry leading batch dims (``(..., r, k)``)."""
    y = blockwise(u, *cols)
    return blockwise(y.transpose(-1, -2), *rows).transpose(-1, -2)


def unrotate(d: Tensor, rows: BlockBasis, cols: BlockBasis) -> Tensor:
    """``O = Q_rows D Q_cols^T`` (the inverse of ``rotate``)."""
    z = blockwise(d, *cols, transpose=True)
    return blockwise(z.transpose(-1, -2), *rows, transpose=True).transpose(-1, -2)


def adam_direction(c: Tensor, v: Tensor, *, step: int, momentum: float, beta2: float, eps: float) -> Tensor:
    """SOAP's element-wise rule on rotated coefficients: ``(c / (1 - mu^t)) / (sqrt(v / (1 - b2^t)) + eps)``
    (``c``: the rotated EMA momentum, ``v``: the EMA of the squared rotated gradient, ``t = step``)."""
    denom = (v / (1.0 - beta2**step)).sqrt_().add_(eps)
    return c.div(1.0 - momentum**step).div_(denom)


def block_pair_rms_(d: Tensor, row_sizes: Sequence[int], col_sizes: Sequence[int], tiny: float = 1e-30) -> Tensor:
    """Scale every block pair ``d[b, c]`` of ``d`` (``(r, k)``) to an RMS of 1, in place (an all-zero
    block stays zero); one reduction per pair of runs of equal blocks."""
    for rr in block_runs(row_sizes):
        for cr in block_runs(col_sizes):
            v = d[..., rr.start : rr.stop, cr.start : cr.stop].unflatten(-2, (rr.count, rr.size)).unflatten(-1, (cr.count, cr.size))
            ms = v.square().mean(dim=(-3, -1), keepdim=True)
            v.mul_(ms.clamp_min_(tiny).rsqrt_())
    return d


def two_sided_update_(*, w: Tensor, u: Tensor, g: Tensor, rows: BlockBasis, cols: BlockBasis, factor: float,
                      dtype: torch.dtype, norm: str = "sign", v: Tensor | None = None, step: int = 1,
                      momentum: float = 0.0, beta2: float = 0.95, eps: float = 1e-8) -> None:
    """``W += factor * Q_rows D Q_cols^T`` for one matrix (``w``, ``u`` the momentum, ``g`` the gradient,
    all oriented ``(rows axis, cols axis)``), products in ``dtype``. ``norm="adam"`` also updates
    ``v`` (the EMA of the squared rotated gradient, in its own dtype, fp32 at least) in place and
    takes ``step`` (1-based) for the bias corrections. ``factor`` carries sign's ``1/sqrt(m)``."""
    if norm == "sign":
        d = rotate(u.to(dtype), rows, cols).sign_()
    else:  # rotate the momentum and the gradient in one pass; V and the ratio in fp32 at least
        c, gr = rotate(torch.stack([u, g]).to(dtype), rows, cols).unbind(0)
        gr = gr.to(v.dtype)
        v.mul_(beta2).addcmul_(gr, gr, value=1.0 - beta2)
        d = adam_direction(c.to(v.dtype), v, step=step, momentum=momentum, beta2=beta2, eps=eps)
        d = block_pair_rms_(d, rows.sizes, cols.sizes).to(dtype)
    o = unrotate(d, rows, cols)
    o.mul_(factor)
    w.add_(o.to(w.dtype))
