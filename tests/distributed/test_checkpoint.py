"""Distributed checkpoints of Dobb reshard across world sizes and resume exactly.

Save on 2 FSDP2 ranks after 3 steps, load on 4 ranks (and save again there), load that on 2 ranks,
and load the 2-rank checkpoint into one plain process; each resumed run must end where the
uninterrupted 2-rank run ends. Sizes keep the block partition identical in every layout (n = 16,
32, 8 with B = 4: each rank's rows hold whole blocks on 1, 2 and 4 ranks). One matrix group blocks
the input side (state Replicate), one the output side (state Shard(0)), and AdamW owns the rest.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _common import REFRESH, Net, data, full_params, max_diff, same_on_all_ranks, state_keys, train
from _spawn import spawn
from dobb import Dobb

pytestmark = pytest.mark.slow
STEPS, SAVE_AT = 6, 3


def make(world):
    model = Net()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for m in (model.fc1, model.fc2, model.head, model):
            fully_shard(m, mesh=mesh)
    mats = [model.fc1.weight, model.head.weight]
    others = [p for n, p in model.named_parameters() if not n.endswith(("fc1.weight", "fc2.weight", "head.weight"))]
    groups = [{"params": mats}, {"params": [model.fc2.weight], "side": "output", "source": "output_grad"},
              {"params": others, "algorithm": "adamw"}]
    opt = Dobb(groups, model, lr=0.02, weight_decay=0.01, blocks=4, refresh_every=REFRESH,
               basis_dtype=torch.float64, stat_dtype=torch.float64)
    return model, opt


def _state(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _ints(opt):
    return [(opt.state[p]["step"], opt.state[p]["captures"]) for g in opt.param_groups
            if g["algorithm"] != "adamw" for p in g["params"]]


def _load(model, opt, path):
    sd = _state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def _shard(world):
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def first(rank, world, path):
    model, opt = make(world)
    batches = data(STEPS)
    train(model, opt, batches[:SAVE_AT], _shard(world))
    dcp.save(_state(model, opt), checkpoint_id=path)
    saved = _ints(opt)
    train(model, opt, batches[SAVE_AT:], _shard(world))
    return {"params": full_params(model), "ints": saved, "same_keys": same_on_all_ranks(state_keys(opt))}


def resume(rank, world, src, dst=None):
    model, opt = make(world)
    _load(model, opt, src)
    ints = _ints(opt)
    if dst is not None:
        dcp.save(_state(model, opt), checkpoint_id=dst)
    train(model, opt, data(STEPS)[SAVE_AT:], _shard(world))
    same = same_on_all_ranks(state_keys(opt)) if world > 1 else True
    return {"params": full_params(model), "ints": ints,
            "types": {type(x) for step, caps in ints for x in (step, *(c for side in caps for c in side))},
            "same_keys": same}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    a, b = os.fspath(root / "two"), os.fspath(root / "four")
    out = {"uninterrupted": spawn(first, 2, a)[0]}
    out["2->4"] = spawn(resume, 4, a, b)
    out["4->2"] = spawn(resume, 2, b)
    out["2->1"] = [resume(0, 1, a)]
    return out


@pytest.mark.parametrize("route", ["2->4", "4->2", "2->1"])
def test_resharded_resume_matches_uninterrupted_run(runs, route):
    ref = runs["uninterrupted"]
    assert ref["same_keys"]
    for r in runs[route]:
        assert r["ints"] == ref["ints"] == [(SAVE_AT, [[2]])] * 3  # python ints survive DCP
        assert r["types"] == {int}
        assert r["same_keys"]
        assert max_diff(r["params"], ref["params"]) < 1e-12


def test_every_parameter_has_state_at_construction():
    model = Net()
    opt = Dobb([{"params": [model.fc1.weight]}, {"params": [model.norm.weight], "algorithm": "adamw"}], model, lr=0.1)
    assert set(opt.state[model.norm.weight]) == {"step", "exp_avg", "exp_avg_sq"}
