"""Transposed weights (stored (in, out): Hugging Face Conv1D, or a layer declaring
``dobb_transposed = True``) are matrices for every optimizer: the same network built from
nn.Linear and from transposed layers trains to the same weights in float64."""
import pytest
import torch
from torch import nn

import dobb
from dobb.groups import transposed_parameters

D, H, OUT, ROWS, STEPS = 12, 20, 6, 48, 4


class DeclaredTransposed(nn.Module):
    """A user layer holding its weight (in, out), declared to the optimizers."""

    dobb_transposed = True

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def _hf_conv1d():
    return pytest.importorskip("transformers.pytorch_utils").Conv1D


def _net(kind, seed=0):
    torch.manual_seed(seed)
    lin = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, OUT)).double()
    if kind == "linear":
        return lin
    layer = (lambda i, o: _hf_conv1d()(o, i)) if kind == "hf" else DeclaredTransposed
    net = nn.Sequential(layer(D, H), nn.Tanh(), layer(H, H), nn.Tanh(), layer(H, OUT)).double()
    with torch.no_grad():
        for a, b in zip(lin, net):
            if isinstance(a, nn.Linear):
                b.weight.copy_(a.weight.T)
                b.bias.copy_(a.bias)
    return net


F64_DOBB = dict(basis_dtype=torch.float64, stat_dtype=torch.float64, refresh_every=2, blocks=2, basis="eigh")
CASES = {
    "dobb": F64_DOBB, "dobb-l2": F64_DOBB, "dobb-g": F64_DOBB, "dobb-g-l2": F64_DOBB,
    # output side: every diagonal block of G G^T is full rank here (of G^T G, the 6-row head's are not,
    # and a null-space basis vector is arbitrary: its coefficient's sign is rounding noise)
    "dobb-grad-gram": dict(F64_DOBB, source="grad_gram", side="output"),
    "muon": dict(ns_dtype="float64"), "owner-muon": dict(ns_dtype="float64"), "dion": {}, "rmnp": {},
    "pr-muon": dict(ns_dtype="float64"), "block-muon": dict(ns_dtype="float64", blocks=2),
    "dion2": {}, "normuon": dict(ns_dtype="float64"), "dion3": dict(ns_dtype="float64"),
}


def _train(net, case):
    name = "dobb" if case == "dobb-grad-gram" else case
    opt = dobb.build_optimizer(name, net, lr=2e-2, weight_decay=0.1, **CASES[case])
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(ROWS, D, generator=g, dtype=torch.float64)
        y = torch.randn(ROWS, OUT, generator=g, dtype=torch.float64)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["hf", "declared"])
def test_linear_and_transposed_networks_train_to_the_same_weights(case, kind):
    ref, net = _net("linear"), _net(kind)
    w0 = net[2].weight.detach().clone()
    opt = _train(net, case)
    _train(ref, case)
    assert len(transposed_parameters(net)) == 3
    groups = [g for g in opt.param_groups if g["algorithm"] != "adamw"]
    assert [g["transposed"] for g in groups] == [True] and len(groups[0]["params"]) == 3
    assert not torch.equal(net[2].weight, w0)
    for a, b in zip(ref, net):
        if isinstance(a, nn.Linear):
            torch.testing.assert_close(b.weight.T, a.weight, atol=1e-12, rtol=0)
            torch.testing.assert_close(b.bias, a.bias, atol=1e-12, rtol=0)
    # state rests under the weight and checkpoints round-trip
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert all(p in opt.state for p in groups[0]["params"])


def test_gpt2_conv1d_weights_are_dobb_matrices_with_input_side_blocks():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    groups = dobb.param_groups(model)
    names = {n for g in groups if g.get("transposed") for n, _ in g["params"]}
    assert names == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                     "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}
    opt = dobb.Dobb(groups, model, lr=1e-3, blocks=4)
    c_fc = model.transformer.h[0].mlp.c_fc.weight  # (32, 128): input axis 32 in 4 blocks of 8
    assert opt.state[c_fc]["stat"].shape == (32, 8)
    model(torch.randint(0, 64, (2, 16)), labels=torch.randint(0, 64, (2, 16))).loss.backward()
    opt.step()
    assert opt.state[c_fc]["captures"] == [[1]]


def test_transposed_must_be_a_bool():
    net = _net("declared")
    groups = dobb.param_groups(net, algorithm="muon")
    groups[0]["transposed"] = "yes"
    with pytest.raises(ValueError, match="transposed"):
        dobb.Muon(groups, lr=1e-3)


def test_conv2d_weights_go_to_adamw_and_refuse_a_matrix_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.Linear(16, 4))
    groups = dobb.param_groups(model)
    adamw = {n for g in groups if g["algorithm"] == "adamw" for n, _ in g["params"]}
    assert "0.weight" in adamw and "2.weight" not in adamw
    with pytest.raises(ValueError, match=r"conv\.weight.*4-D"):
        dobb.Dobb([{"params": [("conv.weight", model[0].weight)]}], model, lr=1e-3)
