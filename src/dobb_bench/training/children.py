"""Child processes of ``compare``/``sweep`` (one per run, ``--isolate``): they never outlive their
parent, never print a traceback of their own for Ctrl-C, and report a user error as one line.

Why each piece:
- Die with the parent: a SIGKILLed ``compare`` must not leave a child training and writing into
  ``--out`` (a rerun would then race it on the same files). On Linux the kernel sends the child
  SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, set through ctypes); elsewhere a
  thread polls ``getppid()``. SIGTERM stops the run after its current step with a checkpoint
  (``stop.StopRequest``), so even that stop is resumable.
- Ctrl-C: the terminal sends SIGINT to the whole process group. Children start with SIGINT
  ignored (the disposition survives exec); the parent alone catches it, sends each child SIGTERM
  and waits, so the user sees one line instead of one traceback per process.
- Errors: a child's ``CliError``/``ValueError``/``OSError`` goes to the parent through a pipe and
  is printed once, by the parent, as part of its one-line error.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Makes this process receive SIGTERM when ``parent_pid`` (its parent) exits, however it exits."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        def watch():
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _entry(target, args, parent_pid: int, conn) -> None:
    die_with_parent(parent_pid)
    from dobb_bench.errors import CliError, one_line as _one_line

    try:
        code = target(*args)
    except KeyboardInterrupt:  # a second SIGTERM while stopping: nothing more to say
        code = 130
    except (CliError, ValueError, OSError) as exc:
        conn.send(_one_line(exc))
        code = 2
    conn.close()
    sys.exit(code or 0)


def start(ctx, target, args):
    """Starts ``target(*args)`` in a child of context ``ctx``; returns (process, message pipe end)."""
    recv, send = ctx.Pipe(duplex=False)
    main = threading.current_thread() is threading.main_thread()  # handlers can change only there
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        proc = ctx.Process(target=_entry, args=(target, args, os.getpid(), send))
        proc.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
    send.close()
    return proc, recv


def message(recv) -> str | None:
    """The child's one-line error, if it sent one."""
    try:
        return recv.recv() if recv.poll() else None
    except (EOFError, OSError):
        return None


def stop(procs, timeout: float = 60.0) -> None:
    """SIGTERM to every live child (each stops after its current step with a checkpoint), then wait;
    SIGKILL whatever is still alive after ``timeout`` seconds."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
