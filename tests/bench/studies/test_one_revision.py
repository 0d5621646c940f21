"""dobb_bench.studies.one_revision (table:one-revision) on hand records: only this study's runs
(folders ``rev-*``) are read, the lr is chosen by the one rule, gaps to Muon are paired by seed with
the frontier's verdict, an unsettled lr marks the gap provisional, and the revision, host and
numerics digest are named under the table."""
import pytest

from dobb_bench.studies import one_revision as O

DOBB = "Dobb-Muon B=4 Bo=4 Nesterov"


def _re(run, lr, seed, common, folder="rev"):
    return {"run": run, "seed": seed, "lr": lr, "steps": 8300, "checkpoint_step": 8000, "model": {"width": 128},
            "common_val_loss": common, "common_groups": [common + 0.001 * k for k in range(4)],
            "run_dir": f"{folder}-{run.replace(' ', '')}-j0-s{seed}",
            "provenance": {"git_rev": "57db80f37c", "git_dirty": False, "machine": {"cpu": "Intel(R) Xeon(R)"}}}


def _run(run, lr, seed, top):
    return {"run": run, "lr": lr, "seed": seed, "steps": 8300,
            "provenance": {"git_rev": "57db80f37c", "git_dirty": False, "machine": {"cpu": "Intel(R) Xeon(R)"}},
            "norms_by_matrix": {"a": [[0, 0.02, 1.0], [4000, 0.03, top / 2], [8300, 0.04, top]]}}


@pytest.fixture
def hand(monkeypatch, tmp_path):
    (tmp_path / "results" / "checks" / "numerics-digest").mkdir(parents=True)
    (tmp_path / "results" / "checks" / "numerics-digest" / "57db80f.json").write_text("{}")
    monkeypatch.setattr(O.R, "DOCS", tmp_path)

    def use(reevals, runs):
        monkeypatch.setattr(O, "reeval_records", lambda: reevals)
        monkeypatch.setattr(O, "_records", lambda: runs)
    return use


def test_gap_paired_by_seed_at_each_rows_chosen_lr_and_only_this_studys_runs(hand):
    a, b, c = 0.00354, 0.0025, 0.005
    muon = [_re("Muon", a, 0, 1.300), _re("Muon", b, 0, 1.320), _re("Muon", c, 0, 1.330)]
    muon += [_re("Muon", a, s, v) for s, v in ((1, 1.310), (2, 1.290))]
    dobb = [_re(DOBB, c, 0, 1.290), _re(DOBB, a, 0, 1.320), _re(DOBB, 0.00707, 0, 1.330)]
    dobb += [_re(DOBB, c, s, v) for s, v in ((1, 1.301), (2, 1.280))]
    # another study's Muon run on the same setting (frontier-20's folders lh-*): never read here
    other = [_re("Muon", a, 0, 0.5, folder="lh")]
    hand(muon + dobb + other, [_run("Muon", a, s, 4.0) for s in (0, 1, 2)] + [_run(DOBB, c, 0, 6.0)])
    text, used = O.one_revision()
    muon_row = next(x for x in text.splitlines() if x.startswith("| Muon |"))
    assert "| 0.00354 |" in muon_row and "1.300 (s0), 1.310 (s1), 1.290 (s2)" in muon_row
    assert "0.5" not in muon_row  # the lh- run was left out
    dobb_row = next(x for x in text.splitlines() if x.startswith(f"| {DOBB} |"))
    # gaps -0.010, -0.009, -0.010 paired by seed: beyond noise over every seed
    assert "-0.010 (-0.010, -0.009, -0.010), beyond noise" in dobb_row
    assert "| 6.00 | 6.00x (2.00x) |" in dobb_row  # norms from its own records
    assert "| SOAP-Muon |" in text and "not run yet" in text
    assert "revision 57db80f" in text and "numerics-digest/57db80f.json" in text and "Intel(R) Xeon(R)" in text
    assert all(r.get("run_dir", "rev").startswith("rev") for r in used if "run_dir" in r)


def test_an_lr_at_an_edge_marks_the_gap_provisional(hand):
    muon = [_re("Muon", 0.00354, s, 1.30) for s in (0, 1, 2)]
    dobb = [_re(DOBB, 0.005, s, 1.29) for s in (0, 1, 2)]  # one lr run: an edge, needs the next out
    hand(muon + dobb, [])
    row = next(x for x in O.one_revision()[0].splitlines() if x.startswith(f"| {DOBB} |"))
    assert "lr not settled" in row and "provisional" in row


def test_collect_reevals_appends_this_studys_runs_once(monkeypatch, tmp_path):
    import json
    monkeypatch.setattr(O.R, "DOCS", tmp_path / "docs")
    runs = tmp_path / "runs"
    runs.mkdir()
    lines = [dict(_re("Muon", 0.00354, 0, 1.3), checkpoint_step=8000),
             dict(_re("Muon", 0.00354, 1, 1.3, folder="lh"), checkpoint_step=8000)]
    (runs / "reeval-scratch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert O.collect_reevals(str(runs)) == 1  # the lh- run is another study's
    assert O.collect_reevals(str(runs)) == 0  # each run once
    assert [r["seed"] for r in O.reeval_records()] == [0]


def test_steps_come_from_the_one_timing_run(hand, monkeypatch):
    """Each row's FSDP2 step is its ratio in the one timing run (Muon timed as owner-compute Muon,
    1.00 by definition), with its range over the repeats; "—" while the run is not committed."""
    muon = [_re("Muon", 0.00354, s, 1.30) for s in (0, 1, 2)]
    dobb = [_re(DOBB, 0.00354, s, 1.29) for s in (0, 1, 2)]
    hand(muon + dobb, [])
    assert "| — |" in next(x for x in O.one_revision()[0].splitlines() if x.startswith(f"| {DOBB} |"))
    spec = O.ONE_REV[1].spec
    monkeypatch.setattr(O, "one_run", lambda: {"ratios": {spec: 0.41, O.OWNER: 1.0}, "ranges": {spec: (0.39, 0.44)},
                                               "repeats": 5, "path": "docs/results/x.jsonl"})
    text = O.one_revision()[0]
    assert "| 0.41 [0.39, 0.44] |" in next(x for x in text.splitlines() if x.startswith(f"| {DOBB} |"))
    assert "| 1.00 |" in next(x for x in text.splitlines() if x.startswith("| Muon |"))
    assert "`docs/results/x.jsonl`, one timing run (median over 5 repeats" in text
