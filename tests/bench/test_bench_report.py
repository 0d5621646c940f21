"""The main job's reading aids: block widths, gap closure, the plain-words summary, provenance,
parallel isolated runs (issue 14 items 1, 3, 6)."""
import json
import os
import subprocess

import pytest
import torch

from dobb_bench import provenance as provenance_module
from dobb_bench import report
from dobb_bench.cli import main
from dobb_bench.provenance import git_state, provenance

SMALL = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--steps", "4",
         "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "4", "--no-progress"]


def test_block_widths_per_matrix_kind():
    model = {"width": 128}
    assert report.block_widths("dobb", {"blocks": "4"}, model) == "32 / 128"  # d/B, 4d/B
    assert report.block_widths("dobb", {"blocks": "16"}, model) == "8 / 32"
    assert report.block_widths("dobb", {}, model) == "128 / 512"  # B=1: whole input axis
    assert report.block_widths("dobb-g", {"blocks": "4"}, model) == "32 / 128 / 96"  # output side
    assert report.block_widths("block-muon", {"blocks": "16"}, model) == "8 / 32"
    assert report.block_widths("block-muon", {"blocks": "4", "axis": "0"}, model) == "32 / 128 / 96"
    assert report.block_widths("adamw", {}, model) is None


def test_gap_closure_and_summary():
    assert report.gap_closure(1.8, 2.0, 1.5) == pytest.approx(0.4)
    assert report.gap_closure(2.1, 2.0, 1.5) == pytest.approx(-0.2)
    assert report.gap_closure(1.8, 1.5, 2.0) is None  # no AdamW-Muon gap to normalise by
    model = {"width": 128, "layers": 2}

    def row(run, name, loss, **hp):
        return {"run": run, "optimizer": name, "hparams": {k: str(v) for k, v in hp.items()},
                "final_val_loss": loss, "diverged": False, "model": model}

    finals = [row("AdamW", "adamw", 2.0), row("Muon", "muon", 1.5),
              row("Dion rho=1/16", "dion", 2.2, rank_fraction=1 / 16), row("Dion rho=1/4", "dion", 1.9, rank_fraction=0.25),
              row("Dobb B=4", "dobb", 1.95, blocks=4)]
    shapes = [(384, 128), (128, 128), (512, 128), (128, 512)] * 2
    text = report.plain_summary(finals, shapes)
    line = next(x for x in text.splitlines() if x.startswith("- Dobb B=4"))
    assert "blocks 32 / 128 wide" in line and "closes 10%" in line
    assert "0.050 ahead of AdamW (within the 0.1-nat noise" in line
    assert "0.450 behind Muon;" in line
    # Dobb's payload is 0, so the nearest Dion row in payload is rho=1/16 (1.5/16 of Muon's)
    assert "0.250 ahead of Dion rho=1/16" in line and "vs 0.000" in line


def test_provenance_names_revision_machine_and_command():
    p = provenance(["/x/dobb_bench/cli.py", "compare", "--steps", "5"])
    assert p["command"] == "dobb-bench compare --steps 5"
    assert p["torch"] == torch.__version__ and p["machine"]["cpu_count"] == os.cpu_count()
    assert git_state() == {"git_rev": p["git_rev"], "git_dirty": p["git_dirty"]}


def test_git_state_follows_tracked_edits_only(tmp_path, monkeypatch):
    """In a scratch repository: the revision is git's own, a tracked edit makes the tree dirty, an
    untracked file (a run output) does not."""
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(provenance_module, "_SRC", tmp_path)
    state = git_state.__wrapped__  # uncached (the cached one holds the session's checkout)
    rev = git("rev-parse", "HEAD").strip()
    assert state() == {"git_rev": rev, "git_dirty": False}
    (tmp_path / "run.jsonl").write_text("{}\n")
    assert state() == {"git_rev": rev, "git_dirty": False}
    (tmp_path / "code.py").write_text("x = 2\n")
    assert state() == {"git_rev": rev, "git_dirty": True}


def test_parallel_isolated_runs_equal_sequential(tmp_path, text_dir, cache_dir, capsys):
    specs = "adamw,dobb:blocks=2"
    common = ["compare", "--optimizers", specs, "--data", str(text_dir), "--cache-dir", str(cache_dir),
              "--isolate"] + SMALL
    assert main(common + ["--jobs", "2", "--out", str(tmp_path / "par")]) == 0
    assert main(common + ["--jobs", "1", "--out", str(tmp_path / "seq")]) == 0
    out = capsys.readouterr().out
    assert "Summary (one seed" in out and "- Dobb B=2 (blocks 16 / 64 wide" in out

    def finals(d):
        rows = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
        return {r["run"]: r for r in rows if r["type"] == "final"}

    par, seq = finals(tmp_path / "par"), finals(tmp_path / "seq")
    assert list(par) == list(seq) == ["AdamW", "Dobb B=2"]  # order of --optimizers, not of finishing
    for k in par:
        assert par[k]["train_losses"] == seq[k]["train_losses"]  # exact: same seed, one thread each
        assert par[k]["provenance"]["command"].startswith("dobb-bench compare --optimizers adamw")
        assert par[k]["tokens"] == 4 * 4 * 32
    assert main(common + ["--jobs", "0", "--out", str(tmp_path / "bad")]) == 2


def test_summary_tells_a_missing_row_from_a_diverged_one():
    model = {"width": 128, "layers": 2}
    finals = [{"run": "Muon", "optimizer": "muon", "hparams": {}, "final_val_loss": float("nan"),
               "diverged": True, "model": model},
              {"run": "Dobb B=4", "optimizer": "dobb", "hparams": {"blocks": "4"}, "final_val_loss": 1.9,
               "diverged": False, "model": model}]
    line = next(x for x in report.plain_summary(finals, [(128, 128)]).splitlines() if x.startswith("- Dobb"))
    assert "AdamW: not in this run" in line and "Muon: no finite result" in line
