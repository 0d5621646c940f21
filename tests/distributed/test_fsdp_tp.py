"""Dobb on 2-D meshes of 4 gloo ranks: FSDP2 x tensor parallel on (dp=2, tp=2), and HSDP (both dims
data-parallel). Reference: the single-process float64 run on the whole batch.
"""
from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _common import (per_rank as _get, BLOCKS, STEPS, VARIANTS, Net, checker, data, full_params, make_opt, max_diff,
                     reference, reference_stats, same_on_all_ranks, state_keys, stats, train)
from _spawn import spawn

pytestmark = pytest.mark.slow
WORLD = 4


def _fsdp_tp(mesh, fsdp_dim):
    def wrap(model):
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for name in Net.matrices:
            fully_shard(getattr(model, name), mesh=mesh["dp"],
                        shard_placement_fn=lambda p: Shard(fsdp_dim if p.dim() == 2 else 0))
        fully_shard(model, mesh=mesh["dp"])
        return model
    return wrap


def worker(rank, world):
    results = {}

    check = checker(results)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_coordinate()[0]

    def fsdp_tp(variant):
        # FSDP shards the axis Dobb does not block: rows for Dobb, columns for Dobb-G
        model = _fsdp_tp(mesh, 0 if VARIANTS[variant]["side"] == "input" else 1)(Net())
        opt = make_opt(model, variant)
        log = train(model, opt, data(), (dp_rank, 2))
        return {"diff": max_diff(full_params(model), reference(variant)), "log": log,
                "same_keys": same_on_all_ranks(state_keys(opt)),
                "stat_diff": max_diff(stats(opt), reference_stats(variant))}

    for v in VARIANTS:
        check(("fsdp_tp", v), fsdp_tp, v)

    def strided_blocked_axis():
        model = _fsdp_tp(mesh, 0)(Net())
        try:
            make_opt(model, "dobb-g")
        except ValueError as e:
            return {"msg": str(e)}
        return {"msg": None}

    check("strided", strided_blocked_axis)

    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def hsdp(variant):
        # HSDP: both mesh dims are data-parallel; the statistic is averaged over the flattened pair
        model = Net()
        for m in (model.fc1, model.fc2, model.head, model):
            fully_shard(m, mesh=hsdp_mesh)
        opt = make_opt(model, variant)
        log = train(model, opt, data(), (rank, world))
        return {"diff": max_diff(full_params(model), reference(variant)), "log": log,
                "stat_diff": max_diff(stats(opt), reference_stats(variant))}

    for v in ("dobb", "dobb-g"):
        check(("hsdp", v), hsdp, v)

    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, WORLD)


# Per-rank payloads on the (dp=2, tp=2) mesh. Statistic (n^2/B per matrix, the tp-sharded blocked
# axis split in two): Dobb fc1 16*4 + fc2 (32*8)/2 + head 16*4; Dobb-G fc1 (32*8)/2 + fc2 16*4 + head 8*2.
# ell2 norms (one per entry of the blocked axis held locally): Dobb fc1 16 + fc2 16 + head 16;
# Dobb-G fc1 16 + fc2 16 + head 8.
FSDP_TP_STAT = {"input": 64 + 128 + 64, "output": 128 + 64 + 16}
FSDP_TP_NORM = {"input": 48, "output": 40}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp_x_tp_matches_single_process(ranks, variant):
    side, norm = VARIANTS[variant]["side"], VARIANTS[variant]["norm"]
    for r in _get(ranks, ("fsdp_tp", variant)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        assert r["same_keys"]
        # + a token count per matrix; the statistic's group (dp) is not the step's (all 4 ranks), so the
        # finiteness flags go in their own reduction every step
        assert [e for _, e, *_ in r["log"]] == [FSDP_TP_STAT[side] + 3 if t % 2 == 0 else 0 for t in range(STEPS)]
        assert [f for *_, f in r["log"]] == [1] * STEPS
        if norm == "sign":
            assert [s for s, *_ in r["log"]] == [0] * STEPS
        else:
            assert [(s, e) for s, _, _, e, _ in r["log"]] == [(3, FSDP_TP_NORM[side])] * STEPS


@pytest.mark.parametrize("variant", ["dobb", "dobb-g"])
def test_hsdp_averages_over_both_data_parallel_dims(ranks, variant):
    side = VARIANTS[variant]["side"]
    full = 16 * 4 + 32 * 8 + 16 * 4 if side == "input" else 32 * 8 + 16 * 4 + 8 * 2  # n^2/B per matrix
    for r in _get(ranks, ("hsdp", variant)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        # + a token count per matrix and Net's 6 finiteness flags (the flattened group is the step's)
        assert [e for _, e, *_ in r["log"]] == [full + 3 + 6 if t % 2 == 0 else 0 for t in range(STEPS)]
        assert [s for s, *_ in r["log"]] == [0] * STEPS


def test_strided_blocked_axis_is_a_value_error(ranks):
    for r in _get(ranks, "strided"):
        # Dobb-G on fc1 (rows: TP Shard(0), then FSDP Shard(0) -> _StridedShard) is refused, with the fix
        assert "(32, 16)" in r["msg"] and "strides" in r["msg"] and "shard_placement_fn" in r["msg"]


def test_block_count_constant():
    assert BLOCKS == 4  # the payload constants above assume it
