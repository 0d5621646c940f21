"""dobb.param_groups: which parameters go to the matrix optimizer and which to AdamW."""
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

