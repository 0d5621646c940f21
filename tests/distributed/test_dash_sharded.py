"""Dash's step on sharded weights (FSDP2-style ``Shard(0)``, tensor-parallel ``Shard(1)``, both on a
2 x 2 mesh) on 2 and 4 gloo ranks, against ``Dash`` on plain float64 tensors in one process.

Tiles are cut from the start of each rank's shard: where every shard boundary is a multiple of
``block_size`` the sharded update equals the single-process one on the whole matrix; where it is
not (uneven 5,5,5,3 rows, empty shards) it equals the single-process update with the shard
boundaries as extra cuts, i.e. ``Dash`` on each shard's slice as a matrix of its own. Every step
issues no collective (``PayloadMeter``), and every rank holds the same state keys.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from _common import exchange, max_diff, same_on_all_ranks, state_keys
from _spawn import spawn_once
from dobb.baselines.shampoo_family.dash import Dash
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow
STEPS, B = 3, 4
KW = [dict(), dict(graft="none", precondition_every=2), dict(inverse_root="newton-db", eps_inv_root=1e-3)]


def problem(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(STEPS)])


def plain(ws, grads_per_step, kw):
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = Dash(params, lr=0.05, weight_decay=0.1, block_size=B, **kw)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def whole(w, grads, kw):
    return plain([w], [[g] for g in grads], kw)[0]


def per_shard(w, grads, dim, world, kw):
    """Single-process Dash on each non-empty shard slice (torch.chunk sizes) as its own matrix."""
    chunk = -(-w.shape[dim] // world)
    sizes = [max(0, min(chunk, w.shape[dim] - i * chunk)) for i in range(world)]
    keep = [i for i, s in enumerate(sizes) if s]
    pieces = [w.split(sizes, dim)[i] for i in keep]
    out = plain(pieces, [[g.split(sizes, dim)[i] for i in keep] for g in grads], kw)
    return torch.cat(out, dim)


def sharded(w, grads, mesh, placements, kw):
    p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, placements))
    opt = Dash([p], lr=0.05, weight_decay=0.1, block_size=B, **kw)
    collectives = 0
    for g in grads:
        p.grad = distribute_tensor(g.clone(), mesh, placements)
        with PayloadMeter() as meter:
            opt.step()
        collectives += len(exchange(meter))
    return p.detach().full_tensor(), collectives, same_on_all_ranks(state_keys(opt))


def worker(rank, world):
    out = {}
    mesh = init_device_mesh("cpu", (world,))
    for k, kw in enumerate(KW):
        # every shard boundary a multiple of B (16 rows, 32 columns over 2 or 4 ranks): the whole-matrix update
        w, grads = problem((16, 32), seed=k)
        for dim in (0, 1):
            full, n, same = sharded(w, grads, mesh, [Shard(dim)], kw)
            out[f"aligned/{k}/Shard({dim})"] = (max_diff(full, whole(w, grads, kw)), n, same)
        # uneven and empty shards: the shard boundaries are extra tile cuts
        for shape in ((18, 10), (10, 18), (2, 9)):
            w, grads = problem(shape, seed=10 + k)
            for dim in (0, 1):
                full, n, same = sharded(w, grads, mesh, [Shard(dim)], kw)
                out[f"uneven/{k}/{shape}/Shard({dim})"] = (max_diff(full, per_shard(w, grads, dim, world, kw)), n, same)
    if world == 4:  # FSDP x TP: rows over one mesh dim, columns over the other
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for k, kw in enumerate(KW):
            w, grads = problem((16, 32), seed=20 + k)
            full, n, same = sharded(w, grads, mesh2, [Shard(0), Shard(1)], kw)
            out[f"2d/{k}"] = (max_diff(full, whole(w, grads, kw)), n, same)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


def test_sharded_dash_is_local_and_matches_single_process(ranks):
    for res in ranks:
        assert len(res) == 8 * len(KW) + (len(KW) if len(ranks) == 4 else 0)
        bad = {k: v for k, v in res.items() if not (v[0] < 1e-10 and v[1] == 0 and v[2])}
        assert not bad, bad
    assert ranks[0].keys() == ranks[-1].keys()
