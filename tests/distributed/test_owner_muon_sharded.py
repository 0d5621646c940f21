"""Owner-compute Muon on 2 and 4 gloo ranks against single-process Muon, with its derived payload.

Reference: ``dobb.Muon`` in one process on the same float64 weights and gradients (``ns_dtype=
"float64"``, so rounding is far below the tolerance; the owner runs the same NS5 on the same full
matrix). Cases: synthetic DTensors (``Shard(0)``/``Shard(1)``, equal shapes stacked, uneven shards
5,5,5,3 and empty ones 1,1,0,0 over 4 ranks: microsoft/dion #74/#83), real FSDP2 (``fully_shard``)
and real DDP on the tiny float64 model of ``_common``. Derived payload per step and rank (float64,
8 bytes an entry): sharded ``8 (sum_i |my shard of i| + sum_{i I own} m_i n_i)`` in exactly two
all-to-alls; replicated ``8 P ceil(N_g/P) m_g n_g`` in one all-gather per shape group ``g``.
"""
from __future__ import annotations

import math
import traceback

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import _common as C
from _common import Net, data, exchange, full_params, groups, max_diff, per_rank, train
from _spawn import spawn_once
from dobb.baselines import Muon
from dobb.baselines.muon_family.owner_muon import OwnerMuon
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow
STEPS, LR, WD = 3, 0.05, 0.1
OPTS = dict(ns_dtype="float64")
# (shape, shard dim): three equal shapes (stacked on their owners), uneven and empty shards
CASES = [((12, 20), 0), ((12, 20), 0), ((12, 20), 0), ((18, 10), 0), ((10, 18), 1), ((2, 9), 0), ((9, 2), 1),
         ((3, 7), 0)]


def chunks(length, parts):
    """DTensor Shard sizes from torch.chunk itself (it drops trailing empty chunks: pad them back)."""
    sizes = [len(c) for c in torch.arange(length).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


def weights_and_grads(shape, seed):
    return C.weights_and_grads(shape, seed, STEPS)


def reference_weights(cases=CASES):
    params = [nn.Parameter(weights_and_grads(s, i)[0]) for i, (s, _) in enumerate(cases)]
    opt = Muon(params, lr=LR, weight_decay=WD, **OPTS)
    for t in range(STEPS):
        for i, (p, (s, _)) in enumerate(zip(params, cases)):
            p.grad = weights_and_grads(s, i)[1][t]
        opt.step()
    return [p.detach() for p in params]


# ----------------------------------------------------------------------------- rank-side code
def _synthetic(rank, world):
    params, grads = C.sharded_problem(init_device_mesh("cpu", (world,)), CASES, STEPS)
    opt = OwnerMuon(params, lr=LR, weight_decay=WD, **OPTS)
    log = C.metered_steps(opt, params, grads)
    return {"W": [p.detach().full_tensor() for p in params], "log": log,
            "owners": [opt.owners[p] for p in params], "gathered": len(opt.gathered),
            "local": [math.prod(p.to_local().shape) for p in params]}


def _fsdp(rank, world):
    model = C.fsdp_net(init_device_mesh("cpu", (world,)))
    opt = OwnerMuon(groups(model), lr=LR, weight_decay=WD, **OPTS)
    mats = opt.param_groups[0]["params"]
    log = train(model, opt, data(), (rank, world), meter=True)
    return {"W": full_params(model), "steps": [s for s, *_ in log], "owners": [opt.owners[p] for p in mats],
            "local": [math.prod(p.to_local().shape) for p in mats], "bytes": _step_bytes(model, opt, rank, world)}


def _step_bytes(model, opt, rank, world):
    """Bytes of one more step() (the meter inside ``train`` logs counts only)."""
    x, y = data(1, seed=7)[0]
    rows = x.shape[0] // world
    torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
    with PayloadMeter() as m:
        opt.step()
    opt.zero_grad()
    rs = exchange(m)
    return (sum(r.bytes for r in rs), sorted({r.op for r in rs}))


def _ddp(rank, world):
    net = Net()
    model = DDP(net)
    opt = OwnerMuon(groups(net), lr=LR, weight_decay=WD, **OPTS)
    log = train(model, opt, data(), (rank, world), meter=True)
    return {"W": full_params(net), "steps": [s for s, *_ in log], "bytes": _step_bytes(model, opt, rank, world),
            "owners": [opt.owners[p] for p in opt.param_groups[0]["params"]]}


FALLBACK = [((12, 20), 0), ((18, 10), 0)]


def _fallback(rank, world):
    """A 2-D mesh (HSDP-like: replicated over dim 0, sharded over dim 1) is not served by the
    all-to-all path: the matrices are gathered as Muon does, and listed."""
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2, world // 2))
    params, grads = [], []
    for i, (shape, _) in enumerate(FALLBACK):
        w, gs = weights_and_grads(shape, i)
        params.append(nn.Parameter(distribute_tensor(w, mesh, [Replicate(), Shard(0)], src_data_rank=None)))
        grads.append([distribute_tensor(g, mesh, [Replicate(), Shard(0)], src_data_rank=None) for g in gs])
    opt = OwnerMuon(params, lr=LR, weight_decay=WD, **OPTS)
    for t in range(STEPS):
        for p, gs in zip(params, grads):
            p.grad = gs[t]
        opt.step()
    return {"W": [p.detach().full_tensor() for p in params], "gathered": sorted(opt.gathered.values())}


def worker(rank, world):
    results = {}
    jobs = (("synthetic", _synthetic), ("fsdp", _fsdp), ("ddp", _ddp)) + ((("fallback", _fallback),) if world == 4 else ())
    for key, fn in jobs:
        try:
            results[key] = fn(rank, world)
        except Exception:  # reported by the test that reads this key
            results[key] = traceback.format_exc()
    return results


def reference_model():
    model = Net()
    opt = Muon(groups(model), lr=LR, weight_decay=WD, **OPTS)
    train(model, opt, data())
    return full_params(model)


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return request.param, spawn_once(worker, request.param)


# ----------------------------------------------------------------------------- tests
def test_sharded_equals_single_process_muon(run):
    world, ranks = run
    ref = reference_weights()
    for r in per_rank(ranks, "synthetic"):
        assert r["gathered"] == 0
        assert max((a - b).abs().max().item() for a, b in zip(r["W"], ref)) < 1e-10


def test_sharded_payload_is_derived_count_in_two_all_to_alls(run):
    world, ranks = run
    results = per_rank(ranks, "synthetic")
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results)  # one decision, taken identically
    assert sorted(set(owners)) == list(range(world))  # every rank owns something here
    for rank, r in enumerate(results):
        # this rank's shard sizes are the torch.chunk sizes (uneven and empty ones included)
        assert r["local"] == [chunks(s[d], world)[rank] * s[1 - d] for s, d in CASES]
        mine = sum(math.prod(s) for (s, _), o in zip(CASES, owners) if o == rank)
        expected = 8 * (sum(r["local"]) + mine)
        assert r["log"] == [(2, expected, ["all_to_all", "all_to_all"])] * STEPS
    # summed over ranks: the table's leading count (dobb-bench payload), 2 mn per matrix, exactly
    from dobb_bench.cost.payload import payload_entries

    total = sum(r["log"][0][1] for r in results)
    assert total == 8 * sum(payload_entries("owner-muon", *s, shards=world) for s, _ in CASES)


def test_owners_balanced_by_cost(run):
    world, ranks = run
    owners = per_rank(ranks, "synthetic")[0]["owners"]
    cost = [2 * min(s) ** 2 * max(s) + min(s) ** 3 for s, _ in CASES]
    loads = [sum(c for c, o in zip(cost, owners) if o == r) for r in range(world)]
    assert max(loads) - min(loads) <= max(cost)
    # the three equal matrices go to three different ranks when there are enough
    assert len({owners[0], owners[1], owners[2]}) == min(3, world)


def test_fsdp2_equals_single_process_muon_with_derived_payload(run):
    world, ranks = run
    ref = reference_model()
    shapes = [tuple(getattr(Net(), m).weight.shape) for m in Net.matrices]
    for rank, r in enumerate(per_rank(ranks, "fsdp")):
        assert max_diff(r["W"], ref) < 1e-10
        assert r["steps"] == [2] * 4  # two all-to-alls per step, nothing else (AdamW is elementwise)
        mine = sum(math.prod(s) for s, o in zip(shapes, r["owners"]) if o == rank)
        assert r["bytes"] == (8 * (sum(r["local"]) + mine), ["all_to_all"])


def test_ddp_equals_single_process_muon_with_derived_payload(run):
    world, ranks = run
    ref = reference_model()
    shapes = [tuple(getattr(Net(), m).weight.shape) for m in Net.matrices]  # three distinct shapes
    expected = 8 * sum(world * 1 * math.prod(s) for s in shapes)  # ceil(1/P) = 1 slot per rank per shape
    for r in per_rank(ranks, "ddp"):
        assert max_diff(r["W"], ref) < 1e-10
        assert r["steps"] == [len(shapes)] * 4  # one all-gather per shape group
        assert r["bytes"] == (expected, ["all_gather"])
        assert sorted(set(r["owners"])) == sorted(set(range(min(world, 3))))  # dealt over the ranks


def test_two_d_mesh_falls_back_to_gather(run):
    world, ranks = run
    if world != 4:
        pytest.skip("a 2 x 2 mesh needs 4 ranks")
    ref = reference_weights(FALLBACK)
    for r in per_rank(ranks, "fallback"):
        assert r["gathered"] == ["2-D mesh", "2-D mesh"]
        assert max((a - b).abs().max().item() for a, b in zip(r["W"], ref)) < 1e-10
