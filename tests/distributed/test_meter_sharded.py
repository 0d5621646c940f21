"""dobb.meter.PayloadMeter on 2 gloo ranks against CommDebugMode (counts) and known sizes (bytes)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from _spawn import spawn
from dobb.collectives import collective_kind
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow


def worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    t = torch.ones(6, dtype=torch.float64)
    with PayloadMeter() as m, CommDebugMode() as c:
        dist.all_reduce(t)
        with collective_kind("stat"):
            dist.all_reduce(t, async_op=True).wait()
        out = torch.empty(12)
        dist.all_gather_into_tensor(out, torch.ones(6))
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6))
        d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()])
    return {"records": [(r.op, r.numel, r.bytes) for r in m.records], "debug": sum(c.get_comm_counts().values()),
            "collectives": m.collectives, "stat": m.kind("stat").bytes, "untagged": m.kind(None).count}


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, 2)


def test_meter_sees_every_collective_with_its_size(ranks):
    for r in ranks:
        assert r["collectives"] == r["debug"] == 6
        assert r["records"][:4] == [("all_reduce", 6, 48), ("all_reduce", 6, 48), ("all_gather", 12, 48),
                                    ("reduce_scatter", 6, 24)]
        # distribute_tensor scatters from rank 0 (c10d), redistribute all-gathers (functional)
        assert r["records"][4][0] == "scatter" and r["records"][5] == ("all_gather", 16, 64)
        # the tag set by dobb.collectives reaches the meter
        assert r["stat"] == 48 and r["untagged"] == 5
