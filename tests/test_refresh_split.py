"""The split refresh's pure parts (``dobb._refresh_split``) in one process: the owner plan against hand
cases, the shared-group rule, and ``solve`` without shared groups against ``refresh_bases``, with a
block solved alone equal to the same block solved in a batch for the even sizes the split moves."""
from __future__ import annotations

import pytest
import torch

from dobb import Dobb
from dobb import functional as F
from _split_host import SIZES, lone_equals_batch
from dobb._refresh_split import RefreshBatch, plan_owners, shared_group, solve


def test_plan_owners_longest_first_to_the_least_loaded_rank():
    # 27 (3^3) first to rank 0; then the 8s to ranks 1, 2, 1 (ties to the lowest rank), 1 to rank 2
    assert plan_owners([8.0, 27.0, 8.0, 8.0, 1.0], 3) == [1, 0, 2, 1, 2]
    assert plan_owners([5.0, 5.0, 5.0, 5.0], 2) == [0, 1, 0, 1]  # equal costs keep their order
    assert plan_owners([], 4) == []
    assert plan_owners([1.0, 2.0], 4) == [1, 0]  # more ranks than units: some own nothing


def test_plan_balances_within_the_largest_unit():
    # greedy longest-first: every rank's load is at most the mean plus the largest unit
    costs = [float(s**3) for s in (768, 768, 768, 768, 3072, 768, 384, 384)]
    owner = plan_owners(costs, 4)
    load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(4)]
    assert max(load) <= sum(costs) / 4 + max(costs)
    assert owner[4] == 0 and load[0] == 3072**3  # the widest block alone on one rank


def test_single_process_layouts_share_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    opt = Dobb(model.parameters(), model, lr=0.01, blocks=2)
    assert shared_group(opt._plans[model[0].weight].layout) is None


@pytest.mark.parametrize("size", SIZES)
def test_even_blocks_alone_equal_blocks_in_a_batch(size):
    # what keeps the split bitwise: an owner solves a subset of the blocks the unsplit refresh batches.
    # Bitwise where the host's kernels give it (tests/_split_host.py; the sharded tests skip elsewhere);
    # to rounding on every host
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(5, 3 * size, size, generator=gen)
    a = x.transpose(1, 2) @ x
    q0 = F.eigh_basis(a + 0.01 * torch.randn(5, size, size, generator=gen))
    for exact in (False, True):
        batch = F.refresh_bases([(a, q0, exact)])[0]
        for j in range(5):
            alone = F.refresh_bases([(a[j : j + 1].clone(), q0[j : j + 1].clone(), exact)])[0]
            torch.testing.assert_close(alone[0], batch[j], atol=1e-4, rtol=0)
            if lone_equals_batch(size):
                assert torch.equal(alone[0], batch[j])


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


def test_split_refresh_must_be_a_bool():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    with pytest.raises(ValueError, match="split_refresh must be True or False"):
        Dobb(model.parameters(), model, lr=0.01, split_refresh="yes")
