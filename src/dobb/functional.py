"""Dobb's math as pure functions on plain tensors (never DTensors, never optimizer state).

Storage convention for one matrix's blocks ("row-stacked"): the ``B`` square blocks of a
block-diagonal ``k x k`` matrix over an axis of length ``k`` are stored as one ``(k, s_max)`` tensor
whose rows ``[start_b, start_b + s_b)`` hold block ``b`` in columns ``[:s_b]``. It costs ``k^2 / B``
entries (the paper's ``n^2 / B``, Table 18), it is a zero-copy view ``(B, s, s)`` when blocks are
equal, and it shards along dim 0 exactly like the blocked axis of the weight, so a distributed
checkpoint reshards it with the weight.

Blocks are contiguous. ``block_sizes`` defines the partition: the axis is cut at its shard
boundaries first (so no block straddles two shards), then every non-empty shard is split into the
same number of nearly equal blocks (``torch.tensor_split`` sizes: the first ``s % k`` blocks are one
longer).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

__all__ = [
    "block_sizes",
    "valid_block_counts",
    "BlockRun",
    "block_runs",
    "block_view",
    "identity_blocks",
    "second_moment_blocks",
    "qr_householder",
    "qr_cholesky",
    "orthogonal_iteration",
    "eigh_basis",
    "normalize_l2",
    "block_direction",
    "direction_input",
    "direction",
    "update_scale",
    "matmul_dtype",
    "block_coefficients",
]


# ----------------------------------------------------------------------------- block partition
def _split_sizes(size: int, parts: int) -> list[int]:
    q, r = divmod(size, parts)
    return [q + 1] * r + [q] * (parts - r)


def valid_block_counts(size: int, shard_sizes: Sequence[int] | None = None) -> list[int]:
    """All block counts ``B`` for which every block lies within one shard of the axis."""
    shards = [s for s in (shard_sizes or [size]) if s > 0]
    if not shards:
        return []
    return [len(shards) * k for k in range(1, min(shards) + 1)]


def block_sizes(size: int, blocks: int, shard_sizes: Sequence[int] | None = None) -> list[int]:
    """Sizes of the ``blocks`` contiguous blocks of an axis of length ``size``.

    ``shard_sizes`` (the lengths of the axis' shards, in order, empty shards allowed) forces every
    block to lie within one shard: each non-empty shard gets ``blocks / n_nonempty`` blocks.
    """
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    if size < 1:
        raise ValueError(f"cannot partition an axis of length {size}")
    if shard_sizes is None:
        shard_sizes = [size]
    if sum(shard_sizes) != size:
        raise ValueError(f"shard sizes {list(shard_sizes)} do not add up to the axis length {size}")
    shards = [s for s in shard_sizes if s > 0]
    per, rem = divmod(blocks, len(shards))
    if rem or per > min(shards):
        if len(shards) == 1:
            raise ValueError(f"blocks={blocks} is larger than the axis length {size}")
        valid = valid_block_counts(size, shard_sizes)
        shown = ", ".join(map(str, valid[:8])) + (", ..." if len(valid) > 8 else "")
        raise ValueError(
            f"blocks={blocks} cannot keep every block within one shard of an axis of length {size} "
            f"sharded as {list(shard_sizes)}; valid block counts: {shown}"
        )
    return [b for s in shards for b in _split_sizes(s, per)]


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
    """``(count, size, size)`` view of a run inside a row-stacked ``(k, s_max)`` tensor."""
    return stacked[run.start : run.stop, : run.size].reshape(run.count, run.size, run.size)


def identity_blocks(sizes: Sequence[int], dtype=torch.float32, device=None) -> Tensor:
    """Row-stacked identity bases for the given block sizes."""
    out = torch.zeros(sum(sizes), max(sizes), dtype=dtype, device=device)
    for run in block_runs(sizes):
        block_view(out, run).copy_(torch.eye(run.size, dtype=dtype, device=device).expand(run.count, -1, -1))
    return out


# ----------------------------------------------------------------------------- statistics
def second_moment_blocks(x: Tensor, sizes: Sequence[int], dtype=torch.float32) -> tuple[Tensor, int]:
    """Unnormalized diagonal blocks of ``sum_i x_i x_i^T`` over the rows of ``x`` (``(..., k)``).

    Returns the row-stacked ``(k, s_max)`` sums and the number of rows ``N``; the second moment is
    ``sums / N``. Only the diagonal blocks are formed: ``k^2 / B`` work per row, not ``k^2``.
    Computed in ``dtype`` even inside an autocast region (capture hooks run in the model's
    forward, where autocast would turn the ``bmm`` into a bf16 product).
    """
    k = sum(sizes)
    x = x.reshape(-1, k).to(dtype)
    out = x.new_zeros(k, max(sizes))
    with torch.autocast(device_type=x.device.type, enabled=False):
        for run in block_runs(sizes):
            xs = x[:, run.start : run.stop].reshape(-1, run.count, run.size).transpose(0, 1)
            block_view(out, run).copy_(torch.bmm(xs.transpose(1, 2), xs))
    return out, x.shape[0]


# ----------------------------------------------------------------------------- QR and bases
def qr_householder(p: Tensor) -> Tensor:
    """Orthonormal factor of a batch of square matrices (LAPACK Householder QR)."""
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


# ----------------------------------------------------------------------------- the direction
def normalize_l2(c: Tensor, col_sq_norms: Tensor | None = None, eps: float = 1e-30) -> Tensor:
    """Dobb-ell2: every coefficient column scaled to unit ell2 norm (zero columns stay zero).

    ``col_sq_norms`` lets a caller pass column norms summed over row shards (``O(n)`` entries).
    """
    if col_sq_norms is None:
        col_sq_norms = c.square().sum(dim=-2)
    return c * torch.rsqrt(col_sq_norms.clamp_min(eps)).unsqueeze(-2)


def block_direction(ub: Tensor, q: Tensor, norm: str = "sign", col_sq_sum=None) -> Tensor:
    """Project, normalize, reconstruct a batch of blocks: ``normalize(U_b Q_b) Q_b^T``.

    ``ub`` is ``(batch, rows, s)``, ``q`` the bases ``(batch, s, s)``, both in the compute dtype.
    Sign normalization is returned unscaled (``sign(C) Q^T``): callers fold ``1/sqrt(rows)`` into
    the step size, so no update-sized temporary is scaled. ell2 column norms are taken in fp32 at
    least; ``col_sq_sum`` (optional) sums the squared norms over the ranks holding other rows.
    """
    return torch.bmm(block_coefficients(ub, q, norm, col_sq_sum), q.transpose(1, 2))


def block_coefficients(ub: Tensor, q: Tensor, norm: str = "sign", col_sq_sum=None) -> Tensor:
    """The normalized coefficients ``normalize(U_b Q_b)`` of ``block_direction`` (same arguments),
    for callers that fuse the reconstruction ``C_b Q_b^T`` into their update (``baddbmm``)."""
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
    ``||O||_F^2 = n`` when no coefficient is zero (Table 9).
    """
    m = u.shape[0]
    scale = 1.0 / math.sqrt(m if rows is None else rows) if norm == "sign" else 1.0
    out = torch.empty_like(u)
    for run in block_runs(sizes):
        ub = u[:, run.start : run.stop].reshape(m, run.count, run.size).transpose(0, 1)
        o = block_direction(ub, block_view(basis, run).to(u.dtype), norm)
        out[:, run.start : run.stop] = o.transpose(0, 1).reshape(m, run.count * run.size) * scale
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
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return True


PRODUCT_DTYPES = ("auto", torch.float32, torch.bfloat16, torch.float16, torch.float64)


def matmul_dtype(dtype: torch.dtype, device: torch.device, product: "str | torch.dtype" = "auto") -> torch.dtype:
    """The dtype the projection products run in (``product_dtype`` of a Dobb group).

    ``product`` a dtype: that dtype, on every device (so a test or a user can force either path on
    any host). ``"auto"``: the basis dtype on accelerators; fp32 on every CPU for a sub-fp32 basis.
    On a CPU without native bf16 (AMD EPYC here) torch's bf16 products are a scalar loop 20-50x
    slower than fp32 (``docs/timing.md``); on a CPU with AVX512-BF16/AMX the main job's training loop
    was still faster with fp32 products (issue 20's report: Dobb B=16 3.53 ms/step with an fp32 basis
    against 4.88 ms with bf16 products, Intel Xeon), since at these block sizes the bf16 casts cost
    more than the products save. One CPU rule also gives every host the numerics of the committed
    records. The stored basis, and so Table 18's memory, is unchanged.
    """
    if product != "auto":
        return product
    if dtype.itemsize < 4 and torch.device(device).type == "cpu":
        return torch.float32
    return dtype
