"""``dobb._agreement``: what the ranks of a step decide together (statistic reduction and the
finiteness flag), in one process; a one-rank gloo group stands in for a statistic group where the
device-side form needs one. The reference: float64 means of the captured rows, the gradients' own
NaN/Inf. The multi-rank behaviour is tests/distributed (test_robustness, test_ddp, test_experts_sharded)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dobb._agreement import DueStat, agree, local_nonfinite
from dobb.capture import PendingStat
from dobb.experts import expert_layout
from dobb.layout import plain_layout

F64 = torch.float64


def _pending(rows, sizes):
    """What the capture hooks hold for ``rows``: the row-stacked block sums and the row count."""
    import dobb.functional as F

    sums, n = F.second_moment_blocks(rows, sizes, F64)
    return PendingStat(sums, n)


def _dense_mean(rows, sizes):
    x, out, start = rows.double(), torch.zeros(sum(sizes), max(sizes), dtype=F64), 0
    for s in sizes:
        out[start : start + s, :s] = x[:, start : start + s].T @ x[:, start : start + s] / x.shape[0]
        start += s
    return out


def _matrix(n=6, blocks=2):
    w = torch.nn.Parameter(torch.zeros(4, n, dtype=F64))
    w.grad = torch.ones_like(w)
    return w, plain_layout(w, "input", blocks)


def test_matrix_statistics_are_row_means_and_unseen_ones_are_flagged():
    (w1, l1), (w2, l2) = _matrix(), _matrix()
    rows = torch.randn(9, 6, dtype=F64)
    due = [DueStat(w1, 0, l1, _pending(rows, l1.local_sizes), F64, True), DueStat(w2, 0, l2, None, F64, True)]
    out = agree(due, [w1, w2], None, check_finite=True)
    assert out.nonfinite is None
    r1, r2 = out.stats[0][w1], out.stats[0][w2]
    assert r1.mean.shape == (1, 6, 3) and r1.seen == [True] and r1.keep is None
    torch.testing.assert_close(r1.mean[0], _dense_mean(rows, [3, 3]), atol=1e-13, rtol=0)
    assert r2.seen == [False]  # no row anywhere: this matrix keeps its statistic and basis


def test_expert_stack_statistics_are_per_expert_means():
    w = torch.nn.Parameter(torch.zeros(3, 4, 6, dtype=F64))
    w.grad = torch.ones_like(w)
    lay = expert_layout(w, "input", 2)
    rows = [torch.randn(5, 6, dtype=F64), torch.zeros(0, 6, dtype=F64), torch.randn(2, 6, dtype=F64)]
    sums = torch.stack([_pending(r, [3, 3]).sums if len(r) else torch.zeros(6, 3, dtype=F64) for r in rows])
    pending = PendingStat(sums, [len(r) for r in rows])
    red = agree([DueStat(w, 0, lay, pending, F64, True)], [w], None, check_finite=False).stats[0][w]
    assert red.seen == [True, False, True] and red.keep is None
    for e in (0, 2):
        torch.testing.assert_close(red.mean[e], _dense_mean(rows[e], [3, 3]), atol=1e-13, rtol=0)


def test_a_nonfinite_gradient_is_reported_before_any_statistic():
    (w1, l1), (w2, _) = _matrix(), _matrix()
    w2.grad[1, 2] = float("nan")
    due = [DueStat(w1, 0, l1, _pending(torch.randn(3, 6, dtype=F64), [3, 3]), F64, False)]
    out = agree(due, [w1, w2], None, check_finite=True)
    assert out.nonfinite == (1, 1) and out.stats == ({}, {})
    assert agree(due, [w1, w2], None, check_finite=False).nonfinite is None
    assert local_nonfinite([w1, w2]).tolist() == [0.0, 1.0]
    w1.grad = w2.grad = None
    assert local_nonfinite([w1, w2]).tolist() == [0.0, 0.0]  # no gradient here: still takes part


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_with_a_group_and_every_matrix_seen_keep_or_update_stays_on_the_device(one_rank_group):
    """check_finite=False and no first statistic: no host read, the has-rows flags stay tensors."""
    w, lay = _matrix()
    lay.stat_group = one_rank_group
    rows = torch.randn(7, 6, dtype=F64)
    seen = agree([DueStat(w, 0, lay, _pending(rows, [3, 3]), F64, False)], [w], None, check_finite=False).stats[0][w]
    assert seen.seen == [True] and seen.keep is not None and seen.keep.tolist() == [True]
    torch.testing.assert_close(seen.mean[0], _dense_mean(rows, [3, 3]), atol=1e-13, rtol=0)
    empty = agree([DueStat(w, 0, lay, None, F64, False)], [w], None, check_finite=False).stats[0][w]
    assert empty.seen == [True] and empty.keep.tolist() == [False]  # counted, but kept on the device
    # a first statistic is read on the host (its count decides the exact eigh and the schedule)
    first = agree([DueStat(w, 0, lay, None, F64, True)], [w], None, check_finite=False).stats[0][w]
    assert first.seen == [False] and first.keep is None
