"""The default refresh (``Dobb(split_refresh=None)``) on 2 and 4 gloo ranks: split where ranks share a
statistic (FSDP2, DDP, HSDP) and the split is bitwise the unsplit refresh by construction
(``core.statistics.split_by_default``: a hook statistic on a CPU), local elsewhere (``grad_gram``).

Each case runs the same training three times on the same ranks, with the default, with
``split_refresh=False`` and with ``split_refresh=True``, at the library's default statistic and basis
dtypes (the bases go out in the basis dtype): weights and every state tensor (statistics, bases,
momenta) bitwise equal after several refreshes (the first exact, staggered and unstaggered); the
default broadcasts exactly what the explicit split does (the ``"basis"`` entries each step); the
collectives each ``step()`` issues (op, kind, entries, bytes, in order, by ``dobb.meter.PayloadMeter``)
are the same on every rank; and the default FSDP2 run equals the single-process run (float64, as
test_fsdp.py). Skipped with the reason where this host's batched solve is not batch-invariant
(``tests/_split_host.py``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import Net, checker, data, full_params, groups, max_diff, per_rank
from _spawn import spawn
from _split_host import REASON, host_is_bitwise
from dobb import Dobb
from dobb.meter import PayloadMeter

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not host_is_bitwise(), reason=REASON)]

STEPS, REFRESH = 6, 2  # refreshes at steps 0 (eigh), 2 and 4 (unstaggered); every step staggered
MODES = ("default", False, True)  # "default": split_refresh left out


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(model, opt):
    out = {f"w:{n}": _local(p) for n, p in model.named_parameters()}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"{i}:{k}"] = _local(v)
    return out


def _train(model, opt, batches, rank, world, drop=None):
    """Steps on this rank's rows. Returns, per step, the collectives ``step()`` issued, in order."""
    log = []
    for t, (x, y) in enumerate(batches):
        rows = x.shape[0] // world
        part = slice(rank * rows, (rank + 1) * rows)
        torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
        if drop is not None:
            drop(t, model)
        with PayloadMeter() as meter:
            opt.step()
        opt.zero_grad()
        log.append([(r.op, r.kind, r.numel, r.bytes) for r in meter.records])
    return log


def _basis(log):
    """The entries the split broadcast, per step."""
    return [sum(n for op, kind, n, _ in step if kind == "basis") for step in log]


def _modes(build, rank, world, batches, drop=None):
    """The run under each of ``MODES``: (keys unequal to the ``False`` run, per mode; step logs, per mode)."""
    snaps, logs = {}, {}
    for mode in MODES:
        model, opt = build(mode)
        assert opt.split_refresh is (None if mode == "default" else mode)
        logs[mode] = _train(model, opt, batches, rank, world, drop)
        snaps[mode] = _snapshot(model, opt)
    ref = snaps[False]
    unequal = {str(m): sorted(k for k in ref if not torch.equal(snaps[m][k], ref[k])) for m in ("default", True)}
    return unequal, {str(m): logs[m] for m in MODES}


def _opt(model, params, mode, **kw):
    split = {} if mode == "default" else {"split_refresh": mode}
    return Dobb(params, model, lr=0.02, weight_decay=0.01, refresh_every=REFRESH, **split, **kw)


def _fsdp(mesh, dim=0, **kw):
    """``Net`` with each matrix sharded on ``dim`` (the blocked axis unsharded: shared blocks)."""
    def build(mode):
        model = Net()
        for name in Net.matrices:
            fully_shard(getattr(model, name), mesh=mesh, shard_placement_fn=lambda p: Shard(dim if p.dim() == 2 else 0))
        fully_shard(model, mesh=mesh)
        return model, _opt(model, groups(model), mode, **kw)
    return build


def _ddp(**kw):
    def build(mode):
        model = DDP(Net())
        return model, _opt(model, groups(model.module), mode, **kw)
    return build


def worker(rank, world):
    results = {}
    check = checker(results)
    mesh = init_device_mesh("cpu", (world,))
    batches = data(STEPS, rows=4 * world)
    cases = {("fsdp", b, s): _fsdp(mesh, blocks=b, stagger=s) for b in (1, 2, 4) for s in (False, True)}
    cases.update({
        ("fsdp", "both"): _fsdp(mesh, blocks=2, side="both", out_blocks=world, stagger=False),
        ("fsdp", "eigh"): _fsdp(mesh, blocks=2, basis="eigh", stagger=False),
        ("fsdp", "grad_gram"): _fsdp(mesh, blocks=2, source="grad_gram", stagger=False),
        ("ddp", 2): _ddp(blocks=2),
        ("ddp", "both"): _ddp(blocks=2, side="both", out_blocks=2, stagger=False),
        ("ddp", "l2"): _ddp(blocks=4, norm="l2", stagger=False),
    })
    if world == 4:  # HSDP: replicate x shard, the statistic over both dims
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        cases[("hsdp", 2)] = _fsdp(hsdp, blocks=2)
        cases[("hsdp", "dobb-g")] = _fsdp(hsdp, 1, blocks=2, side="output", source="output_grad",
                                              stagger=False)
    for key, build in cases.items():
        check(key, _modes, build, rank, world, batches)

    def plain(mode):  # plain parameters, statistic over the world, no gradient sync
        model = Net()
        return model, _opt(model, groups(model), mode, blocks=2, stagger=False, stat_group=dist.group.WORLD)

    def drop(t, model):  # rank 1 holds no gradient of fc2 on the refresh step 2: it refreshes it as idle
        if rank == 1 and t == 2:
            model.fc2.weight.grad = None

    check("idle", _modes, plain, rank, world, batches, drop)

    def single():  # the default FSDP2 run against one process (float64 statistics and bases)
        f64 = dict(blocks=2, stagger=False, basis_dtype=torch.float64, stat_dtype=torch.float64)
        full = data(STEPS, rows=64)  # more rows than the widest block: no null-space coefficients
        model, opt = _fsdp(mesh, **f64)("default")
        log = _train(model, opt, full, rank, world)
        ref = Net()
        _train(ref, _opt(ref, groups(ref), False, stat_group=None, **f64), full, 0, 1)
        return max_diff(full_params(model), full_params(ref)), _basis(log)

    check("single", single)
    return results


# every case runs three times over (3 modes): more than the pool's default 240 s on a loaded 2-core host
@pytest.fixture(scope="module")
def two():
    return spawn(worker, 2, timeout_s=900)


@pytest.fixture(scope="module")
def four():
    return spawn(worker, 4, timeout_s=1200)


SPLIT = [("fsdp", b, s) for b in (1, 2, 4) for s in (False, True)] + [
    ("fsdp", "both"), ("fsdp", "eigh"), ("ddp", 2), ("ddp", "both"), ("ddp", "l2"), "idle"]


def _check_split(ranks, key):
    results = per_rank(ranks, key)
    for unequal, logs in results:
        assert unequal == {"default": [], "True": []}
        assert logs["default"] == logs["True"]  # the default is the split here, collective for collective
        assert _basis(logs["default"])[0] > 0  # it split, on the first (exact) refresh too
        assert _basis(logs["False"]) == [0] * STEPS
        # the bases go out in the basis dtype (the default, bf16: 2 bytes an entry)
        assert all(b == 2 * n for step in logs["default"] for _, kind, n, b in step if kind == "basis")
    # every rank issues the same collectives in the same order, step by step, in every mode
    assert all(logs == results[0][1] for _, logs in results)


@pytest.mark.parametrize("key", SPLIT, ids=str)
def test_default_splits_bitwise_on_two_ranks(two, key):
    _check_split(two, key)


@pytest.mark.parametrize("key", SPLIT, ids=str)
def test_default_splits_bitwise_on_four_ranks(four, key):
    _check_split(four, key)


@pytest.mark.parametrize("key", [("hsdp", 2), ("hsdp", "dobb-g")], ids=str)
def test_default_splits_bitwise_under_hsdp(four, key):
    _check_split(four, key)


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_default_keeps_grad_gram_local(ranks, request):
    """``grad_gram``: each rank's own Gram, not the agreed statistic: the default does not split it."""
    results = per_rank(request.getfixturevalue(ranks), ("fsdp", "grad_gram"))
    for unequal, logs in results:
        assert unequal["default"] == []
        assert logs["default"] == logs["False"]
        assert _basis(logs["default"]) == [0] * STEPS
    assert all(logs == results[0][1] for _, logs in results)


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_default_fsdp2_equals_single_process(ranks, request):
    for diff, basis in per_rank(request.getfixturevalue(ranks), "single"):
        assert diff < 1e-12
        assert basis[0] > 0  # the default split ran
