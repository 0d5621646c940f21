"""MuonBP on 2 and 4 gloo ranks: the sharded step equals the single-process one with the same
blocks, block steps issue no collective, full steps are the owner's two all-to-alls.

Cases (float64, ``ns_dtype="float64"``, period 3 over 5 steps: full steps 0 and 3):

- synthetic DTensors ``Shard(0)`` and ``Shard(1)`` (uneven shards 5,5,5,3 over 4 ranks) against a
  float64 transcription of the schedule (``_baseline_refs.muonbp_reference``) whose blocks are the
  shards (``blocks`` = ranks) or cut within them (``blocks`` = 2 x ranks);
- FSDP2 (``fully_shard``, ``Shard(0)``) on the tiny model of ``_common`` against single-process
  ``MuonBP(blocks=ranks, axis=0)``; the full steps move the derived owner payload;
- TP (``fc1`` column-parallel: row blocks, ``fc2`` row-parallel: column blocks, the head plain)
  against single-process MuonBP with those axes per matrix.
"""
from __future__ import annotations

import math

import pytest
from torch.distributed.device_mesh import init_device_mesh

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _baseline_refs import muonbp_reference
import _common as C
from _common import Net, checker, exchange, data, full_params, groups, max_diff, per_rank
from _spawn import spawn_once
from dobb.baselines import MuonBP
from dobb.functional import block_sizes
from dobb.meter import PayloadMeter
from dobb.sharding import chunk_sizes

pytestmark = pytest.mark.slow
STEPS, PERIOD, LR, WD = 5, 3, 0.05, 0.1
OPTS = dict(ns_dtype="float64", period=PERIOD, momentum=0.9)
FULL = [t % PERIOD == 0 for t in range(STEPS)]
CASES = [((18, 10), 0), ((10, 18), 1), ((12, 20), 0)]


def weights_and_grads(shape, seed):
    return C.weights_and_grads(shape, seed, STEPS)


def _metered(opt):
    with PayloadMeter() as m:
        opt.step()
    rs = exchange(m)
    return len(rs), sum(r.bytes for r in rs), [r.op for r in rs]


# ----------------------------------------------------------------------------- rank-side code
def _synthetic(rank, world, blocks):
    params, grads = C.sharded_problem(init_device_mesh("cpu", (world,)), CASES, STEPS)
    # axis=1 on purpose: a DTensor's blocks follow its sharded axis, whatever the group's axis says
    opt = MuonBP(params, lr=LR, weight_decay=WD, blocks=blocks, axis=1, **OPTS)
    log = C.metered_steps(opt, params, grads)
    return {"W": [p.detach().full_tensor() for p in params], "log": log, "owners": [opt.owners.get(p) for p in params],
            "local": [math.prod(p.to_local().shape) for p in params]}


def _train(model, opt, batches, shard):
    return C.metered_train(model, opt, batches, shard, _metered)


def _fsdp(rank, world):
    model = C.fsdp_net(init_device_mesh("cpu", (world,)))
    opt = MuonBP(groups(model), lr=LR, weight_decay=WD, blocks=world, axis=0, **OPTS)
    mats = opt.param_groups[0]["params"]
    log = _train(model, opt, data(STEPS), (rank, world))
    return {"W": full_params(model), "log": log, "owners": [opt.owners[p] for p in mats],
            "local": [math.prod(p.to_local().shape) for p in mats]}


def _tp(rank, world):
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize_module(Net(), tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = MuonBP(groups(model), lr=LR, weight_decay=WD, blocks=world, axis=0, **OPTS)
    log = _train(model, opt, data(STEPS), (0, 1))  # TP ranks see the same data
    return {"W": full_params(model), "log": log}


def worker(rank, world):
    results = {}
    check = checker(results)
    for blocks in (world, 2 * world):
        check(("synthetic", blocks), _synthetic, rank, world, blocks)
    check("fsdp", _fsdp, rank, world)
    check("tp", _tp, rank, world)
    return results


# ----------------------------------------------------------------------------- references
def synthetic_reference(world, blocks):
    out = []
    for i, (shape, dim) in enumerate(CASES):
        w, gs = weights_and_grads(shape, i)
        sizes = block_sizes(shape[dim], blocks, chunk_sizes(shape[dim], world))
        out.append(muonbp_reference(w, gs, sizes, dim, PERIOD, lr=LR, wd=WD, mu=0.9))
    return out


def model_reference(world, axes):
    """Single-process MuonBP on the whole batch, ``world`` blocks along ``axes[name]`` per matrix."""
    model = Net()
    others = groups(model)[1]
    mats = [{"params": [getattr(model, n).weight], "axis": axes[n]} for n in Net.matrices]
    opt = MuonBP(mats + [others], lr=LR, weight_decay=WD, blocks=world, **OPTS)
    _train(model, opt, data(STEPS), (0, 1))
    return full_params(model)


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return request.param, spawn_once(worker, request.param)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("per_shard", [1, 2])
def test_synthetic_shards_equal_the_float64_schedule(run, per_shard):
    world, ranks = run
    ref = synthetic_reference(world, per_shard * world)
    for r in per_rank(ranks, ("synthetic", per_shard * world)):
        assert max((a - b).abs().max().item() for a, b in zip(r["W"], ref)) < 1e-10


def test_block_steps_issue_no_collective_full_steps_the_owners(run):
    world, ranks = run
    results = per_rank(ranks, ("synthetic", world))
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results)
    for rank, r in enumerate(results):
        mine = sum(math.prod(s) for (s, _), o in zip(CASES, owners) if o == rank)
        full = (2, 8 * (sum(r["local"]) + mine), ["all_to_all", "all_to_all"])
        assert r["log"] == [full if f else (0, 0, []) for f in FULL]
    # a full step summed over ranks is P times the amortized count of dobb-bench payload (block steps: 0)
    from dobb_bench.cost.payload import payload_entries

    full_bytes = sum(r["log"][0][1] for r in results)
    derived = sum(payload_entries("muonbp", *s, {"period": PERIOD}, sharded="output" if d == 0 else "input",
                                  shards=world) for s, d in CASES)
    assert full_bytes == pytest.approx(8 * derived * PERIOD)


def test_fsdp2_equals_single_process_with_the_same_blocks(run):
    world, ranks = run
    ref = model_reference(world, {"fc1": 0, "fc2": 0, "head": 0})
    shapes = [tuple(getattr(Net(), m).weight.shape) for m in Net.matrices]
    for rank, r in enumerate(per_rank(ranks, "fsdp")):
        assert max_diff(r["W"], ref) < 1e-10
        mine = sum(math.prod(s) for s, o in zip(shapes, r["owners"]) if o == rank)
        full = (2, 8 * (sum(r["local"]) + mine), ["all_to_all", "all_to_all"])
        assert r["log"] == [full if f else (0, 0, []) for f in FULL]


def test_tp_equals_single_process_with_the_same_blocks(run):
    world, ranks = run
    # fc1 column-parallel: Shard(0), row blocks; fc2 row-parallel: Shard(1), column blocks; head plain
    ref = model_reference(world, {"fc1": 0, "fc2": 1, "head": 0})
    for r in per_rank(ranks, "tp"):
        assert max_diff(r["W"], ref) < 1e-10
        for f, (count, _, ops) in zip(FULL, r["log"]):
            # full: the owners' two all-to-alls for fc1/fc2, one all-gather for the replicated head
            assert (count, sorted(ops)) == ((3, ["all_gather", "all_to_all", "all_to_all"]) if f else (0, []))
