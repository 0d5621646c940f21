"""Crash-safe distributed checkpoints: one folder per step, marked complete last, checked on load.

Why: ``dcp.save(sd, checkpoint_id=path)`` into one reused folder is not crash-safe. A rank killed
during a save into an existing folder leaves the old ``.metadata``, its own old shard and the other
ranks' new ones: the folder loads without an error, reports the old step and mixes two steps'
tensors. A shard cut short gives a bare ``EOFError`` (or "zip archive corrupted") naming no file.

Layout under ``root``::

    root/step-00000040/            a complete checkpoint (renamed into place after its marker)
        .metadata                  DCP's metadata (written by DCP's coordinator, rank 0)
        __0_0.distcp, __1_0.distcp one file per saving rank (DCP)
        COMPLETE.json              the marker: step, world size, every file's size and sha256, extra
    root/step-00000050.partial/    a save in progress or killed: never loaded, removed by the next save

``save`` writes into ``step-XXXXXXXX.partial``; once ``dcp.save`` has returned on every rank (a
barrier), each rank hashes a share of the files, and rank 0 writes ``COMPLETE.json`` (to a
temporary name, fsynced, renamed) and then renames the folder to ``step-XXXXXXXX``. So a folder named ``step-XXXXXXXX`` with its marker holds a whole checkpoint,
whatever rank died when. (Saving a step that already has a checkpoint moves the old folder to
``step-XXXXXXXX.replaced`` before the rename and deletes it after; a crash between the two leaves
the step without a loadable folder, and the checkpoint before it loads.)

``load_latest`` picks the newest folder ``step-XXXXXXXX`` holding ``COMPLETE.json`` (rank 0 decides
and broadcasts, so every rank loads the same one), checks every file of the manifest against the
folder (missing or another size: a ``ValueError`` naming the folder and the file; ``verify="sha256"``
also compares the checksums, each rank reading a share), runs :func:`dobb.resume.check_resume` (a
checkpoint whose optimizer state is laid out for another number of shards is its ``ValueError``,
never DCP's ``CheckpointException``), then ``dcp.load`` and ``set_model_state_dict`` /
``set_optimizer_state_dict``. A read error inside ``dcp.load`` is a ``ValueError`` naming the
folder, the files and each failing rank's error.

Both functions are collective under an initialised process group (call them on every rank, with
the same ``root``; the folder must be visible to every rank, as DCP needs) and work in one process
without a process group. They use ``get_model_state_dict`` / ``get_optimizer_state_dict``, so the
model may be plain, DDP, or ``fully_shard``-ed (FSDP2), and a checkpoint reshards to another world
size wherever the optimizer's state does (see ``docs/distributed.md``).

Not handled here: a rank that freezes (SIGSTOP, a stuck device) makes the others wait in the next
collective until the process group's timeout; pass ``timeout=`` to ``init_process_group``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import numbers
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import collectives

__all__ = ["Checkpoint", "save", "load_latest", "latest", "complete_checkpoints", "step_folder", "MARKER"]

MARKER = "COMPLETE.json"
FORMAT = "dobb-checkpoint/1"
_STEP = re.compile(r"^step-(\d{8,})$")
_PARTIAL = re.compile(r"^step-(\d{8,})\.(partial|replaced)$")
_HASH_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What ``load_latest`` restored: the step passed to ``save``, the folder, and ``extra``."""

    step: int
    path: Path
    extra: Any = None


def step_folder(root, step: int) -> Path:
    """``root/step-XXXXXXXX`` (eight digits at least, so names sort by step)."""
    return Path(root) / f"step-{int(step):08d}"


def _crash_point(stage: str) -> None:
    """No-op; the tests replace it to kill a rank at ``stage`` of ``save`` ("prepared": before
    ``dcp.save``; "written": after this rank's ``dcp.save`` returned; "marked": rank 0, after the
    marker, before the rename)."""


# --- process group helpers: every helper is called on every rank, in the same order -----------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank."""
    if not _distributed():
        return obj
    return collectives.broadcast_object(obj, 0, "checkpoint")


def _gather(obj) -> list:
    if not _distributed():
        return [obj]
    return collectives.all_gather_object(obj, "checkpoint")


def _on_rank0(fn):
    """Run ``fn`` on rank 0; every rank gets its result, or the same ``ValueError`` if it raised
    (another exception type is re-raised as is on rank 0, and a ``ValueError`` naming it elsewhere,
    so no rank is left waiting in a collective)."""
    result = error = original = None
    if _rank() == 0:
        try:
            result = fn()
        except ValueError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then re-raised here
            error, original = f"rank 0 failed: {type(exc).__name__}: {exc}", exc
    result, error = _broadcast((result, error))
    if original is not None:
        raise original
    if error is not None:
        raise ValueError(error)
    return result


def _agree(error: str | None) -> None:
    """Raise on every rank the errors any rank met (by rank); a no-op when none did."""
    errors = [(r, e) for r, e in enumerate(_gather(error)) if e is not None]
    if errors:
        if len(errors) == 1 or len({e for _, e in errors}) == 1:
            raise ValueError(errors[0][1])
        raise ValueError("; ".join(f"rank {r}: {e}" for r, e in errors))


# --- files -----------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (every rank gets the same list)."""
    return names[_rank()::_world()]


def _read_marker(folder: Path) -> dict:
    path = folder / MARKER
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot load checkpoint {folder}: its marker {path.name} is unreadable ({exc}); "
                         "delete the folder to resume from the previous checkpoint") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(files, dict)
            or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) for v in files.values())):
        raise ValueError(f"cannot load checkpoint {folder}: its marker {path.name} is not a {FORMAT} manifest")
    return manifest


def _check_files(folder: Path, manifest: dict) -> None:
    """Every file of the manifest is there with its size (a stat each: no file is read)."""
    files = manifest["files"]
    if ".metadata" not in files:
        raise ValueError(f"cannot load checkpoint {folder}: its manifest {MARKER} lists no .metadata")
    for name in sorted(files):
        path = folder / name
        want = files[name]["bytes"]
        if not path.is_file():
            raise ValueError(f"cannot load checkpoint {folder}: file {name} is missing (the manifest "
                             f"{MARKER} lists it with {want} bytes); the checkpoint was damaged or copied "
                             "in part: delete the folder to resume from the previous checkpoint")
        size = path.stat().st_size
        if size != want:
            raise ValueError(f"cannot load checkpoint {folder}: file {name} has {size} bytes, the manifest "
                             f"{MARKER} says {want} (truncated or overwritten); delete the folder to resume "
                             "from the previous checkpoint")


def complete_checkpoints(root) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every folder ``step-XXXXXXXX`` under ``root`` holding the marker,
    oldest first (local: no collective, no file is checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        m = _STEP.match(entry.name)
        if m and entry.is_dir() and (entry / MARKER).is_file():
            out.append((int(m.group(1)), entry))
    return sorted(out)


def latest(root) -> Path | None:
    """The newest complete checkpoint folder under ``root``, or ``None`` (local: no collective)."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group that it assumes one process: that is the
    documented single-process use here, so that warning is dropped."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# --- save ------------------------------------------------------------------------------------

def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save(model: nn.Module, optimizer: torch.optim.Optimizer, root, step: int, *, extra: Any = None,
         keep: int | None = None, checksum: bool = True) -> Path:
    """Save ``model`` and ``optimizer`` as the checkpoint of ``step`` under ``root``; returns its folder.

    Collective: call on every rank. ``extra``: JSON values (rank 0's are kept; e.g. a data position,
    a loss history), given back by ``load_latest``. ``keep``: keep this checkpoint and the ``keep - 1``
    newest complete ones before it (older ones are deleted once this one is complete). ``checksum``: record each
    file's sha256 (each rank hashes a share of the files) so ``load_latest(verify="sha256")`` can
    check them. Saving a step that already has a checkpoint replaces it.
    """
    import torch.distributed.checkpoint as dcp

    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    step = int(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int or None, got {keep!r}")
    root = Path(root)
    final = step_folder(root, step)
    partial = final.with_name(final.name + ".partial")

    def prepare():
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint extra must hold JSON values only (saving {final}): {exc}") from None
        if root.exists() and not root.is_dir():
            raise ValueError(f"checkpoint root {root} exists and is not a folder")
        root.mkdir(parents=True, exist_ok=True)
        for entry in root.iterdir():  # saves killed earlier: no rank of this job writes there now
            if _PARTIAL.match(entry.name):
                shutil.rmtree(entry)
        partial.mkdir()

    _on_rank0(prepare)
    _crash_point("prepared")
    sd = _state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save(sd, checkpoint_id=os.fspath(partial))
    _crash_point("written")
    names = _on_rank0(lambda: sorted(p.name for p in partial.iterdir() if p.is_file()))  # also a barrier
    mine = {n: _sha256(partial / n) for n in _share(names)} if checksum else {}
    hashes = {k: v for part in _gather(mine) for k, v in part.items()}

    def publish():
        files = {}
        for name in names:
            files[name] = {"bytes": (partial / name).stat().st_size}
            if checksum:
                files[name]["sha256"] = hashes[name]
        manifest = {"format": FORMAT, "step": step, "world_size": _world(), "torch": torch.__version__,
                    "optimizer": type(optimizer).__name__, "files": files, "extra": extra}
        tmp = partial / (MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / MARKER)
        _fsync(partial)
        _crash_point("marked")
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            replaced = final.with_name(final.name + ".replaced")
            os.replace(final, replaced)
            os.replace(partial, final)
            shutil.rmtree(replaced)
        else:
            os.replace(partial, final)
        _fsync(root)
        if keep is not None:  # the newest keep - 1 before this one stay (never a later step)
            older = [folder for s, folder in complete_checkpoints(root) if s < step]
            for old in older[:max(len(older) - (keep - 1), 0)]:
                shutil.rmtree(old)

    _on_rank0(publish)
    return final


# --- load ------------------------------------------------------------------------------------

def _choose(root: Path) -> tuple[Path, dict] | None:
    """Rank 0: the newest complete checkpoint and its manifest, its files checked."""
    found = complete_checkpoints(root)
    if root.is_dir():
        unmarked = [e.name for e in root.iterdir() if _STEP.match(e.name) and e.is_dir() and not (e / MARKER).exists()]
        if unmarked:
            warnings.warn(f"{root}: ignoring folder(s) without {MARKER} (not written by dobb.checkpoints.save, "
                          f"or damaged): {', '.join(sorted(unmarked))}", stacklevel=3)
    if not found:
        return None
    step, folder = found[-1]
    manifest = _read_marker(folder)
    if manifest.get("step") != step:
        raise ValueError(f"cannot load checkpoint {folder}: its marker {MARKER} is for step "
                         f"{manifest.get('step')!r}, the folder name for step {step}")
    _check_files(folder, manifest)
    return folder, manifest


def load_latest(model: nn.Module, optimizer: torch.optim.Optimizer, root, *,
                verify: str = "size") -> Checkpoint | None:
    """Load the newest complete checkpoint under ``root`` into ``model`` and ``optimizer``.

    Collective: call on every rank. Returns ``None`` (nothing changed) when ``root`` holds no
    complete checkpoint, else a :class:`Checkpoint` (``.step``, ``.path``, ``.extra``); resume
    training at ``.step + 1``. ``verify``: ``"size"`` (every file of the manifest present with its
    size) or ``"sha256"`` (also its checksum; reads every file once more, shared over the ranks).
    Raises ``ValueError`` naming the folder and the file for a damaged checkpoint, and
    :func:`dobb.resume.check_resume`'s ``ValueError`` for optimizer state laid out for another
    number of shards.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from .resume import check_resume

    if verify not in ("size", "sha256"):
        raise ValueError(f"verify must be 'size' or 'sha256', got {verify!r}")
    root = Path(root)
    chosen = _on_rank0(lambda: _choose(root))
    if chosen is None:
        return None
    folder, manifest = chosen
    if verify == "sha256":
        error = None
        for name in _share(sorted(manifest["files"])):
            want = manifest["files"][name].get("sha256")
            if want is None:
                error = f"cannot verify checkpoint {folder}: its manifest {MARKER} has no sha256 for {name} (saved with checksum=False)"
                break
            try:
                got = _sha256(folder / name)
            except OSError as exc:
                error = f"cannot load checkpoint {folder}: file {name} is unreadable ({exc})"
                break
            if got != want:
                error = (f"cannot load checkpoint {folder}: file {name} does not match its sha256 in {MARKER} "
                         "(damaged); delete the folder to resume from the previous checkpoint")
                break
        _agree(error)

    error = None
    try:
        check_resume(model, optimizer, folder)
    except ValueError as exc:
        error = f"{exc} (checkpoint {folder})"
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - unreadable metadata or param groups
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        error = (f"cannot load checkpoint {folder}: reading its metadata and saved param groups (files "
                 f"{', '.join(sorted(manifest['files']))}) failed ({type(exc).__name__}: {first}); "
                 "load_latest(..., verify='sha256') names the damaged file")
    _agree(error)

    sd = _state_dict(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(sd, checkpoint_id=os.fspath(folder))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's failure
        failures = getattr(exc, "failures", None)
        if failures:
            parts = []
            for r, wrapped in sorted(failures.items()):
                err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                first = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:200]
                parts.append(f"rank {r}: {type(err).__name__}: {first}")
            why = "; ".join(parts)
        else:
            why = f"{type(exc).__name__}: {exc}"
        files = ", ".join(sorted(manifest["files"]))
        raise ValueError(f"cannot load checkpoint {folder}: reading its files ({files}) failed: {why}; "
                         "load_latest(..., verify='sha256') names the damaged file; delete the folder to "
                         "resume from the previous checkpoint") from exc
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    return Checkpoint(step=int(manifest["step"]), path=folder, extra=manifest.get("extra"))
