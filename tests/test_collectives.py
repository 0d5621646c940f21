"""dobb.collectives on one process: the ``collective_kind`` tag (nesting, reset after an error),
``SumBucket`` (one all-reduce of the segments, handed back in order and shape), ``all_reduce_sum_``,
and the group rules (``group_ranks``, ``common_group``, ``plain_stat_group``). Collectives are
observed with ``dobb.meter.PayloadMeter`` on a one-rank gloo group (a sum over one rank is the
identity, so the values are known); tests/distributed runs them on 2 and 4 ranks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from _one_rank import one_rank_group
from dobb.collectives import (SumBucket, all_reduce_sum_, collective_kind, common_group, current_kind, group_ranks,
                              plain_stat_group)
from dobb.meter import PayloadMeter


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
    # one flat buffer behind all of them (one collective when there is a group)
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1


def test_sum_bucket_is_one_all_reduce_tagged_with_its_kind():
    with one_rank_group() as world:
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
