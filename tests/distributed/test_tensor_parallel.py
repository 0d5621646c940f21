"""Dobb under tensor parallelism (``fc1`` column-, ``fc2`` row-parallel) on 2 gloo ranks: TP ranks see
the same data, so no statistic is averaged; Dobb-ell2 reduces column norms only for the layer whose
unblocked axis is sharded."""
from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _common import STEPS, VARIANTS, checker, per_rank, run_variant
from _spawn import spawn

pytestmark = pytest.mark.slow


def worker(rank, world):
    results = {}
    check = checker(results)
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def tp(m):
        return parallelize_module(m, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    for v in VARIANTS:  # every rank sees the whole batch: nothing to average
        check(v, run_variant, rank, world, v, tp, (0, 1), stat_group=None)
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, 2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_matches_single_process(ranks, variant):
    norm = VARIANTS[variant]["norm"]
    for r in per_rank(ranks, variant):
        assert r["diff"] < 1e-12 and r["stat_diff"] < 1e-12
        steps = [s for s, *_ in r["log"]]
        if norm == "sign":
            assert steps == [0] * STEPS
        else:  # ell2: only the layer whose unblocked axis is TP-sharded (fc1 rows / fc2 rows) reduces
            assert steps == [1] * STEPS
            assert [e for _, _, _, e, _ in r["log"]] == [16] * STEPS
        assert [e for _, e, *_ in r["log"]] == [0] * STEPS  # stat_group=None: no statistic reduction
        assert [f for *_, f in r["log"]] == [1] * STEPS  # the TP ranks decide finiteness together
