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


def test_pareto_keeps_rows_no_other_row_beats_on_both():
    pts = {"cheap": (1.30, 0.1), "mid": (1.28, 0.5), "dear": (1.27, 1.0), "bad": (1.29, 0.6)}
    assert F.pareto(pts) == {"cheap", "mid", "dear"}


def test_frontier_table_from_hand_records(monkeypatch):
    recs = [_re("Muon", 0.005, 0, 1.30), _re("Muon", 0.00354, 0, 1.28), _re("Muon", 0.0025, 0, 1.29),
            _re("Muon", 0.00354, 1, 1.27), _re("Muon", 0.00354, 2, 1.26),
            _re("Muon", 0.005, 1, 1.0),  # another lr's seed: not Muon's
            _re("Row-block Muon R=4", 0.005, 0, 1.27), _re("Row-block Muon R=4", 0.00707, 0, 1.275),
            _re("Row-block Muon R=4", 0.005, 1, 1.26), _re("Row-block Muon R=4", 0.005, 2, 1.25)]
    monkeypatch.setattr(F.LH, "reeval_records", lambda: recs)
    runs = [_run("Row-block Muon R=4", 0.005, s, 1.0, 2.0 + s) for s in (0, 1)]
    monkeypatch.setattr(F.R, "load", lambda study: runs)
    text, used = F.frontier_20()
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in text.splitlines()
                              if line.startswith("| "))}
    rb = rows["Row-block Muon R=4"]
    assert rb[2] == "0.005: 1.270, 0.00707: 1.275" and rb[3] == "0.005 (edge)"
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


def test_choose_takes_a_close_neighbour_on_the_mean_of_seeds_0_and_1():
    """The driver's rule (define.chosen_j): a neighbour within two window standard errors of the
    seed-0 best is chosen when its mean over seeds 0 and 1 is lower; a far neighbour is not."""
    def rec(lr, seed, common, spread):
        r = _re("R", lr, seed, common)
        r["common_groups"] = [common + e for e in spread]
        return r
    noisy = [0.01, -0.01, 0.02, -0.02]  # groups differ by a noisy amount: the 0.001 gap is within it
    by_lr = {0.0025: {0: rec(0.0025, 0, 1.30, noisy)},
             0.00354: {0: rec(0.00354, 0, 1.276, noisy), 1: rec(0.00354, 1, 1.280, noisy)},
             0.005: {0: rec(0.005, 0, 1.277, [0.0, 0.0, 0.0, 0.0]), 1: rec(0.005, 1, 1.278, noisy)},
             0.00707: {0: rec(0.00707, 0, 1.29, noisy)}}
    assert F.choose(by_lr) == (0.005, True)  # 1.2775 against 1.278 over seeds 0 and 1
    del by_lr[0.005][1]
    assert F.choose(by_lr) == (0.00354, True)  # no seed 1 at the neighbour yet: the seed-0 best
    far = {k: {s: dict(v, common_groups=[v["common_val_loss"]] * 4) for s, v in d.items()} for k, d in by_lr.items()}
    far[0.005][1] = rec(0.005, 1, 1.0, [0.0] * 4)
    assert F.choose(far) == (0.00354, True)  # a neighbour worse beyond the window noise is not close
