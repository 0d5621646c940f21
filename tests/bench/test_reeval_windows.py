"""scripts/reeval_windows.py on a real (tiny) compare run: its own windows reproduce the logged loss
of the checkpoint's step, the groups average to the common-window loss, the record says which run,
and a run whose weights do not match its log is refused."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dobb_bench.cli import main as cli_main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reeval_windows.py"


def _script():
    spec = importlib.util.spec_from_file_location("reeval_windows", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reeval_reproduces_the_logged_loss_and_refuses_other_weights(tmp_path, text_dir, cache_dir):
    run = tmp_path / "cmp"
    assert cli_main(["compare", "--optimizers", "adamw@A", "--no-isolate", "--data", str(text_dir), "--cache-dir",
                     str(cache_dir), "--layers", "1", "--width", "32", "--heads", "2", "--context", "32",
                     "--steps", "4", "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "8", "--seed", "3",
                     "--checkpoint-every", "2", "--no-progress", "--out", str(run)]) == 0
    mod = _script()
    mod.GROUPS = 4
    out = tmp_path / "re.jsonl"
    args = [str(run), "--out", str(out), "--windows", "16", "--data", str(text_dir), "--cache-dir", str(cache_dir)]
    assert mod.main(args) == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["run"] == "A" and rec["seed"] == 3 and rec["checkpoint_step"] == 2 and rec["run_dir"] == "cmp"
    assert rec["own_val_loss"] == pytest.approx(rec["logged_val_loss"], abs=1e-6)
    assert len(rec["common_groups"]) == 4 and rec["common_windows"] == 16
    assert sum(rec["common_groups"]) / 4 == pytest.approx(rec["common_val_loss"], abs=1e-6)
    assert rec["provenance"]["git_rev"] is not None
    assert mod.main(args) == 0 and len(out.read_text().splitlines()) == 1  # resumable: a run once
    # other weights under the same log: refused, nothing written
    (ckpt,) = run.glob("runs/*/checkpoint.pt")
    state = torch.load(ckpt, weights_only=False)
    state["model"] = {k: v * 0.5 for k, v in state["model"].items()}
    torch.save(state, ckpt)
    out2 = tmp_path / "re2.jsonl"
    assert mod.main([*args[:1], "--out", str(out2), *args[3:]]) == 1
    assert not out2.exists() or out2.read_text() == ""
