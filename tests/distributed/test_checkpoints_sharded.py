"""``dobb.checkpoints`` on 2 and 4 gloo ranks under FSDP2: a rank killed inside a save never leaves a
checkpoint that loads, the restart resumes from the previous complete one bitwise, and every
refusal is the same ``ValueError`` on every rank.

The reference is the uninterrupted run (STEPS steps, a checkpoint every 2 steps into one root).
A crashed run SIGKILLs one rank of itself inside its save of step 4 (before its shard is written,
after it, or on rank 0 after the marker and before the rename); a fresh set of ranks then calls
``load_latest`` on the same root, must get step 2, trains on, saves again into that root, and must end
on exactly the uninterrupted weights (``torch.equal`` on every full parameter). Optimizers:
``block-muon`` (``axis=0, blocks=world``: row blocks within each ``Shard(0)``) and ``dobb-muon``
(``out_blocks=world``).

Refusals (one 4-rank call): a DASH checkpoint saved on 2 ranks (tiles cut within each shard) loaded
on 4 is ``check_resume``'s ``ValueError``, on every rank, before anything loads; a checkpoint with
a shard cut in half is a ``ValueError`` naming the folder and the file, on every rank.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _common import Net, full_params
from _spawn import spawn

import dobb
from dobb import checkpoints

pytestmark = pytest.mark.slow
STEPS, EVERY, CRASH_AT = 6, 2, 4
ROWS = 8


def make(name, world):
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.fc1, model.fc2, model.head, model):
        fully_shard(m, mesh=mesh)
    hp = {"block-muon": {"axis": 0, "blocks": world},
          "dobb-muon": {"blocks": 4, "out_blocks": world, "refresh_every": 2,
                        "basis_dtype": torch.float64, "stat_dtype": torch.float64},
          "dash": {"block_size": 8, "precondition_every": 2}}[name]
    return model, dobb.build_optimizer(name, model, lr=0.02, weight_decay=0.01, **hp)


def batch(step, rank, world):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(ROWS, 8, generator=gen, dtype=torch.float64)
    rows = ROWS // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


_no_crash = checkpoints._crash_point


def run(rank, world, name, root, crash=None):
    """Load the newest complete checkpoint under ``root`` (if any), train to STEPS saving every
    EVERY steps; ``crash = (rank, stage)``: that rank SIGKILLs itself at ``stage`` of the save of
    step CRASH_AT."""
    model, opt = make(name, world)
    got = checkpoints.load_latest(model, opt, root)
    start = 1 if got is None else got.step + 1
    for step in range(start, STEPS + 1):
        x, y = batch(step, rank, world)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            if crash is not None and step == CRASH_AT and rank == crash[0]:
                def die(stage, _at=crash[1]):
                    if stage == _at:
                        os.kill(os.getpid(), signal.SIGKILL)
                checkpoints._crash_point = die
            try:
                checkpoints.save(model, opt, root, step, extra={"step": step}, keep=3)
            finally:
                checkpoints._crash_point = _no_crash  # the pool's ranks serve later calls
    return {"loaded": None if got is None else (got.step, got.extra), "params": full_params(model),
            "listing": sorted(os.listdir(root))}


def _bitwise(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cache = {}

    def get(name, world):
        if (name, world) not in cache:
            root = tmp_path_factory.mktemp(f"ref-{name}-{world}")
            res = spawn(run, world, name, os.fspath(root))
            assert all(_bitwise(r["params"], res[0]["params"]) for r in res)
            assert res[0]["listing"] == ["step-00000002", "step-00000004", "step-00000006"]
            cache[name, world] = res[0]["params"]
        return cache[name, world]
    return get


CASES = [("block-muon", 2, "prepared"), ("block-muon", 2, "written"), ("block-muon", 2, "marked"),
         ("block-muon", 4, "written"), ("dobb-muon", 2, "written")]


@pytest.mark.parametrize("name,world,stage", CASES, ids=[f"{n}-{w}-{s}" for n, w, s in CASES])
def test_rank_killed_inside_a_save_resumes_bitwise(tmp_path, uninterrupted, name, world, stage):
    ref = uninterrupted(name, world)
    root = os.fspath(tmp_path)
    # "marked" happens on rank 0 only (it writes the marker); the others on the last rank
    victim = 0 if stage == "marked" else world - 1
    with pytest.raises(RuntimeError, match=f"rank {victim} of {world} died|failed on {world} ranks"):
        spawn(run, world, name, root, (victim, stage), timeout_s=180, collective_timeout_s=30)
    left = sorted(os.listdir(root))
    assert left == ["step-00000002", "step-00000004.partial"], left
    assert (tmp_path / "step-00000004.partial" / checkpoints.MARKER).exists() == (stage == "marked")

    res = spawn(run, world, name, root)
    for r in res:
        assert r["loaded"] == (2, {"step": 2})  # the previous complete checkpoint, on every rank
        assert _bitwise(r["params"], ref)
        assert r["listing"] == ["step-00000002", "step-00000004", "step-00000006"]


def _refusals(rank, world, dash_root, torn_root):
    out = {}
    for key, name, root in (("dash", "dash", dash_root), ("torn", "block-muon", torn_root)):
        model, opt = make(name, world)
        before = {k: v.clone() for k, v in full_params(model).items()}
        try:
            checkpoints.load_latest(model, opt, root)
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
        out[key + "-unchanged"] = _bitwise(full_params(model), before)
    dist.barrier()
    return out


def _save_two(rank, world, dash_root, torn_root):
    for name, root in (("dash", dash_root), ("block-muon", torn_root)):
        model, opt = make(name, world)
        for step in (1, 2):
            x, y = batch(step, rank, world)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        checkpoints.save(model, opt, root, 2)
    return None


def test_refusals_are_the_same_value_error_on_every_rank(tmp_path):
    dash_root, torn_root = os.fspath(tmp_path / "dash"), os.fspath(tmp_path / "torn")
    spawn(_save_two, 2, dash_root, torn_root)
    folder = tmp_path / "torn" / "step-00000002"
    shard = folder / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    res = spawn(_refusals, 4, dash_root, torn_root)
    for r in res:
        assert r["dash"] == res[0]["dash"] and r["torn"] == res[0]["torn"]
        assert r["dash-unchanged"] and r["torn-unchanged"]
    dash, torn = res[0]["dash"], res[0]["torn"]
    assert dash is not None and "DASH cannot resume" in dash and "2 shard(s)" in dash and "4 shard(s)" in dash
    assert "step-00000002" in dash
    assert torn is not None and str(folder) in torn and "__1_0.distcp" in torn and "bytes" in torn


def _frozen_peer(rank, port, timeout_s, conn):
    import datetime
    import time
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    x = torch.ones(1)
    dist.all_reduce(x)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: its sockets stay open
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        conn.send(("no error", time.monotonic() - start))
    except RuntimeError as exc:
        conn.send((str(exc), time.monotonic() - start))  # a pipe: sent before _exit
    os._exit(0)


def test_frozen_rank_ends_with_the_process_group_timeout():
    """What docs/distributed.md tells users: with ``init_process_group(timeout=...)`` a rank frozen
    by SIGSTOP makes the others raise after that timeout instead of waiting on."""
    import torch.multiprocessing as mp

    from _spawn import free_port

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    port, timeout_s = free_port(), 5
    procs = [ctx.Process(target=_frozen_peer, args=(r, port, timeout_s, theirs)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert mine.poll(120), "no rank reported within 120 s"
        message, waited = mine.recv()
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=30)
    assert "Timed out" in message or "timed out" in message, message
    assert timeout_s - 0.5 <= waited < timeout_s + 30
