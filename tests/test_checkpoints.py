"""``dobb.checkpoints`` in one process (no process group): a round trip resumes bitwise, a save cut
short is never loaded, a damaged checkpoint is a ``ValueError`` naming its folder and file.

The reference is the uninterrupted run of the same model, data and optimizer: a run resumed from a
checkpoint must end on exactly its weights (``torch.equal``). The multi-process cases (FSDP2, a rank
killed inside a save, a world-size change) are in ``tests/distributed/test_checkpoints_sharded.py``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import dobb
from dobb import checkpoints

STEPS, SAVE_AT = 6, 3


class Killed(Exception):
    """Stands in for a process killed at a crash point."""


def make(name="block-muon", **hp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    hp = hp or ({"axis": 0, "blocks": 2} if name == "block-muon" else {})
    return model, dobb.build_optimizer(name, model, lr=0.02, weight_decay=0.01, **hp)


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)


def train(model, opt, first, last):
    for step in range(first, last + 1):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def uninterrupted():
    model, opt = make()
    train(model, opt, 1, STEPS)
    return weights(model)


def saved_run(root, steps=(SAVE_AT,), **kw):
    """Train to the last of ``steps``, saving at each; returns the model and optimizer."""
    model, opt = make()
    done = 0
    for s in steps:
        train(model, opt, done + 1, s)
        done = s
        checkpoints.save(model, opt, root, s, extra={"step": s, "losses": [0.5, 0.25]}, **kw)
    return model, opt


@pytest.mark.parametrize("name", ["block-muon", "dobb", "adamw"])
def test_round_trip_resumes_bitwise(tmp_path, name):
    model, opt = make(name)
    train(model, opt, 1, SAVE_AT)
    folder = checkpoints.save(model, opt, tmp_path, SAVE_AT, extra={"data_pos": 24})
    assert folder == tmp_path / "step-00000003"
    train(model, opt, SAVE_AT + 1, STEPS)
    ref = weights(model)

    model2, opt2 = make(name)
    assert not bitwise(weights(model2), ref)
    got = checkpoints.load_latest(model2, opt2, tmp_path)
    assert (got.step, got.path, got.extra) == (SAVE_AT, folder, {"data_pos": 24})
    train(model2, opt2, got.step + 1, STEPS)
    assert bitwise(weights(model2), ref)


def test_layout_and_manifest(tmp_path):
    saved_run(tmp_path, steps=(2, 4))
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000004"]
    folder = tmp_path / "step-00000004"
    names = sorted(os.listdir(folder))
    assert names[:2] == [".metadata", "COMPLETE.json"] and all(n.endswith(".distcp") for n in names[2:])
    manifest = json.loads((folder / "COMPLETE.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 1 and manifest["optimizer"] == "BlockMuon"
    assert sorted(manifest["files"]) == [n for n in names if n != "COMPLETE.json"]
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (folder / name).stat().st_size and len(entry["sha256"]) == 64
    assert checkpoints.latest(tmp_path) == folder
    assert [s for s, _ in checkpoints.complete_checkpoints(tmp_path)] == [2, 4]


def test_nothing_to_load(tmp_path):
    model, opt = make()
    before = weights(model)
    assert checkpoints.load_latest(model, opt, tmp_path / "absent") is None
    assert checkpoints.load_latest(model, opt, tmp_path) is None
    assert bitwise(weights(model), before)


@pytest.mark.parametrize("stage", ["written", "marked"])
def test_save_cut_short_is_ignored(tmp_path, monkeypatch, uninterrupted, stage):
    """A save killed after the shards (or even after the marker, before the rename) leaves a
    ``.partial`` folder: the previous complete checkpoint loads and resumes exactly."""
    model, opt = saved_run(tmp_path, steps=(2,))
    train(model, opt, 3, 4)

    def crash(where):
        if where == stage:
            raise Killed(where)

    monkeypatch.setattr(checkpoints, "_crash_point", crash)
    with pytest.raises(Killed):
        checkpoints.save(model, opt, tmp_path, 4)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000004.partial"]
    assert (tmp_path / "step-00000004.partial" / "COMPLETE.json").exists() == (stage == "marked")

    model2, opt2 = make()
    got = checkpoints.load_latest(model2, opt2, tmp_path)
    assert got.step == 2
    train(model2, opt2, 3, 4)
    checkpoints.save(model2, opt2, tmp_path, 4)  # the next save clears the stale .partial
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000004"]
    train(model2, opt2, 5, STEPS)
    assert bitwise(weights(model2), uninterrupted)


def test_folder_without_marker_is_ignored_with_a_warning(tmp_path):
    saved_run(tmp_path, steps=(2, 4))
    os.remove(tmp_path / "step-00000004" / "COMPLETE.json")
    model, opt = make()
    with pytest.warns(UserWarning, match="step-00000004"):
        assert checkpoints.load_latest(model, opt, tmp_path).step == 2


@pytest.mark.parametrize("damage", ["truncate", "remove", "truncate-metadata"])
def test_damaged_checkpoint_names_folder_and_file(tmp_path, damage):
    saved_run(tmp_path, steps=(2, 4))
    folder = tmp_path / "step-00000004"
    name = ".metadata" if damage == "truncate-metadata" else next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    if damage == "remove":
        os.remove(folder / name)
    else:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:len(data) // 2])
    model, opt = make()
    before = weights(model)
    with pytest.raises(ValueError) as info:
        checkpoints.load_latest(model, opt, tmp_path)
    msg = str(info.value)
    assert str(folder) in msg and name in msg, msg
    assert ("missing" if damage == "remove" else "bytes") in msg
    assert bitwise(weights(model), before)  # nothing loaded


def test_same_size_corruption_found_by_sha256(tmp_path, uninterrupted):
    saved_run(tmp_path, steps=(SAVE_AT,))
    folder = tmp_path / "step-00000003"
    name = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(data))
    model, opt = make()
    with pytest.raises(ValueError, match="sha256") as info:
        checkpoints.load_latest(model, opt, tmp_path, verify="sha256")
    assert str(folder) in str(info.value) and name in str(info.value)


def test_read_error_inside_dcp_names_the_folder(tmp_path, monkeypatch):
    """A read error DCP meets (here: a shard the manifest still matches, damaged in place) is a
    ValueError naming the folder and its files, never a bare DCP exception."""
    saved_run(tmp_path, steps=(SAVE_AT,))
    folder = tmp_path / "step-00000003"
    name = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    size = (folder / name).stat().st_size
    (folder / name).write_bytes(b"\0" * size)
    model, opt = make()
    with pytest.raises(ValueError) as info:
        checkpoints.load_latest(model, opt, tmp_path)
    assert str(folder) in str(info.value) and name in str(info.value)


def test_keep_prunes_old_checkpoints(tmp_path):
    model, opt = saved_run(tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    checkpoints.save(model, opt, tmp_path, 2, keep=1)  # an earlier step: later ones are never pruned
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000003", "step-00000004"]


@pytest.mark.parametrize("bad", ["{", "[]", '{"format": "dobb-checkpoint/1", "files": {".metadata": 3}}'])
def test_bad_marker_names_folder_and_marker(tmp_path, bad):
    saved_run(tmp_path, steps=(2,))
    folder = tmp_path / "step-00000002"
    (folder / "COMPLETE.json").write_text(bad)
    model, opt = make()
    with pytest.raises(ValueError, match="COMPLETE.json") as info:
        checkpoints.load_latest(model, opt, tmp_path)
    assert str(folder) in str(info.value)


def test_saving_a_step_again_replaces_it(tmp_path, uninterrupted):
    model, opt = saved_run(tmp_path, steps=(SAVE_AT,))
    checkpoints.save(model, opt, tmp_path, SAVE_AT, extra="again")
    assert sorted(os.listdir(tmp_path)) == ["step-00000003"]
    model2, opt2 = make()
    got = checkpoints.load_latest(model2, opt2, tmp_path)
    assert (got.step, got.extra) == (SAVE_AT, "again")
    train(model2, opt2, SAVE_AT + 1, STEPS)
    assert bitwise(weights(model2), uninterrupted)


def test_bad_arguments(tmp_path):
    model, opt = make()
    with pytest.raises(ValueError, match="step"):
        checkpoints.save(model, opt, tmp_path, -1)
    with pytest.raises(ValueError, match="keep"):
        checkpoints.save(model, opt, tmp_path, 1, keep=0)
    with pytest.raises(ValueError, match="JSON"):
        checkpoints.save(model, opt, tmp_path, 1, extra={"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="verify"):
        checkpoints.load_latest(model, opt, tmp_path, verify="md5")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        checkpoints.save(model, opt, tmp_path / "file", 1)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("step-")]


def test_layout_change_is_check_resumes_error(tmp_path):
    """Optimizer state laid out for other blocks: check_resume's ValueError before anything loads."""
    model, opt = make("dobb", blocks=4)
    train(model, opt, 1, 1)
    checkpoints.save(model, opt, tmp_path, 1)
    model2, opt2 = make("dobb", blocks=2)
    before = weights(model2)
    with pytest.raises(ValueError, match="cannot resume") as info:
        checkpoints.load_latest(model2, opt2, tmp_path)
    assert "step-00000001" in str(info.value)
    assert bitwise(weights(model2), before)
