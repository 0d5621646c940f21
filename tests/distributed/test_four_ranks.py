"""Dobb on 4 gloo ranks: FSDP2 x tensor parallel on a (dp=2, tp=2) mesh, and uneven / empty FSDP
shards (an 18-row and a 2-row matrix over 4 ranks: shards 5,5,5,3 and 1,1,0,0; microsoft/dion
#74/#83 hung or crashed there). Reference: the single-process float64 run on the whole batch.
"""
from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _common import (per_rank as _get, BLOCKS, REFRESH, STEPS, VARIANTS, Net, data, fixed_partitions, full_params, make_opt,
                     max_diff, partitions, reference, reference_stats, same_on_all_ranks, state_keys, stats, train)
from _spawn import spawn
from dobb import Dobb

pytestmark = pytest.mark.slow
WORLD = 4


class Uneven(nn.Module):
    """``a``: 18 x 16 (FSDP rows 5,5,5,3 over 4 ranks), ``b``: 2 x 18 (rows 1,1,0,0)."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a = nn.Linear(16, 18, dtype=torch.float64)
        self.b = nn.Linear(18, 2, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def uneven_opt(model, variant, blocks_a=4, blocks_b=2, **kw):
    groups = [{"params": [model.a.weight], "blocks": blocks_a}, {"params": [model.b.weight], "blocks": blocks_b},
              {"params": [model.a.bias, model.b.bias], "algorithm": "adamw"}]
    return Dobb(groups, model, lr=0.02, weight_decay=0.01, refresh_every=REFRESH, basis_dtype=torch.float64,
                stat_dtype=torch.float64, **VARIANTS[variant], **kw)


def uneven_reference(variant, batches, sizes):
    model = Uneven()
    with fixed_partitions(sizes):
        opt = uneven_opt(model, variant, stat_group=None)
    train(model, opt, batches)
    return full_params(model)


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

    def check(key, fn, *args):
        try:
            results[key] = fn(*args)
        except Exception:
            results[key] = traceback.format_exc()

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_coordinate()[0]

    def fsdp_tp(variant):
        # FSDP shards the axis Dobb does not block: rows for Dobb, columns for Dobb-G
        model = _fsdp_tp(mesh, 0 if VARIANTS[variant]["side"] == "input" else 1)(Net())
        opt = make_opt(model, variant)
        log = train(model, opt, data(), (dp_rank, 2))
        return {"diff": max_diff(full_params(model), reference(variant)), "log": log,
                "same_keys": same_on_all_ranks(state_keys(opt)),
                "stat_diff": max((a - b).abs().max().item() for a, b in zip(stats(opt), reference_stats(variant)))}

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
                "stat_diff": max((a - b).abs().max().item() for a, b in zip(stats(opt), reference_stats(variant)))}

    for v in ("dobb", "dobb-g"):
        check(("hsdp", v), hsdp, v)

    flat = init_device_mesh("cpu", (world,))
    batches = data(rows=32, out=2)  # more rows than the widest block: no null-space coefficients

    def uneven(variant):
        model = Uneven()
        for m in (model.a, model.b, model):
            fully_shard(m, mesh=flat)
        opt = uneven_opt(model, variant)
        shapes = [tuple(p.to_local().shape) for p in (model.a.weight, model.b.weight)]
        log = train(model, opt, batches, (rank, world))
        sizes = partitions(opt)
        return {"diff": max_diff(full_params(model), uneven_reference(variant, batches, sizes)), "log": log,
                "shapes": shapes, "same_keys": same_on_all_ranks(state_keys(opt)), "sizes": sizes}

    for v in VARIANTS:
        check(("uneven", v), uneven, v)

    def uneven_errors():
        model = Uneven()
        for m in (model.a, model.b, model):
            fully_shard(m, mesh=flat)
        msgs = []
        for ba, bb in ((3, 2), (4, 4)):
            try:
                uneven_opt(model, "dobb-g", ba, bb)
                msgs.append(None)
            except ValueError as e:
                msgs.append(str(e))
        return msgs

    check("uneven_errors", uneven_errors)
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
        assert [e for _, e, *_ in r["log"]] == [FSDP_TP_STAT[side] if t % 2 == 0 else 0 for t in range(STEPS)]
        if norm == "sign":
            assert [s for s, *_ in r["log"]] == [0] * STEPS
        else:
            assert [(s, e) for s, _, _, e in r["log"]] == [(3, FSDP_TP_NORM[side])] * STEPS


@pytest.mark.parametrize("variant", ["dobb", "dobb-g"])
def test_hsdp_averages_over_both_data_parallel_dims(ranks, variant):
    side = VARIANTS[variant]["side"]
    full = 16 * 4 + 32 * 8 + 16 * 4 if side == "input" else 32 * 8 + 16 * 4 + 8 * 2  # n^2/B per matrix
    for r in _get(ranks, ("hsdp", variant)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        assert [e for _, e, *_ in r["log"]] == [full if t % 2 == 0 else 0 for t in range(STEPS)]
        assert [s for s, *_ in r["log"]] == [0] * STEPS


def test_strided_blocked_axis_is_a_value_error(ranks):
    for r in _get(ranks, "strided"):
        # Dobb-G on fc1 (rows: TP Shard(0), then FSDP Shard(0) -> _StridedShard) is refused, with the fix
        assert "(32, 16)" in r["msg"] and "strides" in r["msg"] and "shard_placement_fn" in r["msg"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_uneven_and_empty_shards(ranks, variant):
    side, norm = VARIANTS[variant]["side"], VARIANTS[variant]["norm"]
    for rank, r in enumerate(_get(ranks, ("uneven", variant))):
        assert r["shapes"] == [((5, 5, 5, 3)[rank], 16), ((1, 1, 0, 0)[rank], 18)]
        # blocks cut at the shard boundaries of the blocked axis (an empty shard holds none)
        assert r["sizes"] == ([[4, 4, 4, 4], [9, 9]] if side == "input" else [[5, 5, 5, 3], [1, 1]])
        assert r["diff"] < 1e-12
        assert r["same_keys"]
        # statistic: whole row-stacked (k, s_max) per matrix: Dobb 16*4 + 18*9, Dobb-G 18*5 + 2*1
        stat = 16 * 4 + 18 * 9 if side == "input" else 18 * 5 + 2 * 1
        assert [e for _, e, *_ in r["log"]] == [stat if t % 2 == 0 else 0 for t in range(STEPS)]
        expect = (2, 16 + 18) if norm == "l2" and side == "input" else (0, 0)
        assert [(s, e) for s, _, _, e in r["log"]] == [expect] * STEPS


def test_uneven_block_errors_list_valid_counts(ranks):
    for msgs in _get(ranks, "uneven_errors"):
        assert "a.weight" in msgs[0] or "#0" in msgs[0]
        assert "valid block counts: 4, 8, 12" in msgs[0]
        assert "valid block counts: 2" in msgs[1]


def test_block_count_constant():
    assert BLOCKS == 4  # the payload constants above assume it
