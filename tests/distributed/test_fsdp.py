"""Dobb under FSDP2 (``fully_shard``): Shard(0) and Shard(1) on 2 gloo ranks, uneven and empty shards
on 4 (an 18-row and a 2-row matrix: shards 5,5,5,3 and 1,1,0,0; microsoft/dion #74/#83 hung or
crashed there), and the layouts refused at construction. Reference: the single-process float64 run
on the whole batch.

Derived payloads (the paper's Tables 3 and 7; docs/distributed.md, "When communication happens"):
the statistic mean moves ``n^2/B`` entries per matrix per refresh (row-stacked ``(n, n/B)``),
Dobb/Dobb-G steps issue no collective, Dobb-ell2 with the rows sharded reduces ``n`` column norms
per matrix per step (Dobb-G-ell2: ``m`` with columns sharded).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch import nn

from _common import (REFRESH, SHAPES, STEPS, VARIANTS, Net, checker, data, fixed_partitions, full_params, make_opt,
                     max_diff, partitions, per_rank, run_variant, same_on_all_ranks, stat_entries, state_keys, train)
from _spawn import spawn
from dobb import Dobb

pytestmark = pytest.mark.slow


def fsdp(model, mesh, dim):
    for name in Net.matrices:
        fully_shard(getattr(model, name), mesh=mesh,
                    shard_placement_fn=lambda p, d=dim: Shard(d if p.dim() == 2 else 0))
    fully_shard(model, mesh=mesh)
    return model


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
    kw = {"split_refresh": False, **kw}  # the unsplit refresh: the payload checks are Table 3's (see _common.make_opt)
    return Dobb(groups, model, lr=0.02, weight_decay=0.01, refresh_every=REFRESH, basis_dtype=torch.float64,
                stat_dtype=torch.float64, **VARIANTS[variant], **kw)


def uneven_reference(variant, batches, sizes):
    model = Uneven()
    with fixed_partitions(sizes):
        opt = uneven_opt(model, variant, stat_group=None)
    train(model, opt, batches)
    return full_params(model)


def _errors(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    msgs = {}

    def catch(key, fn):
        try:
            fn()
            msgs[key] = None
        except ValueError as e:
            msgs[key] = str(e)

    model = fsdp(Net(), mesh, 0)
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
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    for dim in (0, 1):
        for v in VARIANTS:
            check((dim, v), run_variant, rank, world, v, lambda m, d=dim: fsdp(m, mesh, d), (rank, world))
    check((0, "gram"), run_variant, rank, world, "dobb", lambda m: fsdp(m, mesh, 0), (rank, world), source="grad_gram")
    for dim in (0, 1):  # the library default: staggered refresh
        check(("stagger", dim), run_variant, rank, world, "dobb", lambda m, d=dim: fsdp(m, mesh, d), (rank, world),
              stagger=True)
    check("errors", _errors, rank, world)
    return results


def worker4(rank, world):
    results = {}
    check = checker(results)
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
    return spawn(worker, 2)


@pytest.fixture(scope="module")
def four():
    return spawn(worker4, 4)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_matches_single_process_with_predicted_payload(ranks, dim, variant):
    side, norm = VARIANTS[variant]["side"], VARIANTS[variant]["norm"]
    blocked = 1 if side == "input" else 0
    for r in per_rank(ranks, (dim, variant)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        assert r["same_keys"]
        # block state: Shard(0) exactly when the weight's blocked axis is sharded
        assert r["placements"] == [(Shard(0),) if dim == blocked else (Replicate(),)] * 3
        assert [e for _, e, *_ in r["log"]] == [stat_entries(side) if t % 2 == 0 else 0 for t in range(STEPS)]
        assert [f for *_, f in r["log"]] == [0 if t % 2 == 0 else 1 for t in range(STEPS)]  # flags folded on refreshes
        if norm == "sign" or dim == blocked:
            assert [s for s, *_ in r["log"]] == [0] * STEPS  # Table 3/7: zero
        else:
            # Table 7: one column (row) norm per unblocked-axis entry and matrix, one reduction per matrix
            k = sum(n if side == "input" else m for m, n in SHAPES.values())
            assert [(s, e) for s, _, _, e, _ in r["log"]] == [(3, k)] * STEPS


def test_fsdp2_grad_gram_source(ranks):
    for r in per_rank(ranks, (0, "gram")):
        assert r["diff"] < 1e-12
        # Gram partial sums over the row shards, only on refresh steps, in step()
        assert [s for s, *_ in r["log"]] == [3 if t % 2 == 0 else 0 for t in range(STEPS)]
        # no statistic reduction to fold the finiteness flags into: they go alone every step
        assert [(e, f) for _, e, _, _, f in r["log"]] == [(0, 1)] * STEPS


def test_bad_layouts_are_value_errors_at_construction(ranks):
    for msgs in per_rank(ranks, "errors"):
        assert "valid block counts: 2, 4, 6" in msgs["blocks"]
        assert "stat_group" in msgs["stat_group"]
        assert msgs["pg_ok"] is None and msgs["dims_ok"] is None
        assert "Partial" in msgs["partial"]
        assert "strides" in msgs["strided"]
        assert msgs["strided_ok_other_axis"] is None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_uneven_and_empty_shards(four, variant):
    side, norm = VARIANTS[variant]["side"], VARIANTS[variant]["norm"]
    for rank, r in enumerate(per_rank(four, ("uneven", variant))):
        assert r["shapes"] == [((5, 5, 5, 3)[rank], 16), ((1, 1, 0, 0)[rank], 18)]
        # blocks cut at the shard boundaries of the blocked axis (an empty shard holds none)
        assert r["sizes"] == ([[4, 4, 4, 4], [9, 9]] if side == "input" else [[5, 5, 5, 3], [1, 1]])
        assert r["diff"] < 1e-12
        assert r["same_keys"]
        # statistic: whole row-stacked (k, s_max) per matrix: Dobb 16*4 + 18*9, Dobb-G 18*5 + 2*1, plus a
        # token count per matrix and 4 finiteness flags folded in
        stat = (16 * 4 + 18 * 9 if side == "input" else 18 * 5 + 2 * 1) + 2 + 4
        assert [e for _, e, *_ in r["log"]] == [stat if t % 2 == 0 else 0 for t in range(STEPS)]
        expect = (2, 16 + 18) if norm == "l2" and side == "input" else (0, 0)
        assert [(s, e) for s, _, _, e, _ in r["log"]] == [expect] * STEPS


def test_uneven_block_errors_list_valid_counts(four):
    for msgs in per_rank(four, "uneven_errors"):
        assert "a.weight" in msgs[0] or "#0" in msgs[0]
        assert "valid block counts: 4, 8, 12" in msgs[0]
        assert "valid block counts: 2" in msgs[1]


@pytest.mark.parametrize("dim", [0, 1])
def test_staggered_refresh_matches_single_process_and_spreads_the_statistic(ranks, dim):
    """stagger=True (the default): the same numbers as one process; step 0 reduces every matrix's
    statistic, later steps each the matrices whose offset is due, one full refresh per cycle."""
    for r in per_rank(ranks, ("stagger", dim)):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        e = [e for _, e, *_ in r["log"]]
        flags = stat_entries("input") - stat_entries("input", flags=0)  # folded into every step's reduction
        assert e[0] == stat_entries("input") and 0 < e[1] < e[0] and e[1] + e[2] == e[0] + flags and e[3] == e[1]
