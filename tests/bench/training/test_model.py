"""The benchmark's GPT: shapes, causality, fused/separate QKV parity, tied head, seeded init."""
import copy
import math

import pytest
import torch
from torch import nn

from dobb_bench.training.model import GPT, PRESETS, ModelConfig, config_from_preset


def test_forward_shapes_and_initial_loss(tiny_model_cfg):
    model = GPT(tiny_model_cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (3, 20), generator=gen)
    targets = torch.randint(0, 256, (3, 20), generator=gen)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 20, 256)
    assert loss.shape == ()
    # small init => near-uniform predictions, loss close to ln(256)
    assert abs(loss.item() - math.log(256)) < 0.1
    assert model(idx)[1] is None


def test_causal_masking(tiny_model_cfg):
    model = GPT(tiny_model_cfg, seed=1)
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 7) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3


def test_fused_and_separate_qkv_agree(tiny_model_cfg):
    fused = GPT(tiny_model_cfg, seed=2)
    sep_cfg = ModelConfig(**{**tiny_model_cfg.to_dict(), "fused_qkv": False})
    separate = GPT(sep_cfg, seed=3)
    sd = {}
    for k, v in fused.state_dict().items():
        if ".qkv." in k:
            for name, part in zip("qkv", v.chunk(3, dim=0)):
                sd[k.replace(".qkv.", f".{name}.")] = part
        else:
            sd[k] = v
    separate.load_state_dict(sd)
    idx = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(fused(idx)[0], separate(idx)[0], rtol=1e-5, atol=1e-5)
    assert all(isinstance(b.attn.q, nn.Linear) for b in separate.blocks)


def test_tied_head_shares_storage(tiny_model_cfg):
    tied = GPT(tiny_model_cfg)
    assert tied.head.weight is tied.wte.weight
    # the tie survives what checkpoints and worker processes do to a model (copy, state-dict load)
    for again in (copy.deepcopy(tied), GPT(tiny_model_cfg)):
        again.load_state_dict(tied.state_dict())
        assert again.head.weight is again.wte.weight
    untied = GPT(ModelConfig(**{**tiny_model_cfg.to_dict(), "tied": False}))
    assert untied.head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == 256 * tiny_model_cfg.width
    # a gradient step through the head moves the embedding too
    idx = torch.randint(0, 256, (1, 8))
    tied(idx, idx)[1].backward()
    assert tied.wte.weight.grad is not None and tied.wte.weight.grad.abs().sum() > 0


def test_seeded_init_ignores_global_rng(tiny_model_cfg):
    torch.manual_seed(123)
    a = GPT(tiny_model_cfg, seed=5).state_dict()
    torch.manual_seed(999)
    b = GPT(tiny_model_cfg, seed=5).state_dict()
    c = GPT(tiny_model_cfg, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.mlp.fc.weight"], c["blocks.0.mlp.fc.weight"])
    # residual projections get the 1/sqrt(2L) scaled init
    std = GPT(ModelConfig(layers=2, width=256, heads=2, seq_len=8)).blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02 / 2) < 0.001


def test_sequence_over_context_and_bad_config(tiny_model_cfg):
    model = GPT(tiny_model_cfg)
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, tiny_model_cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="unknown preset"):
        config_from_preset("huge")


def test_presets_keep_head_dim():
    for name, p in PRESETS.items():
        cfg = config_from_preset(name)
        assert cfg.width // cfg.heads == 32, name
    assert config_from_preset("small-cpu", layers=3).layers == 3
