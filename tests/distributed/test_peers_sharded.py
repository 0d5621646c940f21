"""NorMuon and Dion3 on weights sharded along dim 0 or dim 1 (FSDP-style ``Shard``, uneven rows and
columns) on 2 and 4 gloo ranks against the same optimizer on the plain tensor in one process, all in
float64 (``ns_dtype="float64"``), so any difference is the sharding's, not rounding's.

The per-row second moment ``neuron_variance`` is a whole vector on every rank: it must equal the
single-process one on every rank (a rank that normalized with its own rows only would differ).
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, init_device_mesh

from _common import max_diff, plain_and_sharded
from _spawn import spawn
from dobb.baselines import Dion3, NorMuon

pytestmark = pytest.mark.slow
F64 = dict(ns_dtype="float64")
CASES = [
    (NorMuon, dict(F64)),
    (NorMuon, dict(F64, ns_method="gram", nesterov=False)),
    (Dion3, dict(F64)),
    (Dion3, dict(F64, fraction=0.5, ns_method="gram")),
]
SHAPES = [(13, 22), (22, 13)]  # uneven on 2 and 4 ranks along both axes


def worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for cls, kw in CASES:
        for shape in SHAPES:
            for pl in (Shard(0), Shard(1)):
                torch.manual_seed(0)
                w = torch.randn(*shape, dtype=torch.float64)
                grads = [torch.randn(*shape, dtype=torch.float64) for _ in range(4)]
                a, b, oa, ob = plain_and_sharded(cls, kw, w, grads, mesh, pl)
                key = f"{cls.__name__}{kw}/{shape}/{pl}"
                out[key] = (max_diff(a.detach(), b.detach()),
                            max_diff(oa.state[a]["neuron_variance"], ob.state[b]["neuron_variance"]),
                            max_diff(a.detach(), w))  # the weights moved (the comparison is not vacuous)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_normuon_dion3_match_single_process(world):
    for res in spawn(worker, world):
        assert len(res) == len(CASES) * len(SHAPES) * 2
        bad = {k: v for k, v in res.items() if not (v[0] <= 1e-5 and v[1] <= 1e-5)}
        assert not bad, bad
        assert all(v[2] > 1e-3 for v in res.values())
