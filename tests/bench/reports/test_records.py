"""dobb_bench.reports.records: collecting a run folder's finished runs into a study's records."""
import json

import pytest

from dobb_bench.reports import records as R


def _record(run, loss, seed=0, dirty=False, optimizer="adamw", hparams=None):
    return {"run": run, "optimizer": optimizer, "hparams": hparams or {}, "lr": 1e-3, "seed": seed,
            "steps": 10, "final_val_loss": loss, "diverged": False, "model": {"width": 128, "layers": 2},
            "train": {"batch_size": 4, "micro_batches": 1}, "corpus": {"name": "c"},
            "provenance": {"git_rev": "abc1234", "git_dirty": dirty, "machine": {}}}


def test_collect_keeps_only_the_named_runs(tmp_path):
    run_dir = tmp_path / "out" / "runs"
    for i, label in enumerate(("AdamW", "Dobb B=2")):
        d = run_dir / f"r{i}"
        d.mkdir(parents=True)
        final = dict(_record(label, 2.0 - i), type="final", train={"seed": 0, "batch_size": 4, "micro_batches": 1})
        d.joinpath("metrics.jsonl").write_text(json.dumps({"type": "eval", "step": 5, "val_loss": 2.5}) + "\n"
                                               + json.dumps(final) + "\n")
    new = R.collect(tmp_path / "out", "s", records_dir=tmp_path, runs=["Dobb B=2"])
    assert [r["run"] for r in new] == ["Dobb B=2"] and [r["run"] for r in R.load("s", tmp_path)] == ["Dobb B=2"]
    with pytest.raises(ValueError, match="no finished run labelled"):
        R.collect(tmp_path / "out", "s", records_dir=tmp_path, runs=["Muon"])
