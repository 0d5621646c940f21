"""Checkpoint input/output for the training loop: what may be loaded, and fault injection.

Why: a run folder may be shared, so nothing in it may run code when loaded. Our own files go
through ``torch.load(weights_only=True)`` (extras are tensors and plain types: the RNG states are
converted below); DCP's ``.metadata``, which torch unpickles with plain ``pickle``, is vetted
with an allowlist first. A file that is merely damaged (empty, truncated, overwritten) is told
apart from one that would run code: the user's way out differs (start over vs. distrust the folder). ``DOBB_BENCH_FAULT`` kills a rank at a chosen point so the preemption
tests can show that a killed run resumes exactly and that a half-written save never loads.
"""
from __future__ import annotations

import os
import pickle
import random
import signal
import zipfile
from pathlib import Path

import numpy as np
import torch

COMPLETE = "COMPLETE"  # marker file: a DCP checkpoint folder is loadable only with it
FAULT_ENV = "DOBB_BENCH_FAULT"


def inject_fault(where: str, count: int, rank: int) -> None:
    """Fault injection for the preemption tests: ``DOBB_BENCH_FAULT=RANK:step:N`` SIGKILLs that
    rank right after step N; ``RANK:save:N`` inside its N-th distributed save, after the shards
    are written and before the checkpoint is marked complete."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{where}:{count}":
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def rng_state() -> dict:
    # Tensors and plain types only, so checkpoints load with weights_only=True.
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds objects other than tensors and plain types."""


class UnreadableCheckpoint(ValueError):
    """A checkpoint file is empty, truncated or not a checkpoint at all."""


_START_OVER = "delete it to start the run over, or rerun with --no-resume or another --out"


def _unreadable(path, why: str) -> UnreadableCheckpoint:
    return UnreadableCheckpoint(f"cannot resume from {path}: {why}; {_START_OVER}")


def safe_load(path: Path, map_location=None):
    """``torch.load(weights_only=True)``: a file that would run code when unpickled is refused; an
    empty, truncated or foreign file is reported as unreadable (``torch.save`` writes a zip archive,
    so a file that is not one was never a whole checkpoint)."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise _unreadable(path, "the file is empty (a save cut short?)")
    if not zipfile.is_zipfile(path):
        raise _unreadable(path, "the file is not a torch checkpoint (truncated or overwritten)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc) and "Unsupported class" not in str(exc):
            raise _unreadable(path, "its contents are damaged") from None
        detail = next((x.strip() for x in str(exc).splitlines() if "Unsupported" in x), "")[:200]
        raise UnsafeCheckpoint(
            f"refusing to load {path}: it holds objects other than tensors and plain types, and "
            f"unpickling it could run code from the file ({detail}); delete it or use another --out") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise _unreadable(path, f"its contents are damaged ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})") from None


_DCP_CLASSES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")


# What torch 2.13's DCP metadata pickles besides DCP classes: a layout lookup by name and the
# storage path (constructing a path runs no code of the file's choosing).
_ALLOWED = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
            ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP reads ``.metadata`` with plain ``pickle.load``; we vet it first: only DCP's own classes,
    torch dtypes/``Size`` and containers may appear (no functions, so no code runs)."""

    def find_class(self, module, name):
        obj = super().find_class(module, name)
        if module.startswith(_DCP_CLASSES) and isinstance(obj, type):
            return obj
        if module == "torch" and (name == "Size" or isinstance(obj, torch.dtype)):
            return obj
        if (module, name) in _ALLOWED:
            return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def check_dcp_metadata(folder: Path) -> None:
    path = Path(folder) / ".metadata"
    if not path.exists():
        raise _unreadable(folder, "its .metadata file is missing")
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        if "is not allowed in DCP metadata" in str(exc):
            raise UnsafeCheckpoint(f"refusing to load {folder}: its .metadata holds objects other than "
                                   f"checkpoint metadata ({exc}); delete it or use another --out") from None
        raise _unreadable(folder, "its .metadata is damaged") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, ImportError):
        raise _unreadable(folder, "its .metadata is damaged") from None


def fqn_to_index(optim_sd: dict) -> dict:
    """DCP's optimizer state dict (keyed by parameter names) in ``Optimizer.state_dict`` form.

    ``get_state_dict`` lists each group's parameter names in the optimizer's order, so the i-th
    name is parameter index i. Loading through plain ``optimizer.load_state_dict`` keeps working
    for optimizers whose ``load_state_dict`` expects integer ids (``set_state_dict`` passes names).
    """
    flat = [name for g in optim_sd["param_groups"] for name in g["params"]]
    index = {name: i for i, name in enumerate(flat)}
    groups, start = [], 0
    for g in optim_sd["param_groups"]:
        groups.append({**g, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {"state": {index[k]: v for k, v in optim_sd["state"].items()}, "param_groups": groups}
