"""Every baseline on a weight sharded along dim 0 or dim 1 (FSDP-style ``Shard``, uneven 7 + 6 rows)
on 2 gloo ranks against the same optimizer on the plain tensor in one process.

Block Muon's and Dion2's layout options left to their defaults follow the placement (one block per
shard of the sharded axis; Dion2 selects per row shard): the plain run is given the options they
resolve to (``RESOLVED``), and their former plain defaults are checked given explicitly."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, init_device_mesh

from _common import max_diff, plain_and_sharded
from _spawn import spawn
from dobb.baselines import RMNP, BlockMuon, Dion, Dion2, Muon, PeriodicRowMuon

pytestmark = pytest.mark.slow
CASES = [(cls, {}) for cls in (Muon, Dion, RMNP, PeriodicRowMuon, BlockMuon, Dion2)] + [
    (BlockMuon, {"axis": 0, "blocks": 2}), (BlockMuon, {"axis": 1, "blocks": 4}), (Dion2, {"select": "global"})]
# what the defaults resolve to on the 2 shards of each placement (the plain run's explicit options)
RESOLVED = {(BlockMuon, 0): {"axis": 0, "blocks": 2}, (BlockMuon, 1): {"axis": 1, "blocks": 2},
            (Dion2, 0): {"select": "shard", "blocks": 2}, (Dion2, 1): {"select": "global"}}


def worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for cls, kw in CASES:
        for pl in (Shard(0), Shard(1)):
            torch.manual_seed(0)
            w = torch.randn(13, 20)
            grads = [torch.randn(13, 20) for _ in range(3)]
            if kw or (cls, pl.dim) not in RESOLVED:
                a, b, _, _ = plain_and_sharded(cls, kw, w, grads, mesh, pl)
            else:  # defaults on the DTensor, the options they resolve to on the plain tensor
                a, _, _, _ = plain_and_sharded(cls, RESOLVED[cls, pl.dim], w, grads, mesh, pl)
                _, b, _, _ = plain_and_sharded(cls, kw, w, grads, mesh, pl)
            out[f"{cls.__name__}{kw}/{pl}"] = max_diff(a.detach(), b.detach())
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, 2)


def test_sharded_baselines_match_single_process(ranks):
    for res in ranks:
        assert len(res) == 2 * len(CASES)
        bad = {k: v for k, v in res.items() if not v <= 1e-5}
        assert not bad, bad
