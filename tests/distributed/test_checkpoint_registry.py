"""Every registry optimizer survives a distributed checkpoint under FSDP2 (gloo, float64).

The reference is the uninterrupted run: 6 steps on 2 ranks. Checkpoints are taken with
``torch.distributed.checkpoint`` (``get_optimizer_state_dict``) before the first step and after step
3 of that run; fresh processes load them and finish:

- ``2->2``: the resumed run must end on the uninterrupted run's weights (float64, within 1e-12);
- ``2->4`` then ``4->2`` (the 4-rank run saves again right after loading): an optimizer whose math
  does not depend on the world size must reshard and end on the same weights; one whose blocks or
  tiles follow the shards must be refused by ``dobb.resume.check_resume`` *before* anything
  loads, with a ``ValueError`` naming the optimizer, the saved layout, the current one and what
  would work. An optimizer whose state reshards but whose later steps follow the new shards
  (MuonBP's block steps) must load the saved state exactly (its full tensors are compared);
- ``step 0``: the checkpoint taken before the first step resumes into the whole 6-step run.

The model has a layer no rank ever runs (``spare``: no gradient anywhere, the case that crashes
optimizers that create state at the first step), so every checkpoint holds a never-stepped matrix.
Every optimizer runs in the same spawned processes (one pool call per route) to keep the test
within the suite's budget. ``torch.save(opt.state_dict())`` on one process is checked for every name
at the end (same reference: the uninterrupted single-process run).
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from _common import Net, data, full_params, max_diff, same_on_all_ranks, state_keys
from _spawn import spawn

import dobb
from dobb import OPTIMIZER_NAMES, build_optimizer
from dobb.resume import check_resume

pytestmark = pytest.mark.slow
STEPS, SAVE_AT = 6, 3
TOL = 1e-12
F64 = {"basis_dtype": torch.float64, "stat_dtype": torch.float64}
HPARAMS = {
    **{n: {"blocks": 4, "refresh_every": 2, **F64} for n in ("dobb", "dobb-l2", "dobb-g", "dobb-g-l2")},
    # row blocks must sit within a shard: 4 blocks of the 32 rows fit 2 and 4 ranks alike
    "dobb-muon": {"blocks": 4, "out_blocks": 4, "refresh_every": 2, **F64},
    "dash": {"block_size": 8, "precondition_every": 2},
    "shampoo": {"precondition_every": 2},
    "splus": {"inverse_every": 2, "out_blocks": 4},
    "soap": {"precondition_frequency": 2},
    "newton-muon": {"refresh_every": 2},
}
# Dobb-G with blocks that follow the shards (one block per rank): its layout changes with the world
CASES = {**{n: (n, {}) for n in OPTIMIZER_NAMES}, "dobb-g@shard-blocks": ("dobb-g", {"blocks": "world"})}
# Optimizers that refuse DTensor parameters at construction (checked to say so; their plain
# state_dict round trip is checked below).
NO_FSDP2 = {"newton-muon"}
# State reshards exactly, but the steps after a world-size change follow the new shards.
# Block Muon and Dion2: their default layouts follow the placement (one block per shard), their state
# is the weight-shaped momentum.
FOLLOWS_SHARDS_STATE_RESHARDS = {"muonbp", "block-muon", "dion2"}
# Refused on a world-size change: state laid out by the shards.
REFUSED_ON_RESHARD = {"dash", "shampoo", "splus", "dobb-g@shard-blocks"}


class SpareNet(Net):
    """``Net`` and a matrix no forward pass uses (never a gradient on any rank)."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(16, 16, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.spare.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(7),
                                                dtype=torch.float64) / 4)


def make(case: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    name, extra = CASES[case]
    model = SpareNet()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for m in (model.fc1, model.fc2, model.head, model.spare, model):
            fully_shard(m, mesh=mesh)
    hp = {**HPARAMS.get(name, {}), **{k: (world if v == "world" else v) for k, v in extra.items()}}
    return model, build_optimizer(name, model, lr=0.02, weight_decay=0.01, **hp)


def train(model, opt, batches, world: int, rank: int):
    rows = batches[0][0].shape[0] // world
    for x, y in batches:
        xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()


def _sd(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def full_state(opt) -> dict:
    """Every entry of ``opt.state_dict()["state"]`` as a full plain tensor or a Python value, by
    (param index, key): the state as a checkpoint holds it (SOAP keeps each sharded matrix's state
    on its owner rank, and gives it as DTensor shards here)."""
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                v = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            out[(i, k)] = v
    return out


def _each(cases, fn):
    """``{case: fn(case)}``; a case whose ``fn`` raises records its traceback (the same on every
    rank for the errors these tests expect, so the ranks stay in step)."""
    out = {}
    for case in cases:
        try:
            out[case] = fn(case)
        except Exception as exc:  # noqa: BLE001 - reported by the test of that case
            out[case] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        dist.barrier()
    return out


def first(rank, world, root, cases):
    def one(case):
        try:
            model, opt = make(case, world)
        except ValueError as exc:
            return {"refused": str(exc)}
        batches = data(STEPS)
        dcp.save(_sd(model, opt), checkpoint_id=os.path.join(root, "step0", case))
        train(model, opt, batches[:SAVE_AT], world, rank)
        dcp.save(_sd(model, opt), checkpoint_id=os.path.join(root, "step3", case))
        saved = full_state(opt)
        train(model, opt, batches[SAVE_AT:], world, rank)
        return {"params": full_params(model), "state": saved, "same_keys": same_on_all_ranks(state_keys(opt))}
    return _each(cases, one)


def resume(rank, world, root, src, cases, start=SAVE_AT, dst=None):
    """Load ``root/src/<case>`` into a fresh optimizer on ``world`` ranks and finish the run; with
    ``dst``, save again right after loading (a refused case trains its first steps afresh there, so
    the other route has a checkpoint of this world size to be refused)."""
    def one(case):
        model, opt = make(case, world)
        path = os.path.join(root, src, case)
        try:
            check_resume(model, opt, path)
        except ValueError as exc:
            out = {"check": str(exc)}
            if dst is not None:
                train(model, opt, data(STEPS)[:SAVE_AT], world, rank)
                dcp.save(_sd(model, opt), checkpoint_id=os.path.join(root, dst, case))
            return out
        sd = _sd(model, opt)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        loaded = full_state(opt)
        if dst is not None:
            dcp.save(_sd(model, opt), checkpoint_id=os.path.join(root, dst, case))
        train(model, opt, data(STEPS)[start:], world, rank)
        return {"params": full_params(model), "state": loaded, "same_keys": same_on_all_ranks(state_keys(opt))}
    return _each(cases, one)


def _cases():
    return list(CASES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = os.fspath(tmp_path_factory.mktemp("dcp-registry"))
    cases = _cases()
    out = {"ref": spawn(first, 2, root, cases)[0]}
    live = [c for c in cases if "refused" not in out["ref"][c]]
    out["2->2"] = spawn(resume, 2, root, "step3", live)[0]
    out["step0"] = spawn(resume, 2, root, "step0", live, 0)[0]
    out["2->4"] = spawn(resume, 4, root, "step3", live, SAVE_AT, "four")[0]
    out["4->2"] = spawn(resume, 2, root, "four", live)[0]
    return out


def _ok(res, case):
    assert "error" not in res, f"{case}: {res.get('trace', res)}"


def _same_state(got, want, case):
    assert set(got) == set(want), (case, sorted(set(got) ^ set(want)))
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and max_diff([g], [w]) <= TOL, (case, key)
        else:
            assert g == w and type(g) is type(w), (case, key, g, w)


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_resume_matches_uninterrupted_run(runs, case):
    ref = runs["ref"][case]
    _ok(ref, case)
    if CASES[case][0] in NO_FSDP2:
        # the refusal names the parameters for what they are (not "plain (non-DTensor) parameters")
        assert "refused" in ref and "is a DTensor" in ref["refused"] and "non-DTensor" not in ref["refused"], ref
        return
    assert "refused" not in ref, ref
    assert ref["same_keys"]
    for route in ("2->2", "step0"):
        res = runs[route][case]
        _ok(res, case)
        assert res["same_keys"]
        assert max_diff(res["params"], ref["params"]) <= TOL, (case, route, max_diff(res["params"], ref["params"]))
    _same_state(runs["2->2"][case]["state"], ref["state"], case)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] not in NO_FSDP2])
@pytest.mark.parametrize("route", ["2->4", "4->2"])
def test_dcp_reshards_or_refuses_before_loading(runs, case, route):
    ref, res = runs["ref"][case], runs[route][case]
    _ok(res, case)
    if case in REFUSED_ON_RESHARD:
        saved, now = route.split("->")
        msg = res.get("check", "")
        label = dobb.registry.get(CASES[case][0]).label
        assert label in msg and f"saved on {saved} shard" in msg and f"now {now} shard" in msg, msg
        assert f"resume on {saved} ranks" in msg, msg
        return
    assert "check" not in res, res["check"]
    assert res["same_keys"]
    _same_state(res["state"], ref["state"], case)  # the loaded state is the saved one, resharded
    if case not in FOLLOWS_SHARDS_STATE_RESHARDS:
        assert max_diff(res["params"], ref["params"]) <= TOL, (case, route, max_diff(res["params"], ref["params"]))


# ----- one process: torch.save(opt.state_dict()) -----------------------------------------------------
def _plain(case):
    torch.manual_seed(0)
    return make(case, 1)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_save_round_trip_matches_uninterrupted_run(case, tmp_path):
    batches = data(STEPS)
    model, opt = _plain(case)
    train(model, opt, batches, 1, 0)
    want = full_params(model)

    model, opt = _plain(case)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "zero.pt")
    train(model, opt, batches[:SAVE_AT], 1, 0)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    for path, start in (("ckpt.pt", SAVE_AT), ("zero.pt", 0)):
        saved = torch.load(tmp_path / path, weights_only=False)
        model, opt = _plain(case)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        train(model, opt, batches[start:], 1, 0)
        assert max_diff(full_params(model), want) <= TOL, (case, path)
