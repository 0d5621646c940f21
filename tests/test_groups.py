"""dobb.param_groups: which parameters go to the matrix optimizer and which to AdamW."""
import warnings

import pytest
import torch
from torch import nn

import dobb


def test_param_groups_rule():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(50, 8)
            self.fc = nn.Linear(8, 16)
            self.proj = nn.Linear(16, 8)
            self.ln = nn.LayerNorm(8)
            self.lm_head = nn.Linear(8, 50, bias=False)
            self.lm_head.weight = self.wte.weight  # tied head
            self.scale = nn.Parameter(torch.ones(()))

    groups = dobb.param_groups(Tiny())
    matrix = [n for n, _ in groups[0]["params"]]
    other = [n for g in groups[1:] for n, _ in g["params"]]
    assert [g["algorithm"] for g in groups] == ["dobb", "adamw", "adamw"]
    assert matrix == ["fc.weight", "proj.weight"]
    assert set(other) == {"wte.weight", "fc.bias", "proj.bias", "ln.weight", "ln.bias", "scale"}
    # the 1-D and 0-D parameters of the AdamW part without weight decay, the embedding with it
    assert [n for n, _ in groups[1]["params"]] == ["wte.weight"] and "weight_decay" not in groups[1]
    assert groups[2]["weight_decay"] == 0.0


def test_param_groups_keep_hidden_layers_of_vocabulary_or_context_width():
    """A byte-level model of width 256 has hidden Linears with out_features == vocab == 256 and a
    position table whose size equals some widths: only the last, vocabulary-sized Linear is the head."""
    model = nn.Sequential(nn.Embedding(256, 64), nn.Embedding(64, 64), nn.Linear(64, 256), nn.Linear(256, 64),
                          nn.Linear(64, 256))
    groups = dobb.param_groups(model)
    assert [n for n, _ in groups[0]["params"]] == ["2.weight", "3.weight"]
    assert "4.weight" in [n for n, _ in groups[1]["params"]]


def test_decay_names_split_the_adamw_part_only():
    """Hugging Face's rule: the AdamW parameters not named in decay_names get weight_decay=0;
    matrices always decay; None (the default) decays those of 2 or more dimensions only (every
    name given: all of them decay, the behaviour before issue 53)."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    groups = dobb.param_groups(model, "muon", decay_names=["0.weight", "3.weight"])
    got = {(g["algorithm"], g.get("weight_decay")): sorted(n for n, _ in g["params"]) for g in groups}
    assert got == {("muon", None): ["1.weight"], ("adamw", None): ["0.weight", "3.weight"],
                   ("adamw", 0.0): ["1.bias", "2.bias", "2.weight", "3.bias"]}
    plain = dobb.param_groups(model, "muon")
    got = {(g["algorithm"], g.get("weight_decay")): sorted(n for n, _ in g["params"]) for g in plain}
    assert got == {("muon", None): ["1.weight"], ("adamw", None): ["0.weight", "3.weight"],
                   ("adamw", 0.0): ["1.bias", "2.bias", "2.weight", "3.bias"]}
    every = dobb.param_groups(model, "muon", decay_names=[n for n, _ in model.named_parameters()])
    assert [g.get("weight_decay") for g in every] == [None, None]
    assert sorted(n for n, _ in every[1]["params"]) == ["0.weight", "1.bias", "2.bias", "2.weight", "3.bias",
                                                         "3.weight"]



# ----------------------------------------------------------------------------- nn.MultiheadAttention (issue 53, 6a)
def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _grouped(model, algorithm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = dobb.param_groups(model, algorithm)
    return groups, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


IN_PROJ = ["layers.0.self_attn.in_proj_weight", "layers.1.self_attn.in_proj_weight"]
HIDDEN = [f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("self_attn.out_proj", "linear1", "linear2")]


def _adamw_names(model):
    return {n for n, p in model.named_parameters() if p.dim() == 1}


@pytest.mark.parametrize("algorithm", ["muon", "block-muon", "normuon"])
def test_mha_in_proj_is_three_matrices_where_the_optimizer_cuts_fused_weights(algorithm):
    model = _encoder()
    groups, caught = _grouped(model, algorithm)
    assert caught == []
    got = [(g["algorithm"], g.get("split_sizes"), g.get("weight_decay"), sorted(n for n, _ in g["params"]))
           for g in groups]
    assert got == [(algorithm, None, None, sorted(HIDDEN)), (algorithm, (32, 32, 32), None, IN_PROJ),
                   ("adamw", None, 0.0, sorted(_adamw_names(model)))]
    # a split_sizes of the caller wins: no group of its own
    groups = dobb.param_groups(model, algorithm, split_sizes="qkv")
    assert sorted(n for n, _ in groups[0]["params"]) == sorted(HIDDEN + IN_PROJ)


@pytest.mark.parametrize("algorithm", ["dobb", "dion", "soap", "shampoo", "rmnp"])
def test_mha_in_proj_is_one_matrix_with_a_warning_naming_it_where_the_optimizer_cannot_cut(algorithm):
    model = _encoder()
    groups, caught = _grouped(model, algorithm)
    assert [(g["algorithm"], sorted(n for n, _ in g["params"])) for g in groups] == [
        (algorithm, sorted(HIDDEN + IN_PROJ)), ("adamw", sorted(_adamw_names(model)))]
    (msg,) = caught
    assert msg.startswith(f"nn.MultiheadAttention's fused q/k/v projection(s) {', '.join(IN_PROJ)} go to the "
                          f"{algorithm!r} matrix update as one (3E, E) matrix each")
    assert "'muon', 'cmuon', 'block-muon' or 'normuon'" in msg and "is_matrix" in msg
    # build_optimizer warns the same
    with pytest.warns(UserWarning, match=r"layers\.0\.self_attn\.in_proj_weight, layers\.1\.self_attn\.in_proj_weight"):
        opt = dobb.build_optimizer(algorithm, model, lr=0.01)
    getattr(opt, "remove_hooks", lambda: None)()


def test_mha_with_other_key_value_widths_gives_its_three_projections_as_matrices():
    mha = nn.MultiheadAttention(16, 2, kdim=8, vdim=12)
    groups, caught = _grouped(mha, "muon")
    assert caught == []  # no fused weight
    assert sorted(n for n, _ in groups[0]["params"]) == ["k_proj_weight", "out_proj.weight", "q_proj_weight",
                                                          "v_proj_weight"]
    assert sorted(n for n, _ in groups[1]["params"]) == ["in_proj_bias", "out_proj.bias"]


def test_a_step_on_the_mha_in_proj_is_muon_on_q_k_v_as_three_matrices():
    """Muon's step on the fused (3E, E) weight equals torch.optim.Muon's on q, k and v as three
    separate (E, E) parameters fed the same gradient slices (float64 Newton-Schulz on both sides
    is not available in torch's Muon, so both run its bf16 NS5)."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon (the reference) is not in this torch")
    model = _encoder()
    w = model.layers[0].self_attn.in_proj_weight
    parts = [w.detach()[i * 32:(i + 1) * 32].clone().requires_grad_() for i in range(3)]
    whole = w.detach().clone().requires_grad_()
    opt = dobb.build_optimizer("muon", model, lr=0.02, weight_decay=0.1, ns_dtype="bfloat16")
    ref = torch.optim.Muon(parts, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_whole = torch.optim.Muon([whole], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        for i, q in enumerate(parts):
            q.grad = w.grad[i * 32:(i + 1) * 32].clone()
        whole.grad = w.grad.clone()
        opt.step()
        ref.step()
        ref_whole.step()
    assert torch.equal(w.detach(), torch.cat([q.detach() for q in parts]))
    # the reference tells the two apart: one whole (3E, E) matrix moves otherwise
    assert not torch.allclose(w.detach(), whole.detach(), rtol=0, atol=1e-4)


def test_dobb_heads_recognises_the_mha_projections():
    from dobb.core.heads import role

    assert role("layers.0.self_attn.in_proj_weight") == "qkv"
    assert role("attn.q_proj_weight") == "qkv"
    assert role("layers.0.self_attn.out_proj.weight") == "out"
    assert role("layers.0.linear1.weight") is None
