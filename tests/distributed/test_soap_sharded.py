"""SOAP on 2 and 4 gloo ranks, owner-computed, against single-process SOAP; its payload; its checkpoints.

Reference: ``dobb.SOAP`` in one process on the same float64 weights and gradients (an independent
run: the owner must reproduce it from the gathered shards). ``precondition_frequency=2`` so the runs
cross several basis refreshes. Cases: synthetic DTensors (``Shard(0)``/``Shard(1)``, equal shapes
stacked, uneven shards 5,5,5,3 and empty ones 1,1,0,0 over 4 ranks, a one-sided matrix, a
``blocks=2`` group), real FSDP2 (``fully_shard``) and tensor parallelism (``fc1`` column-, ``fc2``
row-parallel; ``head`` plain, computed locally) on the float64 model of ``_common`` (square: ``_soap_cases``), and a
distributed checkpoint (``torch.distributed.checkpoint``) saved on 2 ranks before the first step and
mid-run, resumed on 2 and on 4, and saved again on 4 and resumed on 2. Derived payload per step and
rank (float64, 8 bytes an entry): the first step (no update) ``8 sum_i |my shard of i|`` in one
all-to-all per param group, then ``8 (sum_i |my shard of i| + sum_{i I own} m_i n_i)`` in two per
group, all tagged ``"owner"``.
"""
from __future__ import annotations

import math
import os
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import _common as C
import _soap_cases as S
from _soap_cases import CASES, GROUP_OPTS, LR, MODEL_EPS, WD, case_groups as _groups, fsdp_square, held as _held, square_net
from _common import Net, full_params, max_diff, per_rank, same_on_all_ranks, state_keys, train
from _spawn import spawn, spawn_once
from dobb import SOAP
from dobb.baselines.shampoo_family.soap import OWNED_KEYS, soap_cost
from dobb.meter import PayloadMeter
from dobb.sharding import chunk_sizes

pytestmark = pytest.mark.slow
STEPS = 6
OPTS = dict(precondition_frequency=2)
MODEL_STEPS, SAVE_AT = 6, 3
MODEL_OPTS = dict(OPTS, eps=MODEL_EPS)  # see _soap_cases


def batches(steps=MODEL_STEPS):
    return S.batches(steps)


def reference_weights():
    return S.reference_weights(SOAP, STEPS, **OPTS)


def reference_model(steps=MODEL_STEPS):
    return S.reference_model(SOAP, steps, **MODEL_OPTS)


# ----------------------------------------------------------------------------- rank-side code
def _synthetic(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    params, grads = C.sharded_problem(mesh, [(s, d) for s, d, _ in CASES], STEPS)
    # the owners' exchange alone: the finiteness check's all-reduce (nonfinite="raise", one float per
    # matrix) is tests/distributed/test_safety_sharded.py's
    opt = SOAP(_groups(params), lr=LR, weight_decay=WD, nonfinite="off", **OPTS)
    log = C.metered_steps(opt, params, grads)
    weights = [p.detach().full_tensor() for p in params]
    kinds = sorted({r.kind for r in _one_more_step(opt, params, grads).records})
    return {"W": weights, "log": log, "kinds": kinds,
            "owners": [opt.owners[p] for p in params], "held": _held(opt, params),
            "local": [math.prod(p.to_local().shape) for p in params], "same_keys": same_on_all_ranks(state_keys(opt))}


def _one_more_step(opt, params, grads):
    for p, gs in zip(params, grads):
        p.grad = gs[-1]
    with PayloadMeter() as m:
        opt.step()
    return m


def _model_run(model, rank, world, shard):
    opt = SOAP(C.groups(model), lr=LR, weight_decay=WD, **MODEL_OPTS)
    mats = opt.param_groups[0]["params"]
    log = train(model, opt, batches(), shard, meter=True)
    return {"W": full_params(model), "steps": [s for s, *_ in log], "same_keys": same_on_all_ranks(state_keys(opt)),
            "owners": [opt.owners.get(p) for p in mats], "held": _held(opt, mats)}


def _fsdp(rank, world):
    return _model_run(fsdp_square(init_device_mesh("cpu", (world,))), rank, world, (rank, world))


def _tp(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize_module(square_net(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return _model_run(model, rank, world, (0, 1))  # TP ranks see the whole batch


def _refusals(rank, world):
    """Layouts SOAP cannot own-compute are refused at construction, naming the parameter."""
    out = {}
    w = torch.zeros(8, 8, dtype=torch.float64)
    layouts = {"replicate": (init_device_mesh("cpu", (world,)), [Replicate()])}
    if world == 4:
        layouts["2d"] = (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])
    for key, (mesh, placements) in layouts.items():
        p = nn.Parameter(distribute_tensor(w, mesh, placements))
        try:
            SOAP([("enc.weight", p)], lr=LR)
            out[key] = "accepted"
        except ValueError as e:
            out[key] = str(e)
    return out


def worker(rank, world):
    results = {}
    for key, fn in (("synthetic", _synthetic), ("fsdp", _fsdp), ("tp", _tp), ("refusals", _refusals)):
        try:
            results[key] = fn(rank, world)
        except Exception:  # reported by the test that reads this key
            results[key] = traceback.format_exc()
    return results


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return request.param, spawn_once(worker, request.param)


# ----------------------------------------------------------------------------- checkpoints
def _make(world):
    model = fsdp_square(init_device_mesh("cpu", (world,)))
    return model, SOAP(C.groups(model), lr=LR, weight_decay=WD, **MODEL_OPTS)


def _sd(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _dcp_first(rank, world, path):
    """2 ranks: save before the first step and after SAVE_AT steps, then finish; the finished weights
    are the reference."""
    model, opt = _make(world)
    run = batches()
    dcp.save(_sd(model, opt), checkpoint_id=os.path.join(path, "start"))
    train(model, opt, run[:SAVE_AT], (rank, world))
    sd = _sd(model, opt)
    keys = sorted((fqn, k, type(v).__name__) for fqn, st in sd["optim"]["state"].items() for k, v in st.items())
    dcp.save(sd, checkpoint_id=os.path.join(path, "mid"))
    train(model, opt, run[SAVE_AT:], (rank, world))
    return {"W": full_params(model), "same_keys": same_on_all_ranks(keys)}


def _dcp_resume(rank, world, src, start, dst=None):
    """Load ``src`` (taken after ``start`` steps), optionally save it again at once to ``dst``, and
    finish the run."""
    model, opt = _make(world)
    sd = _sd(model, opt)
    dcp.load(sd, checkpoint_id=src)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    if dst is not None:
        dcp.save(_sd(model, opt), checkpoint_id=dst)
    mats = opt.param_groups[0]["params"]
    steps = [opt.state[p]["step"] for p in mats]
    train(model, opt, batches()[start:], (rank, world))
    return {"W": full_params(model), "steps": steps, "held": _held(opt, mats),
            "owners": [opt.owners[p] for p in mats]}


def _fresh_state_dict_round_trip(rank, world):
    """state_dict() -> load_state_dict() in the same run changes nothing (DTensors gathered back)."""
    model, opt = _make(world)
    train(model, opt, batches()[:SAVE_AT], (rank, world))
    mats = opt.param_groups[0]["params"]
    before = [{k: opt.state[p][k].clone() for k in OWNED_KEYS} for p in mats]
    sd = opt.state_dict()
    placements = sorted({str(tuple(v.placements)) for st in sd["state"].values() for k, v in st.items()
                         if k in OWNED_KEYS and hasattr(v, "placements")})
    opt.load_state_dict(sd)
    diff = max(float((opt.state[p][k] - b[k]).abs().max()) if b[k].numel() else 0.0
               for p, b in zip(mats, before) for k in OWNED_KEYS)
    # a state saved with other blocks is refused before any exchange, naming the parameter
    other = fsdp_square(init_device_mesh("cpu", (world,)))
    named = [{"params": [(f"{m}.weight", getattr(other, m).weight) for m in Net.matrices], "blocks": 2},
             {"params": [p for n, p in other.named_parameters() if not n.endswith("fc1.weight")
                         and not n.endswith("fc2.weight") and not n.endswith("head.weight")], "algorithm": "adamw"}]
    try:
        SOAP(named, lr=LR, **MODEL_OPTS).load_state_dict(sd)
        refused = "loaded"
    except ValueError as e:
        refused = str(e)
    return {"diff": diff, "placements": placements, "refused": refused}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("soap_dcp") / "ckpt")
    os.makedirs(path, exist_ok=True)
    first = spawn(_dcp_first, 2, path)
    return path, first


# ----------------------------------------------------------------------------- tests
def test_sharded_equals_single_process_soap(run):
    world, ranks = run
    ref = reference_weights()
    for r in per_rank(ranks, "synthetic"):
        assert r["same_keys"]
        assert max((a - b).abs().max().item() for a, b in zip(r["W"], ref)) < 1e-10


def test_sharded_payload_is_derived_count(run):
    world, ranks = run
    results = per_rank(ranks, "synthetic")
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results)  # one plan, computed identically
    assert sorted(set(owners)) == list(range(world))
    for rank, r in enumerate(results):
        assert r["local"] == [chunk_sizes(s[d], world)[rank] * s[1 - d] for s, d, _ in CASES]
        mine = sum(math.prod(s) for (s, _, _), o in zip(CASES, owners) if o == rank)
        # per param group: gradients to the owners, then (not on the first step) the updates back
        assert r["log"][0] == (2, 8 * sum(r["local"]), ["all_to_all"] * 2)
        assert r["log"][1:] == [(4, 8 * (sum(r["local"]) + mine), ["all_to_all"] * 4)] * (STEPS - 1)
        assert r["kinds"] == ["owner"]
    from dobb_bench.cost.payload import payload_entries

    total = sum(r["log"][1][1] for r in results)
    assert total == 8 * sum(payload_entries("soap", *s, shards=world) for s, _, _ in CASES)


def test_owner_alone_holds_the_state(run):
    world, ranks = run
    results = per_rank(ranks, "synthetic")
    owners = results[0]["owners"]
    for rank, r in enumerate(results):
        for (s, _, g), o, held in zip(CASES, owners, r["held"]):
            if o != rank:
                assert held == 0
            else:
                assert held >= math.prod(s) * 2  # momentum and the rotated second moment, at least


def test_owners_balanced_by_cost(run):
    world, ranks = run
    owners = per_rank(ranks, "synthetic")[0]["owners"]
    cost = [soap_cost(s[0], s[1] // GROUP_OPTS[g].get("blocks", 1), GROUP_OPTS[g].get("blocks", 1),
                      s[0] <= GROUP_OPTS[g].get("max_precondition_dim", 10000),
                      s[1] // GROUP_OPTS[g].get("blocks", 1) <= GROUP_OPTS[g].get("max_precondition_dim", 10000))
            for s, _, g in CASES]
    loads = [sum(c for c, o in zip(cost, owners) if o == r) for r in range(world)]
    assert max(loads) - min(loads) <= max(cost)
    assert len({owners[0], owners[1], owners[2]}) == min(3, world)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_model_equals_single_process_soap(run, layout):
    world, ranks = run
    ref = reference_model()
    sharded = 3 if layout == "fsdp" else 2  # under TP the head stays a plain tensor
    for rank, r in enumerate(per_rank(ranks, layout)):
        assert r["same_keys"]
        assert max_diff(r["W"], ref) < 1e-10
        # the first step sends gradients only; then gradients and updates (AdamW is elementwise)
        assert r["steps"] == [1] + [2] * (MODEL_STEPS - 1)
        assert sum(o is not None for o in r["owners"]) == sharded


def test_other_layouts_refused_naming_the_parameter(run):
    world, ranks = run
    for r in per_rank(ranks, "refusals"):
        assert set(r) == ({"replicate", "2d"} if world == 4 else {"replicate"})
        for msg in r.values():
            assert "enc.weight" in msg and "Shard(0) or Shard(1) on a 1-D mesh" in msg


def test_dcp_resume_2_to_2_is_exact(checkpoint):
    path, first = checkpoint
    ref = first[0]["W"]
    assert all(r["same_keys"] for r in first)
    for r in spawn(_dcp_resume, 2, os.path.join(path, "mid"), SAVE_AT):
        assert r["steps"] == [SAVE_AT] * 3
        assert max_diff(r["W"], ref) < 1e-12


def test_dcp_before_the_first_step_resumes_exactly(checkpoint):
    path, first = checkpoint
    for r in spawn(_dcp_resume, 2, os.path.join(path, "start"), 0):
        assert r["steps"] == [0] * 3
        assert max_diff(r["W"], first[0]["W"]) < 1e-12


def test_dcp_resume_2_to_4_and_4_to_2_reshard(checkpoint):
    """Saved on 2 ranks, loaded on 4 (other owners) and saved there at once, that loaded on 2."""
    path, first = checkpoint
    ref = first[0]["W"]
    results = spawn(_dcp_resume, 4, os.path.join(path, "mid"), SAVE_AT, os.path.join(path, "mid4"))
    owners = results[0]["owners"]
    for rank, r in enumerate(results):
        assert r["steps"] == [SAVE_AT] * 3
        assert max_diff(r["W"], ref) < 1e-10  # 4 ranks sum the gradients in another order than 2
        assert all((h > 0) == (o == rank) for h, o in zip(r["held"], owners))
    for r in spawn(_dcp_resume, 2, os.path.join(path, "mid4"), SAVE_AT):
        assert max_diff(r["W"], ref) < 1e-12  # the 2-rank run from the state that went through 4 ranks


def test_state_dict_round_trip_in_place():
    for r in spawn(_fresh_state_dict_round_trip, 2):
        assert r["diff"] == 0.0
        assert r["placements"] == ["(Shard(dim=0),)", "(Shard(dim=1),)"]
        assert r["refused"].startswith("fc1.weight: saved state 'exp_avg_sq' has shape (1, 16, 16)")
        assert "needs (2, 16, 8)" in r["refused"]
