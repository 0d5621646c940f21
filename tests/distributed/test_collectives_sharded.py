"""Every collective an optimizer's step issues is tagged with its kind (``dobb.collectives``), on 2
gloo ranks: the payload meter sees no untagged record in a step of OwnerMuon (FSDP2 shards: two
all-to-alls; DDP replicas: all-gathers), MuonBP's full step, SOAP (owner compute), SPlus's refresh
(the other side's partial Gram sums), Dion (its partial products) and Dobb (statistic, finiteness
and gradient-Gram sums), and the kinds are the ones ``dobb.collectives`` documents for them."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from _spawn import spawn_once
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow
SHAPES = [(12, 8), (12, 8), (10, 6)]


def _records(opt, params, sharded, mesh, steps=2):
    """(op, kind) of every collective of ``steps`` steps (gradients seeded per step, the same on every rank)."""
    out = []
    for t in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * t + i), dtype=torch.float64)
            p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None) if sharded else g
        with PayloadMeter() as m:
            opt.step()
        out += [(r.op, r.kind) for r in m.records]
    return out


def _params(mesh, sharded):
    out = []
    for i, shape in enumerate(SHAPES):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        out.append(nn.Parameter(distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None) if sharded else w))
    return out


def worker(rank, world):
    import dobb
    from dobb.baselines import SOAP, Dion, MuonBP, OwnerMuon, SPlus

    mesh = init_device_mesh("cpu", (world,))
    builds = {
        "owner-muon fsdp": (True, lambda ps: OwnerMuon(ps, lr=0.1, ns_dtype="float64")),
        "owner-muon ddp": (False, lambda ps: OwnerMuon(ps, lr=0.1, ns_dtype="float64")),
        "muonbp full": (True, lambda ps: MuonBP(ps, lr=0.1, ns_dtype="float64", period=1, blocks=world)),
        "soap": (True, lambda ps: SOAP(ps, lr=0.1)),
        "splus": (True, lambda ps: SPlus(ps, lr=0.1, out_blocks=world, inverse_every=1)),
        "dion": (True, lambda ps: Dion(ps, lr=0.1)),
        "dobb grad_gram": (True, lambda ps: dobb.Dobb(ps, lr=0.1, source="grad_gram", refresh_every=1)),
    }
    out = {}
    for name, (sharded, build) in builds.items():
        params = _params(mesh, sharded)
        out[name] = _records(build(params), params, sharded, mesh)
    return out


# every sharded step also agrees on the gradients' finiteness (nonfinite="raise", the default): one
# all-reduce of kind "finite" over the parameters' mesh; plain parameters (DDP) need none
_FINITE = ("all_reduce", "finite")
EXPECTED = {"owner-muon fsdp": {("all_to_all", "owner"), _FINITE}, "owner-muon ddp": {("all_gather", "owner")},
            "muonbp full": {("all_to_all", "owner"), _FINITE}, "soap": {("all_to_all", "owner"), _FINITE},
            "splus": {("all_reduce", "norm"), _FINITE}, "dion": {("all_reduce", "partial"), _FINITE}}


@pytest.fixture(scope="module")
def ranks():
    return spawn_once(worker, 2)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_baselines_collectives_carry_their_kind(ranks, name):
    for res in ranks:
        records = res[name]
        assert records, name  # the case does communicate
        assert set(records) == EXPECTED[name], (name, sorted(set(records)))


def test_dobbs_collectives_are_all_tagged(ranks):
    for res in ranks:
        kinds = {kind for _, kind in res["dobb grad_gram"]}
        assert kinds and None not in kinds and kinds <= {"stat", "finite", "norm"}, kinds
