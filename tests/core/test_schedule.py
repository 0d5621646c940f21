"""``dobb.core.schedule``: the plan, the refresh rule and the refresh queue, read on their own.

The hand-computed schedules (``due``, periods, offsets, capture forms) are exercised through the
class in ``tests/core/test_optimizer.py``; here: the names the optimizer re-exports are these, the
period/offset rule of a group, the muon row-block check and the refresh queue on a hand case.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dobb
from dobb.core import optimizer, schedule
from dobb.placement import layout_for


def test_the_optimizer_re_exports_the_schedule():
    for name in ("Side", "Plan", "due", "captures", "saved_captures", "refresh_period", "cycle", "stagger_offsets",
                 "two_sided_layouts"):
        assert getattr(optimizer, name) is getattr(schedule, name), name


def _sides(*widths):
    """One one-sided matrix per width: ``widths[i]`` its block sizes (global), a stack of one."""
    lay = lambda sizes: type("L", (), {"global_sizes": sizes, "stack_size": 1})()  # noqa: E731
    return [(schedule.Side(lay(sizes)),) for sizes in widths]


def test_schedule_of_reads_the_widest_block_and_staggers():
    group = {"refresh_every": 4, "refresh_width": 8, "stagger": False}
    assert schedule.schedule_of(_sides([8, 8], [16], [4]), group) == ([4, 8, 4], [0, 0, 0])
    group = {"refresh_every": 4, "refresh_width": None, "stagger": True}
    periods, offsets = schedule.schedule_of(_sides([8], [8], [8], [8]), group)
    assert periods == [4] * 4 and sorted(offsets) == [0, 1, 2, 3]  # equal work spread over the period
    assert (periods, offsets) == (periods, schedule.stagger_offsets([512] * 4, periods))


def test_ns_rows_only_for_muon_and_names_the_matrix():
    p = torch.zeros(6, 4)
    assert schedule.ns_rows(p, {"norm": "sign", "transposed": False}, 2, "w", layout_for) is None
    rows = schedule.ns_rows(p, {"norm": "muon", "transposed": False}, 2, "w", layout_for)
    assert rows.blocked_axis == 0 and rows.local_sizes == [3, 3]
    with pytest.raises(ValueError, match="^w: norm='muon' row blocks: .*out_blocks="):
        schedule.ns_rows(p, {"norm": "muon", "transposed": False}, 7, "w", layout_for)


def test_queue_refresh_folds_the_gram_and_leaves_the_rest():
    """``grad_gram``: a due matrix folds its gradient's statistic (counts one capture) and queues one
    request per block; the state's capture lists are new lists (a state_dict taken before keeps its
    counts). A statistic absent from ``agreed`` (hook sources) is no request."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 8))
    opt = dobb.Dobb([w], lr=0.01, source="grad_gram", blocks=2)
    w.grad = torch.randn(6, 8)
    st, plan = opt.state[w], opt._plans[w]
    before = st["captures"]
    requests, shared = schedule.queue_refresh(opt.param_groups[0], [w], [w.grad], [st], [plan], ({}, {}))
    assert len(requests) == len(shared) >= 1 and st["captures"] == [[1]] and before == [[0]]
    group = dict(opt.param_groups[0], source="activation")
    st["captures"] = [[0]]
    assert schedule.queue_refresh(group, [w], [w.grad], [st], [plan], ({}, {})) == ([], [])
