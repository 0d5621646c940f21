"""Head-aligned blocks (``heads``, issue 40): attention matrices blocked per head, others as the group says.

With ``heads = H`` a matrix is recognised by its parameter name (the module path of its layer):

- **query / key / value** (a fused ``qkv``, ``c_attn``, ``query_key_value``, ``Wqkv`` or ``in_proj``
  (``nn.MultiheadAttention``'s ``in_proj_weight`` and ``q_proj_weight``... too), or
  separate ``q``, ``k``, ``v``, ``q_proj``, ``k_proj``, ``v_proj``, ``query``, ``key``, ``value``): its
  output side (rows) is cut into ``m / d_head`` blocks, ``d_head = n / H``: one block per head of each
  of q, k and v (fewer key/value heads, as in grouped-query attention, follow from ``m``);
- **the output projection** (``o_proj``, ``out_proj``, or ``proj``, ``c_proj``, ``o``, ``out``,
  ``dense`` inside a module whose name contains ``attn`` or ``attention``): its input side (columns)
  is cut into ``H`` blocks, one per head;
- every other matrix (the MLP, the LM head) keeps the group's ``blocks`` / ``out_blocks`` (equal cuts).

Which side is which: ``blocks`` is Dobb's input side, ``out_blocks`` the output side of
``side="both"`` or the Newton-Schulz row blocks of ``norm="muon"``; a one-sided Dobb (``side="input"``,
sign or l2) takes only the output projection's per-head input blocks. A width that ``H`` does not
divide is a ``ValueError`` naming the matrix.
"""
from __future__ import annotations

__all__ = ["QKV_NAMES", "OUT_NAMES", "role", "head_blocks"]

QKV_NAMES = ("qkv", "c_attn", "query_key_value", "wqkv", "in_proj", "q", "k", "v", "q_proj", "k_proj", "v_proj",
             "query", "key", "value")
OUT_NAMES = ("o_proj", "out_proj")
OUT_IN_ATTENTION = ("proj", "c_proj", "o", "out", "dense")


def role(name: str | None) -> str | None:
    """``"qkv"``, ``"out"`` or None (not an attention matrix) for a parameter name such as
    ``blocks.0.attn.qkv.weight``."""
    if not name:
        return None
    parts = name.lower().split(".")
    if parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    elif parts[-1].endswith("_weight"):  # nn.MultiheadAttention's in_proj_weight, q_proj_weight, ...
        parts[-1] = parts[-1].removesuffix("_weight")
    if not parts:
        return None
    leaf, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
    in_attention = "attn" in parent or "attention" in parent
    if leaf in QKV_NAMES:
        return "qkv"
    if leaf in OUT_NAMES or (leaf in OUT_IN_ATTENTION and in_attention):
        return "out"
    return None


def head_blocks(name: str | None, shape: tuple[int, int], heads: int | None, blocks: int,
                out_blocks: int) -> tuple[int, int]:
    """``(blocks, out_blocks)`` of one ``m x n`` matrix (``shape``, as ``nn.Linear`` stores it) with
    ``heads`` (None: the group's own counts)."""
    if heads is None:
        return blocks, out_blocks
    kind = role(name)
    m, n = shape
    if kind is None:
        return blocks, out_blocks
    if n % heads:
        raise ValueError(f"{name}: heads={heads} must divide the attention width {n} (columns of {m} x {n})")
    d_head = n // heads
    if kind == "out":
        return heads, out_blocks
    if m % d_head:
        raise ValueError(f"{name}: its {m} rows are not a whole number of heads of width {d_head} "
                         f"(heads={heads}, {n} columns)")
    return blocks, m // d_head
