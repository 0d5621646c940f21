"""Property: Dobb's step on a sharded weight equals the single-process step (float64, 1e-5).

Hypothesis draws the shape (1-row and prime sizes), the sharded dim, side, norm, statistic source
and a valid block count; shard counts are 2 and 4 (uneven and empty shards arise from the sizes).
Why examples run inside one spawned group: starting processes costs seconds, an example tens of
milliseconds. Every rank runs the same derandomized example sequence (generation phase only, no
shrinking, so no rank can wander off), and a failing example is recorded, not raised, so the ranks
stay in step; the test reports every failing case.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from _common import fixed_partitions, max_diff
from _spawn import spawn
from dobb import Dobb
from dobb.functional import valid_block_counts
from dobb.sharding import chunk_sizes, local_slice

SIZES = [1, 2, 3, 5, 7, 11, 13]
STEPS, TOL = 3, 1e-5
# CI runs a few examples per shard count; the slow test runs DOBB_PROPERTY_EXAMPLES per shard count
# (set it to run the test: 100 gives the 200 examples of issue 15; minutes on 2 shared cores).
CI_EXAMPLES = 4
MANY = os.environ.get("DOBB_PROPERTY_EXAMPLES")


@st.composite
def cases(draw, world):
    m, n = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    dim, side, norm = draw(st.sampled_from([0, 1])), draw(st.sampled_from(["input", "output"])), draw(st.sampled_from(["sign", "l2"]))
    axis = 1 if side == "input" else 0
    k = (m, n)[axis]
    shards = chunk_sizes((m, n)[dim], world) if dim == axis else None
    blocks = draw(st.sampled_from(valid_block_counts(k, shards)[:6]))
    # grad_gram's statistic has rank <= the other axis' length: only well-posed when that exceeds a block
    hook = "activation" if side == "input" else "output_grad"
    sources = [hook, "grad_gram"] if (m, n)[1 - axis] > -(-k // blocks) + 1 else [hook]
    source = draw(st.sampled_from(sources))
    return dict(m=m, n=n, dim=dim, side=side, norm=norm, blocks=blocks, source=source,
                seed=draw(st.integers(0, 2**16)))


class ShardedLinear(nn.Module):
    """A linear layer whose weight is a DTensor sharded like FSDP's (any dim, uneven and empty shards,
    which ``fully_shard`` refuses on dim 1). Forward uses the gathered weight; ``sync_grad`` sets
    the weight's gradient to this rank's shard of the data-parallel mean, as FSDP's reduce-scatter does."""

    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x):
        self.full = self.weight.detach().full_tensor().requires_grad_()
        return x @ self.full.T

    def sync_grad(self, world):
        g = self.full.grad
        dist.all_reduce(g)
        self.weight.grad = DTensor.from_local(local_slice(g / world, self.weight), self.weight.device_mesh,
                                              self.weight.placements, shape=g.shape, stride=g.stride())


def _train(layer, opt, xs, ys, rows, world=None):
    for x, y in zip(xs, ys):
        torch.nn.functional.mse_loss(layer(x[rows]), y[rows]).backward()
        if world is not None:
            layer.sync_grad(world)
        opt.step()
        opt.zero_grad()


def run_case(case, mesh, rank, world) -> float:
    m, n = case["m"], case["n"]
    gen = torch.Generator().manual_seed(case["seed"])
    w0 = torch.randn(m, n, generator=gen, dtype=torch.float64)
    r = max(m, n) + 2  # rows per rank: every statistic block has full rank
    xs = [torch.randn(r * world, n, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
    ys = [torch.randn(r * world, m, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
    kw = dict(lr=0.05, weight_decay=0.1, blocks=case["blocks"], side=case["side"], norm=case["norm"],
              source=case["source"], refresh_every=2, basis_dtype=torch.float64, stat_dtype=torch.float64)

    layer = ShardedLinear(distribute_tensor(w0.clone(), mesh, [Shard(case["dim"])]))
    opt = Dobb([layer.weight], layer, **kw)
    _train(layer, opt, xs, ys, slice(rank * r, (rank + 1) * r), world)
    sizes = list(opt._plans[layer.weight].layout.global_sizes)
    got = layer.weight.full_tensor()

    ref = nn.Linear(n, m, bias=False, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(w0)
    with fixed_partitions([sizes]):  # the sharded cut (at shard boundaries) for the reference too
        ref_opt = Dobb([ref.weight], ref, stat_group=None, **kw)
    _train(ref, ref_opt, xs, ys, slice(None))
    return max_diff(got, ref.weight.detach())


def worker(rank, world, n_examples):
    mesh = init_device_mesh("cpu", (world,))
    out = {"ran": 0, "failures": []}

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases(world))
    def prop(case):
        out["ran"] += 1
        try:
            diff = run_case(case, mesh, rank, world)
            if not diff <= TOL:
                out["failures"].append((case, diff))
        except Exception:
            out["failures"].append((case, traceback.format_exc()))

    prop()
    return out


def _check(world, n_examples):
    for res in spawn(worker, world, n_examples, timeout_s=1800):
        assert res["ran"] == n_examples  # hypothesis ran them all (no example was rejected)
        assert not res["failures"], res["failures"][:3]
    return res["ran"]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_step_equals_single_process_few_examples(world):
    _check(world, CI_EXAMPLES)


@pytest.mark.slow
@pytest.mark.skipif(not MANY, reason="set DOBB_PROPERTY_EXAMPLES (e.g. 100) to run the long property test")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_step_equals_single_process_many_examples(world):
    ran = _check(world, int(MANY))
    assert ran >= int(MANY)
