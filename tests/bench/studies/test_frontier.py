"""dobb_bench.studies.frontier (table:frontier-20) on hand records: the lr chosen at seed 0 on the
common windows, the seed-paired gap to Muon with its t-test over every seed and over the seeds that
did not choose the lr, the weight-norm columns, and the loss / step frontier; and the committed
record's norm fields (records.compact)."""
import json

import pytest

from dobb_bench.reports import records as R
from dobb_bench.studies import frontier as F


def _re(run, lr, seed, common):
    return {"run": run, "seed": seed, "lr": lr, "steps": 8300, "checkpoint_step": 8000, "model": {"width": 128},
            "own_val_loss": common, "common_val_loss": common, "common_groups": [common] * 4,
            "run_git_rev": "197e872aa", "provenance": {"git_rev": "e1d94e4bb", "git_dirty": False}}


def _run(run, lr, seed, first, last):
    return {"run": run, "lr": lr, "seed": seed, "steps": 8300, "model": {"layers": 2, "width": 128},
            "norms_by_matrix": {"a": [[0, 0.02, first], [4000, 0.03, (first + last) / 2], [8300, 0.04, last]],
                                "b": [[0, 0.02, 1.0], [4000, 0.02, 1.0], [8300, 0.02, 1.0]]}}


def test_verdict_repeats_the_test_on_the_seeds_that_did_not_choose_the_lr():
    # every seed: mean -0.01667, se 0.0024, t = 6.9 > t(2) 4.303 -> beyond; seeds 1, 2 alone: mean
    # -0.015, se 0.003, t = 5.0 < t(1) 12.706 -> not
    mean, text = F.verdict({0: -0.020, 1: -0.018, 2: -0.012})
    assert mean == pytest.approx(-0.05 / 3) and text.startswith("beyond noise only with seed 0")
    assert "t = -6.9" in text and "t = -5.0" in text
    mean, text = F.verdict({0: -0.0200, 1: -0.0201, 2: -0.0200})
    assert text.startswith("beyond noise (")  # the later seeds alone agree closely enough
    assert F.verdict({0: -0.02, 1: 0.01, 2: -0.005})[1].startswith("within noise")
    assert F.verdict({0: -0.02, 1: -0.01})[1] == "2 seeds: no verdict"


def test_verdict_has_words_for_a_lead_on_the_later_seeds_only():
    # every seed: mean +0.00443, se 0.0032 -> t = 1.4 (within); seeds 1, 2: +0.0075, +0.0078 ->
    # t = 51 > 12.706 (beyond): SPlus's case in issue 55
    mean, text = F.verdict({0: -0.002, 1: 0.0075, 2: 0.0078})
    assert text.startswith("beyond noise on the seeds that did not choose the lr only (t = 1.4; seeds 1+ alone t = 51.0)")


def _seeds(*vals):
    return dict(enumerate(vals))


def test_pareto_keeps_rows_no_other_row_beats_on_both_beyond_noise():
    pts = {"cheap": (_seeds(1.30, 1.31, 1.29), 0.1), "mid": (_seeds(1.28, 1.29, 1.27), 0.5),
           "dear": (_seeds(1.27, 1.28, 1.26), 1.0), "bad": (_seeds(1.29, 1.30, 1.28), 0.6)}
    assert F.pareto(pts) == {"cheap", "mid", "dear"}  # "bad": mid is cheaper and lower at every seed by 0.01
    # a row cheaper by less than the timing spread does not push another off
    assert F.pareto(pts, spread=0.25) == {"cheap", "mid", "dear", "bad"}
    # with one run's ranges: mid's slowest repeat (0.58) is faster than bad's fastest (0.59): bad goes;
    # overlapping ranges keep it
    rng = {"cheap": (0.08, 0.12), "mid": (0.45, 0.58), "dear": (0.9, 1.1), "bad": (0.59, 0.62)}
    assert F.pareto(pts, ranges=rng) == {"cheap", "mid", "dear"}
    assert F.pareto(pts, ranges={**rng, "bad": (0.55, 0.65)}) == {"cheap", "mid", "dear", "bad"}
    # lower at the mean but within paired noise: level, both stay (the old rule dropped "tie")
    pts = {"a": (_seeds(1.280, 1.290, 1.270), 0.3), "tie": (_seeds(1.279, 1.295, 1.268), 0.5)}
    assert F.pareto(pts) == {"a", "tie"} and F.level(pts, "a", "tie")
    assert not F.level({"x": (_seeds(1.0, 1.1, 1.2), 1), "y": (_seeds(1.01, 1.11, 1.21), 1)}, "x", "y")


def test_timing_spread_is_measured_between_the_committed_timing_records():
    spread, twice = F.timing_spread()
    got = dict((k, v) for k, v in twice)
    assert sorted(got["dobb:blocks=1"]) == pytest.approx([0.874, 0.968], abs=5e-4)
    assert spread == pytest.approx(max(max(v) / min(v) - 1 for v in got.values()))
    assert 0.09 < spread < 0.12 and "splus:out_blocks=4" not in got  # fsdp4-splus times a cycle, not a step


def test_frontier_table_from_hand_records(monkeypatch):
    recs = [_re("Muon", 0.005, 0, 1.30), _re("Muon", 0.00354, 0, 1.28), _re("Muon", 0.0025, 0, 1.29),
            _re("Muon", 0.00354, 1, 1.27), _re("Muon", 0.00354, 2, 1.26),
            _re("Muon", 0.005, 1, 1.0),  # another lr's seed: not Muon's
            _re("Row-block Muon R=4", 0.005, 0, 1.27), _re("Row-block Muon R=4", 0.00707, 0, 1.275),
            _re("Row-block Muon R=4", 0.005, 1, 1.26), _re("Row-block Muon R=4", 0.005, 2, 1.25)]
    monkeypatch.setattr(F.LH, "reeval_records", lambda: recs)
    monkeypatch.setattr(F.LH, "amd_rule_runs", lambda: [])  # the committed AMD runs are not these rows'
    runs = [_run("Row-block Muon R=4", 0.005, s, 1.0, 2.0 + s) for s in (0, 1)]
    monkeypatch.setattr(F.R, "load", lambda study: runs)
    text, used = F.frontier_20()
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in text.splitlines()
                              if line.startswith("| "))}
    rb = rows["Row-block Muon R=4"]
    assert rb[2] == "0.005: 1.270, 0.00707: 1.275" and rb[3] == "0.005 (edge) (lr not settled: needs 0.00354 seed 0)"
    assert rb[4] == "1.270 (s0), 1.260 (s1), 1.250 (s2)" and rb[5] == "1.260 ± 0.010 (3)"
    # gaps -0.01 at every seed: sd 0 -> beyond, on the later seeds too
    assert rb[6].startswith("-0.010 (-0.010, -0.010, -0.010), beyond noise (")
    # norms: largest top singular value 2.0 and 3.0 -> 2.5; growth max(2/1, 1) and 3/1 -> 2.5x;
    # end / halfway: 2/1.5 and 3/2 -> mean 1.417
    assert rb[10] == "2.50" and rb[11] == "2.50x (1.42x)"
    mu = rows["Muon"]
    assert mu[3] == "0.00354" and mu[4] == "1.280 (s0), 1.270 (s1), 1.260 (s2)" and mu[6] == ""
    assert rows["Dobb B=4"][2] == "not run yet"
    assert "1 rows were compared with Muon" in text
    assert any(r["run"] == "Row-block Muon R=4" and r.get("seed") == 2 for r in used)


def test_compact_keeps_norms_and_the_raw_curve():
    ev = lambda step, a, b: {"type": "eval", "step": step, "val_loss": 2.0, "eval_weights": "iterate-ema",
                             "val_loss_raw": 2.5,
                             "weight_norms": {"matrices": {"m": [a, b]}, "max_rms": a, "max_top_sv": b}}
    evals = [ev(0, 0.1, 1.0), ev(10, 0.2, 2.0), ev(20, 0.3, 4.0)]
    rec = R.compact({"run": "x", "train_losses": [1.0] * 20, "train": {"seed": 0}}, evals)
    assert rec["norm_curve"] == [[0, 0.1, 1.0], [10, 0.2, 2.0], [20, 0.3, 4.0]]
    assert rec["norms_by_matrix"] == {"m": [[0, 0.1, 1.0], [10, 0.2, 2.0], [20, 0.3, 4.0]]}
    assert rec["raw_curve"] == [[0, 2.5], [10, 2.5], [20, 2.5]]
    json.dumps(rec)
    plain = R.compact({"run": "y", "train": {"seed": 0}}, [{"type": "eval", "step": 0, "val_loss": 2.0}])
    assert "norm_curve" not in plain and "raw_curve" not in plain


def _rec(lr, seed, common, spread, run="R"):
    r = _re(run, lr, seed, common)
    r["common_groups"] = [common + e for e in spread]
    return r


NOISY = [0.01, -0.01, 0.02, -0.02]  # groups differ by a noisy amount: gaps of 0.001-0.002 are within it
STEADY = [0.0, 0.0, 0.0, 0.0]


def _old_choose(by_lr):
    """The rule before issue 55 (for the tests that show where the new one differs): the seed-0
    best, or its close neighbours' lowest mean over seeds 0 and 1 once all have seed 1, with the
    bracketing of the seed-0 best."""
    import math
    from dobb_bench.reports.tables import paired
    from dobb_bench.studies.define import best_of
    best, bracketed = best_of((lr, s[0]["common_val_loss"]) for lr, s in by_lr.items() if 0 in s)
    ref = by_lr[best][0]["common_groups"]
    cands = [best] + [lr for lr in by_lr if lr != best and 0 in by_lr[lr] and abs(math.log2(lr / best)) < 0.51
                      and (g := paired(by_lr[lr][0]["common_groups"], ref)) and g[0] < 2 * g[1]]
    if len(cands) == 1 or any(1 not in by_lr[lr] for lr in cands):
        return best, bracketed
    means = [(by_lr[lr][0]["common_val_loss"] + by_lr[lr][1]["common_val_loss"]) / 2 for lr in cands]
    return cands[means.index(min(means))], bracketed


def test_choose_takes_a_close_neighbour_on_the_mean_of_seeds_0_and_1():
    """A neighbour within two window standard errors of the seed-0 best is chosen when its mean over
    seeds 0 and 1 is lower beyond the window noise; a far neighbour is not close."""
    by_lr = {0.0025: {0: _rec(0.0025, 0, 1.30, NOISY)},
             0.00354: {0: _rec(0.00354, 0, 1.276, NOISY), 1: _rec(0.00354, 1, 1.300, STEADY)},
             0.005: {0: _rec(0.005, 0, 1.277, STEADY), 1: _rec(0.005, 1, 1.278, STEADY)},
             0.00707: {0: _rec(0.00707, 0, 1.29, NOISY)}}
    got = F.choose(by_lr)  # 1.2775 against 1.288 over seeds 0 and 1, beyond the window noise of the mean
    assert (got.lr, got.edge, got.needs, got.settled, got.how) == (0.005, False, (), True, "seeds 0+1")
    far = {k: {s: dict(v, common_groups=[v["common_val_loss"]] * 4) for s, v in d.items()} for k, d in by_lr.items()}
    del far[0.005][1]
    assert F.choose(far).lr == 0.00354 and F.choose(far).settled  # worse beyond the window noise: not close


def test_the_new_rule_marks_what_the_old_one_kept_silently():
    """Synthetic records on which the rule before issue 55 and the one rule choose differently."""
    # (1) a close neighbour without seed 1: the old rule silently kept the seed-0 best
    by_lr = {0.0025: {0: _rec(0.0025, 0, 1.30, NOISY)},
             0.00354: {0: _rec(0.00354, 0, 1.276, NOISY), 1: _rec(0.00354, 1, 1.28, NOISY)},
             0.005: {0: _rec(0.005, 0, 1.277, STEADY)},
             0.00707: {0: _rec(0.00707, 0, 1.29, NOISY)}}
    assert _old_choose(by_lr) == (0.00354, True)
    got = F.choose(by_lr)
    assert got.lr == 0.00354 and not got.settled and got.needs == ((0.005, 1),)
    assert got.cell() == "0.00354 (lr not settled: needs 0.005 seed 1)"
    # (2) a tie within the window noise on seeds 0+1 (1.2781041 against 1.2781054): seed 2 at both decides
    tie = {0.0025: {0: _rec(0.0025, 0, 1.30, NOISY)},
           0.00354: {0: _rec(0.00354, 0, 1.2760, NOISY), 1: _rec(0.00354, 1, 1.2802108, NOISY),
                     2: _rec(0.00354, 2, 1.2700, NOISY)},
           0.005: {0: _rec(0.005, 0, 1.2770, STEADY), 1: _rec(0.005, 1, 1.2792082, STEADY)},
           0.00707: {0: _rec(0.00707, 0, 1.29, NOISY)}}
    assert _old_choose(tie) == (0.005, True)  # the lower mean by 1.3e-6
    got = F.choose(tie)
    assert (got.lr, got.needs) == (0.005, ((0.005, 2),)) and "needs 0.005 seed 2" in got.cell()
    tie[0.005][2] = _rec(0.005, 2, 1.2830, STEADY)
    got = F.choose(tie)  # seeds 0-2: 1.2754 at 0.00354 against 1.2797 at 0.005
    assert (got.lr, got.settled, got.how) == (0.00354, True, "seed 2")
    # (3) the lr chosen on seeds 0+1 is the highest run: an edge, though the seed-0 best is bracketed
    edge = {0.001768: {0: _rec(0.001768, 0, 1.344, STEADY)},
            0.0025: {0: _rec(0.0025, 0, 1.325, NOISY), 1: _rec(0.0025, 1, 1.330, STEADY)},
            0.003536: {0: _rec(0.003536, 0, 1.327, STEADY), 1: _rec(0.003536, 1, 1.308, STEADY)}}
    assert _old_choose(edge) == (0.003536, True)
    got = F.choose(edge)  # 1.3175 against 1.3275 over seeds 0 and 1: beyond the window noise, no tie
    assert (got.lr, got.edge, got.needs) == (0.003536, True, ((0.005, 0),))
    assert got.cell() == "0.00354 (edge) (lr not settled: needs 0.005 seed 0)"


def test_steps_from_one_timing_run_with_their_range(monkeypatch, tmp_path):
    """With the one timing run committed, every row's step is its ratio there, with its range over
    the repeats, and the frontier's timing spread is the widest of those ranges (AdamW's step, at
    the timer's resolution, sets none)."""
    rb, owner = "block-muon:axis=0:blocks=4:ns_dtype=float32", F.OWNER
    run = {"kind": "run", "config": {"repeats": 5},
           "ratio_matrix": {rb: {owner: 0.40}, owner: {owner: 1.0}, "torch-adamw": {owner: 0.01}},
           "ratio_range": {rb: {owner: [0.38, 0.45]}, owner: {owner: [1.0, 1.0]}, "torch-adamw": {owner: [0.005, 0.02]}}}
    path = tmp_path / "results" / F.ONE_RUN
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run) + "\n")
    monkeypatch.setattr(F.R, "DOCS", tmp_path)
    timed = F.one_run()
    assert timed["ratios"][rb] == 0.40 and timed["ranges"][rb] == (0.38, 0.45) and timed["repeats"] == 5
    spread, widest = F.one_run_spread(timed)
    assert spread == pytest.approx(0.45 / 0.38 - 1) and widest == rb
    assert F.one_run_spread(timed, {owner}) == (0.0, "")  # only the specs asked for
    recs = [_re("Muon", 0.00354, s, 1.28) for s in (0, 1, 2)] + [_re("Row-block Muon R=4", 0.005, s, 1.27)
                                                                 for s in (0, 1, 2)]
    monkeypatch.setattr(F.LH, "reeval_records", lambda: recs)
    monkeypatch.setattr(F.R, "load", lambda study: [])
    text, _ = F.frontier_20()
    row = next(line for line in text.splitlines() if line.startswith("| Row-block Muon R=4 |"))
    assert "| 0.40 [0.38, 0.45] |" in row
    muon = next(line for line in text.splitlines() if line.startswith("| Muon |"))
    assert "| 1.00 |" in muon
    assert f"{F.ONE_RUN}` (median over 5 repeats" in text and "max / min - 1: 18%, " + rb + ")" in text
