"""Dobb's ``refresh_width`` (longer refresh periods for wider blocks, ``dobb.core.optimizer``) under FSDP2
on 2 and 4 gloo ranks: every rank picks the same periods and offsets (from global block sizes,
though the ranks hold different rows), and the sharded run equals the single-process float64 run
with the option on, staggered or not, input and output side, B=1 and B=4. The option is checked to
change the run (the single-process runs with and without it differ), so the comparison can fail.
"""
from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from _common import Net, checker, data, full_params, make_opt, max_diff, per_rank, reference, same_on_all_ranks, train
from _spawn import spawn_once
from test_fsdp import fsdp

pytestmark = pytest.mark.slow

STEPS = 9  # covers a period of 4 twice after step 0 (REFRESH = 2 in _common)
# (variant, blocks, refresh_width) -> hand-computed periods of fc1, fc2, head (Net: fc1 32x16,
# fc2 16x32, head 8x16; REFRESH = 2): input side widths 16, 32, 16 at B=1 and 4, 8, 4 at B=4;
# output side (dobb-g) 8, 4, 2 at B=4
CASES = {
    ("dobb", 1, 16): [2, 4, 2],
    ("dobb", 4, 4): [2, 4, 2],
    ("dobb-g", 4, 2): [8, 4, 2],
}


def worker(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(steps=STEPS, rows=64)  # more rows than the widest block: no null-space coefficients

    def run(variant, blocks, width, stagger):
        model = fsdp(Net(), mesh, 0)
        opt = make_opt(model, variant, blocks, refresh_width=width, stagger=stagger)
        periods = [opt._plans[p].period for p in opt.param_groups[0]["params"]]
        offsets = [opt._plans[p].offset for p in opt.param_groups[0]["params"]]
        train(model, opt, batches, (rank, world))
        want = reference(variant, blocks, batches=batches, refresh_width=width, stagger=stagger)
        without = reference(variant, blocks, batches=batches, stagger=stagger)
        return {"diff": max_diff(full_params(model), want), "changed": max_diff(want, without),
                "periods": periods, "same": same_on_all_ranks((periods, offsets)), "cycle": opt.refresh_cycle()}

    for (variant, blocks, width) in CASES:
        for stagger in (False, True):
            check((variant, blocks, width, stagger), run, variant, blocks, width, stagger)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


@pytest.mark.parametrize("stagger", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_equals_single_process_with_longer_periods(ranks, case, stagger):
    for r in per_rank(ranks, (*case, stagger)):
        assert r["periods"] == CASES[case] and r["same"] and r["cycle"] == max(CASES[case])
        assert r["diff"] < 1e-12
        assert r["changed"] > 1e-6  # the option changed the run: the comparison above can fail
