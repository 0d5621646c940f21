"""The rank pool of ``_spawn.spawn``, which every test in this folder runs on: it must reuse its
ranks, and must never let one call's failure or random state reach the next call.

- two calls on a pool run on the same processes;
- each call starts from the rank's start-up seed: the random numbers a fresh process draws;
- ``fresh=True`` runs on processes of its own, which are gone afterwards, and leaves the pool as it was;
- a call that raises on one rank reports that rank's exception to the caller, and the next call
  runs on new processes (the old ones are gone) in a working process group;
- a call that hangs in a collective raises ``TimeoutError`` after ``timeout_s``, and is recovered
  the same way.

The pools here have a collective timeout of their own (``_CT``): the pools of other test modules
of this pytest process (keyed by world size and collective timeout) are never the ones killed.
On 2 ranks: each pool start costs 3-5 s on 2 busy cores (7 s for 4 ranks, where these tests
passed too: ``WORLD = 4``).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from _spawn import spawn

pytestmark = pytest.mark.slow

_CT = 31.0  # collective timeout (s): this module's pool key
_CALL = 60  # timeout_s of the calls that should succeed: a broken pool fails them instead of hanging
WORLD = 2
_SUM = WORLD * (WORLD + 1) / 2  # of rank + 1 over the ranks


def _pid(rank, world):
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    return os.getpid()


def _sum_of_ranks(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return os.getpid(), t.item()


def _draw(rank, world):
    return os.getpid(), torch.initial_seed(), torch.rand(4).tolist()


def _raise_on_last(rank, world):
    if rank == world - 1:
        raise ValueError(f"boom on rank {rank} of {world}")
    return os.getpid()  # the other ranks wait in spawn's barrier until their pool is killed


def _hang_on_last(rank, world):
    if rank == world - 1:
        time.sleep(600)  # killed with its pool long before
    else:
        dist.all_reduce(torch.ones(1))  # waits for the last rank
    return os.getpid()


def _call(fn, **kw):
    return spawn(fn, WORLD, timeout_s=kw.pop("timeout_s", _CALL), collective_timeout_s=_CT, **kw)


def _gone(pid: int) -> bool:
    """The process has exited and been reaped (the pool's processes are children of this one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_recovered(old_pids):
    pids, sums = zip(*_call(_sum_of_ranks))
    assert len(set(pids)) == WORLD and not set(pids) & set(old_pids), (pids, old_pids)
    assert sums == (_SUM,) * WORLD
    assert all(_gone(p) for p in old_pids), [p for p in old_pids if not _gone(p)]
    assert _call(_pid) == list(pids)  # and the new pool is kept in turn


def test_consecutive_calls_run_on_the_same_ranks():
    first = _call(_pid)
    assert len(set(first)) == WORLD and os.getpid() not in first
    assert _call(_pid) == first
    assert _call(_sum_of_ranks) == [(p, _SUM) for p in first]


def test_each_call_starts_from_the_start_up_seed():
    a, b = _call(_draw), _call(_draw)
    assert [p for p, *_ in a] == [p for p, *_ in b]  # one pool: the second call drew after the first
    assert a == b
    # the numbers a process draws first from its start-up seed (torch picks one per process)
    for _, seed, x in a:
        assert x == torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()


def test_fresh_runs_on_processes_of_its_own():
    pool = _call(_pid)
    pids, sums = zip(*_call(_sum_of_ranks, fresh=True))
    assert len(set(pids)) == WORLD and not set(pids) & set(pool)
    assert sums == (_SUM,) * WORLD
    assert all(_gone(p) for p in pids)  # stopped when the call returned
    assert _call(_pid) == pool  # the pool was left as it was


def test_a_call_that_raises_on_one_rank_is_reported_and_the_pool_replaced():
    old = _call(_pid)
    with pytest.raises(RuntimeError) as info:
        _call(_raise_on_last)
    message = str(info.value)
    assert f"_raise_on_last failed on {WORLD} ranks" in message
    assert f"rank {WORLD - 1}:" in message and f"ValueError: boom on rank {WORLD - 1} of {WORLD}" in message
    _assert_recovered(old)


def test_a_call_that_hangs_times_out_and_the_pool_is_replaced():
    old = _call(_pid)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"_hang_on_last on {WORLD} ranks did not finish in 2s"):
        _call(_hang_on_last, timeout_s=2)
    assert time.monotonic() - start < 15  # abandoned after timeout_s (the ranks would wait _CT, then 600 s)
    _assert_recovered(old)
