"""One ``heads`` option on real model layouts (issue 53, item 2): Hugging Face GPT-2 (fused q/k/v in
a ``Conv1D``, stored ``(in, out)``), a Llama-style model (separate ``q_proj``/``k_proj``/``v_proj``,
grouped-query attention) and an MLP-only model, with ``dobb``, ``dobb-muon``, ``block-muon``,
``muon`` and ``normuon`` built by ``dobb.build_optimizer(name, model, heads=4)``.

References: the per-head blocks of GPT-2's ``c_attn`` are checked against Muon run on each head's
rows as a matrix of its own (``dobb.Muon`` on separate parameters, no tiles), and the whole step on
the ``Conv1D`` model against the same weights stored by ``nn.Linear`` (transposed), a layout the
optimizers read without any transposition.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import dobb  # noqa: E402

HEADS, WIDTH, HEAD = 4, 64, 16
F64 = {"dobb": dict(basis_dtype=torch.float64, stat_dtype=torch.float64, product_dtype=torch.float64),
       "dobb-muon": dict(basis_dtype=torch.float64, stat_dtype=torch.float64, product_dtype=torch.float64,
                         ns_dtype="float64"),
       "block-muon": dict(ns_dtype="float64"), "muon": dict(ns_dtype="float64"), "normuon": dict(ns_dtype="float64")}
NAMES = tuple(F64)


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=HEADS, vocab_size=128, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    with torch.no_grad():  # LayerNorm's zero-mean outputs leave the all-ones direction out of every
        for m in model.modules():  # statistic; shifted, each statistic is full-rank (unique bases)
            if isinstance(m, nn.LayerNorm):
                m.bias.normal_(0.0, 0.3)
    return model


def llama():
    cfg = transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def as_linear(model):
    """A copy of ``model`` whose ``Conv1D`` layers are ``nn.Linear`` with the transposed weights."""
    twin = copy.deepcopy(model)
    for parent in list(twin.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ == "Conv1D":
                lin = nn.Linear(child.nx, child.nf, dtype=child.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    lin.bias.copy_(child.bias)
                setattr(parent, child_name, lin)
    return twin


def batches(steps=3, rows=2):
    """Token batches; Dobb's comparisons take ``rows=16`` (512 tokens, more than the widest input: every
    statistic is full-rank, so its eigenbasis, and the sign of each coefficient, is unique)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (rows, 32), generator=g) for _ in range(steps)]


def train(model, opt, xs):
    for x in xs:
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def build(name, model, **kw):
    return dobb.build_optimizer(name, model, lr=0.02, heads=HEADS, **F64[name], **kw)


@pytest.mark.parametrize("name", NAMES)
def test_gpt2_conv1d_steps_as_the_same_weights_stored_by_linear(name):
    conv = gpt2()
    lin = as_linear(conv)
    oc, ol = build(name, conv), build(name, lin)
    xs = batches(rows=16 if name.startswith("dobb") else 2)
    train(conv, oc, xs)
    train(lin, ol, xs)
    start = dict(gpt2().named_parameters())
    lin_params = dict(lin.named_parameters())
    stored_in_out = {f"{m}.weight" for m, mod in conv.named_modules() if type(mod).__name__ == "Conv1D"}
    assert len(stored_in_out) == 8
    for n, p in conv.named_parameters():
        q = lin_params[n]
        want = q.t() if n in stored_in_out else q
        torch.testing.assert_close(p, want, rtol=0, atol=1e-9, msg=n)
    assert not torch.equal(conv.transformer.h[0].attn.c_attn.weight, start["transformer.h.0.attn.c_attn.weight"])
    for o in (oc, ol):
        getattr(o, "remove_hooks", lambda: None)()


@pytest.mark.parametrize("name", ["block-muon", "muon"])
def test_gpt2_c_attn_moves_as_muon_on_each_head(name):
    """One step: c_attn (logical 192 x 64: q, k, v of 4 heads of 16) moves as 12 Muon matrices of 16 x 64."""
    model = gpt2()
    opt = build(name, model)
    w = model.transformer.h[0].attn.c_attn.weight
    before = w.detach().t().clone()  # logical (out, in)
    x = batches(1)[0]
    model(x, labels=x).loss.backward()
    grad = w.grad.detach().t().clone()
    opt.step()
    rows = [before[i:i + HEAD] for i in range(0, 3 * WIDTH, HEAD)]
    ref = [nn.Parameter(r.clone()) for r in rows]
    ref_opt = dobb.Muon(ref, lr=0.02, ns_dtype="float64")
    for r, i in zip(ref, range(0, 3 * WIDTH, HEAD)):
        r.grad = grad[i:i + HEAD].clone()
    ref_opt.step()
    torch.testing.assert_close(w.detach().t(), torch.cat([r.detach() for r in ref]), rtol=0, atol=1e-12)
    whole = nn.Parameter(before.clone())  # not the whole matrix's Muon step: the cut matters
    whole.grad = grad.clone()
    dobb.Muon([whole], lr=0.02, ns_dtype="float64").step()
    assert (whole.detach() - w.detach().t()).abs().max() > 1e-4


def _dobb_sizes(opt, model):
    out = {}
    for n, p in model.named_parameters():
        plan = opt._plans.get(p)
        if plan is not None:
            out[n] = ([list(s.layout.global_sizes) for s in plan.sides],
                      None if plan.ns_rows is None else list(plan.ns_rows.global_sizes))
    return out


def test_gpt2_dobb_blocks_per_head():
    model = gpt2()
    sizes = _dobb_sizes(build("dobb-muon", model), model)
    assert sizes["transformer.h.0.attn.c_attn.weight"] == ([[WIDTH]], [HEAD] * 12)  # q, k, v rows per head
    assert sizes["transformer.h.0.attn.c_proj.weight"] == ([[HEAD] * 4], [WIDTH])  # input columns per head
    assert sizes["transformer.h.0.mlp.c_fc.weight"] == ([[WIDTH]], [4 * WIDTH])  # the MLP as the defaults say
    sizes = _dobb_sizes(build("dobb", model), model)
    assert sizes["transformer.h.0.attn.c_proj.weight"] == ([[HEAD] * 4], None)


def _tiles(opt, p):
    tiles, _ = opt._plans[p]
    return [(t[0].indices(p.shape[0]), t[1].indices(p.shape[1])) for t in tiles]


def test_llama_separate_qkv_and_grouped_kv_heads():
    model = llama()
    attn = model.model.layers[0].self_attn
    sizes = _dobb_sizes(build("dobb-muon", model), model)
    pre = "model.layers.0."
    assert sizes[pre + "self_attn.q_proj.weight"][1] == [HEAD] * 4
    assert sizes[pre + "self_attn.k_proj.weight"][1] == [HEAD] * 2  # 2 key/value heads
    assert sizes[pre + "self_attn.o_proj.weight"][0] == [[HEAD] * 4]
    assert sizes[pre + "mlp.up_proj.weight"] == ([[WIDTH]], [128])
    opt = build("block-muon", model)
    assert _tiles(opt, attn.k_proj.weight) == [((i, i + HEAD, 1), (0, WIDTH, 1)) for i in (0, HEAD)]
    assert _tiles(opt, attn.o_proj.weight) == [((0, WIDTH, 1), (i, i + HEAD, 1)) for i in range(0, WIDTH, HEAD)]
    assert len(_tiles(opt, model.model.layers[0].mlp.up_proj.weight)) == 4  # axis=1, blocks=4: the defaults
    for name in NAMES:
        m = llama()
        o = build(name, m)
        before = m.model.layers[0].self_attn.k_proj.weight.detach().clone()
        train(m, o, batches(2))
        assert not torch.equal(before, m.model.layers[0].self_attn.k_proj.weight)
        getattr(o, "remove_hooks", lambda: None)()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)


@pytest.mark.parametrize("name", NAMES)
def test_heads_on_a_model_without_attention_is_an_error(name):
    with pytest.raises(ValueError, match=r"heads=4: no matrix of this model is cut by heads.*'fc1.weight'"):
        build(name, MLP())


@pytest.mark.parametrize("name", NAMES)
def test_bad_heads_name_the_parameter_once_with_both_shapes(name):
    with pytest.raises(ValueError) as exc:
        dobb.build_optimizer(name, gpt2(), lr=0.02, heads=3)
    msg = str(exc.value)
    assert msg.count("transformer.h.0.attn.c_attn.weight") == 1, msg
    assert "stored (64, 192) as (in, out)" in msg and "logical 192 x 64" in msg, msg
    assert "heads=3 must divide the attention width 64" in msg


def test_num_heads_is_a_deprecated_alias_with_its_former_meaning():
    torch.manual_seed(0)
    w = torch.randn(12, 4, dtype=torch.float64)
    g = torch.randn(12, 4, dtype=torch.float64)
    a = nn.Parameter(w.clone())
    with pytest.warns(DeprecationWarning, match="num_heads is deprecated: use heads"):
        opt = dobb.Muon([a], lr=0.1, num_heads=3, ns_dtype="float64")
    a.grad = g.clone()
    opt.step()
    parts = [nn.Parameter(w[i:i + 4].clone()) for i in range(0, 12, 4)]
    ref = dobb.Muon(parts, lr=0.1, ns_dtype="float64")
    for p, i in zip(parts, range(0, 12, 4)):
        p.grad = g[i:i + 4].clone()
    ref.step()
    torch.testing.assert_close(a.detach(), torch.cat([p.detach() for p in parts]), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="num_heads is the deprecated name of heads"):
        dobb.Muon([("attn.q.weight", nn.Parameter(w.clone()))], lr=0.1, num_heads=3, heads=3)
