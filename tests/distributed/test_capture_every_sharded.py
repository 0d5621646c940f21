"""Dobb's ``capture_every`` (the hook statistic captured and folded between refreshes,
``core.schedule.captured``) under FSDP2 on 2 and 4 gloo ranks: the sharded run equals the
single-process float64 run with ``capture_every=1``, input side (activations) and output side
(output gradients), B=1 and B=4, with the refresh split over the ranks or not. A capture-only step
issues what a refresh step issues for the statistic (one token-weighted reduction of the same entries,
the finiteness flags folded in, kind ``"stat"``) and none of the refresh's basis broadcasts; every
rank issues the same. The option is checked to change the run, so the comparison can fail.
"""
from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from _common import (REFRESH, checker, data, full_params, make_opt, max_diff, per_rank, reference, same_on_all_ranks,
                     train, Net)
from _spawn import spawn_once
from test_fsdp import fsdp

pytestmark = pytest.mark.slow

STEPS = 6  # refresh_every = REFRESH = 2 (stagger off): steps 1, 3, 5 capture only
CASES = [("dobb", 1, False), ("dobb", 4, False), ("dobb-g", 4, False), ("dobb", 4, None)]  # split_refresh


def worker(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(steps=STEPS, rows=64)  # more rows than the widest block: no null-space coefficients

    def run(variant, blocks, split):
        logs = {}
        for every in (1, None):
            model = fsdp(Net(), mesh, 0)
            opt = make_opt(model, variant, blocks, capture_every=every, split_refresh=split)
            logs[every] = train(model, opt, batches, (rank, world))
            if every == 1:
                got = full_params(model)
        want = reference(variant, blocks, batches=batches, capture_every=1)
        without = reference(variant, blocks, batches=batches)
        return {"diff": max_diff(got, want), "changed": max_diff(want, without), "logs": logs,
                "same": same_on_all_ranks(logs)}

    for case in CASES:
        check(case, run, *case)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return spawn_once(worker, request.param)


@pytest.mark.parametrize("case", CASES, ids=[f"{v}-B{b}-split{s}" for v, b, s in CASES])
def test_sharded_equals_single_process_capturing_every_step(ranks, case):
    for r in per_rank(ranks, case):
        assert r["same"]  # every rank issued the same collectives, step for step
        assert r["diff"] < 1e-12
        assert r["changed"] > 1e-6  # capture_every changed the run: the comparison above can fail
        every, plain = r["logs"][1], r["logs"][None]
        for t, (step, base) in enumerate(zip(every, plain)):
            # (other collectives in step(), statistic entries, forward/backward collectives, norm entries,
            #  finiteness-only reductions)
            assert step[1] == every[0][1] > 0 and step[4] == 0  # the refresh step's statistic reduction
            assert step[0] == base[0] and step[2:4] == base[2:4]  # nothing else changes
            if t % REFRESH:  # capture-only: the plain run reduces no statistic there; no basis broadcast
                assert base[1] == 0 and base[4] == 1 and step[0] == 0
            elif case[2] is None:  # a refresh step of the split refresh: its basis broadcasts
                assert step[0] > 0
