"""torchtitan conventions: builder param-group keys, the zero-lr state-creation step, FQN-keyed
optimizer state (torch.distributed.checkpoint.state_dict, nested and flattened), and Dobb inside
torchtitan's OptimizersContainer when torchtitan is installed."""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import dobb
from dobb.integrations.torchtitan import dobb_factory

VOCAB, WIDTH = 32, 32


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(self.embed(tokens))))))


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 9), generator=g) for _ in range(n)]


def _train(model, opt, batches):
    for tokens in batches:
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()


def _builder_groups(model, fused):
    """What torchtitan's container hands a factory for the catch-all pattern."""
    names, params = zip(*model.named_parameters())
    return [{"params": list(params), "param_names": list(names), "fused": fused, "foreach": not fused,
             "lr": 5e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "blocks": 2, "refresh_every": 3}]


@pytest.mark.parametrize("name", ["dobb", "muon", "dion"])
def test_builder_keys_fused_foreach_param_names_initial_lr_are_accepted(name):
    model = Net()
    cls = type(dobb.build_optimizer(name, model, lr=1e-3))
    groups = dobb.param_groups(model, algorithm=cls.algorithm)
    for g in groups:  # what torchtitan's builder and torch's schedulers add to every group
        adamw = g["algorithm"] == "adamw"  # the AdamW part honours fused; the matrix step has no fused kernel
        g.update(param_names=[n for n, _ in g["params"]], params=[p for _, p in g["params"]], fused=adamw,
                 foreach=not adamw, initial_lr=1e-3)
    kw = {"model": model} if cls is dobb.Dobb else {}
    opt = cls(groups, lr=1e-3, **kw)
    with pytest.raises(ValueError, match="unknown key"):
        cls([dict(groups[0], fusd=True)], lr=1e-3, **kw)
    with pytest.raises(ValueError, match="^fused=True: the matrix step has no fused kernel"):
        cls([dict(groups[0], fused=True)], lr=1e-3, **kw)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = model.fc1.weight.detach().clone()
    _train(model, opt, _batches(2))
    assert not torch.equal(before, model.fc1.weight)
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["fc1.weight", "fc2.weight"]


def test_factory_splits_builder_groups_and_keeps_names_aligned():
    model = Net()
    opt = dobb_factory(_builder_groups(model, fused=True), model=model)
    matrix = [g for g in opt.param_groups if g["algorithm"] == "dobb"]
    assert [n for g in matrix for n in g["param_names"]] == ["fc1.weight", "fc2.weight"]
    for g in opt.param_groups:
        assert [id(p) for p in g["params"]] == [id(dict(model.named_parameters())[n]) for n in g["param_names"]]
        assert g["adamw_betas"] == (0.9, 0.95) and g["blocks"] == 2
        # torchtitan's fused/foreach reach the AdamW groups, which honour them; not the matrix groups
        flags = (True, False) if g["algorithm"] == "adamw" else (None, None)
        assert (g["fused"], g["foreach"]) == flags, g["algorithm"]
    shared = dobb_factory(_builder_groups(model, fused=True), model=model, fused=False, foreach=True)
    assert [(g["fused"], g["foreach"]) for g in shared.param_groups if g["algorithm"] == "adamw"] == [(True, False)]
    only_shared = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in _builder_groups(model, True)]
    shared = dobb_factory(only_shared, model=model, fused=True)
    assert [g["fused"] for g in shared.param_groups] == [None if g["algorithm"] != "adamw" else True
                                                         for g in shared.param_groups]
    with pytest.raises(ValueError, match="param_names"):
        dobb_factory([{"params": [model.fc1.weight], "param_names": [], "lr": 1.0}], model=model)


@pytest.mark.parametrize("source", ["activation", "grad_gram"])
def test_zero_lr_step_on_zero_gradients_changes_no_weight_and_no_statistic(source):
    """torchtitan's init_optim_state: zero gradients, lr=0, one step."""
    model = Net()
    opt = dobb.build_optimizer("dobb", model, lr=5e-3, weight_decay=0.1, source=source, side="input")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    saved = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, saved):
        g["lr"] = lr
    opt.zero_grad()
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
        for key in ("stat", "basis", "captures", "momentum", "exp_avg", "exp_avg_sq"):
            if key in state[n]:
                before, after = state[n][key], opt.state[p][key]
                assert torch.equal(after, before) if torch.is_tensor(before) else after == before, (n, key)
    # and the next real step takes the first statistic (a refresh), as a fresh optimizer would
    _train(model, opt, _batches(1))
    assert all(opt.state[p]["captures"] == [[1]] for p in opt.iter_matrix_params())


@pytest.mark.parametrize("name", ["adamw", "dobb", "dobb-g", "muon", "dion", "rmnp", "pr-muon", "block-muon", "dion2"])
def test_zero_lr_step_leaves_weights_finite_and_unchanged_for_every_optimizer(name):
    model = Net()
    opt = dobb.build_optimizer(name, model, lr=5e-3, weight_decay=0.1)
    weights = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
    for st in opt.state.values():
        for v in st.values():
            assert not torch.is_tensor(v) or not v.is_floating_point() or bool(v.isfinite().all())


@pytest.mark.parametrize("flatten", [False, True])
def test_state_loads_by_fqn_through_get_and_set_optimizer_state_dict(flatten):
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    batches = _batches(8, seed=3)
    model = Net()
    opt = dobb.build_optimizer("dobb", model, lr=5e-3, weight_decay=0.1, blocks=2, refresh_every=3)
    _train(model, opt, batches[:4])
    sd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))  # it shares the live tensors
    keys = list(sd) if flatten else list(sd["state"])
    assert any("fc1.weight" in k for k in keys) and not any(isinstance(k, int) for k in keys)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, batches[4:])

    model2 = Net(seed=1)
    model2.load_state_dict(weights)
    opt2 = dobb.build_optimizer("dobb", model2, lr=5e-3, weight_decay=0.1, blocks=2, refresh_every=3)
    set_optimizer_state_dict(model2, opt2, sd, options=options)
    st = opt2.state[model2.fc1.weight]
    assert st["stat"].dtype == torch.float32 and st["basis"].dtype == torch.bfloat16 and st["step"] == 4
    _train(model2, opt2, batches[4:])
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n


def test_dobb_in_torchtitans_optimizers_container_resumes_exactly():
    pytest.importorskip("torchtitan")
    from torchtitan.components.optimizer import ParamGroupConfig

    from dobb.integrations.torchtitan import DobbOptimizersContainer

    def build(model):
        config = DobbOptimizersContainer.Config(param_groups=[
            ParamGroupConfig(pattern=r"^embed\.", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 5e-3, "weight_decay": 0.0, "betas": (0.9, 0.95)}),
            ParamGroupConfig(pattern=r".*", optimizer_name="Dobb",
                             optimizer_kwargs={"lr": 5e-3, "weight_decay": 0.1, "blocks": 2, "refresh_every": 3}),
        ], implementation="for-loop")
        return config.build(model_parts=[model])

    batches = _batches(8, seed=5)
    model = Net()
    container = build(model)
    dobb_opt = next(o for o in container if isinstance(o, dobb.Dobb))
    assert {g["algorithm"] for g in dobb_opt.param_groups} == {"dobb", "adamw"}
    _train(model, container, batches[:4])
    flat = copy.deepcopy(container.state_dict())  # torchtitan's flat FQN-keyed form
    assert "state.fc1.weight.stat" in flat and "state.fc1.weight.basis" in flat
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, container, batches[4:])

    model2 = Net(seed=1)
    model2.load_state_dict(weights)
    container2 = build(model2)
    container2.load_state_dict(flat)
    _train(model2, container2, batches[4:])
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
