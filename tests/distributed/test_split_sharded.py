"""CMuon's split (``split_sizes``/``num_heads``) and SAMuon on weights sharded along dim 0 or dim 1
(FSDP-style ``Shard``; 13 x 22 is uneven on 2 and 4 ranks along both axes) on 2 and 4 gloo ranks
against the same optimizer on the plain tensor in one process, in float64.

A split weight's parts straddle shard boundaries (13 rows as 5 + 4 + 4), so the step gathers it
and each rank keeps its shard of the tiled update; the result must be the single process's.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, init_device_mesh

from _common import max_diff, plain_and_sharded
from _spawn import spawn
from dobb.baselines import BlockMuon, Muon, NorMuon, SAMuon

pytestmark = pytest.mark.slow
F64 = dict(ns_dtype="float64")
SPLIT = dict(split_sizes=(5, 4, 4))
CASES = [
    (Muon, dict(F64, **SPLIT)),
    (NorMuon, dict(F64, **SPLIT)),
    (BlockMuon, dict(F64, blocks=2, axis=1, **SPLIT)),  # axis given: its default follows the placement
    (BlockMuon, dict(F64, blocks=2, axis=0, **SPLIT)),
    (SAMuon, dict(F64, gamma=4.0, gamma_warmup=0.0, top_k=3)),
    (SAMuon, dict(F64, gamma=4.0, total_steps=4, top_k=1, topk_method="power")),
]
SHAPES = [(13, 22)]


def worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for cls, kw in CASES:
        for shape in SHAPES:
            for pl in (Shard(0), Shard(1)):
                torch.manual_seed(0)
                w = torch.randn(*shape, dtype=torch.float64)
                grads = [torch.randn(*shape, dtype=torch.float64) for _ in range(4)]
                a, b, _, _ = plain_and_sharded(cls, kw, w, grads, mesh, pl)
                out[f"{cls.__name__}{kw}/{shape}/{pl}"] = (max_diff(a.detach(), b.detach()), max_diff(a.detach(), w))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_split_and_samuon_sharded_match_single_process(world):
    for res in spawn(worker, world):
        assert len(res) == len(CASES) * len(SHAPES) * 2
        bad = {k: v for k, v in res.items() if not v[0] <= 1e-10}
        assert not bad, bad
        assert all(v[1] > 1e-3 for v in res.values())  # the weights moved
