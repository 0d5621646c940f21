"""Dion2 with ``select="shard"`` on 2 and 4 gloo ranks: rows chosen and orthogonalized within each
row shard equal the single process with the same blocks, and the step issues no collective.

Cases (float64, ``ns_dtype="float64"``):

- synthetic DTensors: ``Shard(0)`` (uneven rows 5,5,5,3 over 4 ranks) against a float64
  transcription of the rule (``_baseline_refs.dion2_shard_reference``) on the shard-cut blocks, no
  collective; ``Shard(1)`` (rows span the shards) is gathered and equals the same transcription;
- FSDP2 (``fully_shard``) on the tiny model of ``_common`` against single-process Dion2 with
  ``blocks`` = ranks and 2 x ranks: no collective in any step.
"""
from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from _baseline_refs import dion2_shard_reference
import _common as C
from _common import Net, checker, exchange, data, full_params, groups, max_diff, per_rank
from _spawn import spawn_once
from dobb.baselines import Dion2
from dobb.functional import block_sizes
from dobb.meter import PayloadMeter
from dobb.sharding import chunk_sizes


pytestmark = pytest.mark.slow
STEPS, LR, WD, FRACTION = 4, 0.05, 0.1, 0.25
OPTS = dict(ns_dtype="float64", select="shard", momentum=0.9, fraction=FRACTION)
CASES = [((18, 10), 0), ((12, 20), 0), ((18, 10), 1)]


def weights_and_grads(shape, seed):
    return C.weights_and_grads(shape, seed, STEPS)


def _metered(opt):
    with PayloadMeter() as m:
        opt.step()
    rs = exchange(m)
    return len(rs), sorted({r.op for r in rs})


def _synthetic(rank, world, dim):
    cases = [c for c in CASES if c[1] == dim]
    params, grads = C.sharded_problem(init_device_mesh("cpu", (world,)), cases, STEPS)
    opt = Dion2(params, lr=LR, weight_decay=WD, blocks=world, **OPTS)
    log = [(n, sorted(set(ops))) for n, _, ops in C.metered_steps(opt, params, grads)]
    return {"W": [p.detach().full_tensor() for p in params], "log": log}


def _fsdp(rank, world, blocks):
    model = C.fsdp_net(init_device_mesh("cpu", (world,)))
    opt = Dion2(groups(model), lr=LR, weight_decay=WD, blocks=blocks, **OPTS)
    log = _train(model, opt, data(STEPS), (rank, world))
    return {"W": full_params(model), "log": log}


def _train(model, opt, batches, shard):
    return C.metered_train(model, opt, batches, shard, _metered)


def worker(rank, world):
    results = {}
    check = checker(results)
    for dim in (0, 1):
        check(("synthetic", dim), _synthetic, rank, world, dim)
    for blocks in (world, 2 * world):
        check(("fsdp", blocks), _fsdp, rank, world, blocks)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return request.param, spawn_once(worker, request.param)


def synthetic_reference(world, dim):
    out = []
    for i, (shape, d) in enumerate(c for c in CASES if c[1] == dim):
        w, gs = weights_and_grads(shape, i)
        shards = chunk_sizes(shape[0], world) if d == 0 else None  # row blocks cut at row shards
        sizes = block_sizes(shape[0], world, shards)
        out.append(dion2_shard_reference(w, gs, sizes, FRACTION, lr=LR, wd=WD, mu=0.9))
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_synthetic_shards_equal_the_float64_rule(run, dim):
    world, ranks = run
    ref = synthetic_reference(world, dim)
    for r in per_rank(ranks, ("synthetic", dim)):
        assert max((a - b).abs().max().item() for a, b in zip(r["W"], ref)) < 1e-10
        if dim == 0:  # rows local: no communication in any step
            assert r["log"] == [(0, [])] * STEPS
        else:  # rows span the column shards: gathered
            assert all(count > 0 for count, _ in r["log"])


@pytest.mark.parametrize("per_shard", [1, 2])
def test_fsdp2_equals_single_process_with_no_collective(run, per_shard):
    world, ranks = run
    blocks = per_shard * world
    model = Net()
    opt = Dion2(groups(model), lr=LR, weight_decay=WD, blocks=blocks, **OPTS)
    _train(model, opt, data(STEPS), (0, 1))
    ref = full_params(model)
    for r in per_rank(ranks, ("fsdp", blocks)):
        assert max_diff(r["W"], ref) < 1e-10
        assert r["log"] == [(0, [])] * STEPS
