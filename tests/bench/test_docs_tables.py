"""Every marked table in docs/*.md equals its regeneration from committed records (issue 14.1).

A table is delimited by ``<!-- table:NAME -->`` ... ``<!-- /table -->``; ``dobb-bench report``
rewrites it from ``docs/results/records``. These tests fail when someone edits a number by hand,
commits records without regenerating, or backs a table with a run from a dirty tree.
"""
import json

import pytest

from dobb_bench import docs_tables as D, records as R


def test_docs_tables_match_their_regeneration():
    changed = D.regenerate_docs(write=False)
    assert not changed, f"docs tables differ from `dobb-bench report`: {changed}"


def test_docs_tables_rest_on_clean_tree_records():
    used = []
    for md in sorted(R.DOCS.glob("*.md")):
        _, per_table = D.regenerate_text(md.read_text())
        for name, recs in per_table:
            assert recs, f"{md.name}: table {name} rests on no record"
            used += [(md.name, name, r) for r in recs]
    dirty = [(f, n, r.get("run")) for f, n, r in used if not R.clean(r)]
    assert not dirty, f"tables resting on dirty-tree or revision-less records: {dirty[:5]}"


def _record(run, loss, seed=0, dirty=False, optimizer="adamw", hparams=None):
    return {"run": run, "optimizer": optimizer, "hparams": hparams or {}, "lr": 1e-3, "seed": seed,
            "steps": 10, "final_val_loss": loss, "diverged": False, "model": {"width": 128, "layers": 2},
            "train": {"batch_size": 4, "micro_batches": 1}, "corpus": {"name": "c"},
            "provenance": {"git_rev": "abc1234", "git_dirty": dirty, "machine": {}}}


def test_regeneration_detects_a_hand_edit_and_dirty_records(tmp_path, monkeypatch):
    from dobb_bench import tables

    recs = [_record("AdamW", 2.0, s) for s in (0, 1)] + [_record("Muon", 1.5, s) for s in (0, 1)]
    recs += [_record("Dobb B=4", 1.75, 0, optimizer="dobb", hparams={"blocks": "4"}),
             _record("Dobb B=4", 1.85, 1, optimizer="dobb", hparams={"blocks": "4"})]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setitem(D.TABLES, "t", lambda: (tables.seeds_table(R.load("t", tmp_path)), R.load("t", tmp_path)))
    text = "intro\n<!-- table:t -->\nstale\n<!-- /table -->\nend\n"
    new, used = D.regenerate_text(text)
    assert new != text and new.startswith("intro\n<!-- table:t -->\n| optimizer") and new.endswith("<!-- /table -->\nend\n")
    row = next(line for line in new.splitlines() if line.startswith("| Dobb B=4"))
    # mean 1.80, sample std 0.0707, gap closure (2.0 - 1.8) / (2.0 - 1.5) = 40%, widths 32 / 128
    assert "1.800 ± 0.071" in row and "40%" in row and "32 / 128" in row and "-0.200 (beyond noise)" in row
    assert D.regenerate_text(new)[0] == new  # idempotent
    assert all(R.clean(r) for r in used[0][1])
    assert not R.clean({**recs[0], "provenance": {"git_rev": "abc", "git_dirty": True}})
    assert not R.clean({**recs[0], "provenance": {"git_rev": None, "git_dirty": False}})
    with pytest.raises(ValueError, match="no generator"):
        D.regenerate_text("<!-- table:nope -->\n<!-- /table -->")


def test_width_points_and_fp32_muon_reference():
    """penalty / gap = (Dobb B - Dobb B=1) / (AdamW - Muon) on seed means; Muon-fp32 stands in for Muon."""
    from dobb_bench import main_job, tables

    recs = [_record("AdamW", 2.2, s) for s in (0, 1)] + [_record("Muon-fp32", 1.6, s, optimizer="muon") for s in (0, 1)]
    recs += [_record("Dobb B=1", v, s, optimizer="dobb", hparams={"blocks": "1"}) for s, v in ((0, 1.7), (1, 1.8))]
    recs += [_record("Dobb B=8", v, s, optimizer="dobb", hparams={"blocks": "8"}) for s, v in ((0, 1.9), (1, 2.0))]
    (b1, w1, p1, *_), (b8, w8, p8, m8, _, n8) = main_job.width_points(recs)[128]
    assert (b1, w1, b8, w8, n8) == (1, 128, 8, 16, 2) and p1 == 0.0
    assert p8 == pytest.approx((1.95 - 1.75) / (2.2 - 1.6)) and m8 == pytest.approx(1.95)
    assert "| Dobb B=8 |" in tables.seeds_table(recs) and "42%" in tables.seeds_table(recs)  # (2.2-1.95)/0.6


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
