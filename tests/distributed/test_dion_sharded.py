"""Dion's distributed step (``O(r(m+n))`` partial sums, no gather) against the single-process Dion.

One 2-rank spawn and one 4-rank spawn run every check; the tests assert on what the ranks returned.
Reference: ``dobb.Dion`` on plain float64 tensors with the same weights, gradients and seed, in the
spawning process (tolerance 1e-10 on weights, momentum and ``Q``). Derived payload per matrix and
step, in logical entries (``s = min(m, n)``: ``P``'s axis, ``l = max(m, n)``: ``Q``'s axis,
``k = ceil(1.25 r)``), from the algorithm in ``dobb/baselines/dion_family/dion.py``:

- rows of the oriented matrix split (``Shard(0)`` of a wide/square weight, ``Shard(1)`` of a tall
  one): Householder ``s r`` (P completed) + ``l r`` (R = B^T P); rcqr ``k r + r^2 + l r``;
- columns split: ``s r`` (P = B Q) + ``r`` (column norms of R);
- both split (2-D mesh): each rank's sum of the pieces it takes part in (see ``_two_d_expected``).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _common import checker, exchange
from _compare import max_diff
from _spawn import spawn
from dobb import Dion
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow
STEPS, LR, WD, FRACTION = 3, 0.05, 0.1, 0.25
ELEM = 8  # float64
CASES_2 = [(shape, dim, qr) for shape in ((13, 21), (21, 13), (12, 12)) for dim in (0, 1)
           for qr in ("householder", "rcqr")]
SWEEP = [(1.0, "householder"), (0.25, "householder"), (1 / 16, "householder"), (0.25, "rcqr")]
SWEEP_SHAPE = (32, 48)
MIXED = [(13, 21), (13, 21), (21, 13), (13, 21)]
UNEVEN = [((18, 10), "householder"), ((10, 18), "householder"), ((10, 18), "rcqr"), ((2, 9), "householder"),
          ((2, 9), "rcqr")]  # over 4 ranks: 18 -> 5,5,5,3 (tall: Q's axis; wide: P's axis); 2 -> 1,1,0,0


def weights_and_grads(shape, seed, steps=STEPS):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    return w, [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def rank_of(shape, fraction=FRACTION):
    return max(1, round(fraction * min(shape)))


def expected_entries(shape, dim, qr, fraction=FRACTION):
    m, n = shape
    s, l, r = min(m, n), max(m, n), rank_of(shape, fraction)
    rows_split = dim == (1 if m > n else 0)  # the sharded weight axis is P's axis
    if not rows_split:
        return s * r + r
    return (s * r if qr == "householder" else math.ceil(1.25 * r) * r + r * r) + l * r


# ----------------------------------------------------------------------------- rank-side code
def _run(mesh, placements_list, shapes, seeds, steps=STEPS, meter=False, **kw):
    """Dion over DTensor weights (one per shape); returns full weights/momentum/Q and per-step meters."""
    from torch.distributed.tensor import distribute_tensor

    params, grads = [], []
    for shape, seed, pl in zip(shapes, seeds, placements_list):
        w, gs = weights_and_grads(shape, seed, steps)
        params.append(nn.Parameter(distribute_tensor(w, mesh, pl, src_data_rank=None)))
        grads.append([distribute_tensor(g, mesh, pl, src_data_rank=None) for g in gs])
    opt = Dion(params, lr=LR, weight_decay=WD, **kw)
    log = []
    for t in range(steps):
        for p, gs in zip(params, grads):
            p.grad = gs[t]
        with PayloadMeter() as m:
            opt.step()
        rs = exchange(m)
        log.append((len(rs), sum(r.bytes for r in rs), sorted({r.op for r in rs})))
    return {"W": [p.detach().full_tensor() for p in params],
            "M": [opt.state[p]["momentum"].full_tensor() for p in params],
            "Q": [opt.state[p]["Q"].full_tensor() for p in params],
            "Q_placements": [tuple(opt.state[p]["Q"].placements) for p in params],
            "gathered": dict(opt.gathered), "log": log if meter else None}


def _same_keys(opt):
    import torch.distributed as dist

    keys = sorted((i, k) for i, p in enumerate(opt.param_groups[0]["params"]) for k in opt.state[p])
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, keys)
    return all(o == out[0] for o in out)


def _checkpoint_first(mesh, path):
    """Two steps of the tall matrix (Q sharded along its rows), then a DCP save (resumed on 4 ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    w, gs = weights_and_grads((21, 13), 7)
    model = Holder(distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None))
    opt = Dion([model.w], lr=LR, weight_decay=WD, qr="rcqr")
    for g in gs[:2]:
        model.w.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
        opt.step()
    dcp.save(_dcp_state(model, opt), checkpoint_id=path)
    return {"same_keys": _same_keys(opt)}


class Holder(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def worker2(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    check = checker(results)

    for i, (shape, dim, qr) in enumerate(CASES_2):
        check(("case", shape, dim, qr), _run, mesh, [[Shard(dim)]], [shape], [i], meter=True, qr=qr,
              rank_fraction=FRACTION)
    for shape_dim in ((SWEEP_SHAPE, 0), (SWEEP_SHAPE, 1)):
        for fraction, qr in SWEEP:
            check(("sweep", shape_dim[1], fraction, qr), _run, mesh, [[Shard(shape_dim[1])]], [SWEEP_SHAPE], [50],
                  steps=2, meter=True, qr=qr, rank_fraction=fraction)
    # one group, equal oriented shapes laid out differently (placement, orientation): sub-batches,
    # one rcqr sketch for the batch the single process forms
    check("mixed", _run, mesh, [[Shard(0)], [Shard(1)], [Shard(0)], [Shard(0)]], MIXED, [20, 21, 22, 23],
          qr="rcqr")
    check("ckpt", _checkpoint_first, mesh, path)
    return results


def _resume_on_four(mesh, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    w, gs = weights_and_grads((21, 13), 7)
    model = Holder(distribute_tensor(torch.zeros_like(w), mesh, [Shard(0)], src_data_rank=None))
    p = model.w
    opt = Dion([p], lr=LR, weight_decay=WD, qr="rcqr")
    sd = _dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    p.grad = distribute_tensor(gs[2], mesh, [Shard(0)], src_data_rank=None)
    opt.step()
    return {"W": p.detach().full_tensor(), "Q": opt.state[p]["Q"].full_tensor(),
            "M": opt.state[p]["momentum"].full_tensor(),
            "Q_placements": tuple(opt.state[p]["Q"].placements),
            "local_q_rows": opt.state[p]["Q"].to_local().shape[0]}


def worker4(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    check = checker(results)

    for shape, qr in UNEVEN:
        check(("uneven", shape, qr), _run, mesh, [[Shard(0)]], [shape], [30], meter=True, qr=qr)
    for pl in ((Shard(0), Shard(1)), (Shard(1), Shard(0))):
        for qr in ("householder", "rcqr"):
            check(("2d", pl, qr), _run, mesh2, [list(pl)], [(13, 21)], [31], meter=True, qr=qr)
    check("fallback", _run, mesh2, [[Shard(0), Shard(0)]], [(13, 21)], [32], meter=True)
    check("resume", _resume_on_four, mesh, path)
    return results


# ----------------------------------------------------------------------------- reference
def reference(shapes, seeds, steps=STEPS, **kw):
    params, grads = [], []
    for shape, seed in zip(shapes, seeds):
        w, gs = weights_and_grads(shape, seed, steps)
        params.append(nn.Parameter(w.clone()))
        grads.append(gs)
    opt = Dion(params, lr=LR, weight_decay=WD, **kw)
    for t in range(steps):
        for p, gs in zip(params, grads):
            p.grad = gs[t]
        opt.step()
    return {"W": [p.detach() for p in params], "M": [opt.state[p]["momentum"] for p in params],
            "Q": [opt.state[p]["Q"] for p in params]}


def assert_matches(got, ref, tol=1e-10):
    for key in ("W", "M", "Q"):
        assert max_diff(got[key], ref[key]) < tol, key


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dion_ckpt"))
    return spawn(worker2, 2, path), path


@pytest.fixture(scope="module")
def four(two):
    return spawn(worker4, 4, two[1])


def _get(results, key):
    out = []
    for res in results:
        assert not isinstance(res[key], str), res[key]
        out.append(res[key])
    return out


@pytest.mark.parametrize("shape,dim,qr", CASES_2)
def test_two_ranks_match_single_process_with_derived_payload(two, shape, dim, qr):
    from torch.distributed.tensor import Replicate, Shard

    ref = reference([shape], [CASES_2.index((shape, dim, qr))], qr=qr, rank_fraction=FRACTION)
    m, n = shape
    q_sharded = dim == (0 if m > n else 1)  # the weight's sharded axis is Q's (the longer one)
    entries = expected_entries(shape, dim, qr)
    for res in _get(two[0], ("case", shape, dim, qr)):
        assert_matches(res, ref)
        assert res["gathered"] == {}
        assert res["Q_placements"] == [(Shard(0),) if q_sharded else (Replicate(),)]
        ops = ["all_reduce"]
        counts = 2 if (q_sharded or qr == "householder") else 3
        assert res["log"] == [(counts, entries * ELEM, ops)] * STEPS
        assert entries * ELEM < m * n * ELEM  # never the whole matrix


def test_payload_shrinks_with_the_rank_fraction(two):
    m, n = SWEEP_SHAPE
    for dim in (0, 1):
        per_fraction = []
        for fraction, qr in SWEEP:
            ref = reference([SWEEP_SHAPE], [50], steps=2, qr=qr, rank_fraction=fraction)
            for res in _get(two[0], ("sweep", dim, fraction, qr)):
                assert_matches(res, ref)
                entries = expected_entries(SWEEP_SHAPE, dim, qr, fraction)
                assert [b for _, b, _ in res["log"]] == [entries * ELEM] * 2
            per_fraction.append(entries)
        hh = per_fraction[:3]  # householder at rho = 1, 1/4, 1/16
        assert hh[0] > hh[1] > hh[2]
        r = rank_of(SWEEP_SHAPE, 0.25)
        if dim == 0:  # rows (P's axis) split: exactly Table 3's r(m+n)
            assert hh[1] == r * (m + n)
        assert hh[1] < m * n  # below the full-matrix gather Dion used to pay (1/4: ratio < 1)


def test_mixed_layouts_in_one_batch(two):
    ref = reference(MIXED, [20, 21, 22, 23], qr="rcqr")
    for res in _get(two[0], "mixed"):
        assert_matches(res, ref)


def test_four_ranks_uneven_and_empty_shards(four):
    from torch.distributed.tensor import Replicate, Shard

    for shape, qr in UNEVEN:
        ref = reference([shape], [30], qr=qr)
        for res in _get(four, ("uneven", shape, qr)):
            assert_matches(res, ref)
            assert res["Q_placements"] == [(Shard(0),) if shape[0] > shape[1] else (Replicate(),)]
            assert [b for _, b, _ in res["log"]] == [expected_entries(shape, 0, qr) * ELEM] * STEPS


def _two_d_expected(pl, qr, shape=(13, 21)):
    """Per-rank entries on a (2, 2) mesh with both axes split (weight not tall: rows = P's axis)."""
    m, n = shape
    r = rank_of(shape)
    rows_local = [7, 6]  # chunk sizes of 13 over 2
    cols_local = [11, 10]  # of 21 over 2
    orth = m * r if qr == "householder" else math.ceil(1.25 * r) * r + r * r
    # coordinate of the mesh dim splitting rows / columns for each of the 4 ranks
    d_rows = 0 if pl[0].dim == 0 else 1
    out = []
    for rank in range(4):
        coord = (rank // 2, rank % 2)
        s_loc, l_loc = rows_local[coord[d_rows]], cols_local[coord[1 - d_rows]]
        out.append(s_loc * r + orth + l_loc * r + r)  # P partial sums, orth, R partial sums, norms
    return out


def test_four_ranks_two_d_mesh(four):
    from torch.distributed.tensor import Replicate, Shard

    for pl in ((Shard(0), Shard(1)), (Shard(1), Shard(0))):
        for qr in ("householder", "rcqr"):
            ref = reference([(13, 21)], [31], qr=qr)
            want = _two_d_expected(pl, qr)
            for rank, res in enumerate(_get(four, ("2d", pl, qr))):
                assert_matches(res, ref)
                q_pl = tuple(Shard(0) if p.dim == 1 else Replicate() for p in pl)
                assert res["Q_placements"] == [q_pl]
                assert [b for _, b, _ in res["log"]] == [want[rank] * ELEM] * STEPS


def test_unsupported_layout_falls_back_to_gather(four):
    ref = reference([(13, 21)], [32])
    for res in _get(four, "fallback"):
        assert_matches(res, ref)
        (reason,) = res["gathered"].values()
        assert "axis 0 is split over mesh dims 0 and 1" in reason
        assert all("all_gather" in ops for _, _, ops in res["log"])


def test_checkpoint_two_ranks_resumes_on_four(two, four):
    from torch.distributed.tensor import Shard

    assert all(r["same_keys"] for r in _get(two[0], "ckpt"))
    ref = reference([(21, 13)], [7], qr="rcqr")
    for res in _get(four, "resume"):
        assert (res["W"] - ref["W"][0]).abs().max().item() < 1e-10
        assert (res["Q"] - ref["Q"][0]).abs().max().item() < 1e-10  # rcqr's sketch follows the restored step
        assert (res["M"] - ref["M"][0]).abs().max().item() < 1e-10
        assert res["Q_placements"] == (Shard(0),)
    assert [r["local_q_rows"] for r in _get(four, "resume")] == [6, 6, 6, 3]  # 21 over 4
