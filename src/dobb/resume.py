"""``check_resume``: refuse, before anything loads, a distributed checkpoint whose optimizer state
was laid out for another sharding.

Most of this package's optimizers keep state that ``torch.distributed.checkpoint`` (DCP) reshards
with the weights: momentum shaped like the weight, blocks that do not move with the shards. Some lay
their state out by the shards themselves: DASH's and Shampoo's tile factors are cut within each
rank's shard, SPlus's blocks are cut at the shard boundaries and each rank keeps a partial
statistic, Dobb's blocks are cut at the shard boundaries when ``blocks`` follows the world size.
Their state then has another global shape on another number of shards, and DCP's own error names
a tensor size only. Call this on every rank before ``dcp.load``::

    dobb.resume.check_resume(model, opt, path)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)

It first reads the optimizer's saved param groups (small pickled values: which optimizer saved them
and with which options, no tensor, no collective) and refuses another optimizer or preset
(``dobb._safety.check_saved_optimizer``, what ``load_state_dict`` checks too, but before the weights
load); then the checkpoint's metadata (no tensor is read, no collective beyond those of
``get_optimizer_state_dict``); last, saved group values the parameters here cannot take (a block
count that must fit the shards, saved on another number of ranks: Dobb-Muon's ``out_blocks``). It raises a ``ValueError`` naming the optimizer, the state, the saved
and the current layout, and what works.
"""
from __future__ import annotations

import os
import re

import torch
from torch import nn

__all__ = ["check_resume", "optimizer_label"]


def optimizer_label(opt: torch.optim.Optimizer) -> str:
    """The registry label of ``opt`` (``"DASH"``, ``"Dobb-G"``): the entry of its class whose preset
    its first matrix group matches most closely; the class name for an optimizer not registered."""
    from ._safety import label_of

    group = next((g for g in opt.param_groups if g.get("algorithm") != "adamw"), opt.defaults)
    return label_of(type(opt), group)


def _shards(t: torch.Tensor) -> int:
    from .sharding import shard_count
    return shard_count(t)


def check_resume(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id=None, *,
                 storage_reader=None) -> None:
    """Raise ``ValueError`` when a state tensor of ``optimizer`` has another global shape in the
    checkpoint than here (its layout follows the shards, and they changed); see the module
    docstring. ``storage_reader``: DCP's reader, when not a file system path."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("check_resume needs checkpoint_id (a path) or storage_reader")
        storage_reader = FileSystemReader(os.fspath(checkpoint_id))
    saved = storage_reader.read_metadata().state_dict_metadata
    groups = _saved_param_groups(saved, storage_reader)
    mine = groups is not None and hasattr(optimizer, "_check_group")  # a MatrixOptimizer's checkpoint
    where = f"checkpoint {checkpoint_id or storage_reader!s}"
    if mine:  # which optimizer saved it, first: the state's keys and shapes are that optimizer's
        from ._safety import check_saved_optimizer

        check_saved_optimizer(optimizer, groups, where=where, trial=False)
    current = get_optimizer_state_dict(model, optimizer)
    label = optimizer_label(optimizer)
    notes = ""
    for group in optimizer.param_groups:
        note = getattr(optimizer, "_layout_note", None)
        if note is not None and group.get("algorithm") != "adamw":
            notes = note(group)
            break
    for fqn, state in current["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            name = f"state.{fqn}.{key}"
            hits = [k for k in saved if k == name or k.endswith("." + name)]
            if len(hits) != 1 or not isinstance(saved[hits[0]], TensorStorageMetadata):
                continue  # absent, or ambiguous: DCP's own load reports it
            meta = saved[hits[0]]
            if tuple(meta.size) == tuple(value.shape):
                continue
            before, now = len(meta.chunks), _shards(value)
            why = f" ({notes})" if notes else ""
            raise ValueError(
                f"{label} cannot resume from this checkpoint: state {key!r} of {fqn} was saved on {before} "
                f"shard(s) of the weight (global shape {tuple(meta.size)}), now {now} shard(s) (global shape "
                f"{tuple(value.shape)}){why}. Saved layout: {before} shard(s); current layout: {now} shard(s). "
                f"What works: resume on {before} ranks (the saved sharding), or load the model's weights "
                f"alone and start a new {label} state here"
            )
    if mine:  # the same shapes: the saved group values must still fit the parameters here
        check_saved_optimizer(optimizer, groups, where=where)


_GROUP_KEY = re.compile(r"^(?:(.*)\.)?param_groups\.(\d+)\.([^.]+)$")


def _saved_param_groups(saved: dict, storage_reader) -> list[dict] | None:
    """The optimizer's saved param groups (every value but ``params``), or None when the checkpoint
    holds none. DCP keeps a group's values as pickled bytes (``BytesStorageMetadata``: the metadata
    names them, without their values); they are read here alone, on this rank (``no_dist``: no
    collective), no tensor with them. A checkpoint holding several optimizers' groups (prefixes) is left
    to DCP's load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    found = {}
    for key, meta in saved.items():
        m = _GROUP_KEY.match(key)
        if m and isinstance(meta, BytesStorageMetadata) and m.group(3) != "params":
            found[key] = (m.group(1), int(m.group(2)), m.group(3))
    prefixes = {prefix for prefix, _, _ in found.values()}
    if not found or len(prefixes) != 1:
        return None
    values = dict.fromkeys(found)
    storage_reader.reset() if hasattr(storage_reader, "reset") else None
    dcp.load(values, storage_reader=storage_reader, no_dist=True)
    groups: dict[int, dict] = {}
    for key, (_, index, name) in found.items():
        groups.setdefault(index, {})[name] = values[key]
    if sorted(groups) != list(range(len(groups))):
        return None
    return [groups[i] for i in range(len(groups))]
