"""The split refresh (``split_refresh=True``, ``dobb.core.statistics``) against the unsplit one on the same
ranks: bitwise equal weights, statistics and bases after refresh and non-refresh steps, including
the first (exact ``eigh``) refresh, under FSDP2 on 2 and 4 gloo ranks (uneven and empty shards,
an odd block size that stays replicated), under DDP, and with a rank that holds no gradient of a
shared matrix on a refresh step. The broadcast entries equal the split blocks' ``s^2`` sums, and
the split run equals the single-process float64 run as the unsplit one does (test_fsdp.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import Net, checker, data, fixed_partitions, full_params, groups, max_diff, partitions, per_rank
from _spawn import spawn
from _split_host import REASON, host_is_bitwise
from dobb import Dobb
from dobb.meter import PayloadMeter
from test_fsdp import Uneven

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not host_is_bitwise(), reason=REASON)]

STEPS, REFRESH = 5, 2  # refreshes at steps 0 (eigh), 2 and 4


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(model, opt):
    out = {f"w:{n}": _local(p) for n, p in model.named_parameters()}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"{i}:{k}"] = _local(v)
    return out


def _train(model, opt, batches, rank, world, drop=None):
    """Steps on this rank's rows; ``drop(step, model)`` may remove gradients before a step. Returns
    the entries broadcast by the split per step (meter kind "basis")."""
    basis = []
    for t, (x, y) in enumerate(batches):
        rows = x.shape[0] // world
        loss = torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        if drop is not None:
            drop(t, model)
        with PayloadMeter() as meter:
            opt.step()
        opt.zero_grad()
        basis.append(meter.kind("basis").numel)
    return basis


def _pair(build, rank, world, batches, drop=None, **kw):
    """The same run with and without the split: (equal everywhere, per-step broadcast entries, the
    split run's model and optimizer)."""
    snaps, logs, keep = {}, {}, None
    for split in (False, True):
        model, opt = build(split, **kw)
        logs[split] = _train(model, opt, batches, rank, world, drop)
        snaps[split] = _snapshot(model, opt)
        keep = (model, opt)
    unequal = [k for k in snaps[True] if not torch.equal(snaps[True][k], snaps[False][k])]
    return unequal, logs[True], logs[False], keep


def _net_fsdp(mesh, blocks, **kw):
    def build(split):
        model = Net()
        for name in Net.matrices:
            fully_shard(getattr(model, name), mesh=mesh, shard_placement_fn=lambda p: Shard(0))
        fully_shard(model, mesh=mesh)
        opt = Dobb(groups(model), model, lr=0.02, weight_decay=0.01, blocks=blocks, refresh_every=REFRESH,
                   basis_dtype=torch.float64, stat_dtype=torch.float64, split_refresh=split, **kw)
        return model, opt
    return build


def worker(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(STEPS, rows=4 * world)
    for blocks in (1, 2, 4):
        for stagger in (False, True):
            check(("fsdp", blocks, stagger), lambda b=blocks, s=stagger: _pair(
                _net_fsdp(mesh, b, stagger=s), rank, world, batches)[:3])
    check(("fsdp", "l2"), lambda: _pair(_net_fsdp(mesh, 2, norm="l2", stagger=False), rank, world, batches)[:3])
    check(("fsdp", "both"), lambda: _pair(_net_fsdp(mesh, 2, side="both", out_blocks=world, stagger=False), rank, world, batches)[:3])

    def ddp(split):
        model = DDP(Net())
        opt = Dobb(groups(model.module), model, lr=0.02, weight_decay=0.01, blocks=2, refresh_every=REFRESH,
                   basis_dtype=torch.float64, stat_dtype=torch.float64, split_refresh=split, stagger=False)
        return model, opt

    check("ddp", lambda: _pair(ddp, rank, world, batches)[:3])

    def plain(split):  # plain parameters, statistic over the world, no gradient sync
        model = Net()
        opt = Dobb(groups(model), model, lr=0.02, weight_decay=0.01, blocks=2, refresh_every=REFRESH,
                   basis_dtype=torch.float64, stat_dtype=torch.float64, split_refresh=split, stagger=False,
                   stat_group=dist.group.WORLD)
        return model, opt

    def drop(t, model):  # rank 1 holds no gradient of fc2 on the refresh step 2: it refreshes it as idle
        if rank == 1 and t == 2:
            model.fc2.weight.grad = None

    check("idle", lambda: _pair(plain, rank, world, batches, drop)[:3])
    return results


def worker4(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(STEPS, rows=32, out=2)  # more rows than the widest block: no null-space coefficients

    def uneven(blocks_b):
        def build(split):
            model = Uneven()
            for m in (model.a, model.b, model):
                fully_shard(m, mesh=mesh)
            grp = [{"params": [model.a.weight], "blocks": 4}, {"params": [model.b.weight], "blocks": blocks_b},
                   {"params": [model.a.bias, model.b.bias], "algorithm": "adamw"}]
            opt = Dobb(grp, model, lr=0.02, weight_decay=0.01, refresh_every=REFRESH, basis_dtype=torch.float64,
                       stat_dtype=torch.float64, split_refresh=split, stagger=False)
            return model, opt

        unequal, split_log, plain_log, (model, opt) = _pair(build, rank, world, batches)
        sizes = partitions(opt)
        ref_model = Uneven()
        grp = [{"params": [ref_model.a.weight], "blocks": 4}, {"params": [ref_model.b.weight], "blocks": blocks_b},
               {"params": [ref_model.a.bias, ref_model.b.bias], "algorithm": "adamw"}]
        with fixed_partitions(sizes):
            ref_opt = Dobb(grp, ref_model, lr=0.02, weight_decay=0.01, refresh_every=REFRESH, basis_dtype=torch.float64,
                           stat_dtype=torch.float64, stagger=False, stat_group=None)
        _train(ref_model, ref_opt, batches, 0, 1)
        return unequal, split_log, plain_log, max_diff(full_params(model), full_params(ref_model)), sizes

    check(("uneven", 2), uneven, 2)  # b: two blocks of 9 (odd: replicated, no broadcast)
    check(("uneven", 3), uneven, 3)  # b: three blocks of 6 (split)
    for blocks in (1, 4):
        check(("fsdp", blocks), lambda b=blocks: _pair(_net_fsdp(mesh, b, stagger=False), rank, world,
                                                       data(STEPS, rows=4 * world))[:3])
    return results


@pytest.fixture(scope="module")
def two():
    return spawn(worker, 2)


@pytest.fixture(scope="module")
def four():
    return spawn(worker4, 4)


def _entries(blocks):
    """Basis entries of Net's three matrices at ``blocks``: ``n^2 / B`` each (n = 16, 32, 16)."""
    return sum(n * n // blocks for n in (16, 32, 16))


REFRESH_STEPS = [t % REFRESH == 0 for t in range(STEPS)]


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_fsdp2_split_is_bitwise_the_unsplit_refresh(two, blocks):
    for unequal, split_log, plain_log in per_rank(two, ("fsdp", blocks, False)):
        assert unequal == []
        assert plain_log == [0] * STEPS  # no split: no broadcast
        assert split_log == [_entries(blocks) if r else 0 for r in REFRESH_STEPS]


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_staggered_split_broadcasts_each_matrix_once_per_period(two, blocks):
    for unequal, split_log, _ in per_rank(two, ("fsdp", blocks, True)):
        assert unequal == []
        # step 0 refreshes every matrix; then each matrix once per period, on its own offset
        assert split_log[0] == _entries(blocks)
        assert sum(split_log[1:1 + REFRESH]) == _entries(blocks)


@pytest.mark.parametrize("case", [("fsdp", "l2"), ("fsdp", "both"), "ddp", "idle"])
def test_split_other_layouts(two, case):
    for unequal, split_log, _ in per_rank(two, case):
        assert unequal == []
        assert split_log[0] > 0  # the split ran (on the first, exact refresh too)


def test_uneven_and_empty_shards_on_four_ranks(four):
    for rank, r in enumerate(per_rank(four, ("uneven", 2))):
        unequal, split_log, plain_log, diff, sizes = r
        assert sizes == [[4, 4, 4, 4], [9, 9]]
        assert unequal == [] and diff < 1e-12
        # a's four blocks of 4 are split; b's blocks of 9 (odd) stay replicated
        assert split_log == [16 * 4 if r_ else 0 for r_ in REFRESH_STEPS] and plain_log == [0] * STEPS
    for r in per_rank(four, ("uneven", 3)):
        unequal, split_log, _, diff, sizes = r
        assert sizes == [[4, 4, 4, 4], [6, 6, 6]]
        assert unequal == [] and diff < 1e-12
        assert split_log == [16 * 4 + 18 * 6 if r_ else 0 for r_ in REFRESH_STEPS]


@pytest.mark.parametrize("blocks", [1, 4])
def test_fsdp2_split_on_four_ranks(four, blocks):
    for unequal, split_log, _ in per_rank(four, ("fsdp", blocks)):
        assert unequal == []
        assert split_log == [_entries(blocks) if r else 0 for r in REFRESH_STEPS]
