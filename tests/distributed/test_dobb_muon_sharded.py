"""Dobb-preconditioned Muon (``norm="muon"``) under FSDP2 ``Shard(0)`` = single process, on 2 and 4
gloo ranks.

Each rank holds rows; the input-side bases are full-width statistics averaged over the
data-parallel ranks (as Dobb's), the second moment is kept on the rank's rows, and the
``out_blocks = 4`` row blocks lie within the row shards, so the step issues no collective of its own:
``step()`` issues exactly one-sided Dobb's collectives (the statistic reduction on refresh steps, the
finiteness flags otherwise). Reference: the single-process float64 run on the whole batch.
Row blocks that would straddle a shard are a ``ValueError`` naming ``out_blocks`` and the valid counts.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from _common import REFRESH, STEPS, Net, checker, data, full_params, groups, max_diff, per_rank, same_on_all_ranks, \
    state_keys, stats
from _spawn import spawn_once
from dobb import Dobb
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow

ROWS = 64  # more tokens than the widest block: every statistic block has full rank


KINDS = {"muon": dict(norm="muon", out_blocks=4, ns_dtype="float64"), "sign": dict(norm="sign"),
         # whole_every: a whole-matrix NS5 step (owner-computed, two all-to-alls) every 2nd step
         "muon-whole": dict(norm="muon", out_blocks=4, ns_dtype="float64", whole_every=2),
         "two-sided-whole": dict(norm="sign", side="both", out_blocks=4, ns_dtype="float64", whole_every=2)}


def make(model, kind="muon", **kw):
    extra = {**KINDS[kind], **kw}
    return Dobb(groups(model), model, lr=0.02, weight_decay=0.01, blocks=2, refresh_every=REFRESH,
                basis_dtype=torch.float64, stat_dtype=torch.float64, product_dtype=torch.float64, stagger=False,
                beta2=0.9, **extra)


def train(model, opt, batches, shard=(0, 1)):
    r, p = shard
    log = []
    for x, y in batches:
        rows = x.shape[0] // p
        torch.nn.functional.mse_loss(model(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows]).backward()
        with PayloadMeter() as st:
            opt.step()
        opt.zero_grad()
        log.append((st.collectives, st.kind("stat").numel))
    return log


def fsdp(model, mesh):
    for name in Net.matrices:
        fully_shard(getattr(model, name), mesh=mesh, shard_placement_fn=lambda p: Shard(0))
    fully_shard(model, mesh=mesh)
    return model


def compare(rank, world, norm):
    batches = data(steps=STEPS + 2, rows=ROWS)
    model = fsdp(Net(), init_device_mesh("cpu", (world,)))
    opt = make(model, norm)
    log = train(model, opt, batches, (rank, world))
    ref = Net()
    ref_opt = make(ref, norm, stat_group=None)
    train(ref, ref_opt, batches)
    moved = max_diff(full_params(ref), full_params(Net()))
    return {"diff": max_diff(full_params(model), full_params(ref)), "moved": moved,
            "stat_diff": max_diff(stats(opt), stats(ref_opt)), "log": log, "same_keys": same_on_all_ranks(state_keys(opt)),
            "local_rows": [getattr(opt._plans[p].ns_rows, "local_sizes", None) for p in opt.param_groups[0]["params"]]}


def _error(world):
    try:
        make(fsdp(Net(), init_device_mesh("cpu", (world,))), out_blocks=3)
    except ValueError as exc:
        return {"msg": str(exc)}
    return {"msg": None}


def worker(rank, world):
    results = {}
    check = checker(results)
    for kind in KINDS:
        check(kind, compare, rank, world, kind)
    check("error", _error, world)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


def test_fsdp2_matches_single_process(ranks):
    world = len(ranks)
    for rank, r in enumerate(per_rank(ranks, "muon")):
        assert r["moved"] > 1e-2
        assert r["diff"] < 1e-10 and r["stat_diff"] < 1e-12 and r["same_keys"]
        # out_blocks=4 row blocks of fc1 (32 rows), fc2 (16), head (8), cut within each rank's rows
        assert r["local_rows"] == [[32 // 4] * (4 // world), [16 // 4] * (4 // world), [8 // 4] * (4 // world)]


@pytest.mark.parametrize("kind", ["muon-whole", "two-sided-whole"])
def test_whole_matrix_steps_match_single_process(ranks, kind):
    for r, sign in zip(per_rank(ranks, kind), per_rank(ranks, "sign")):
        assert r["moved"] > 1e-2 and r["diff"] < 1e-10 and r["same_keys"]
        # whole steps (0, 2, 4, ...) add the owner's two all-to-alls to one-sided Dobb's collectives
        assert [c - s for (c, _), (s, _) in zip(r["log"], sign["log"])] == [2 * (t % 2 == 0) for t in range(len(r["log"]))]


def test_step_issues_one_sided_dobbs_collectives(ranks):
    for muon, sign in zip(per_rank(ranks, "muon"), per_rank(ranks, "sign")):
        assert muon["log"] == sign["log"]


def test_row_blocks_across_shards_are_refused(ranks):
    for msg in (r["msg"] for r in per_rank(ranks, "error")):
        assert msg is not None and "norm='muon' row blocks" in msg and "out_blocks=3" in msg and "valid block counts" in msg
