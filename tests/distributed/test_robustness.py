"""Failure modes on 2 and 4 gloo ranks (issue 15): each check would hang, abort or diverge silently
before the fix; here every rank gets the same answer.

- plain parameters under a process group without DDP or ``stat_group``: ValueError at construction;
  a model optimized on one rank only (``stat_group=None``) trains without a collective;
- a NaN in one rank's FSDP gradient shard: the same ValueError on every rank, nothing changed, the
  next step continues the run exactly;
- a layer that runs on rank 0 only (an MoE expert without tokens elsewhere): no hang, the same
  bases on every rank, the token-weighted statistic of the single-process run; when no rank
  captured, the statistic and basis are kept;
- a matrix with a gradient on one rank only (no gradient sync, explicit ``stat_group``): every rank
  still refreshes its shared statistic, schedules and bases agree;
- destroying and re-creating the process group in one process (HSDP, flattened groups): works.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import (D, Net, checker, data, full_params, make_opt, max_diff, per_rank, reference,
                     same_on_all_ranks, stats, train)
from _compare import full
from _spawn import free_port, spawn, spawn_once
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow


def _no_guess(rank, world):
    out = {}
    try:
        make_opt(Net(), "dobb")
        out["plain"] = None
    except ValueError as e:
        out["plain"] = str(e)
    make_opt(DDP(Net()), "dobb")  # the DDP module names its group
    make_opt(Net(), "dobb-g", stat_group=None)  # explicit: this rank's data alone
    # a model optimized on rank 0 only: no collective at all, the single-process numbers
    if rank == 0:
        model = Net()
        opt = make_opt(model, "dobb", stat_group=None)
        with PayloadMeter() as meter:
            train(model, opt, data())
        out["alone"] = (meter.collectives, max_diff(full_params(model), reference("dobb")))
    dist.barrier()
    return out


def _snapshot(model, opt):
    state = [opt.state[p][k] for g in opt.param_groups for p in g["params"] for k in sorted(opt.state[p])
             if isinstance(opt.state[p][k], torch.Tensor)]
    return {"params": full_params(model), "state": [full(s).clone() for s in state]}


def _nonfinite(rank, world, variant, gradless_others=False):
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    for m in (model.fc1, model.fc2, model.head, model):
        fully_shard(m, mesh=mesh)
    opt = make_opt(model, variant)
    batches = data()
    train(model, opt, batches[:1], (rank, world))
    x, y = batches[1]
    rows = x.shape[0] // world
    torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
    if rank == world - 1:  # one entry of the last rank's shard of fc2
        model.fc2.weight.grad.to_local()[0, 0] = math.nan
    elif gradless_others:  # the other ranks hold no gradient at all: they must still take part
        for p in model.parameters():
            p.grad = None
    before = _snapshot(model, opt)
    try:
        opt.step()
        msg = None
    except ValueError as e:
        msg = str(e)
    unchanged = max_diff(before, _snapshot(model, opt))
    opt.zero_grad()
    train(model, opt, batches[1:], (rank, world))  # the rejected step is retried, then the run goes on
    return {"msg": msg, "same_msg": same_on_all_ranks(msg), "unchanged": unchanged,
            "diff": max_diff(full_params(model), reference(variant))}


class Gated(Net):
    """Net with an ``expert`` that only the first ``k`` rows of the global batch go through (on
    ``world`` ranks: all of rank 0's rows, none of the others')."""

    def __init__(self, seed=0):
        super().__init__(seed=seed)
        self.expert = nn.Linear(D, D, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.expert.weight.copy_(torch.randn(D, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64) / 4)
        self.k = None

    def forward(self, x):
        k = x.shape[0] if self.k is None else self.k
        if k > 0:
            x = torch.cat([x[:k] + self.expert(x[:k]), x[k:]])
        return super().forward(x)

    matrices = ("fc1", "fc2", "head", "expert")


def _skipped_layer(rank, world, variant, paused_refresh):
    batches = data(rows=32 * world)
    rows = 32
    model = DDP(Gated(), find_unused_parameters=True)
    model.module.k = rows if rank == 0 else 0
    opt = make_opt(model, variant, matrices=Gated.matrices)
    for t, (x, y) in enumerate(batches):
        xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        ctx = opt.capture_paused() if paused_refresh and t == 2 else _null()
        with ctx:
            torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    expert = opt.state[model.module.expert.weight]
    # the single process: rank 0's rows through the expert
    ref = Gated()
    ref.k = rows
    ref_opt = make_opt(ref, variant, matrices=Gated.matrices, stat_group=None)
    for t, (x, y) in enumerate(batches):
        ctx = ref_opt.capture_paused() if paused_refresh and t == 2 else _null()
        with ctx:
            torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"same_basis": same_on_all_ranks(expert["basis"].tolist()), "captures": expert["captures"],
            "ref_captures": ref_opt.state[ref.expert.weight]["captures"],
            "stat_diff": max_diff(stats(opt), stats(ref_opt)),
            "diff": max_diff(full_params(model.module), full_params(ref))}


def _grad_on_one_rank(rank, world):
    """Plain parameters, an explicit ``stat_group`` and no gradient sync (each rank steps its own
    replica): the expert runs on rank 0 only, so only rank 0 holds its gradient. Its statistic is
    shared state: every rank takes part in each refresh (before the fix the other ranks left its
    slot out of the reduction: gloo aborted on the size mismatch), so the step counts and bases
    agree and equal a single process fed rank 0's rows; the weight stays where there is no grad."""
    rows = 32
    batches = data(rows=rows * world)
    model = Gated()
    model.k = rows if rank == 0 else 0
    opt = make_opt(model, "dobb", matrices=Gated.matrices, stat_group=dist.group.WORLD)
    before = model.expert.weight.detach().clone()
    ref = Gated()
    ref.k = rows
    ref_opt = make_opt(ref, "dobb", matrices=Gated.matrices, stat_group=None)
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x[:rows]), y[:rows]).backward()  # rank 0's rows
        ref_opt.step()
        ref_opt.zero_grad()
    mine, theirs = opt.state[model.expert.weight], ref_opt.state[ref.expert.weight]
    return {"same": same_on_all_ranks((mine["step"], mine["captures"], mine["basis"].tolist())),
            "step": (mine["step"], theirs["step"]), "captures": (mine["captures"], theirs["captures"]),
            "stat_diff": (mine["stat"] - theirs["stat"]).abs().max().item(),
            "basis_diff": (mine["basis"] - theirs["basis"]).abs().max().item(),
            "moved": (model.expert.weight - before).abs().max().item()}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _recreate_group(rank, world, port):
    """Build, step, destroy the process group, re-create it, build again on a mesh that needs
    flattened groups (HSDP on 4 ranks), train: the run equals the single-process one."""
    def run():
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        model = Net()
        for m in (model.fc1, model.fc2, model.head, model):
            fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(0))
        opt = make_opt(model, "dobb")
        train(model, opt, data(), (rank, world))
        return max_diff(full_params(model), reference("dobb"))

    first = run()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return {"first": first, "second": run()}


def worker(rank, world):
    results = {}
    check = checker(results)
    check("no_guess", _no_guess, rank, world)
    for v in ("dobb", "dobb-g-l2"):
        check(("nonfinite", v), _nonfinite, rank, world, v)
    check(("nonfinite_gradless", "dobb"), _nonfinite, rank, world, "dobb", True)
    for v in ("dobb", "dobb-g"):
        check(("skip", v), _skipped_layer, rank, world, v, False)
    check(("skip", "paused"), _skipped_layer, rank, world, "dobb", True)
    check("grad_on_one_rank", _grad_on_one_rank, rank, world)
    return results


def recreate_worker(rank, world, port):
    results = {}
    checker(results)("recreate", _recreate_group, rank, world, port)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


@pytest.fixture(scope="module", params=[2, 4])
def recreated(request):  # on processes of its own: it replaces their process group
    return spawn(recreate_worker, request.param, free_port(), fresh=True)


def test_plain_parameters_need_a_named_group(ranks):
    for rank, r in enumerate(per_rank(ranks, "no_guess")):
        assert "stat_group" in r["plain"] and "DistributedDataParallel" in r["plain"]
        if rank == 0:
            assert r["alone"][0] == 0 and r["alone"][1] < 1e-12


@pytest.mark.parametrize("variant", ["dobb", "dobb-g-l2"])
def test_nonfinite_gradient_on_one_rank_is_decided_together(ranks, variant):
    res = per_rank(ranks, ("nonfinite", variant))
    for r in res:
        assert "non-finite gradient" in r["msg"] and "parameter #1 (shape (16, 32))" in r["msg"]  # fc2
        assert f"on 1 of {len(res)} ranks" in r["msg"] and r["same_msg"]
        assert r["unchanged"] == 0.0
        assert r["diff"] < 1e-12  # the retried step and the rest of the run: the single-process numbers


def test_nonfinite_flag_collective_issued_by_ranks_without_gradients(ranks):
    res = per_rank(ranks, ("nonfinite_gradless", "dobb"))
    for r in res:
        assert "non-finite gradient" in r["msg"] and f"on 1 of {len(res)} ranks" in r["msg"] and r["same_msg"]
        assert r["unchanged"] == 0.0


@pytest.mark.parametrize("variant", ["dobb", "dobb-g"])
def test_layer_skipped_on_some_ranks_gives_token_weighted_statistic(ranks, variant):
    for r in per_rank(ranks, ("skip", variant)):
        assert r["same_basis"]
        assert r["captures"] == r["ref_captures"] == [[2]]  # steps 0 and 2 (refresh_every=2)
        assert r["stat_diff"] < 1e-12 and r["diff"] < 1e-12


def test_refresh_without_any_token_keeps_statistic_and_basis(ranks):
    for r in per_rank(ranks, ("skip", "paused")):
        assert r["same_basis"]
        assert r["captures"] == r["ref_captures"] == [[1]]  # step 2 saw no token anywhere: nothing replaced
        assert r["stat_diff"] < 1e-12 and r["diff"] < 1e-12


def test_process_group_destroyed_and_recreated(recreated):
    for r in per_rank(recreated, "recreate"):
        assert r["first"] < 1e-12 and r["second"] < 1e-12


def test_shared_statistic_of_a_matrix_with_a_gradient_on_one_rank_only(ranks):
    for rank, r in enumerate(per_rank(ranks, "grad_on_one_rank")):
        assert r["same"]
        assert r["step"][0] == r["step"][1] and r["captures"][0] == r["captures"][1] and r["captures"][0][0][0] >= 2
        assert r["stat_diff"] < 1e-12 and r["basis_diff"] < 1e-12
        assert (r["moved"] > 0) == (rank == 0)  # a rank without the gradient leaves the weight alone
