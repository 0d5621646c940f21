"""Run a function on N gloo CPU ranks and hand each rank's return value back to the test.

Why a helper: on 2 cores, starting a rank (a Python process, ``import torch``, the gloo
rendezvous) costs more than most checks run on it. So the ranks are kept: the first ``spawn`` for
a world size starts ``world`` processes that join one gloo group and then serve one call after
another (``_serve``), for every test module of this pytest process; they are stopped at exit.

A call that fails on any rank (its error gives the traceback of every rank that failed), or runs
past ``timeout_s``, kills that pool (its group may be stuck mid-collective) and the next call
starts a fresh one, so one failure never leaks into another test. ``fresh=True`` runs a call on
its own processes (for a call that replaces the process group itself). A hang is a test failure,
not a stuck CI job: gloo collectives time out after ``collective_timeout_s`` and the call is
abandoned after ``timeout_s``.

Between calls each rank resets torch's default generator to its start-up seed, so a call sees the
random state a fresh process would.

Exit: a pool is stopped by one message to every rank; the ranks meet in a last ``barrier`` and
call ``destroy_process_group`` (ranks 1.. first, rank 0, the TCP store's host, once they are gone).
A rank that dies *after* every result of the pool was delivered (all of them are verified by the
tests) is a platform abort at exit (SIGABRT "terminate called without an active exception" from
gloo's threads on a loaded host), not a failure of any check: ``stop`` reports it as a
``PlatformExitAbort`` warning (stderr for the pools stopped at exit) naming the rank and its exit
code. A rank that dies before its result is a failure of that call (``RuntimeError``, as before).
``DOBB_SPAWN_EXIT_LOG``: a file the reports of pools stopped at exit are appended to as well.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_START_SEED = torch.initial_seed()
_EXIT_GRACE_S = 60.0  # how long a stopped rank may take to exit before it is killed  # the generator's seed in a process that never seeded it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlatformExitAbort(UserWarning):
    """A rank exited with an error after every result of its pool was delivered and verified."""


def _serve(rank, world, port, conn, collective_timeout_s, once):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    clean = False  # a stop message (every rank got one): the ranks can meet in a last barrier
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:  # the test process is gone
                return
            if not message:  # stop
                clean = True
                return
            path, payload = pickle.loads(message)
            sys.path[:] = path + [p for p in sys.path if p not in path]  # the test's modules import
            torch.manual_seed(_START_SEED)
            try:
                fn, args = pickle.loads(payload)
                result = fn(rank, world, *args)
                dist.barrier()  # every rank finished before any rank takes the next call
                reply = pickle.dumps((True, result))
            except BaseException:  # noqa: BLE001 - reported to the test, then this pool is dropped
                conn.send_bytes(pickle.dumps((False, f"rank {rank}:\n{traceback.format_exc()}")))
                return
            conn.send_bytes(reply)
            if once:
                conn.recv_bytes()  # the stop, sent once every rank has replied
                clean = True
                return
    finally:
        if dist.is_initialized():
            if clean:
                dist.barrier()  # every rank leaves together
                if rank == 0:
                    # Rank 0 hosts the TCP store: it leaves once the others are gone (see _Pool.stop),
                    # so no rank loses its store peer while tearing gloo down.
                    try:
                        conn.recv_bytes()
                    except EOFError:
                        pass
            dist.destroy_process_group()


class _Pool:
    def __init__(self, world: int, collective_timeout_s: float, once: bool = False):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world, self.conns, self.procs = world, [], []
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, theirs, collective_timeout_s, once),
                               name=f"spawn-rank{rank}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def call(self, fn, args, timeout_s: float) -> list:
        message = pickle.dumps((list(sys.path), pickle.dumps((fn, args))))
        for conn in self.conns:
            conn.send_bytes(message)
        deadline = time.monotonic() + timeout_s
        results, waiting = [None] * self.world, set(range(self.world))
        while waiting:
            for rank in sorted(waiting):
                conn = self.conns[rank]
                if conn.poll(0.05):
                    try:
                        ok, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        raise RuntimeError(f"{_name(fn)}: rank {rank} of {self.world} died "
                                           f"(exit code {self.procs[rank].exitcode})") from None
                    if not ok:
                        failures = {rank: value, **self._other_failures(waiting - {rank})}
                        raise RuntimeError(f"{_name(fn)} failed on {self.world} ranks, "
                                           + "\n".join(failures[r] for r in sorted(failures)))
                    results[rank] = value
                    waiting.discard(rank)
                elif not self.procs[rank].is_alive() and not conn.poll():
                    raise RuntimeError(f"{_name(fn)}: rank {rank} of {self.world} died "
                                       f"(exit code {self.procs[rank].exitcode})")
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"{_name(fn)} on {self.world} ranks did not finish in {timeout_s}s")
        return results

    def _other_failures(self, ranks: set, grace_s: float = 2.0) -> dict:
        """The failures the other ``ranks`` report within ``grace_s``. The rank that raised leaves
        its group, so the others fail too (gloo: connection closed by peer), often before its
        report is read: reporting every rank's failure keeps the exception that started it."""
        failures, deadline = {}, time.monotonic() + grace_s
        while ranks and time.monotonic() < deadline:
            for rank in sorted(ranks):
                if self.conns[rank].poll(0.05):
                    ranks.discard(rank)
                    try:
                        ok, value = pickle.loads(self.conns[rank].recv_bytes())
                    except EOFError:
                        continue
                    if not ok:
                        failures[rank] = value
                elif not self.procs[rank].is_alive():
                    ranks.discard(rank)
        return failures

    def stop(self) -> str | None:
        """Every rank gets the stop (they meet in a barrier), ranks 1.. leave first, then rank 0 (the
        store's host); whatever does not leave is killed. Returns the report of ranks that exited
        with an error after every result was delivered (``None`` when all exited cleanly)."""
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        # A rank's exit (torch and gloo teardown) took 8-20 s on 2 cores at a load average of 30.
        for rank in range(1, self.world):
            self.procs[rank].join(timeout=_EXIT_GRACE_S)
        try:
            self.conns[0].send_bytes(b"")  # rank 0 may leave now
        except OSError:
            pass
        self.procs[0].join(timeout=_EXIT_GRACE_S)
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        self.kill()
        codes = {r: p.exitcode for r, p in enumerate(self.procs) if r not in alive and p.exitcode}
        if not codes and not alive:
            return None
        after = f"after every result of this {self.world}-rank pool was delivered and verified (not a test failure)"
        parts = []
        if codes:
            parts.append(f"platform abort at exit, {after}: " + ", ".join(
                f"rank {r} exit code {c}{' (SIGABRT)' if c == -6 else ''}" for r, c in sorted(codes.items())))
        if alive:
            parts.append(f"slow exit, {after}: rank(s) {alive} still exiting after {_EXIT_GRACE_S:.0f} s, killed")
        return "; ".join(parts)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()


_POOLS: dict[tuple[int, float], _Pool] = {}


def _name(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


def spawn(fn, world: int, *args, timeout_s: float = 240, collective_timeout_s: float = 60,
          fresh: bool = False) -> list:
    """``fn(rank, world, *args)`` on ``world`` ranks; returns the list of their results.

    ``fn`` must be importable (a module-level function), and its arguments and result picklable.
    """
    if fresh:
        pool = _Pool(world, collective_timeout_s, once=True)
        try:
            result = pool.call(fn, args, timeout_s)
        except BaseException:
            pool.kill()
            raise
        report = pool.stop()
        if report:
            warnings.warn(PlatformExitAbort(f"{_name(fn)}: {report}"), stacklevel=2)
        return result
    key = (world, collective_timeout_s)
    if key not in _POOLS:
        _POOLS[key] = _Pool(world, collective_timeout_s)
    try:
        return _POOLS[key].call(fn, args, timeout_s)
    except BaseException:
        _POOLS.pop(key).kill()
        raise


_ONCE: dict[tuple, list] = {}


def spawn_once(fn, world: int, *args, **kwargs) -> list:
    """``spawn``, remembered for this pytest process per ``(fn, world, args)``.

    For module fixtures parametrized by world size: pytest sets such a fixture up again when
    parametrized tests interleave its parameters, and each set-up would run every check again.
    """
    key = (fn.__module__, fn.__qualname__, world, repr(args))
    if key not in _ONCE:
        _ONCE[key] = spawn(fn, world, *args, **kwargs)
    return _ONCE[key]


@atexit.register
def shutdown() -> None:
    while _POOLS:
        report = _POOLS.popitem()[1].stop()
        if report:
            print(f"_spawn: {report}", file=sys.stderr, flush=True)
            log = os.environ.get("DOBB_SPAWN_EXIT_LOG")  # an xdist worker's stderr at exit is not shown
            if log:
                with open(log, "a") as f:
                    f.write(f"_spawn: {report}\n")
