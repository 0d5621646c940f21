"""GPT-2 matrix sets for the optimizer benchmarks (timing, payload): shapes only, no model, no data.

Why: the paper's optimizer-call times (Tables 5, 22-25) and its payload figure (Figure 1) depend
only on the hidden weight matrices an optimizer updates, not on what the model computes. A matrix
set is the list of ``(name, (m, n))`` of those matrices in ``nn.Linear`` convention (``m`` = output
features, ``n`` = input features, weight stored ``m x n``):

per layer, width ``d``: attention ``q, k, v, o`` (``d x d`` each; or one fused ``qkv`` ``3d x d``
plus ``o``), MLP ``fc`` (``4d x d``) and ``proj`` (``d x 4d``), i.e. ``12 d^2`` entries per layer.

Embeddings, the tied LM head, norms and biases are AdamW's in every optimizer compared here and
are left out of the sets. ``gpt2_param_count`` gives the whole model's count (Hugging Face GPT-2:
tied head, biases, LayerNorms, learned positions) so the presets can be checked against the
published sizes (124M, 355M, 774M, 1.56B).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPT2_PRESETS", "GPT2Preset", "matrix_shapes", "parse_layers", "gpt2_param_count", "preset"]


@dataclass(frozen=True)
class GPT2Preset:
    name: str
    layers: int
    width: int
    heads: int
    vocab: int = 50257
    context: int = 1024


GPT2_PRESETS: dict[str, GPT2Preset] = {
    "small": GPT2Preset("small", 12, 768, 12),
    "medium": GPT2Preset("medium", 24, 1024, 16),
    "large": GPT2Preset("large", 36, 1280, 20),
    "xl": GPT2Preset("xl", 48, 1600, 25),
    "tiny": GPT2Preset("tiny", 2, 64, 2, vocab=256, context=64),  # test-only stand-in (seconds on CPU)
}
_ALIASES = {f"gpt2-{k}": k for k in GPT2_PRESETS} | {"gpt2": "small"}


def preset(name: str) -> GPT2Preset:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in GPT2_PRESETS:
        raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {', '.join(GPT2_PRESETS)}")
    return GPT2_PRESETS[key]


def parse_layers(spec: str | None, total: int) -> range:
    """``None``/``"all"`` -> every layer; ``"K"`` -> the first K; ``"a:b"`` -> layers a..b-1."""
    if spec is None or str(spec).strip().lower() in ("", "all"):
        return range(total)
    text = str(spec).strip()
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            start = int(a) if a.strip() else 0
            stop = int(b) if b.strip() else total
        else:
            start, stop = 0, int(text)
    except ValueError:
        raise ValueError(f"--layers must be 'all', a count K or a slice a:b, got {spec!r}") from None
    if not (0 <= start < stop <= total):
        raise ValueError(f"--layers {spec!r} selects no valid layers of a {total}-layer model (0 <= a < b <= {total})")
    return range(start, stop)


def layer_shapes(width: int, fused_qkv: bool = False) -> list[tuple[str, tuple[int, int]]]:
    d = width
    attn = [("qkv", (3 * d, d))] if fused_qkv else [("q", (d, d)), ("k", (d, d)), ("v", (d, d))]
    return attn + [("o", (d, d)), ("fc", (4 * d, d)), ("proj", (d, 4 * d))]


def matrix_shapes(name: str, layers: str | None = None, fused_qkv: bool = False) -> list[tuple[str, tuple[int, int]]]:
    """The hidden matrices of a GPT-2 preset: ``[("h3.fc", (4d, d)), ...]`` for the selected layers."""
    p = preset(name)
    out = []
    for i in parse_layers(layers, p.layers):
        out += [(f"h{i}.{k}", shape) for k, shape in layer_shapes(p.width, fused_qkv)]
    return out


def gpt2_param_count(name: str) -> int:
    """Parameters of the Hugging Face GPT-2 model of this size (tied head, positions included)."""
    p = preset(name)
    d = p.width
    per_layer = 12 * d * d + 13 * d  # qkv 3d^2+3d, o d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LayerNorms 4d
    return p.vocab * d + p.context * d + p.layers * per_layer + 2 * d
