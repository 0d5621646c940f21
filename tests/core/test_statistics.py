"""``dobb.core.statistics`` in one process: the sums over ranks (``SumBucket``, ``all_reduce_sum_``),
the agreement (statistic reduction and the finiteness flag; a one-rank gloo group stands in for a
statistic group where the device-side form needs one; reference: float64 means of the captured rows,
the gradients' own NaN/Inf), the one refresh rule ``fold_side`` (reference: the rule written out per
matrix in float64: count on due and seen; copy on the first capture, else the EMA; eigh on the first
capture with init_basis="eigh"; kept where not chosen) and the split refresh's pure parts (the
shared-group rule, ``solve`` without shared groups against ``refresh_bases``, a block solved alone
equal to the same block solved in a batch for the even sizes the split moves). The multi-rank
behaviour is tests/distributed (test_robustness, test_ddp, test_experts_sharded,
test_refresh_split_sharded)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _one_rank import one_rank_group as one_rank
from _split_host import SIZES, lone_and_batched, lone_equals_batch
from dobb import Dobb
from dobb import functional as F
from dobb.capture import PendingStat
from dobb.core.experts import expert_layout
from dobb.core.statistics import (DueStat, RefreshBatch, split_by_default, SumBucket, agree, all_reduce_sum_, fold_side,
                                  local_nonfinite, shared_group, solve)
from dobb.layout import ReducedStat, plain_layout
from dobb.meter import PayloadMeter


# ------------------------------------------------------------- sums over ranks
def test_sum_bucket_without_group_hands_back_the_segments_in_order():
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.tensor([7, 8], dtype=torch.int64)
    c = torch.ones(1, 1, 2, dtype=torch.bfloat16)
    bucket = SumBucket(None, torch.float64, torch.device("cpu"))
    assert [bucket.add(t) for t in (a, b, c)] == [0, 1, 2]
    with PayloadMeter() as meter:
        out = bucket.reduce("stat")
    assert meter.collectives == 0
    assert [o.shape for o in out] == [a.shape, b.shape, c.shape]
    assert all(o.dtype == torch.float64 for o in out)
    assert torch.equal(out[0], a.double()) and torch.equal(out[1], b.double()) and torch.equal(out[2], c.double())
    # no flat buffer without a group: a segment already in the bucket's dtype is handed back itself
    same = SumBucket(None, torch.float32, torch.device("cpu"))
    same.add(a)
    assert same.reduce("stat")[0] is a


def test_sum_bucket_is_one_all_reduce_tagged_with_its_kind():
    with one_rank() as world:
        bucket = SumBucket(world, torch.float32, torch.device("cpu"))
        bucket.add(torch.full((2, 3), 2.0))
        bucket.add(torch.arange(4.0))
        with PayloadMeter() as meter:
            out = bucket.reduce("stat")
            norms = all_reduce_sum_(torch.ones(5), world)
    assert [(r.op, r.kind, r.numel, r.bytes) for r in meter.records] == [
        ("all_reduce", "stat", 10, 40), ("all_reduce", "norm", 5, 20)]
    assert torch.equal(out[0], torch.full((2, 3), 2.0)) and torch.equal(out[1], torch.arange(4.0))
    assert torch.equal(norms, torch.ones(5))


def test_all_reduce_sum_without_group_is_the_tensor_itself():
    t = torch.arange(3.0)
    with PayloadMeter() as meter:
        assert all_reduce_sum_(t, None) is t
    assert meter.collectives == 0 and torch.equal(t, torch.arange(3.0))


# ------------------------------------------------------------------- agreement
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


@pytest.mark.parametrize("foreach", [False, True], ids=["sums (CPU)", "max-norms (accelerators)"])
def test_a_nonfinite_gradient_is_reported_before_any_statistic(foreach):
    """Both reductions of the check (per-gradient sums on a CPU, one grouped max-norm elsewhere, forced
    here on a CPU) give the same flags."""
    (w1, l1), (w2, _) = _matrix(), _matrix()
    w2.grad[1, 2] = float("nan")
    due = [DueStat(w1, 0, l1, _pending(torch.randn(3, 6, dtype=F64), [3, 3]), F64, False)]
    out = agree(due, [w1, w2], None, check_finite=True)
    assert out.nonfinite == (1, 1) and out.stats == ({}, {})
    assert agree(due, [w1, w2], None, check_finite=False).nonfinite is None
    assert local_nonfinite([w1, w2], foreach).tolist() == [0.0, 1.0]
    w2.grad[1, 2], w1.grad[0, 0] = float("inf"), float("-inf")
    assert local_nonfinite([w1, w2], foreach).tolist() == [1.0, 1.0]
    w1.grad = None
    assert local_nonfinite([w1, w2], foreach).tolist() == [0.0, 1.0]  # a parameter without a gradient is finite
    # fp16 gradients whose sum exceeds fp16's range (65504) are finite: the sum is taken in fp32
    w3 = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float16))
    w3.grad = torch.full_like(w3, 60000.0)
    assert local_nonfinite([w1, w3], foreach).tolist() == [0.0, 0.0]
    w4 = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))  # mixed dtypes, an infinity in bf16
    w4.grad = torch.tensor([1.0, float("-inf"), 2.0], dtype=torch.bfloat16)
    assert local_nonfinite([w3, w4, w2], foreach).tolist() == [0.0, 1.0, 1.0]
    w1.grad = w2.grad = None
    assert local_nonfinite([w1, w2], foreach).tolist() == [0.0, 0.0]  # no gradient here: still takes part


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


def test_with_check_finite_the_flags_and_the_counts_are_one_host_read(one_rank_group):
    """check_finite reads the flags on the host (the raise is a host decision); the counts of a refresh
    come in the same read, one ``tolist`` where there were two, the same statistic."""
    from _hostsync import HostReads

    w, lay = _matrix()
    lay.stat_group = one_rank_group
    rows = torch.randn(7, 6, dtype=F64)
    due = [DueStat(w, 0, lay, _pending(rows, [3, 3]), F64, False)]
    with HostReads() as spy:
        out = agree(due, [w], one_rank_group, check_finite=True)
    assert spy.hits == ["tolist"] and out.nonfinite is None
    stat = out.stats[0][w]
    assert stat.seen == [True] and stat.keep is None  # exact captures: counted on the host
    torch.testing.assert_close(stat.mean[0], _dense_mean(rows, [3, 3]), atol=1e-13, rtol=0)
    w.grad[0, 1] = float("nan")
    with HostReads() as spy:
        assert agree(due, [w], one_rank_group, check_finite=True).nonfinite == (0, 1)
    assert spy.hits == ["tolist"]


# ---------------------------------------------------------- the statistic fold
GROUP = dict(stat_decay=0.9, eigh=False, init_eigh=True)  # basis="orthogonal_iteration", init_basis="eigh"


def _state(layout, like):
    return {"stat": layout.new_block_state(F64, identity=False, like=like),
            "basis": layout.new_block_state(F64, identity=True, like=like)}


def _fold(state, lay, counts, due, new, requests):
    fold_side(new, layout=lay, stat=state["stat"], basis=state["basis"], counts=counts, due=due, requests=requests,
              **GROUP)


def _solve(requests):
    for (a, q0, exact, put), q in zip(requests, F.refresh_bases([r[:3] for r in requests])):
        put(q)


def test_a_matrix_counts_folds_and_takes_an_exact_first_basis():
    w = torch.zeros(4, 6, dtype=F64)
    lay = plain_layout(w, "input", 2)
    state = _state(lay, w)
    g = torch.Generator().manual_seed(0)
    new = [F.second_moment_blocks(torch.randn(8, 6, generator=g, dtype=F64), [3, 3], F64)[0] for _ in range(2)]
    counts, requests = [0], []
    _fold(state, lay, counts, [True], ReducedStat(new[0][None], [True]), requests)
    assert counts == [1] and torch.equal(state["stat"], new[0])  # first capture: a copy
    assert [r[2] for r in requests] == [True]  # exact eigh, both blocks in one batch
    _solve(requests)
    for b in range(2):
        a, q = new[0][3 * b : 3 * b + 3], state["basis"][3 * b : 3 * b + 3]
        assert (q.T @ a @ q - torch.diag((q.T @ a @ q).diagonal())).abs().max() < 1e-10
    requests = []
    _fold(state, lay, counts, [True], ReducedStat(new[1][None], [True]), requests)
    assert counts == [2] and [r[2] for r in requests] == [False]
    torch.testing.assert_close(state["stat"], 0.9 * new[0] + 0.1 * new[1], atol=1e-15, rtol=0)
    requests = []  # no rank saw a row: no count, statistic and basis kept
    before = {k: v.clone() for k, v in state.items()}
    _fold(state, lay, counts, [True], ReducedStat(new[0][None], [False]), requests)
    assert counts == [2] and not requests and all(torch.equal(state[k], before[k]) for k in state)


def test_a_stack_applies_the_rule_per_expert():
    """Expert 0: due and seen (EMA); 1: not due (kept, not counted); 2: first capture (copy, exact);
    3: due but no row (kept). One request per rule and run, covering only the chosen experts."""
    w = torch.zeros(4, 5, 6, dtype=F64)
    lay = expert_layout(w, "input", 2)
    state = _state(lay, w)
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, 3, generator=g, dtype=F64)
    state["stat"].copy_(old)
    new = torch.randn(4, 6, 3, generator=g, dtype=F64)
    counts, requests = [3, 3, 0, 3], []
    _fold(state, lay, counts, [True, False, True, True], ReducedStat(new, [True, True, True, False]),
              requests)
    assert counts == [4, 3, 1, 3]
    expected = torch.stack([0.9 * old[0] + 0.1 * new[0], old[1], new[2], old[3]])
    torch.testing.assert_close(state["stat"], expected, atol=1e-15, rtol=0)
    assert [(r[0].shape[0], r[2]) for r in requests] == [(2, True), (2, False)]  # expert 2 exact, expert 0 not
    _solve(requests)
    ident = F.identity_blocks([3, 3], dtype=F64)
    assert torch.equal(state["basis"][1], ident) and torch.equal(state["basis"][3], ident)
    assert not torch.equal(state["basis"][0], ident) and not torch.equal(state["basis"][2], ident)


def test_device_keep_flags_keep_statistic_and_basis_without_a_host_read():
    w = torch.zeros(2, 5, 6, dtype=F64)
    lay = expert_layout(w, "input", 1)
    state = _state(lay, w)
    old = torch.randn(2, 6, 6, dtype=F64)
    state["stat"].copy_(old)
    new = torch.randn(2, 6, 6, dtype=F64)
    counts, requests = [2, 2], []
    _fold(state, lay, counts, [True, True], ReducedStat(new, [True, True], torch.tensor([False, True])),
              requests)
    assert counts == [3, 3]  # counted: the host did not look
    _solve(requests)
    assert torch.equal(state["stat"][0], old[0]) and torch.equal(state["basis"][0], torch.eye(6, dtype=F64))
    torch.testing.assert_close(state["stat"][1], 0.9 * old[1] + 0.1 * new[1], atol=1e-15, rtol=0)
    assert not torch.equal(state["basis"][1], torch.eye(6, dtype=F64))


# ------------------------------------------------------------- the basis solve
def test_single_process_layouts_share_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    opt = Dobb(model.parameters(), model, lr=0.01, blocks=2)
    assert shared_group(opt._plans[model[0].weight].layout) is None


@pytest.mark.parametrize("size", SIZES)
def test_even_blocks_alone_equal_blocks_in_a_batch(size):
    # what keeps the split bitwise: an owner solves a subset of the blocks the unsplit refresh batches.
    # Bitwise where the host's kernels give it (tests/_split_host.py; the sharded tests skip elsewhere);
    # to rounding on every host
    for alone, batched in lone_and_batched(size):
        torch.testing.assert_close(alone, batched, atol=1e-4, rtol=0)
        if lone_equals_batch(size):
            assert torch.equal(alone, batched)


def test_solve_without_shared_groups_is_refresh_bases():
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for b, s, exact in ((2, 4, False), (3, 5, True), (1, 4, False)):
        x = torch.randn(b, 2 * s, s, generator=gen)
        a = x.transpose(1, 2) @ x
        blocks.append((a, torch.linalg.qr(torch.randn(b, s, s, generator=gen)).Q, exact))
    out = solve([RefreshBatch(1, "householder", torch.float32, blocks, [None] * 3)])
    ref = F.refresh_bases(blocks, 1, "householder")
    assert all(torch.equal(o, r) for o, r in zip(out[0], ref))
    # one request per block size and rule: solved from its own tensors (no concatenation), bitwise the same;
    # the basis in bf16 as the optimizer keeps it, a statistic that is a view of a wider state
    state = blocks[0][0].new_zeros(3, 4, 4)
    state[1:] = blocks[0][0]
    lone = [(state[1:], blocks[0][1].bfloat16(), False), blocks[1]]
    out = solve([RefreshBatch(2, "householder", torch.bfloat16, lone, [None] * 2)])
    ref = F.refresh_bases(lone, 2, "householder")
    assert all(torch.equal(o, r) for o, r in zip(out[0], ref))


@pytest.mark.parametrize("value", ["yes", 1, 0, "none"])
def test_split_refresh_must_be_a_bool_or_none(value):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    with pytest.raises(ValueError, match="split_refresh must be True or False"):
        Dobb(model.parameters(), model, lr=0.01, split_refresh=value)
    for ok in (None, True, False):
        assert Dobb(model.parameters(), model, lr=0.01, split_refresh=ok).split_refresh is ok
    assert Dobb(model.parameters(), model, lr=0.01).split_refresh is None  # the default: split where bitwise


def _single_process_run(**split):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    mats = [model[0].weight, model[2].weight]
    groups = [{"params": mats}, {"params": [model[0].bias, model[2].bias], "algorithm": "adamw"}]
    opt = Dobb(groups, model, lr=0.02, weight_decay=0.01, blocks=2, refresh_every=2, **split)
    gen = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(5):
        x, y = torch.randn(20, 12, generator=gen), torch.randn(20, 6, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with PayloadMeter() as meter:
            opt.step()
        opt.zero_grad()
        counts.append(meter.collectives)
    state = [v for p in mats for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + state, counts


def test_single_process_default_is_the_unsplit_refresh_bitwise():
    """No process group: the default (and an explicit True) is the unsplit refresh, bit for bit, and
    the step issues no collective."""
    assert not dist.is_initialized()
    ref, counts = _single_process_run(split_refresh=False)
    assert counts == [0] * 5
    for split in ({}, {"split_refresh": True}):
        out, counts = _single_process_run(**split)
        assert counts == [0] * 5 and len(out) == len(ref)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_split_by_default_where_bitwise_by_construction():
    """The default splits a hook statistic (all-reduced: the same on every rank) on any device (the
    unsplit refresh mirrors the owners' batches: tests/distributed/test_refresh_mirror.py), never a
    gradient Gram (each rank's own)."""
    assert split_by_default("activation")
    assert split_by_default("output_grad")
    assert not split_by_default("grad_gram")


@pytest.mark.parametrize("shape", [(1, 1, 256), (2, 2, 256), (1, 3, 32), (2, 1, 300)])
@pytest.mark.parametrize("keep", [None, (True, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_put_bases_stores_the_bits_of_a_plain_copy(shape, keep, dtype):
    """``_put_bases`` (rounding QR's column-major blocks first, large ones copied a 2-D block at a time)
    writes exactly what ``bv.copy_(where(keep, q, bv))`` writes, into a basis run view that is a strided
    part of a larger row-stacked basis (uneven blocks: ``s`` below the basis width)."""
    from dobb.core.statistics import _put_bases

    E, count, s = shape
    if keep is not None and E != 2:
        pytest.skip("keep flags are per matrix of a stack of two")
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(E * count, s, s, generator=gen, dtype=torch.float64).float()
    q = torch.linalg.householder_product(*torch.geqrf(p))  # LAPACK's column-major blocks
    assert not q.is_contiguous()
    for width in (s, s + 3):  # the run's blocks fill the basis width, or a wider block elsewhere pads it
        basis = torch.randn(E, count * s + 5, width, generator=gen).to(dtype)
        bv = basis[:, 5:].unflatten(1, (count, s))[..., :s]
        ref = basis.clone()
        k4 = None if keep is None else torch.tensor(keep).view(-1, 1, 1, 1)
        rv = ref[:, 5:].unflatten(1, (count, s))[..., :s]
        rv.copy_(q.view(rv.shape) if k4 is None else torch.where(k4, q.view(rv.shape), rv))
        _put_bases(bv, q, None, k4)
        assert torch.equal(basis, ref)
        assert not torch.equal(basis[:, 5:], torch.zeros_like(basis[:, 5:]))
