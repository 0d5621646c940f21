"""dobb.distribution on one process: the owner plans (pure), the strategy's routes without a group
(every matrix computed locally, bitwise the function itself), and the argument's validation. The
multi-process exchanges are tested where they are used: tests/distributed/test_owner_muon_sharded.py,
test_muonbp_sharded.py, test_soap_sharded.py, test_dobb_muon_sharded.py and the split refresh's
tests/distributed tests, on 2 and 4 ranks."""
from __future__ import annotations

import pytest
import torch

from dobb import distribution as D
from dobb.newton_schulz import orthogonalize


def test_ns_cost_and_wire_dtype():
    assert D.ns_cost((8, 2)) == D.ns_cost((2, 8)) == 2 * 4 * 8 + 8
    assert D.wire_dtype(torch.float32, torch.bfloat16) == torch.bfloat16  # the narrower compute dtype travels
    assert D.wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16  # never wider than the input


def test_plain_matrices_without_a_group_are_computed_locally():
    owner = D.OwnerCompute(None)
    mats = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plans = owner.plan(mats, [torch.float32] * 3)
    assert [p.route for p in plans] == ["local"] * 3 and D.owners_of(dict(zip(mats, plans))) == {}
    fn = lambda xs: orthogonalize(xs, dtype=torch.float32)  # noqa: E731
    out = owner.compute(plans, mats, mats, fn, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(out, fn(mats)))


def test_default_group_is_none_without_a_process_group():
    assert D.OwnerCompute().replicated_pg() is None
    with pytest.raises(ValueError, match="replicated_group must be 'default', None or a ProcessGroup"):
        D.OwnerCompute("world")


def test_owner_plan_fields_extend_a_plan():
    plan = D.OwnerPlan("shard", None, 0, 1)
    assert D.owner_plan_fields(plan) == {"route": "shard", "group": None, "dim": 0, "owner": 1, "why": None}
    assert D.gathered_of({"w": D.OwnerPlan("gather", why="2-D mesh")}) == {"w": "2-D mesh"}
