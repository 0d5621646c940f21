"""torchtitan's DistMuon (FlexShard ``Owned`` layout) under FSDP2 on 2 and 4 gloo CPU ranks.

Why this test exists (issue 23 item 4): DistMuon is the maintained version of the owner-compute
layout that Dobb's zero-payload claim competes with, so the docs must either time it beside Dobb
or say exactly why they cannot. On CPU/gloo it cannot be built, for two independent reasons that
this test pins down (so the docs' statement fails loudly the day a torchtitan release runs here):

1. ``DistMuon._validate_parameter_storage`` refuses any parameter whose local shard is not on CUDA
   (``ValueError: DistMuon requires one CUDA device per process``), at construction;
2. with that check bypassed, its redistribution runtime creates a transfer stream with
   ``device_handle.Stream(device=..., priority=0)``, which the CPU stream stub does not accept
   (``TypeError``), so the CUDA-stream design, not only the guard, ties it to GPUs.

The reference the docs keep in its place is the project's owner-compute Muon
(``dobb.baselines.muon_family.owner_muon.OwnerMuon``), whose sharded step equals single-process Muon in float64
on 2 and 4 ranks (``test_owner_muon_sharded.py``).
"""
from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

from _spawn import spawn

pytest.importorskip("torchtitan.distributed.flex_shard.dist_muon")
pytestmark = pytest.mark.slow

GUARD = "DistMuon requires one CUDA device per process"


def _build(rank, world, bypass_guard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon, build_dist_muon
    from torchtitan.distributed.flex_shard.optimizer_reshard import BucketConfig, ComputeLayout, Owned

    torch.manual_seed(0)
    # 12 x 8 and 6 x 12 over 4 ranks: even shards of the first, uneven ones (2,2,2,0) of the second
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 6, bias=False)).double()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    fully_shard(model, mesh=mesh)
    names = [n for n, _ in model.named_parameters()]
    if bypass_guard:  # only in this spawned process: reach the next CUDA dependency
        DistMuon._validate_parameter_storage = lambda self: torch.device("cpu")
    try:
        build_dist_muon([{"params": list(model.parameters()), "param_names": names}],
                        compute_sharding_by_fqn={n: ComputeLayout({"dp_shard": Owned()}) for n in names},
                        bucket_configs=[BucketConfig(("*",))], lr=0.05, weight_decay=0.1)
    except Exception as exc:  # noqa: BLE001 - the exception is the result under test
        return {"type": type(exc).__name__, "message": str(exc), "where": traceback.format_exc(limit=-1)}
    return {"type": None, "message": "built", "where": ""}


@pytest.mark.parametrize("world", [2, 4])
def test_dist_muon_refuses_cpu_ranks(world):
    results = spawn(_build, world, False)
    for r in results:
        assert r["type"] == "ValueError" and GUARD in r["message"], r


@pytest.mark.parametrize("world", [2, 4])
def test_dist_muon_runtime_needs_cuda_streams(world):
    results = spawn(_build, world, True)
    for r in results:
        assert r["type"] == "TypeError" and "device" in r["message"], r
        assert "Stream" in r["where"], r
