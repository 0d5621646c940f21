"""Dobb on 2 gloo ranks: DDP, FSDP2 (Shard(0) and Shard(1)), tensor parallel, the payload meter,
and construction errors. One spawn runs every check; the tests assert on what the ranks returned.

Reference: the single-process run of the same float64 model on the whole batch (``_common``).
Derived payloads (SPEC Table 3/7): the statistic mean moves ``n^2/B`` entries per matrix per
refresh (row-stacked ``(n, n/B)``), Dobb/Dobb-G steps issue no collective, Dobb-ell2 with the
rows sharded reduces ``n`` column norms per matrix per step (Dobb-G-ell2: ``m`` with columns sharded).
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import (per_rank as _get, BLOCKS, STEPS, VARIANTS, Net, data, full_params, make_opt, max_diff, reference,
                     reference_stats, same_on_all_ranks, state_keys, stats, train)
from _spawn import spawn
from dobb import Dobb
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow
WORLD = 2
SHAPES = {"fc1": (32, 16), "fc2": (16, 32), "head": (8, 16)}  # (m, n) of Net's matrices


def stat_entries(side):
    """Table 3's excluded term: ``k^2 / B`` per matrix (k = blocked axis length)."""
    return sum((n if side == "input" else m) ** 2 // BLOCKS for m, n in SHAPES.values())


def _fsdp(model, mesh, dim):
    for name in Net.matrices:
        fully_shard(getattr(model, name), mesh=mesh,
                    shard_placement_fn=lambda p, d=dim: Shard(d if p.dim() == 2 else 0))
    fully_shard(model, mesh=mesh)
    return model


def _run(rank, world, variant, wrap, shard, **kw):
    model = wrap(Net())
    inner = model.module if isinstance(model, DDP) else model
    opt = make_opt(inner, variant, **kw)
    log = train(model, opt, data(), shard)
    stat_diff = max((a - b).abs().max().item() for a, b in zip(stats(opt), reference_stats(variant, **kw)))
    return {"diff": max_diff(full_params(inner), reference(variant, **kw)), "log": log, "stat_diff": stat_diff,
            "placements": [tuple(getattr(s["stat"], "placements", ())) for s in (opt.state[p] for p in opt.param_groups[0]["params"])],
            "same_keys": same_on_all_ranks(state_keys(opt))}


def _meter_checks(rank, world):
    """The meter against CommDebugMode (counts) and known sizes (bytes)."""
    mesh = init_device_mesh("cpu", (world,))
    t = torch.ones(6, dtype=torch.float64)
    with PayloadMeter() as m, CommDebugMode() as c:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        out = torch.empty(12)
        dist.all_gather_into_tensor(out, torch.ones(6))
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6))
        d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        d.redistribute(mesh, [torch.distributed.tensor.Replicate()])
    return {"records": [(r.op, r.numel, r.bytes) for r in m.records], "debug": sum(c.get_comm_counts().values()),
            "collectives": m.collectives}


def _errors(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    msgs = {}

    def catch(key, fn):
        try:
            fn()
            msgs[key] = None
        except ValueError as e:
            msgs[key] = str(e)

    model = _fsdp(Net(), mesh, 0)
    catch("blocks", lambda: make_opt(model, "dobb-g", blocks=3))
    catch("stat_group", lambda: make_opt(model, "dobb", stat_group="nope"))
    # a ProcessGroup equal to the mesh's data-parallel dim is accepted; an explicit dim index too
    catch("pg_ok", lambda: make_opt(model, "dobb-g", stat_group=dist.group.WORLD))
    catch("dims_ok", lambda: make_opt(model, "dobb-g", stat_group=[0]))
    partial = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, [Partial()]))
    catch("partial", lambda: Dobb([partial], lr=0.1, source="grad_gram"))
    from torch.distributed.tensor.placement_types import _StridedShard
    strided = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 2), mesh, [_StridedShard(1, split_factor=2)],
                                                    shape=torch.Size((4, 4)), stride=(4, 1)))
    catch("strided", lambda: Dobb([strided], lr=0.1, source="grad_gram"))
    catch("strided_ok_other_axis", lambda: Dobb([strided], lr=0.1, source="grad_gram", side="output"))
    return msgs


def worker(rank, world):
    results = {}

    def check(key, fn, *args, **kw):
        try:
            results[key] = fn(*args, **kw)
        except Exception:  # reported by the test that reads this key
            results[key] = traceback.format_exc()

    shard = (rank, world)
    for v in ("dobb", "dobb-g"):
        check(("ddp", v), _run, rank, world, v, DDP, shard)
    mesh = init_device_mesh("cpu", (world,))
    for dim in (0, 1):
        for v in VARIANTS:
            check(("fsdp", dim, v), _run, rank, world, v, lambda m, d=dim: _fsdp(m, mesh, d), shard)
    check(("fsdp", 0, "gram"), _run, rank, world, "dobb", lambda m: _fsdp(m, mesh, 0), shard, source="grad_gram")
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = lambda m: parallelize_module(m, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})  # noqa: E731
    for v in VARIANTS:  # TP ranks see the same data: nothing to average (the plain head's default is the world)
        check(("tp", v), _run, rank, world, v, tp, (0, 1), stat_group=None)
    check("meter", _meter_checks, rank, world)
    check("errors", _errors, rank, world)
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, WORLD)


@pytest.mark.parametrize("variant", ["dobb", "dobb-g"])
def test_ddp_matches_single_process(ranks, variant):
    for r in _get(ranks, ("ddp", variant)):
        assert r["diff"] < 1e-12
        # the statistic itself equals the whole-batch one (output gradients rescaled by 1/P)
        assert r["stat_diff"] < 1e-12
        side = VARIANTS[variant]["side"]
        # step() issues nothing: the statistic mean was launched by the capture hook and overlapped
        assert [s for s, *_ in r["log"]] == [0] * STEPS
        assert [e for _, e, *_ in r["log"]] == [stat_entries(side) if t % 2 == 0 else 0 for t in range(STEPS)]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_matches_single_process_with_predicted_payload(ranks, dim, variant):
    side, norm = VARIANTS[variant]["side"], VARIANTS[variant]["norm"]
    blocked = 1 if side == "input" else 0
    for r in _get(ranks, ("fsdp", dim, variant)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        assert r["same_keys"]
        # block state: Shard(0) exactly when the weight's blocked axis is sharded
        assert r["placements"] == [(Shard(0),) if dim == blocked else (torch.distributed.tensor.Replicate(),)] * 3
        assert [e for _, e, *_ in r["log"]] == [stat_entries(side) if t % 2 == 0 else 0 for t in range(STEPS)]
        if norm == "sign" or dim == blocked:
            assert [s for s, *_ in r["log"]] == [0] * STEPS  # Table 3/7: zero
        else:
            # Table 7: one column (row) norm per unblocked-axis entry and matrix, one reduction per matrix
            k = sum(n if side == "input" else m for m, n in SHAPES.values())
            assert [(s, e) for s, _, _, e in r["log"]] == [(3, k)] * STEPS


def test_fsdp2_grad_gram_source(ranks):
    for r in _get(ranks, ("fsdp", 0, "gram")):
        assert r["diff"] < 1e-12
        # Gram partial sums over the row shards, only on refresh steps, in step()
        assert [s for s, *_ in r["log"]] == [3 if t % 2 == 0 else 0 for t in range(STEPS)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_matches_single_process(ranks, variant):
    norm = VARIANTS[variant]["norm"]
    for r in _get(ranks, ("tp", variant)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        steps = [s for s, *_ in r["log"]]
        if norm == "sign":
            assert steps == [0] * STEPS
        else:  # ell2: only the layer whose unblocked axis is TP-sharded (fc1 rows / fc2 rows) reduces
            assert steps == [1] * STEPS
            assert [e for *_, e in r["log"]] == [16] * STEPS
        assert [e for _, e, *_ in r["log"]] == [0] * STEPS  # stat_group=None: no statistic reduction


def test_meter_sees_every_collective_with_its_size(ranks):
    for r in _get(ranks, "meter"):
        assert r["collectives"] == r["debug"] == 6
        assert r["records"][:4] == [("all_reduce", 6, 48), ("all_reduce", 6, 48), ("all_gather", 12, 48),
                                    ("reduce_scatter", 6, 24)]
        # distribute_tensor scatters from rank 0 (c10d), redistribute all-gathers (functional)
        assert r["records"][4][0] == "scatter" and r["records"][5] == ("all_gather", 16, 64)


def test_bad_layouts_are_value_errors_at_construction(ranks):
    for msgs in _get(ranks, "errors"):
        assert "valid block counts: 2, 4, 6" in msgs["blocks"]
        assert "stat_group" in msgs["stat_group"]
        assert msgs["pg_ok"] is None and msgs["dims_ok"] is None
        assert "Partial" in msgs["partial"]
        assert "strides" in msgs["strided"]
        assert msgs["strided_ok_other_axis"] is None
