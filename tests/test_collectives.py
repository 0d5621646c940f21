"""dobb.collectives on one process: the ``collective_kind`` tag (nesting, reset after an error),
the owner plan ``plan_owners`` against hand cases, and the group rules (``group_ranks``,
``common_group``, ``plain_stat_group``) on a one-rank gloo group; tests/distributed runs them on 2
and 4 ranks."""
from __future__ import annotations

import pytest
from torch import nn

from _one_rank import one_rank_group
from dobb.collectives import collective_kind, common_group, current_kind, group_ranks, plain_stat_group, plan_owners


def test_collective_kind_nests_and_is_reset_after_an_error():
    assert current_kind() is None
    with collective_kind("stat"):
        assert current_kind() == "stat"
        with pytest.raises(RuntimeError):
            with collective_kind("norm"):
                assert current_kind() == "norm"
                raise RuntimeError("inside")
        assert current_kind() == "stat"
    assert current_kind() is None


def test_group_rules_on_one_process():
    assert group_ranks(None) == frozenset([0])
    assert common_group([]) is None and common_group([None, None]) is None
    with one_rank_group() as world:
        assert group_ranks(world) == frozenset([0])
        assert common_group([None, world]) is world


def test_plain_stat_group_single_process():
    model = nn.Linear(3, 2)
    assert plain_stat_group(model, "default") is None  # no process group: no averaging
    assert plain_stat_group(model, None) is None
    with one_rank_group() as world:
        assert plain_stat_group(model, "default") is None  # one rank: nothing to average
        assert plain_stat_group(model, world) is None


@pytest.mark.parametrize("bad", ["dp", 0, ("dp",)])
def test_plain_stat_group_refuses_mesh_names_naming_stat_group(bad):
    with pytest.raises(ValueError) as err:
        plain_stat_group(nn.Linear(3, 2), bad)
    assert str(err.value) == (f"stat_group for plain (non-DTensor) parameters must be a ProcessGroup or None, got "
                              f"{bad!r} (mesh dim names apply to DTensor parameters only)")


def test_plan_owners_longest_first_to_the_least_loaded_rank():
    # 27 (3^3) first to rank 0; then the 8s to ranks 1, 2, 1 (ties to the lowest rank), 1 to rank 2
    assert plan_owners([8.0, 27.0, 8.0, 8.0, 1.0], 3) == [1, 0, 2, 1, 2]
    assert plan_owners([5.0, 5.0, 5.0, 5.0], 2) == [0, 1, 0, 1]  # equal costs keep their order
    assert plan_owners([], 4) == []
    assert plan_owners([1.0, 2.0], 4) == [1, 0]  # more ranks than units: some own nothing



def test_plan_owners_continues_from_earlier_loads():
    loads = [10.0, 0.0, 4.0]
    # the 8 goes to the idle rank 1, then 3 to rank 2 (4 < 8, 10), and the loads are updated in place
    assert plan_owners([3.0, 8.0], 3, loads) == [2, 1]
    assert loads == [10.0, 8.0, 7.0]
    with pytest.raises(ValueError, match="loads has 2 entries for 3 ranks"):
        plan_owners([1.0], 3, [0.0, 0.0])


def test_plan_balances_within_the_largest_unit():
    # greedy longest-first: every rank's load is at most the mean plus the largest unit
    costs = [float(s**3) for s in (768, 768, 768, 768, 3072, 768, 384, 384)]
    owner = plan_owners(costs, 4)
    load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(4)]
    assert max(load) <= sum(costs) / 4 + max(costs)
    assert owner[4] == 0 and load[0] == 3072**3  # the widest block alone on one rank
