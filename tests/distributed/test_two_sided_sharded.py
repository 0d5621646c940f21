"""Two-sided Dobb (``side="both"``) sharded = single process: FSDP2 ``Shard(0)`` (rows: the output
blocks are cut at the row shards) and ``Shard(1)`` (columns: the input blocks are), tensor parallel
(``fc1`` column-, ``fc2`` row-parallel) on 2 gloo ranks; uneven and empty row shards on 4 (an
18-row and a 2-row matrix: 5,5,5,3 and 1,1,0,0); a distributed checkpoint saved on 2 ranks resumed on
4 ranks and in one process. Reference: the single-process float64 run on the whole batch, with the
same block partition.

Collectives (``dobb.meter``): with ``source="activation"`` the output-gradient statistic joins the
input statistic's reduction, so two-sided Dobb issues exactly one-sided Dobb's collectives, with
``m^2 / out_blocks + 1`` more entries per matrix per refresh; the step itself issues none.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dobb.core.optimizer as dobb_module
from _common import (REFRESH, SHAPES, STEPS, Net, checker, data, full_params, groups, max_diff, per_rank,
                     same_on_all_ranks, state_keys, stats)
from _spawn import spawn
from dobb import Dobb
from dobb.meter import PayloadMeter

pytestmark = pytest.mark.slow

ROWS = 64  # more rows than the widest block: every statistic block has full rank (distinct eigenvalues)
KINDS = {"sign": dict(norm="sign", source="activation"), "adam": dict(norm="adam", source="activation"),
         "gram-sign": dict(norm="sign", source="grad_gram"), "gram-adam": dict(norm="adam", source="grad_gram")}


def make(model, kind, blocks=4, out_blocks=2, **kw):
    """Two-sided Dobb (``kind`` in KINDS) or, for ``kind="one-sided"``, Dobb itself. ``model.groups``
    (when the model has it) gives per-matrix groups."""
    extra = dict(norm="sign") if kind == "one-sided" else dict(side="both", out_blocks=out_blocks, **KINDS[kind])
    gs = model.groups() if hasattr(model, "groups") else groups(model)
    # the unsplit refresh: the counts below are its (the default split's: test_refresh_split_default.py)
    kw = {"split_refresh": False, **kw}
    return Dobb(gs, model, lr=0.02, weight_decay=0.01, blocks=blocks, refresh_every=REFRESH,
                basis_dtype=torch.float64, stat_dtype=torch.float64, stagger=False, beta2=0.9, **extra, **kw)


def train(model, opt, batches, shard=(0, 1)):
    """Per step: (collectives in step(), Dobb statistic entries, collectives in forward/backward)."""
    r, p = shard
    log = []
    for x, y in batches:
        rows = x.shape[0] // p
        with PayloadMeter() as fb:
            torch.nn.functional.mse_loss(model(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows]).backward()
        with PayloadMeter() as st:
            opt.step()
        opt.zero_grad()
        log.append((st.collectives, st.kind("stat").numel + fb.kind("stat").numel, fb.collectives))
    return log


def fixed(sizes):
    """Build the next optimizer with these block sizes, one list per ``layout_for`` call (per matrix:
    input side, then output side): a sharded axis is cut at its shard boundaries first."""
    queue = [list(s) for s in sizes]
    original = dobb_module.layout_for

    def patched(param, side, blocks, stat_group="default"):
        layout = original(param, side, blocks, stat_group)
        mine = queue.pop(0)
        return dataclasses.replace(layout, local_sizes=mine, global_sizes=mine)

    return patched, original


def sizes_of(opt):
    return [list(lay.global_sizes) for g in opt.param_groups if g["algorithm"] != "adamw" for p in g["params"]
            for lay in (side.layout for side in opt._plans[p].sides)]


def out_stats(opt):
    """Every matrix's output-side statistic as a full tensor (collective for DTensors)."""
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
            for t in (opt.state[p]["out_stat"] for p in opt.param_groups[0]["params"])]


def reference(kind, batches, model_fn=Net, sizes=None, **kw):
    model = model_fn()
    if sizes is not None:
        dobb_module.layout_for, original = fixed(sizes)
    try:
        opt = make(model, kind, stat_group=None, **kw)
    finally:
        if sizes is not None:
            dobb_module.layout_for = original
    train(model, opt, batches)
    return full_params(model), stats(opt), out_stats(opt) if kind != "one-sided" else []


def compare(rank, world, kind, wrap, shard, **kw):
    batches = data(rows=ROWS)
    model = wrap(Net())
    opt = make(model, kind, **kw)
    log = train(model, opt, batches, shard)
    ref_params, ref_stats, ref_out = reference(kind, batches, **{k: v for k, v in kw.items() if k != "stat_group"})
    mine = out_stats(opt) if kind != "one-sided" else []
    return {"diff": max_diff(full_params(model), ref_params), "stat_diff": max_diff(stats(opt), ref_stats),
            "out_diff": max_diff(mine, ref_out) if mine else 0.0, "log": log,
            "placements": [tuple(getattr(opt.state[p].get("out_stat"), "placements", ())) for p in opt.param_groups[0]["params"]],
            "same_keys": same_on_all_ranks(state_keys(opt))}


def fsdp(model, mesh, dim):
    for name in Net.matrices:
        fully_shard(getattr(model, name), mesh=mesh, shard_placement_fn=lambda p, d=dim: Shard(d if p.dim() == 2 else 0))
    fully_shard(model, mesh=mesh)
    return model


def _errors(mesh):
    msgs = {}
    for key, kw in {"rows": dict(out_blocks=3), "cols": dict(blocks=3)}.items():
        try:
            make(fsdp(Net(), mesh, 0 if key == "rows" else 1), "sign", **kw)
            msgs[key] = None
        except ValueError as e:
            msgs[key] = str(e)
    return msgs


def worker(rank, world, path):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for dim in (0, 1):
        for kind in (*KINDS, "one-sided"):
            check((dim, kind), compare, rank, world, kind, lambda m, d=dim: fsdp(m, mesh, d), (rank, world))

    def tp(m):
        return parallelize_module(m, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    for kind in ("sign", "adam", "one-sided"):  # TP ranks see the same data: nothing to average
        check(("tp", kind), compare, rank, world, kind, tp, (0, 1), stat_group=None)
    check("errors", _errors, mesh)
    check("dcp", _save, rank, world, path)
    return results


# ------------------------------------------------------------------ distributed checkpoint
SAVE_AT, DCP_STEPS = 3, 6


def _dcp_model(world):
    model = Net()
    if world > 1:
        fsdp(model, init_device_mesh("cpu", (world,)), 0)
    # out_blocks=4: fc1/fc2/head rows 32/16/8 give the same blocks on 1, 2 and 4 ranks
    return model, make(model, "adam", out_blocks=4)


def _run(model, opt, world, batches):
    import torch.distributed as dist

    shard = (dist.get_rank(), world) if world > 1 else (0, 1)
    train(model, opt, batches, shard)


def _save(rank, world, path):
    model, opt = _dcp_model(world)
    batches = data(DCP_STEPS, rows=ROWS)
    _run(model, opt, world, batches[:SAVE_AT])
    dcp.save({"optim": get_optimizer_state_dict(model, opt), "model": model.state_dict()}, checkpoint_id=path)
    _run(model, opt, world, batches[SAVE_AT:])
    return full_params(model)


def _resume(world, path):
    model, opt = _dcp_model(world)
    sd = {"optim": get_optimizer_state_dict(model, opt), "model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    st = opt.state[model.fc1.weight]
    kept = (st["step"], list(st["captures"]), sorted(st))  # a copy: training goes on
    _run(model, opt, world, data(DCP_STEPS, rows=ROWS)[SAVE_AT:])
    return {"params": full_params(model), "kept": kept}


# ------------------------------------------------------------------ 4 ranks: uneven and empty shards
class Uneven(torch.nn.Module):
    """``a``: 18 x 16 (FSDP rows 5,5,5,3 over 4 ranks), ``b``: 2 x 18 (rows 1,1,0,0)."""

    def __init__(self, seed=0, blocks_b=None):
        super().__init__()
        self.blocks_b = blocks_b
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Linear(16, 18, dtype=torch.float64)
        self.b = torch.nn.Linear(18, 2, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def groups(self, out_blocks=(4, 2)):
        # the output blocks follow each matrix's row shards: a 5,5,5,3 (4 blocks), b 1,1,0,0 (2)
        b = {} if self.blocks_b is None else {"blocks": self.blocks_b}
        return [{"params": [self.a.weight], "out_blocks": out_blocks[0]},
                {"params": [self.b.weight], "out_blocks": out_blocks[1], **b},
                {"params": [self.a.bias, self.b.bias], "algorithm": "adamw"}]


def worker4(rank, world, path):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(rows=ROWS, out=2)

    def uneven(kind):
        # grad_gram: b's gradient (2 x 18) has rank 2, so only 2-wide input blocks of G^T G have
        # distinct eigenvalues (wider ones a null space whose eigenvectors are arbitrary)
        blocks_b = 9 if kind.startswith("gram") else None
        model = Uneven(blocks_b=blocks_b)
        for m in (model.a, model.b, model):
            fully_shard(m, mesh=mesh)
        opt = make(model, kind, blocks=2)
        shapes = [tuple(p.to_local().shape) for p in (model.a.weight, model.b.weight)]
        log = train(model, opt, batches, (rank, world))
        sizes = sizes_of(opt)
        ref, _, _ = reference(kind, batches, lambda: Uneven(blocks_b=blocks_b), sizes, blocks=2)
        return {"diff": max_diff(full_params(model), ref), "log": log, "shapes": shapes, "sizes": sizes,
                "same_keys": same_on_all_ranks(state_keys(opt))}

    for kind in ("sign", "adam", "gram-sign"):
        check(("uneven", kind), uneven, kind)

    def uneven_error():
        model = Uneven()
        for m in (model.a, model.b, model):
            fully_shard(m, mesh=mesh)
        model.groups = lambda: Uneven.groups(model, out_blocks=(2, 2))
        try:
            make(model, "sign", blocks=2)
        except ValueError as e:
            return {"msg": str(e)}  # (a bare string would read as this rank's failure report)

    check("uneven_error", uneven_error)
    check("dcp", _resume, world, path)
    return results


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return os.fspath(tmp_path_factory.mktemp("dcp2") / "two")


@pytest.fixture(scope="module")
def ranks(path):
    return spawn(worker, 2, path)


@pytest.fixture(scope="module")
def four(ranks, path):  # resumes the checkpoint the 2-rank run saved
    return spawn(worker4, 4, path)


def _entries(out_blocks=2, blocks=4, flags=6):
    """The statistic reduction of a refresh: ``n^2/B + 1`` and ``m^2/B_out + 1`` per matrix, plus the
    finiteness flags folded in."""
    return sum(n * n // blocks + 1 + m * m // out_blocks + 1 for m, n in SHAPES.values()) + flags


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp2_matches_single_process(ranks, dim, kind):
    for r in per_rank(ranks, (dim, kind)):
        assert r["diff"] < 1e-10 and r["stat_diff"] < 1e-12 and r["out_diff"] < 1e-12
        assert r["same_keys"]
        # output-side block state: Shard(0) exactly when the rows are sharded
        assert r["placements"] == [(Shard(0),) if dim == 0 else (Replicate(),)] * 3
        if KINDS[kind]["source"] == "activation":
            assert [e for _, e, _ in r["log"]] == [_entries() if t % 2 == 0 else 0 for t in range(STEPS)]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", ["sign", "adam"])
def test_fsdp2_collectives_equal_one_sided_dobb(ranks, dim, kind):
    """Same collectives as one-sided Dobb in step() and in forward/backward, every step."""
    for two, one in zip(per_rank(ranks, (dim, kind)), per_rank(ranks, (dim, "one-sided"))):
        assert [(s, f) for s, _, f in two["log"]] == [(s, f) for s, _, f in one["log"]]
        # one statistic reduction on refresh steps, the finiteness flags alone otherwise
        assert [s for s, _, _ in two["log"]] == [1] * STEPS


@pytest.mark.parametrize("kind", ["sign", "adam"])
def test_tensor_parallel_matches_single_process_without_collectives(ranks, kind):
    for two, one in zip(per_rank(ranks, ("tp", kind)), per_rank(ranks, ("tp", "one-sided"))):
        assert two["diff"] < 1e-10 and two["out_diff"] < 1e-12
        assert [e for _, e, _ in two["log"]] == [0] * STEPS  # stat_group=None
        assert [s for s, _, _ in two["log"]] == [s for s, _, _ in one["log"]] == [1] * STEPS  # the flags only


def test_non_local_block_counts_are_refused_with_the_way_out(ranks):
    for msgs in per_rank(ranks, "errors"):
        assert "output side" in msgs["rows"] and "out_blocks=3" in msgs["rows"]
        assert "valid block counts: 2, 4, 6" in msgs["rows"] and "side='both' blocks both axes" in msgs["rows"]
        assert "input side" in msgs["cols"] and "blocks=3" in msgs["cols"]


@pytest.mark.parametrize("kind", ["sign", "adam", "gram-sign"])
def test_uneven_and_empty_row_shards(four, kind):
    for rank, r in enumerate(per_rank(four, ("uneven", kind))):
        assert r["shapes"] == [((5, 5, 5, 3)[rank], 16), ((1, 1, 0, 0)[rank], 18)]
        # per matrix: input blocks (whole columns), output blocks cut at the row shards
        assert r["sizes"] == [[8, 8], [5, 5, 5, 3], [2] * 9 if kind.startswith("gram") else [9, 9], [1, 1]]
        assert r["diff"] < 1e-10 and r["same_keys"]


def test_uneven_out_blocks_error_lists_valid_counts(four):
    for msg in (r["msg"] for r in per_rank(four, "uneven_error")):
        assert "out_blocks=2" in msg and "valid block counts: 4, 8, 12" in msg


def test_dcp_round_trip_resumes_exactly_across_world_sizes(ranks, four, path):
    ref = per_rank(ranks, "dcp")[0]
    resumed = [*per_rank(four, "dcp"), _resume(1, path)]
    for r in resumed:
        assert max_diff(r["params"], ref) < 1e-12
        assert r["kept"] == (SAVE_AT, [[2], [2]], ["basis", "captures", "momentum", "out_basis", "out_stat",
                                               "second_moment", "stat", "step"])
