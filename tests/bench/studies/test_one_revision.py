"""dobb_bench.studies.one_revision (table:one-revision) on hand records: only this study's runs
(folders ``rev-*``) are read, the lr is chosen by the one rule, gaps to Muon are paired by seed with
the frontier's verdict, an unsettled lr marks the gap provisional, and the revision, host and
numerics digest are named under the table."""
import os

import pytest

from dobb_bench.studies import one_revision as O
from dobb_bench.studies.runs_folder import RunsFolder

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

    def use(reevals, runs, frontier=(), amd=(), hk=(), training=()):
        """This study's re-evaluations and records; table:frontier-20's re-evaluations, study
        one-revision-amd's and host-check's (the second host kind), and their training records."""
        monkeypatch.setattr(O, "reeval_records", lambda: reevals)
        monkeypatch.setattr(O, "_records", lambda: runs)
        monkeypatch.setattr(O.R, "reeval_records", lambda: list(frontier))
        files = {O.AMD_REEVAL: list(amd), O.HK_REEVAL: list(hk)}
        monkeypatch.setattr(O, "jsonl", lambda path: next((v for k, v in files.items() if path.parts[-1] == k[-1]), []))
        monkeypatch.setattr(O, "_training_records", lambda study: list(training) if study == "long-horizon" else [])
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


AMD = {"cpu": "AMD EPYC", "bf16_flags": ["avx512_bf16"]}
BP = "MuonBP R=4 P=10"


def _amd(run, lr, seed, common, folder="lh", rev="a94277a50d"):
    r = _re(run, lr, seed, common, folder=folder)
    r["provenance"] = {"git_rev": rev, "git_dirty": False, "machine": AMD}
    return r


def test_the_second_host_kind_counts_equal_revisions_and_pairs_with_muon_there(hand):
    """table:frontier-20's FR rows on the AMD host kind: runs at a94277a (whose numbers equal 57db80f's
    there) and study one-revision-amd's at 57db80f count; a run at another revision or on another host
    kind does not; gaps pair with host-check's Muon runs on that host kind, never with the Intel ones."""
    a, c = 0.00354, 0.005
    intel_muon = [_re("Muon", a, s, 1.300) for s in (0, 1, 2)] + [_re("Muon", x, 0, 1.32) for x in (0.0025, c)]
    frontier = [_amd(BP, x, 0, v) for x, v in ((a, 1.290), (c, 1.274), (0.00707, 1.284))]
    frontier += [_amd(BP, c, s, v) for s, v in ((1, 1.278), (2, 1.281))]
    frontier += [_amd(BP, c, 3, 0.9, rev="1658d62aaa"),  # another revision: left out
                 dict(_amd(BP, c, 4, 0.9), provenance={"git_rev": "a94277a50d", "machine": {"cpu": "Intel(R) Xeon(R)"}})]
    amd = [_amd("DASH 32", 0.00707, 0, 1.330, folder="ra", rev="57db80f37c")]
    frontier += [_amd("DASH 32", x, 0, v) for x, v in ((0.0025, 1.328), (c, 1.325))]
    hk = [_amd("Muon", a, s, v, folder="hk", rev="57db80f37c") for s, v in ((0, 1.286), (1, 1.285), (2, 1.280))]
    amd += [_amd("Muon", a, 3, 1.290, folder="ra", rev="57db80f37c")]  # seed 3 from one-revision-amd-seeds
    hand(intel_muon, [], frontier=frontier, amd=amd, hk=hk)
    text, used = O.one_revision()
    row = next(x for x in text.splitlines() if x.startswith(f"| {BP} |"))
    assert "1.274 (s0), 1.278 (s1), 1.281 (s2) | 1.278 ± 0.004 (3)" in row  # neither 0.9 run
    # paired with the AMD Muon runs: -0.012, -0.007, +0.001 (against Intel's 1.300 it would be -0.022...)
    assert "-0.006 (-0.012, -0.007, +0.001), within noise" in row
    dash = next(x for x in text.splitlines() if x.startswith("| DASH 32 |"))
    assert "0.00707: 1.330" in dash  # the rule's run at 57db80f counts beside a94277a's
    assert "*AMD EPYC (avx512_bf16): runs at a94277a, 57db80f; gaps to Muon's runs there (studies host-check and one-revision-amd-seeds, seeds 0, 1, 2, 3)*" in text
    assert all(r["common_val_loss"] != 0.9 for r in used)
    assert "Intel(R) Xeon(R)" in text and "AMD EPYC (avx512_bf16)" in text


def test_collect_reevals_takes_its_own_kind_only(monkeypatch, tmp_path):
    """A label with a slash runs in a flat folder (``ra-Dion214pershardR4-j2-s0``), so the
    re-evaluation's folder name tells the kinds apart: the study's own run is collected, another's not."""
    import json
    monkeypatch.setattr(O.R, "DOCS", tmp_path / "docs")
    runs = tmp_path / "runs"
    rf = RunsFolder(str(runs))
    ra, lh = (rf.out_dir(k, "Dion2 1/4 per shard R=4", j, 0) for k, j in (("ra", 2), ("lh", 3)))
    assert "/" not in ra[len(str(runs)) + 1:] and os.path.basename(ra) == "ra-Dion214pershardR4-j2-s0"
    lines = [dict(_re("Dion2 1/4 per shard R=4", 0.01, 0, 1.36), run_dir=os.path.basename(ra)),
             dict(_re("Dion2 1/4 per shard R=4", 0.0141, 0, 1.36), run_dir=os.path.basename(lh))]
    runs.mkdir()
    (runs / "reeval-scratch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert O.collect_reevals_amd(str(runs)) == 1
    assert [r["lr"] for r in O.jsonl(tmp_path / "docs" / "results" / "checks" / "reeval-windows" / "one-revision-amd.jsonl")] == [0.01]


def test_runs_folder_reads_a_nested_runs_record_as_its_own_kind_only(tmp_path):
    """The committed re-evaluations of runs made while a slash nested the folder name the folder's
    path (``lh-Dion21/4pershardR4-j3-s0``): the lh run reads as finished, the ra run of the same
    grid point does not."""
    import json
    rec = tmp_path / "reeval.jsonl"
    rec.write_text(json.dumps(dict(_re("Dion2 1/4 per shard R=4", 0.0141, 0, 1.36), run_dir="lh-Dion21/4pershardR4-j3-s0",
                                   logged_val_loss=1.37)) + "\n")
    rf = RunsFolder(str(tmp_path / "runs"), [str(rec)])
    assert rf.loss("lh", "Dion2 1/4 per shard R=4", 3, 0) == 1.37
    assert rf.loss("ra", "Dion2 1/4 per shard R=4", 3, 0) is None
