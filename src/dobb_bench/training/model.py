"""GPT-2 style language model for the benchmark, shrunk to CPU scale.

Why it looks like this: the paper's quality comparison (Tables 4, 10) trains GPT-2 style models
(learned positions, pre-LayerNorm, GELU MLP 4x, causal attention). Every hidden matrix is an
``nn.Linear`` so that optimizers which hook module inputs/outputs (Dobb's activation or
output-gradient capture) can find the module that owns each weight. The LM head is an
``nn.Linear`` named ``head``; when tied, ``head.weight`` *is* the token-embedding weight, which
the library's parameter split recognizes and sends to AdamW.

Presets keep the paper family's shape (head dimension fixed, depth and width growing together)
at CPU scale. Paper family [T10] -> preset:

=============  ===================  =====================  ===========================
paper row      layers/width/heads   preset                 layers/width/heads (head dim)
=============  ===================  =====================  ===========================
(tests only)   --                   ``tiny``               2 / 64 / 2   (32)
62M            6 / 640 / 10         ``small-cpu``          4 / 128 / 4  (32)
124M           12 / 768 / 12        ``medium-cpu``         6 / 192 / 6  (32)
219M           18 / 896 / 14        ``large-cpu``          8 / 256 / 8  (32)
354M           24 / 1024 / 16       (none: custom flags)   e.g. 10 / 320 / 10
=============  ===================  =====================  ===========================

The paper's head dimension is 64 and width grows by 128 per row; here the head dimension is 32
and width grows by 64, depth by 2 instead of 6.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

PRESETS: dict[str, dict] = {
    "tiny": dict(layers=2, width=64, heads=2, seq_len=64),
    "small-cpu": dict(layers=4, width=128, heads=4, seq_len=128),
    "medium-cpu": dict(layers=6, width=192, heads=6, seq_len=128),
    "large-cpu": dict(layers=8, width=256, heads=8, seq_len=128),
}
"""CPU-scale stand-ins for the paper's model family; see the module docstring for the mapping."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one model. ``seq_len`` is the context (number of learned positions)."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    seq_len: int = 128
    vocab_size: int = 256
    fused_qkv: bool = True
    tied: bool = True
    bias: bool = False

    def __post_init__(self):
        for name in ("layers", "width", "heads", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")

    def to_dict(self) -> dict:
        return asdict(self)


def config_from_preset(preset: str | None = None, **overrides) -> ModelConfig:
    """A ``ModelConfig`` from a named preset, with non-None ``overrides`` applied on top."""
    base = ModelConfig()
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        base = replace(base, **PRESETS[preset])
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; fused ``qkv`` (one 3d-wide Linear) or separate ``q``/``k``/``v``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.width
        self.heads = cfg.heads
        self.fused = cfg.fused_qkv
        if self.fused:
            self.qkv = nn.Linear(d, 3 * d, bias=cfg.bias)
        else:
            self.q = nn.Linear(d, d, bias=cfg.bias)
            self.k = nn.Linear(d, d, bias=cfg.bias)
            self.v = nn.Linear(d, d, bias=cfg.bias)
        self.proj = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if self.fused:
            q, k, v = self.qkv(x).split(d, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block (the unit FSDP shards)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only LM. ``forward(idx, targets=None)`` returns ``(logits, loss_or_None)``."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.wte.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init from a private generator, so the init does not depend on global RNG state.

        Normal(0, 0.02) for weights, residual output projections scaled by ``1/sqrt(2 * layers)``,
        zero biases, unit LayerNorm gains. Parameters are visited in a fixed order.
        """
        gen = torch.Generator().manual_seed(int(seed))
        std = 0.02
        for name, p in self.named_parameters():  # shared (tied) parameters are visited once
            if p.dim() < 2:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
                continue
            scale = 1.0 / math.sqrt(2 * self.config.layers) if name.endswith("proj.weight") else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * (std * scale))

    def num_params(self, include_positions: bool = False) -> int:
        """Parameter count; excludes position embeddings by default, as the paper's N_param does."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_positions else n - self.wpe.weight.numel()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model context {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
