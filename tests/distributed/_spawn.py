"""Run a function on N gloo CPU ranks and hand each rank's return value back to the test.

Why a helper: every distributed test module spawns its ranks once (process start-up and
``import torch`` dominate on 2 cores) and runs several checks inside. A hang must become a test
failure, not a stuck CI job: gloo collectives time out after ``collective_timeout_s`` and the
whole run is killed after ``timeout_s``.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, out_dir, args, collective_timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank's result is on disk before any rank tears gloo down
    finally:
        dist.destroy_process_group()
        # Rank 0 hosts the TCP store: if it exits while another rank is still tearing its gloo
        # context down, that rank's store thread loses its peer and the process aborts
        # ("terminate called without an active exception"). Rank 0 leaves last.
        open(os.path.join(out_dir, f"down{rank}"), "w").close()
        if rank == 0:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                    os.path.exists(os.path.join(out_dir, f"down{r}")) for r in range(world)):
                time.sleep(0.05)


def spawn(fn, world: int, *args, timeout_s: float = 240, collective_timeout_s: float = 60) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the list of their results.

    ``fn`` must be importable (a module-level function) and its result picklable by ``torch.save``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out_dir, args, collective_timeout_s),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(world)]
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks did not finish in {timeout_s}s")
        except mp.ProcessExitedException:
            # A death after every rank saved its result and passed the barrier is a teardown
            # problem, not the code under test's; it is reported (so loops can count it) and
            # tolerated. Any earlier death leaves a result file missing and fails the test.
            if not all(os.path.exists(p) for p in paths):
                raise
            print(f"_spawn: a rank died during teardown of {getattr(fn, '__name__', fn)} on {world} ranks",
                  file=sys.stderr)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(p, weights_only=False) for p in paths]
