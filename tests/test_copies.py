"""dobb._copies (through ``MatrixOptimizer.__getstate__``), against ``torch.optim.AdamW``'s behaviour in
the same case (``"adamw"`` is torch's AdamW itself, so the parametrized tests run the reference too):
``copy.deepcopy`` and ``pickle`` give a copy that steps exactly as the original would, or (for an
optimizer that hooks a model) a ``TypeError`` naming ``state_dict()``."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import dobb
from _contract_net import D, MATRIX_NAMES, Net, backward, build, holds_model, same, snapshot, train
from dobb.factory import OPTIMIZER_NAMES


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj))}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_copy_steps_as_the_original_or_refuses_naming_state_dict(name, how):
    """A copy of (model, optimizer) taken mid-training continues exactly as the original (torch's
    AdamW: ``name == "adamw"``); an optimizer holding hooks on a model refuses with a TypeError
    naming ``state_dict()``, and the refusal leaves the original training."""
    model = Net()
    opt = build(name, model)
    train(model, opt, 2)
    if holds_model(opt):
        with pytest.raises(TypeError, match=r"state_dict\(\).*load_state_dict\(\)"):
            COPIES[how]((model, opt))
        with pytest.raises(TypeError, match=r"state_dict\(\)"):
            COPIES[how](opt)
        before = snapshot(model, opt)[0]
        train(model, opt, 1, start=2)
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return
    model2, opt2 = COPIES[how]((model, opt))
    mine = [p for g in opt2.param_groups for p in g["params"]]
    assert {id(p) for p in mine} == {id(p) for p in model2.parameters()}  # steps the copied model
    train(model, opt, 2, start=2)
    train(model2, opt2, 2, start=2)
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
    assert same(snapshot(model, opt)[1], snapshot(model2, opt2)[1])
    if name in MATRIX_NAMES:  # error messages still name the copy's parameters
        opt2.zero_grad()
        backward(model2, 9)
        model2.hidden.weight.grad = model2.hidden.weight.grad.to_sparse()
        with pytest.raises(RuntimeError, match=r"hidden\.weight"):
            opt2.step()


@pytest.mark.parametrize("how", COPIES)
def test_copy_of_a_dobb_without_model_steps_as_the_original(how):
    """Dobb with source='grad_gram' holds no model: its copy works, module-level sentinels kept
    (adding a group to the copy resolves its statistic group as the original would)."""
    model = Net()
    opt = dobb.Dobb(dobb.param_groups(model, algorithm="dobb", source="grad_gram"), lr=0.01, weight_decay=0.1,
                    refresh_every=2)
    train(model, opt, 3)
    model2, opt2 = COPIES[how]((model, opt))
    for m, o in ((model, opt), (model2, opt2)):
        torch.manual_seed(1)
        extra = nn.Linear(D, D, bias=False)
        m.extra = extra
        o.add_param_group({"params": [extra.weight], "algorithm": "dobb", "source": "grad_gram"})
        for t in range(3, 6):
            o.zero_grad()
            backward(m, t)
            extra.weight.grad = torch.ones_like(extra.weight) * t
            o.step()
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n


def test_copy_of_an_optimizer_holding_a_process_group_refuses_naming_it():
    """A process group cannot be carried by a copy (the same refusal as for a model's hooks)."""
    import torch.distributed as dist

    from _one_rank import one_rank_group
    from dobb.baselines import OwnerMuon

    with one_rank_group():
        opt = OwnerMuon([nn.Parameter(torch.zeros(4, 4))], lr=0.1, replicated_group=dist.group.WORLD)
        for how in COPIES.values():
            with pytest.raises(TypeError) as err:
                how(opt)
            assert str(err.value).startswith("OwnerMuon cannot be copied or pickled: it holds a process group "
                                              "('_replicated_group'). Save opt.state_dict() instead")
