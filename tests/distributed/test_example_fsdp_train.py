"""``examples/fsdp_train.py`` under ``torchrun --nproc_per_node=2`` (gloo, CPU): it trains, writes the
checkpoint layout docs/distributed.md describes, and a rerun with ``--resume`` continues exactly.

Three launches: 4 steps (checkpoints at 2 and 4), then ``--resume`` to 6 steps, and a fresh
uninterrupted 6-step run into another folder; the resumed run must start at step 5 and print the
uninterrupted run's losses for steps 5 and 6 exactly (same data per step, bitwise state restored).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_train.py"


def exit_abort(proc) -> bool:
    """Whether a failed launch is a rank's abort in gloo's teardown after the run completed: its
    ``done:`` line printed (after every save and collective), then SIGABRT "terminate called without
    an active exception" on a loaded host."""
    return (re.search(r"^done: steps ", proc.stdout, re.M) is not None
            and "terminate called without an active exception" in proc.stderr and "exitcode: -6" in proc.stderr)


def launch(ckpt, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
           "--save-every", "2", "--ckpt-dir", str(ckpt), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and exit_abort(proc):
        # the run finished (its last line printed after its last save) and a rank died in gloo's
        # teardown: the platform abort _spawn reports for its pools, not a failure of the example
        # a plain UserWarning: xdist's controller unpickles warnings and cannot import _spawn's class
        warnings.warn(f"platform exit abort: examples/fsdp_train.py {' '.join(args)}: a rank aborted at exit")
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", proc.stdout, re.M)}
    return proc.stdout, losses


def test_example_trains_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    out, first = launch(ckpt, "--steps", "4")
    assert sorted(first) == [1, 2, 3, 4] and all(math.isfinite(v) for v in first.values())
    assert sorted(os.listdir(ckpt)) == ["step-00000002", "step-00000004"]
    for folder in ckpt.iterdir():
        names = sorted(os.listdir(folder))
        assert names == [".metadata", "COMPLETE.json", "__0_0.distcp", "__1_0.distcp"], names
        manifest = json.loads((folder / "COMPLETE.json").read_text())
        assert manifest["world_size"] == 2 and f"step-{manifest['step']:08d}" == folder.name
        assert sorted(manifest["files"]) == [n for n in names if n != "COMPLETE.json"]

    out, resumed = launch(ckpt, "--steps", "6", "--resume")
    assert f"resumed from {ckpt / 'step-00000004'} (step 4" in out, out
    assert sorted(resumed) == [5, 6] and all(math.isfinite(v) for v in resumed.values())
    assert sorted(os.listdir(ckpt)) == ["step-00000002", "step-00000004", "step-00000006"]

    out, whole = launch(tmp_path / "whole", "--steps", "6")
    assert {s: whole[s] for s in (5, 6)} == resumed  # repr of the float: bitwise the same loss
    assert whole[6] < whole[1]
