"""The output-gradient statistic (Dobb-G, ``source="output_grad"``) under FSDP2 ``Shard(1)``, one row
block (B=1), on 2 and 4 gloo ranks: each rank captures the output gradients of its own tokens, the
token-weighted mean is taken over the ranks, and the sharded run equals the single-process float64
run on the whole batch.

Why two models. ``Net`` puts a LayerNorm after ``fc2``; LayerNorm's backward removes the mean over
features, so every output gradient of ``fc2`` (and so its statistic and its gradient) is orthogonal
to the all-ones vector, whatever the token count: the statistic has an exact null direction. The
momentum's coefficient on that basis vector is rounding noise, and ``sign()`` turns it into a full
±1 row of the update, so two runs that only sum in a different order (sharded vs single process,
or the same batch with its rows permuted) move ``fc2`` differently along ``1 a^T`` (about 1e-2
after a few steps). The loss cannot see that direction (LayerNorm removes it), so the models compute
the same function. ``TanhNet`` replaces the LayerNorm by an element-wise tanh: every statistic is
full rank and the sharded run must equal the single-process run everywhere (docs/algorithm.md,
"Degenerate statistics").
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from _common import Net, checker, data, full_params, make_opt, max_diff, per_rank, train
from _spawn import spawn_once
from test_fsdp import fsdp

pytestmark = pytest.mark.slow

ROWS, STEPS = 64, 6  # more tokens than the widest block (32); 3 refreshes (REFRESH = 2 in _common)


class TanhNet(Net):
    """``Net`` with an element-wise tanh instead of the LayerNorm: full-rank output-gradient statistics."""

    def __init__(self, seed=0):
        super().__init__(seed=seed)
        self.norm = nn.Tanh()


def relative_eigenvalues(opt) -> list[torch.Tensor]:
    """Each matrix's statistic's eigenvalues over its largest (one block: B=1, single process)."""
    out = []
    for p in opt.param_groups[0]["params"]:
        ev = torch.linalg.eigvalsh(opt.state[p]["stat"])
        out.append(ev / ev.max())
    return out


def off_ones(w: torch.Tensor) -> torch.Tensor:
    """``w`` without its component along the all-ones direction of its rows (the LayerNorm-invisible part)."""
    return w - w.mean(dim=0, keepdim=True)


def worker(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(steps=STEPS, rows=ROWS)
    probe = torch.randn(16, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def run(model_fn):
        model = fsdp(model_fn(), mesh, 1)
        opt = make_opt(model, "dobb-g", 1)
        train(model, opt, batches, (rank, world))
        ref = model_fn()
        ref_opt = make_opt(ref, "dobb-g", 1, stat_group=None)
        train(ref, ref_opt, batches)
        got, want = full_params(model), full_params(ref)
        with torch.no_grad():
            out_diff = max_diff(ref(probe), model(probe))  # FSDP gathers the weights: every rank calls it
        fc2 = "fc2.weight"
        return {"diff": max_diff({k: v for k, v in got.items() if k != fc2}, {k: v for k, v in want.items() if k != fc2}),
                "fc2": max_diff(got[fc2], want[fc2]), "fc2_off_ones": max_diff(off_ones(got[fc2]), off_ones(want[fc2])),
                "out": out_diff, "moved": max_diff(want, full_params(model_fn())), "eig": relative_eigenvalues(ref_opt)}

    check("full_rank", run, TanhNet)
    check("layernorm", run, Net)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


def test_full_rank_output_gradient_statistic_sharded_equals_single_process(ranks):
    for r in per_rank(ranks, "full_rank"):
        assert all(ev.min() > 1e-6 for ev in r["eig"])  # every statistic full rank: no arbitrary basis vector
        assert r["moved"] > 1e-2  # the weights moved: the comparisons below can fail
        assert r["diff"] < 1e-12 and r["fc2"] < 1e-12 and r["out"] < 1e-12


def test_layernorm_null_direction_is_the_only_difference(ranks):
    for r in per_rank(ranks, "layernorm"):
        # fc2's statistic has exactly one null direction (LayerNorm's), the others none
        assert [int((ev < 1e-12).sum()) for ev in r["eig"]] == [0, 1, 0]
        assert r["moved"] > 1e-2
        # everything but fc2's all-ones direction agrees, and so does the function the model computes
        assert r["diff"] < 1e-12 and r["fc2_off_ones"] < 1e-12 and r["out"] < 1e-12
