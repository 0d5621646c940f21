"""Head-aligned blocks (``heads``, issues 40 and 53): attention matrices blocked per head, others as the group says.

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
divide is a ``ValueError`` with the matrix's stored and logical shapes (the caller names it once).
Shapes here are logical, ``(out, in)`` as ``nn.Linear`` stores them: a weight stored ``(in, out)``
(Hugging Face ``Conv1D``, GPT-2's ``c_attn``; a ``transposed=True`` group) is read transposed.
``heads`` on a model none of whose matrices is an attention matrix is a ``ValueError`` too
(``check_heads_apply``): it would otherwise change nothing, silently.

The Muon family (``muon``, ``normuon``, ``block-muon``) takes the same ``heads`` with the same
recognition: each q/k/v matrix is cut into its per-head row blocks (each orthogonalized as a matrix
of its own), and Block Muon also cuts the output projection into per-head column blocks.
"""
from __future__ import annotations

__all__ = ["QKV_NAMES", "OUT_NAMES", "role", "head_blocks", "head_rows", "check_heads_apply", "shapes_note"]

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


def shapes_note(shape: tuple[int, int], transposed: bool = False) -> str:
    """``"(stored (64, 192) as (in, out), logical 192 x 64)"`` for a matrix of logical ``shape``."""
    m, n = shape
    stored = f"(stored {(n, m)} as (in, out), " if transposed else f"(stored {(m, n)}, "
    return f"{stored}logical {m} x {n})"


def head_blocks(name: str | None, shape: tuple[int, int], heads: int | None, blocks: int,
                out_blocks: int, transposed: bool = False) -> tuple[int, int]:
    """``(blocks, out_blocks)`` of one ``m x n`` matrix (``shape``: logical, ``(out, in)`` as
    ``nn.Linear`` stores it; ``transposed``: stored ``(in, out)``, for messages) with ``heads``
    (None: the group's own counts). Messages do not name the matrix: the caller does."""
    if heads is None:
        return blocks, out_blocks
    kind = role(name)
    m, n = shape
    if kind is None:
        return blocks, out_blocks
    if n % heads:
        raise ValueError(f"heads={heads} must divide the attention width {n} (the input side) "
                         f"{shapes_note(shape, transposed)}")
    d_head = n // heads
    if kind == "out":
        return heads, out_blocks
    if m % d_head:
        raise ValueError(f"its {m} rows are not a whole number of heads of width {d_head} "
                         f"(heads={heads}, {n} columns) {shapes_note(shape, transposed)}")
    return blocks, m // d_head


def head_rows(name: str | None, shape: tuple[int, int], heads: int | None,
              transposed: bool = False) -> list[int] | None:
    """The per-head row sizes of a q/k/v matrix of logical ``shape`` (``m / d_head`` rows of
    ``d_head = n / heads`` each); None for any other matrix or without ``heads``."""
    if heads is None or role(name) != "qkv":
        return None
    _, out_blocks = head_blocks(name, shape, heads, 1, 1, transposed)
    return [shape[0] // out_blocks] * out_blocks


def check_heads_apply(heads: int | None, names: list[str | None]) -> None:
    """``ValueError`` when ``heads`` is given and none of the matrices ``names`` (every matrix the
    optimizer holds with ``heads``) is an attention matrix: ``heads`` would silently change nothing."""
    if heads is None or any(role(n) is not None for n in names):
        return
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    raise ValueError(
        f"heads={heads}: no matrix of this model is cut by heads (attention matrices are found by name: "
        f"q/k/v as {', '.join(QKV_NAMES[:6])}, ...; the output projection as {', '.join(OUT_NAMES)}, or "
        f"proj/c_proj/dense in an attention module); the matrices are {shown}. Leave heads unset, or "
        f"give it to the attention matrices' param group")
