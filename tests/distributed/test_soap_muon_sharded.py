"""SOAP-Muon on 2 and 4 gloo ranks, owner-computed (SOAP's path), against the single-process run; its
payload; its distributed checkpoints.

Reference: ``dobb.SOAPMuon`` in one process on the same float64 weights and gradients (Newton-Schulz
in float64, ``ns_dtype="float64"``), an independent run the owners must reproduce from the gathered
shards. ``precondition_frequency=2`` so the runs cross refreshes. Cases: synthetic DTensors (as
``test_soap_sharded``: ``Shard(0)``/``Shard(1)``, equal shapes batched, uneven and empty shards, a
one-sided matrix, a ``blocks=2`` group) and real FSDP2 (``fully_shard``) on a square float64 model
(full-rank statistics from the first step, see ``test_soap_sharded``; ``eps=1e-4`` there for the
same reason). Unlike SOAP, the first step has an update (plain Muon), so every step, the first
included, sends the gradients to the owners and the updates back: per step and rank (8 bytes an
entry) ``8 (sum_i |my shard of i| + sum_{i I own} m_i n_i)`` in two ``all_to_all`` per param group.
Checkpoints: ``torch.distributed.checkpoint`` saved on 2 ranks mid-run, resumed on 2 (bitwise) and on
4 (other owners), and ``state_dict``/``load_state_dict`` in place.
"""
from __future__ import annotations

import math
import os
import traceback

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh

import _common as C
import _soap_cases as S
from _soap_cases import CASES, LR, MODEL_EPS, WD, case_groups as _groups, fsdp_square, held as _held
from _common import full_params, max_diff, per_rank, same_on_all_ranks, state_keys, train
from _spawn import spawn, spawn_once
from dobb import SOAPMuon
from dobb.baselines.shampoo_family.soap import OWNED_KEYS

pytestmark = pytest.mark.slow
STEPS = 5
OPTS = dict(precondition_frequency=2, ns_dtype="float64")
MODEL_STEPS, SAVE_AT = 5, 2
MODEL_OPTS = dict(OPTS, eps=MODEL_EPS)  # see _soap_cases


def batches(steps=MODEL_STEPS):
    return S.batches(steps)


def reference_weights():
    return S.reference_weights(SOAPMuon, STEPS, **OPTS)


def reference_model(steps=MODEL_STEPS):
    return S.reference_model(SOAPMuon, steps, **MODEL_OPTS)


# ----------------------------------------------------------------------------- rank-side code
def _synthetic(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    params, grads = C.sharded_problem(mesh, [(s, d) for s, d, _ in CASES], STEPS)
    opt = SOAPMuon(_groups(params), lr=LR, weight_decay=WD, **OPTS)
    log = C.metered_steps(opt, params, grads)
    return {"W": [p.detach().full_tensor() for p in params], "log": log,
            "owners": [opt.owners[p] for p in params], "held": _held(opt, params),
            "local": [math.prod(p.to_local().shape) for p in params], "same_keys": same_on_all_ranks(state_keys(opt))}


def _fsdp(rank, world):
    model = fsdp_square(init_device_mesh("cpu", (world,)))
    opt = SOAPMuon(C.groups(model), lr=LR, weight_decay=WD, **MODEL_OPTS)
    mats = opt.param_groups[0]["params"]
    log = train(model, opt, batches(), (rank, world), meter=True)
    return {"W": full_params(model), "steps": [s for s, *_ in log], "same_keys": same_on_all_ranks(state_keys(opt)),
            "owners": [opt.owners.get(p) for p in mats], "held": _held(opt, mats)}


def worker(rank, world):
    results = {}
    for key, fn in (("synthetic", _synthetic), ("fsdp", _fsdp)):
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
    return model, SOAPMuon(C.groups(model), lr=LR, weight_decay=WD, **MODEL_OPTS)


def _sd(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _dcp_first(rank, world, path):
    """Save after SAVE_AT steps, finish the run (the reference), and check the in-place round trip."""
    model, opt = _make(world)
    run = batches()
    train(model, opt, run[:SAVE_AT], (rank, world))
    mats = opt.param_groups[0]["params"]
    before = [{k: opt.state[p][k].clone() for k in OWNED_KEYS} for p in mats]
    sd = _sd(model, opt)
    dcp.save(sd, checkpoint_id=os.path.join(path, "mid"))
    opt.load_state_dict(opt.state_dict())  # in place: the owners' state gathered back unchanged
    diff = max(float((opt.state[p][k] - b[k]).abs().max()) if b[k].numel() else 0.0
               for p, b in zip(mats, before) for k in OWNED_KEYS)
    train(model, opt, run[SAVE_AT:], (rank, world))
    return {"W": full_params(model), "diff": diff}


def _dcp_resume(rank, world, src, start):
    model, opt = _make(world)
    sd = _sd(model, opt)
    dcp.load(sd, checkpoint_id=src)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    mats = opt.param_groups[0]["params"]
    steps = [opt.state[p]["step"] for p in mats]
    train(model, opt, batches()[start:], (rank, world))
    return {"W": full_params(model), "steps": steps, "held": _held(opt, mats),
            "owners": [opt.owners[p] for p in mats]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("soap_muon_dcp") / "ckpt")
    os.makedirs(path, exist_ok=True)
    return path, spawn(_dcp_first, 2, path)


# ----------------------------------------------------------------------------- tests
def test_sharded_equals_single_process(run):
    world, ranks = run
    ref = reference_weights()
    for r in per_rank(ranks, "synthetic"):
        assert r["same_keys"]
        assert max((a - b).abs().max().item() for a, b in zip(r["W"], ref)) < 1e-10


def test_payload_every_step_both_ways(run):
    world, ranks = run
    results = per_rank(ranks, "synthetic")
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results)
    for rank, r in enumerate(results):
        mine = sum(math.prod(s) for (s, _, _), o in zip(CASES, owners) if o == rank)
        assert r["log"] == [(4, 8 * (sum(r["local"]) + mine), ["all_to_all"] * 4)] * STEPS
        for (s, _, _), o, held in zip(CASES, owners, r["held"]):
            assert (held > 0) == (o == rank)
    from dobb_bench.cost.payload import payload_entries

    # the bench's formula for the name (SOAP's owner formula) is the metered count
    total = sum(r["log"][1][1] for r in results)
    assert total == 8 * sum(payload_entries("soap-muon", *s, shards=world) for s, _, _ in CASES)


def test_fsdp_equals_single_process(run):
    world, ranks = run
    ref = reference_model()
    for r in per_rank(ranks, "fsdp"):
        assert r["same_keys"]
        assert max_diff(r["W"], ref) < 1e-10
        assert r["steps"] == [2] * MODEL_STEPS  # gradients to the owners and updates back, from step 1
        assert sum(o is not None for o in r["owners"]) == 3


def test_dcp_resume_2_to_2_is_bitwise(checkpoint):
    path, first = checkpoint
    assert all(r["diff"] == 0.0 for r in first)
    for r in spawn(_dcp_resume, 2, os.path.join(path, "mid"), SAVE_AT):
        assert r["steps"] == [SAVE_AT] * 3
        assert max_diff(r["W"], first[0]["W"]) == 0.0


def test_dcp_resume_2_to_4(checkpoint):
    path, first = checkpoint
    results = spawn(_dcp_resume, 4, os.path.join(path, "mid"), SAVE_AT)
    owners = results[0]["owners"]
    for rank, r in enumerate(results):
        assert r["steps"] == [SAVE_AT] * 3
        assert max_diff(r["W"], first[0]["W"]) < 1e-10  # 4 ranks sum the gradients in another order
        assert all((h > 0) == (o == rank) for h, o in zip(r["held"], owners))
