"""Fused matrices cut along functional boundaries before orthogonalizing (CMuon): the option and
the tiles (the family's tiled update, ``tiled_directions``, is in ``muon``).

``heads`` (the one head option of the package, Dobb's too: ``dobb.attention_heads``) cuts every attention
q/k/v matrix, found by its parameter name (fused ``c_attn``/``qkv`` or separate ``q_proj``, ...; a
Hugging Face ``Conv1D`` weight read as its logical ``(out, in)`` matrix), into its per-head row
blocks: ``m / d_head`` parts of ``d_head = n / heads`` rows; the other matrices follow
``split_sizes``. ``num_heads`` is its deprecated former name with the former meaning (below).

``split_sizes`` names the row (output) sizes of the parts of a fused weight: ``(d, d, d)`` for a
fused Q/K/V projection ``(3d, d)``; ``"qkv"`` means three equal parts of every matrix whose row
count is three times its column count (the fused QKV of a width-``d`` model, and no MLP matrix).
A matrix is split only when its row count equals ``sum(split_sizes)`` (for ``"qkv"``: ``m == 3n``);
every other matrix of the group is left whole, so one hyperparameter can be given to a whole
model. ``num_heads`` then cuts every part into that many equal row blocks (one per head); with no
``split_sizes`` it cuts every matrix of the group, so give it per param group (e.g. to q, k, v).

Each tile is a matrix of its own: NS5 of its momentum and the shared protocol's scale of its own
shape, ``tau*sqrt(max(m_t, n))``, exactly as if the parts were separate ``nn.Linear`` layers.
Momentum stays one buffer per weight: it is element-wise, so a tile's slice of it *is* the tile's
own momentum (CMuon's "independent momentum per chunk" needs nothing more).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..._hparams import Rule, integer, option, optional

WHOLE = (slice(None), slice(None))
Tile = tuple[slice, slice]


def _split_sizes_ok(sizes) -> bool:
    return sizes is None or sizes == "qkv" or (
        isinstance(sizes, (list, tuple)) and len(sizes) >= 1
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes))


@dataclass(frozen=True, kw_only=True)
class SplitOptions:
    """The fused-weight split (CMuon) of the classes that take it (``None``: every matrix whole)."""
    split_sizes: str | tuple[int, ...] | None = option(None, Rule(
        _split_sizes_ok, "be None, 'qkv' or a sequence of positive integers (the row sizes of a fused weight's parts)"))
    heads: int | None = option(None, optional(integer(1)).hint("attention heads: per-head blocks"))
    # deprecated (DeprecationWarning at construction): cuts every matrix of its group
    num_heads: int | None = option(None, optional(integer(1)))


def row_parts(shape: Sequence[int], split_sizes, num_heads) -> list[int] | None:
    """Row sizes of the tiles of an ``m x n`` matrix, or ``None`` when it stays whole.

    Raises ``ValueError`` when ``num_heads`` does not divide a part the matrix is cut into.
    """
    m, n = shape
    if split_sizes is None:
        parts = [m] if num_heads is not None else None
    elif split_sizes == "qkv":
        parts = [n, n, n] if m == 3 * n else None
    else:
        parts = list(split_sizes) if sum(split_sizes) == m else None
    if parts is None:
        return None
    if num_heads is not None:
        bad = [p for p in parts if p % num_heads]
        if bad:
            raise ValueError(f"num_heads={num_heads} must divide every part of a split {m} x {n} matrix; "
                             f"parts {parts} (split_sizes={split_sizes!r})")
        parts = [p // num_heads for p in parts for _ in range(num_heads)]
    return parts if len(parts) > 1 else None


def row_tiles(parts: list[int] | None) -> list[Tile]:
    if parts is None:
        return [WHOLE]
    tiles, start = [], 0
    for p in parts:
        tiles.append((slice(start, start + p), slice(None)))
        start += p
    return tiles
