"""Dobb under DDP on 2 gloo ranks: the same weights and statistics as the single-process run on the
whole batch, with the statistic mean (``n^2/B`` entries and a token count per matrix and refresh) and the
finiteness flags folded into it, all issued by ``step()`` in parameter order."""
from __future__ import annotations

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import STEPS, VARIANTS, checker, per_rank, run_variant, stat_entries
from _spawn import spawn

pytestmark = pytest.mark.slow


def worker(rank, world):
    results = {}
    check = checker(results)
    for v in ("dobb", "dobb-g"):
        check(v, run_variant, rank, world, v, DDP, (rank, world))
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, 2)


@pytest.mark.parametrize("variant", ["dobb", "dobb-g"])
def test_ddp_matches_single_process(ranks, variant):
    for r in per_rank(ranks, variant):
        assert r["diff"] < 1e-12
        # the statistic itself equals the whole-batch one (output gradients rescaled by 1/P)
        assert r["stat_diff"] < 1e-12
        side = VARIANTS[variant]["side"]
        # step() issues only its own reductions: on refresh steps one all-reduce of the statistic
        # sums, token counts and finiteness flags together; otherwise the flags alone
        assert [s for s, *_ in r["log"]] == [0] * STEPS
        assert [e for _, e, *_ in r["log"]] == [stat_entries(side) if t % 2 == 0 else 0 for t in range(STEPS)]
        assert [f for *_, f in r["log"]] == [0 if t % 2 == 0 else 1 for t in range(STEPS)]
