"""SPlus on DTensor weights (FSDP2's ``Shard(0)`` rows, row-parallel ``Shard(1)`` columns) on 2 and
4 gloo ranks against the same optimizer on the plain tensor in one process, with the blocks of the
sharded side within shards: equal weights and averages, no collective on a non-refresh step, and
exactly one all-reduce (the other side's partial Gram blocks) on each refresh step."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from _common import exchange
from _spawn import spawn_once
from dobb.baselines.shampoo_family.splus import SPlus
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow
STEPS, EVERY = 6, 2  # refreshes on steps 1, 2, 4, 6


def worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for pl, kw in ((Shard(0), {"out_blocks": world, "blocks": 2}), (Shard(1), {"blocks": world, "out_blocks": 2})):
        torch.manual_seed(0)
        w = torch.randn(16, 12, dtype=torch.float64)
        grads = [torch.randn(16, 12, dtype=torch.float64) for _ in range(STEPS)]
        a, b = nn.Parameter(w.clone()), nn.Parameter(distribute_tensor(w.clone(), mesh, [pl]))
        kw = dict(lr=0.1, weight_decay=0.1, inverse_every=EVERY, ema_rate=0.5, **kw)
        oa, ob = SPlus([a], **kw), SPlus([b], **kw)
        counts = []
        for g in grads:
            a.grad, b.grad = g.clone(), distribute_tensor(g.clone(), mesh, [pl])
            oa.step()
            with PayloadMeter() as meter:
                ob.step()
            rs = exchange(meter)
            counts.append((len(rs), sorted({r.op for r in rs})))
        diff = (a.detach() - b.detach().full_tensor()).abs().max().item()
        oa.eval(), ob.eval()
        avg = (a.detach() - b.detach().full_tensor()).abs().max().item()
        oa.train(), ob.train()
        out[str(pl)] = (diff, avg, counts)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


def test_sharded_splus_matches_single_process_and_steps_without_collectives(ranks):
    refresh = [t == 1 or t % EVERY == 0 for t in range(1, STEPS + 1)]
    for res in ranks:
        for pl, (diff, avg, counts) in res.items():
            assert diff <= 1e-12 and avg <= 1e-12, (pl, diff, avg)
            assert [c for c, _ in counts] == [1 if r else 0 for r in refresh], (pl, counts)
            assert all(ops == [] or all('all_reduce' in o for o in ops) for _, ops in counts), counts
