"""Expert stacks (E, out, in) under FSDP2 ``fully_shard`` (the expert axis sharded, Shard(0)) on 2 and
4 gloo ranks. Reference: the single-process float64 run on the whole batch, with each expert's
statistic the mean over the rows routed to it on all ranks (``capture``) or its gradient Gram.

Each rank routes its own rows to all E experts and captures them all; the token-weighted sums and
per-expert counts are reduced in ``step()`` and each rank keeps its own experts' statistics.
A placement that splits an expert (Shard(1)/Shard(2)) is a ValueError at construction.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from _common import checker, max_diff, per_rank, same_on_all_ranks
from _spawn import spawn_once
from dobb import Dobb

pytestmark = pytest.mark.slow

E, D, H, ROWS, STEPS = 4, 8, 12, 96, 5
VARIANTS = {
    "dobb": {},
    "dobb-l2": {"norm": "l2"},
    "grad_gram": {"source": "grad_gram"},
    "grad_gram-g": {"source": "grad_gram", "side": "output"},
    "grad_gram-both": {"source": "grad_gram", "side": "both", "out_blocks": 3},  # two-sided stack
}


def drop(step, rank):
    """Expert without rows: 2 on rank 0 only at step 0 (the others still route to it), 1 on every
    rank at step 2 (a refresh step: it keeps its statistic and basis)."""
    return {0: 2 if rank == 0 else None, 2: 1}.get(step)


class MoE(nn.Module):
    dobb_capture = False
    dobb_experts = ("w",)

    def __init__(self, seed=0, experts=E, d_in=D, d_out=H):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        router = torch.randn(experts, d_in, generator=gen, dtype=torch.float64)
        self.register_buffer("router", router / router.norm(dim=1, keepdim=True))  # fixed, balanced routing
        self.w = nn.Parameter(torch.randn(experts, d_out, d_in, generator=gen, dtype=torch.float64) / d_in**0.5)
        self.routed = None

    def forward(self, x, dropped=None):
        logits = x @ self.router.T
        if dropped is not None:
            logits[:, dropped] = -float("inf")
        choice = logits.argmax(-1)
        self.routed = [x[choice == e] for e in range(self.w.shape[0])]
        out = x.new_zeros(x.shape[0], self.w.shape[1])
        for e, xe in enumerate(self.routed):
            out[choice == e] = xe @ self.w[e].T
        return out


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + 1)
        self.moe = MoE(seed)
        self.head = nn.Linear(H, 2, dtype=torch.float64)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(2, H, generator=gen, dtype=torch.float64) / H**0.5)
            self.head.bias.zero_()

    def forward(self, x, dropped=None):
        return self.head(torch.tanh(self.moe(x, dropped)))


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, D, generator=gen, dtype=torch.float64), torch.randn(ROWS, 2, generator=gen, dtype=torch.float64))
            for _ in range(STEPS)]


def make_opt(model, variant, **kw):
    stack = model.moe.w
    opt = Dobb([{"params": [("moe.w", stack)]}, {"params": list(model.head.parameters()), "algorithm": "adamw"}],
               model, lr=0.03, weight_decay=0.01, blocks=2, refresh_every=2, stagger=False,
               basis_dtype=torch.float64, stat_dtype=torch.float64, **VARIANTS[variant], **kw)
    return opt, stack


def train(model, opt, stack, variant, rank, world):
    """Rank ``rank`` of ``world`` steps on its rows of each batch; world 1 with rank None is the
    reference: all rows, each rank's chunk routed with that rank's dropped expert."""
    capture = VARIANTS[variant].get("source", "activation") == "activation"
    for step, (x, y) in enumerate(batches()):
        chunks = range(world) if rank is None else [rank]
        parts = world if rank is None else 1
        n = ROWS // world
        loss, routed = 0.0, [[] for _ in range(E)]
        for r in chunks:
            xs, ys = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
            loss = loss + torch.nn.functional.mse_loss(model(xs, drop(step, r)), ys) / parts
            for e in range(E):
                routed[e].append(model.moe.routed[e])
        loss.backward()
        if capture:  # the optimizer's (sharded) parameter, after the forward pass
            opt.capture(stack, [torch.cat(rows) for rows in routed])
        opt.step()
        opt.zero_grad()


def reference(variant, world):
    model = Net()
    opt, stack = make_opt(model, variant, stat_group=None)  # one process: no statistic group
    train(model, opt, stack, variant, None, world)
    st = opt.state[stack]
    return model.moe.w.detach(), st["stat"], st["basis"], st["captures"]


def run(rank, world, variant):
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    fully_shard(model.moe, mesh=mesh)  # default: Shard(0), the expert axis
    fully_shard(model, mesh=mesh)
    opt, stack = make_opt(model, variant)
    train(model, opt, stack, variant, rank, world)
    st = opt.state[stack]
    w, stat, basis, captures = reference(variant, world)
    return {"w": max_diff(model.moe.w.full_tensor(), w), "stat": max_diff(st["stat"].full_tensor(), stat),
            "basis": max_diff(st["basis"].full_tensor(), basis), "captures": (st["captures"], captures),
            "local": (tuple(stack.to_local().shape), tuple(st["stat"].to_local().shape)),
            "placements": (tuple(stack.placements), tuple(st["stat"].placements)),
            "same_captures": same_on_all_ranks(st["captures"])}


def split_expert_error(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    fully_shard(model.moe, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 3 else Shard(0))
    try:
        make_opt(model, "grad_gram")
    except ValueError as e:
        return {"msg": str(e)}
    return {"msg": None}


def worker(rank, world):
    results = {}
    check = checker(results)
    for v in VARIANTS:
        check(v, run, rank, world, v)
    check("split", split_expert_error, rank, world)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, spawn_once(worker, request.param)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_expert_stack_equals_single_process(ranks, variant):
    world, results = ranks
    for r in per_rank(results, variant):
        assert r["w"] < 1e-10 and r["stat"] < 1e-10 and r["basis"] < 1e-10, r
        assert r["captures"][0] == r["captures"][1] and r["same_captures"]
        assert r["local"] == ((E // world, H, D), (E // world, D if variant != "grad_gram-g" else H, 4 if variant != "grad_gram-g" else 6))
        assert r["placements"] == ((Shard(0),), (Shard(0),))
    if VARIANTS[variant].get("source") != "grad_gram":
        # refreshes at steps 0, 2, 4; expert 1 got no row on step 2 on any rank
        assert per_rank(results, variant)[0]["captures"][0] == [[3, 2, 3, 3]]


def test_a_shard_that_splits_experts_is_refused_naming_the_parameter(ranks):
    for msg in (r["msg"] for r in per_rank(ranks[1], "split")):
        assert msg is not None and "moe.w" in msg and "split the experts" in msg and "Shard(0)" in msg
