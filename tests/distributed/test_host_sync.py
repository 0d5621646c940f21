"""No host read inside ``step()`` under data parallelism once every due matrix has a statistic.

With ``check_finite=False`` and a statistic group, a refresh after the first keeps or updates each
statistic and basis on the device (``torch.where`` on the reduced token count); only a matrix (or
an expert of a stack) without a statistic makes the step read the reduced counts on the host.
Checked on gloo ranks against the single process of today's host-decided path (``check_finite``
on): the same weights, statistics and bases, including a refresh in which no rank saw a token of
a layer (``capture_paused``) and an expert without rows on any rank.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _common import (Net, checker, data, full_params, make_opt, max_diff, per_rank, reference, reference_stats,
                     same_on_all_ranks, stats, train)
from _spawn import spawn_once
from dobb import Dobb
from _hostsync import HostReads
from test_experts_sharded import MoE
from test_robustness import Gated, _null

pytestmark = pytest.mark.slow




def _adamw_steps(opt):
    # torch's AdamW keeps its step counter as a CPU tensor and reads it on the host by design
    return [opt.state[p]["step"] for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]]


def _state(opt, p):
    return opt.state[p]["stat"], opt.state[p]["basis"]


def _matrices(rank, world):
    """Gated (DDP): the expert runs on rank 0's rows only; step 2 (a refresh) is paused on every
    rank, so no rank captures anything: statistics and bases must stay, decided on the device."""
    rows = 8
    batches = data(steps=6, rows=rows * world)
    model = DDP(Gated(), find_unused_parameters=True)
    model.module.k = rows if rank == 0 else 0
    opt = make_opt(model, "dobb", matrices=Gated.matrices, check_finite=False)
    ref = Gated()
    ref.k = rows
    ref_opt = make_opt(ref, "dobb", matrices=Gated.matrices, stat_group=None)  # check_finite: host path
    hits = {}
    for t, (x, y) in enumerate(batches):
        xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        with opt.capture_paused() if t == 2 else _null():
            torch.nn.functional.mse_loss(model(xs), ys).backward()
        with HostReads(_adamw_steps(opt)) as spy:
            opt.step()
        hits[t] = spy.hits
        opt.zero_grad()
        with ref_opt.capture_paused() if t == 2 else _null():
            torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    mods = [getattr(model.module, m).weight for m in Gated.matrices]
    refs = [getattr(ref, m).weight for m in Gated.matrices]
    return {"hits": hits, "w": max_diff([p.detach() for p in mods], [q.detach() for q in refs]),
            "state": max_diff([s for p in mods for s in _state(opt, p)], [s for q in refs for s in _state(ref_opt, q)]),
            "captures": [opt.state[p]["captures"] for p in mods],
            "ref_captures": [ref_opt.state[q]["captures"] for q in refs],
            "same": same_on_all_ranks([opt.state[p]["captures"] for p in mods])}


E, DIN, DOUT, ROWS = 3, 8, 6, 24


class Stack(MoE):
    """An (E, out, in) expert stack fed through ``capture``; routing by a fixed router. Expert 1 gets
    no row at step 2 (a refresh) on any rank; expert 2 none at step 0 on rank 0 only."""

    def __init__(self):
        super().__init__(experts=E, d_in=DIN, d_out=DOUT)

    def forward(self, x, dropped=None):
        return torch.tanh(super().forward(x, dropped)).sum(-1, keepdim=True)


def _dropped(step, rank):
    return {0: 2 if rank == 0 else None, 2: 1}.get(step)


def _stack_opt(model, stat_group, **kw):
    return Dobb([{"params": [model.w]}], model, lr=0.03, weight_decay=0.01, blocks=2, refresh_every=2,
                stagger=False, basis_dtype=torch.float64, stat_dtype=torch.float64, stat_group=stat_group, **kw)


def _stack(rank, world):
    """The stack replicated on every rank (DDP averages the gradients), statistic group WORLD: each
    rank captures its rows per expert; the reference is one process fed every rank's chunk."""
    batches = data(steps=5, rows=ROWS * world, d=DIN, out=1)
    model = DDP(Stack())
    opt = _stack_opt(model.module, dist.group.WORLD, check_finite=False)
    ref = Stack()
    ref_opt = _stack_opt(ref, None)
    hits = {}
    for t, (x, y) in enumerate(batches):
        xs, ys = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        ((model(xs, _dropped(t, rank)) - ys) ** 2).mean().backward()
        opt.capture(model.module.w, model.module.routed)
        with HostReads() as spy:
            opt.step()
        hits[t] = spy.hits
        opt.zero_grad()
        loss, routed = 0.0, [[] for _ in range(E)]
        for r in range(world):
            loss = loss + ((ref(x[r * ROWS:(r + 1) * ROWS], _dropped(t, r)) - y[r * ROWS:(r + 1) * ROWS]) ** 2).mean() / world
            for e in range(E):
                routed[e].append(ref.routed[e])
        loss.backward()
        ref_opt.capture(ref.w, [torch.cat(rows) for rows in routed])
        ref_opt.step()
        ref_opt.zero_grad()
    return {"hits": hits, "w": max_diff(model.module.w.detach(), ref.w.detach()),
            "state": max_diff(list(_state(opt, model.module.w)), list(_state(ref_opt, ref.w))),
            "captures": opt.state[model.module.w]["captures"], "ref_captures": ref_opt.state[ref.w]["captures"],
            "same": same_on_all_ranks(opt.state[model.module.w]["captures"])}


def _fsdp(rank, world):
    """FSDP2 (DTensor statistic and basis, rows sharded): every step after the first reads nothing."""
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    for m in (model.fc1, model.fc2, model.head, model):
        fully_shard(m, mesh=mesh)
    opt = make_opt(model, "dobb", check_finite=False)
    step, hits = opt.step, []

    def spied():
        with HostReads(_adamw_steps(opt)) as spy:
            step()
        hits.append(spy.hits)

    opt.step = spied
    train(model, opt, data(), (rank, world))
    return {"hits": hits, "w": max_diff(full_params(model), reference("dobb")),
            "state": max_diff(stats(opt), reference_stats("dobb"))}


def worker(rank, world):
    results = {}
    check = checker(results)
    check("matrices", _matrices, rank, world)
    check("fsdp", _fsdp, rank, world)
    check("stack", _stack, rank, world)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


def test_refresh_after_the_first_reads_nothing_on_the_host(ranks):
    for r in per_rank(ranks, "matrices"):
        # step 0 takes the first statistics (host read of the reduced counts); every later step,
        # the refreshes at 2 (nothing captured anywhere) and 4 included, reads no tensor value
        assert all(r["hits"][t] == [] for t in r["hits"] if t > 0), r["hits"]
        assert r["hits"][0]  # the spy sees the first statistic's read
        assert r["w"] < 1e-12 and r["state"] < 1e-12, r  # today's numbers
        # captures: exact where the host reads the counts; on the device path a refresh counts
        # whether or not any rank had a row (step 2, paused everywhere: refreshes 0, 2, 4 -> 3)
        assert r["ref_captures"] == [[[2]]] * 4 and r["captures"] == [[[3]]] * 4 and r["same"]


def test_expert_stack_refresh_after_the_first_reads_nothing_on_the_host(ranks):
    for r in per_rank(ranks, "stack"):
        assert r["hits"][0] and all(r["hits"][t] == [] for t in r["hits"] if t > 0), r["hits"]
        assert r["w"] < 1e-12 and r["state"] < 1e-12, r  # expert 1 kept its statistic at step 2
        assert r["ref_captures"] == [[3, 2, 3]] and r["captures"] == [[3, 3, 3]] and r["same"]


def test_fsdp_refresh_after_the_first_reads_nothing_on_the_host(ranks):
    for r in per_rank(ranks, "fsdp"):
        assert r["hits"][0] and all(h == [] for h in r["hits"][1:]), r["hits"]
        assert r["w"] < 1e-12 and r["state"] < 1e-12, r
