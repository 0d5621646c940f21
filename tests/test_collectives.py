"""dobb.collectives on one process: the ``collective_kind`` tag (nesting, reset after an error),
the owner plan ``plan_owners`` against hand cases, and the group rules (``group_ranks``,
``common_group``, ``plain_stat_group``) on a one-rank gloo group; tests/distributed runs them on 2
and 4 ranks. Also: no other module of ``dobb`` issues a collective (an AST check, shown able to
fail), each collective reaches the payload meter with its kind, and an unknown kind is a
``ValueError`` (tests/distributed/test_collectives_sharded.py: every optimizer's kinds on 2 ranks)."""
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


# ----------------------------------------------------------------------------- one door for every collective
import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import dobb  # noqa: E402
from dobb import collectives  # noqa: E402
from dobb.meter import PayloadMeter  # noqa: E402

SRC = Path(dobb.__file__).resolve().parent
# torch.distributed's point-to-point and collective calls (and the functional collectives' module)
COLLECTIVE_CALLS = {"all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
                    "all_gather_coalesced", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
                    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
                    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
                    "monitored_barrier"}


def collective_calls(source: str) -> list[str]:
    """``dist.X(...)`` / ``torch.distributed.X(...)`` calls of a collective ``X`` in ``source``, names
    of collectives imported from ``torch.distributed``, and imports of its functional collectives."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_CALLS:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed", "c10d"):
                found.append(f"{owner}.{node.func.attr} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [f"import of {node.module}.{a.name} (line {node.lineno})" for a in node.names
                      if a.name in COLLECTIVE_CALLS or a.name == "_functional_collectives"]
            if "_functional_collectives" in (node.module or ""):
                found.append(f"import of {node.module} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            found += [f"import of {a.name} (line {node.lineno})" for a in node.names if "_functional_collectives" in a.name]
    return found


def test_no_module_but_collectives_issues_a_collective():
    """Every collective of the library goes through ``dobb.collectives`` with its kind."""
    bad = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "collectives.py":
            continue
        calls = collective_calls(path.read_text())
        if calls:
            bad[path.relative_to(SRC).as_posix()] = calls
    assert bad == {}


def test_the_collective_check_finds_each_form():
    """The check can fail: the forms a module could use are found (and a tensor's own methods are not)."""
    source = ("import torch.distributed as dist\nimport torch\n"
              "dist.all_reduce(t, group=g)\ntorch.distributed.all_to_all_single(o, i)\n"
              "from torch.distributed import broadcast\n"
              "import torch.distributed._functional_collectives as funcol\n"
              "torch.gather(b, 1, idx)\nb.scatter(1, idx, v)\n")
    assert sorted(c.split(" (")[0] for c in collective_calls(source)) == [
        "dist.all_reduce", "import of torch.distributed._functional_collectives",
        "import of torch.distributed.broadcast", "torch.distributed.all_to_all_single"]


@pytest.mark.parametrize("call", [
    lambda: collective_kind("stats").__enter__(),
    lambda: collectives.all_reduce_sum_(torch.ones(2), None, "stats"),
    lambda: collectives.all_to_all([], [], [], torch.float32, "cpu", None, "stats"),
    lambda: collectives.all_gather_into_(torch.ones(2), torch.ones(2), None, "stats"),
    lambda: collectives.broadcast_(torch.ones(2), 0, None, "stats")])
def test_an_unknown_kind_is_a_value_error_naming_it(call):
    with pytest.raises(ValueError, match=r"collective kind must be one of \('stat', .*\), got 'stats'"):
        with collective_kind("stat"):
            call()


def test_each_collective_reaches_the_meter_with_its_kind_on_one_rank():
    with one_rank_group() as world:
        t = torch.arange(4.0)
        with PayloadMeter() as m:
            collectives.all_reduce_sum_(t, world, "stat")
            collectives.all_reduce_sum_(t, None, "stat")  # no group: no collective
            out = collectives.all_to_all([torch.arange(3.0)], [3], [3], torch.float32, "cpu", world, "owner")
            gathered = collectives.all_gather_into_(torch.empty(4), torch.ones(4), world, "owner")
            collectives.broadcast_(t, 0, world, "basis")
    assert [(r.op, r.kind, r.numel) for r in m.records] == [
        ("all_reduce", "stat", 4), ("all_to_all", "owner", 3), ("all_gather", "owner", 4), ("broadcast", "basis", 4)]
    assert torch.equal(t, torch.arange(4.0)) and torch.equal(out, torch.arange(3.0))
    assert torch.equal(gathered, torch.ones(4))
