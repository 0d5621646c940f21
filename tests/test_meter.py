"""dobb.meter on one process: ``state_bytes`` (the one measure of optimizer state size) against sizes
counted by hand, and ``PayloadMeter``'s records and totals on a one-rank gloo group against the
logical sizes of its module docstring. The multi-rank checks (against ``CommDebugMode``) are in
tests/distributed/test_meter_sharded.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from _one_rank import one_rank_group
from dobb.collectives import collective_kind
from dobb.meter import PayloadMeter, Totals, state_bytes


def test_state_bytes_of_torch_adamw_counted_by_hand():
    """AdamW on Linear(4, 3): per parameter exp_avg + exp_avg_sq (fp32) and a scalar fp32 step."""
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert state_bytes(opt) == 0  # no state before the first step
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    expected = (12 * 4 * 2 + 4) + (3 * 4 * 2 + 4)
    assert state_bytes(opt) == state_bytes(opt.state) == state_bytes(opt.state_dict()["state"]) == expected


def test_state_bytes_counts_each_storage_once_and_no_python_numbers():
    base = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    other = torch.zeros(3, dtype=torch.bfloat16)  # 6 bytes
    state = {"p": {"buf": base, "view": base[2:5], "reshaped": base.view(2, 5), "count": 7, "lr": 0.1,
                   "nested": [other, {"again": other}]},
             "q": {"same_buffer": base}}
    assert state_bytes(state) == 80 + 6
    assert state_bytes({"p": {"slice": base[:1]}}) == 80  # a view keeps its whole storage alive


def test_state_bytes_of_a_dtensor_is_its_local_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with one_rank_group():
        d = distribute_tensor(torch.zeros(4, 6), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert state_bytes({"p": {"stat": d}}) == 4 * 6 * 4


def test_meter_sees_nothing_without_collectives():
    with PayloadMeter() as meter:
        (torch.randn(8, 8) @ torch.randn(8, 8)).sum()
    assert meter.records == [] and meter.collectives == meter.bytes == meter.numel == 0
    assert meter.by_op == {} and meter.kind("stat") == Totals()


def test_meter_records_and_totals_on_one_rank():
    """Logical sizes: the reduced tensor (all-reduce), the gathered output (all-gather), the full
    input (reduce-scatter); the tag of the enclosing collective_kind, None outside one."""
    import torch.distributed as dist

    with one_rank_group():
        with PayloadMeter() as meter:
            dist.all_reduce(torch.ones(6, dtype=torch.float64))
            with collective_kind("stat"):
                dist.all_reduce(torch.ones(5), async_op=True).wait()
            dist.all_gather_into_tensor(torch.empty(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))
            dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3))
        assert not meter._mode  # the mode is left on exit
    assert [(r.op, r.kind, r.numel, r.bytes) for r in meter.records] == [
        ("all_reduce", None, 6, 48), ("all_reduce", "stat", 5, 20), ("all_gather", None, 4, 8),
        ("reduce_scatter", None, 3, 12)]
    assert (meter.collectives, meter.numel, meter.bytes) == (4, 18, 88)
    assert meter.by_op == {"all_reduce": Totals(2, 11, 68), "all_gather": Totals(1, 4, 8),
                           "reduce_scatter": Totals(1, 3, 12)}
    assert meter.kind("stat") == Totals(1, 5, 20) and meter.kind(None) == Totals(3, 13, 68)
    assert meter.kind("norm") == Totals()


@pytest.mark.parametrize("n", [0, 1])
def test_meter_counts_empty_collectives(n):
    import torch.distributed as dist

    with one_rank_group():
        with PayloadMeter() as meter:
            dist.all_reduce(torch.ones(n))
    assert meter.collectives == 1 and meter.numel == n and meter.bytes == 4 * n
