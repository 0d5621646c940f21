"""The unsplit refresh of a shared request (``split_refresh=False``) solves every block on every rank
in the batches the split's owners would solve (``core.statistics.solve``'s ``mirror``,
``distribution.solve_as_owners``), so it stores the split's bits on any device, and the default can
split wherever ranks share a hook statistic, CUDA included.

A device whose batched solve rounds a block by its batch is simulated on CPU: ``functional.refresh_bases``
wrapped to add an offset that grows with the number of blocks in the call. Under it, on 2 and 4 gloo
ranks (FSDP2 and DDP), the split and the unsplit refresh give bitwise equal weights, statistics and
bases; the unsplit solve without the mirror (one batch per request, as before) gives other bases, so
the check can fail; and the collectives of the unsplit run are none (no ``"basis"`` broadcast).
"""
from __future__ import annotations

import pytest
import torch

import dobb.core.optimizer as O
import dobb.functional as F
from _common import checker, data, per_rank
from _spawn import spawn
from test_refresh_split_default import STEPS, _basis, _ddp, _fsdp, _snapshot, _train
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.slow


def _batch_variant(real):
    def refresh_bases(blocks, *args, **kwargs):
        out = real(blocks, *args, **kwargs)
        n = sum(b[0].shape[0] for b in blocks)  # the blocks solved in this call
        return [q + 1e-3 * n for q in out]
    return refresh_bases


def _runs(build, rank, world, batches):
    """Snapshots and step logs of the split, the unsplit and the unsplit without the mirror, under the
    batch-variant solve."""
    real_solve, real_refresh = O.solve, F.refresh_bases

    def no_mirror(batches_):
        for b in batches_:
            b.mirror = []
        return real_solve(batches_)

    F.refresh_bases = _batch_variant(real_refresh)
    try:
        snaps, logs = {}, {}
        for mode in (True, False, "plain"):
            if mode == "plain":
                O.solve = no_mirror
            model, opt = build(mode if mode != "plain" else False)
            logs[mode] = _train(model, opt, batches, rank, world)
            snaps[mode] = _snapshot(model, opt)
    finally:
        F.refresh_bases, O.solve = real_refresh, real_solve
    ref = snaps[True]
    unequal = {str(m): sorted(k for k in ref if not torch.equal(snaps[m][k], ref[k])) for m in (False, "plain")}
    return unequal, [_basis(logs[m]) for m in (True, False)]


def worker(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(STEPS, rows=4 * world)
    check("fsdp", _runs, _fsdp(mesh, blocks=2, stagger=False), rank, world, batches)
    check("ddp", _runs, _ddp(blocks=4), rank, world, batches)
    return results


@pytest.fixture(scope="module")
def two():
    return spawn(worker, 2, timeout_s=600)


@pytest.fixture(scope="module")
def four():
    return spawn(worker, 4, timeout_s=900)


@pytest.mark.parametrize("ranks", ["two", "four"])
@pytest.mark.parametrize("case", ["fsdp", "ddp"])
def test_unsplit_refresh_takes_the_owners_batches(ranks, case, request):
    for unequal, (split, unsplit) in per_rank(request.getfixturevalue(ranks), case):
        assert unequal["False"] == []  # the unsplit refresh: the split's bits
        assert any(k.endswith(":basis") for k in unequal["plain"])  # one batch per request: other bits
        assert split[0] > 0 and unsplit == [0] * STEPS  # the split broadcast; the unsplit sent nothing
