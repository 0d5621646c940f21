"""dobb_bench.reports.tables: the statistics and the noise rule every docs table states, against
hand-computed values on synthetic records (mean ± sample std; beyond noise only past 2 std of the
noisier row, 0.1 nats for a one-seed row; diverged runs count as seeds but carry no loss)."""
import math

import pytest

from dobb_bench.reports import tables as T


def _rec(run, seed, loss, diverged=False):
    return {"run": run, "optimizer": "adamw", "hparams": {}, "lr": 1e-3, "seed": seed, "steps": 10,
            "final_val_loss": loss, "diverged": diverged, "model": {"width": 64, "layers": 1, "seq_len": 8},
            "train": {"batch_size": 4, "micro_batches": 1}, "corpus": {"name": "c"},
            "provenance": {"git_rev": "abc1234", "git_dirty": False, "machine": {"cpu": "x"}}}


def test_stats_are_mean_and_sample_std_of_finite_values():
    m, s, n = T.stats([1.0, 2.0, 4.0, None, math.nan])
    assert n == 3 and m == pytest.approx(7 / 3)
    assert s == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert T.stats([2.5]) == (2.5, None, 1)
    m, s, n = T.stats([None])
    assert math.isnan(m) and (s, n) == (None, 0)
    assert T.fmt_ms(1.23456, 0.0456, 3) == "1.235 ± 0.046" and T.fmt_ms(1.5, None, 1) == "1.500"
    assert T.fmt_ms(math.nan, None, 0) == "diverged"


@pytest.mark.parametrize("a,b,bar", [(0.02, 0.05, 0.10), (0.08, 0.01, 0.16), (None, 0.03, 0.10), (None, 0.07, 0.14),
                                     (0.2, None, 0.4), (None, None, 0.1)])
def test_noise_is_two_std_of_the_noisier_row_with_a_one_seed_floor(a, b, bar):
    assert T.noise(a, b) == pytest.approx(bar)


def test_pairs_table_pairs_by_seed_and_applies_the_noise_rule():
    recs = [_rec("A", 0, 2.0), _rec("A", 1, 2.2), _rec("A", 2, 9.9),
            _rec("B", 0, 1.7), _rec("B", 1, 1.9), _rec("B", 3, 0.1),   # seeds 2 and 3 are unpaired
            _rec("C", 0, 2.05), _rec("C", 1, 2.25)]
    text, used = T.pairs_table(recs, [("A", "B"), ("A", "C"), ("A", "missing")], per_seed=True)
    rows = [x for x in text.splitlines() if x.startswith("| A |")]
    # A - B over seeds 0,1: 2.1 - 1.8 = +0.300; both std 0.141 -> bar 0.283: beyond
    assert rows[0] == "| A | B | 0,1 | 2.100 ± 0.141 | 1.800 ± 0.141 | +0.300 | beyond noise | +0.300, +0.300 |"
    assert rows[1] == "| A | C | 0,1 | 2.100 ± 0.141 | 2.150 ± 0.141 | -0.050 | within noise | -0.050, -0.050 |"
    assert len(rows) == 2  # no common seed with "missing": no row
    assert sorted((r["run"], r["seed"]) for r in used) == [("A", 0), ("A", 1), ("B", 0), ("B", 1), ("C", 0), ("C", 1)]


def test_seeds_table_counts_a_diverged_seed_without_a_loss():
    recs = [_rec("AdamW", 0, 2.0), _rec("AdamW", 1, 2.2), _rec("X", 0, 1.9), _rec("X", 1, None, diverged=True)]
    row = next(x for x in T.seeds_table(recs).splitlines() if x.startswith("| X |"))
    # one finite seed: 1.9 vs AdamW 2.1 ± 0.141 -> -0.200 against 2 x 0.141 = 0.283: within
    assert "| 0,1 | 1.900 |" in row and "-0.200 (within noise)" in row


def test_lr_grid_table_with_grid_seed_picks_the_best_lr_on_that_seed_alone():
    # Seed 0 is best at lr 2e-3 (1.50 < 1.60); seeds 1-2 exist only at 1e-3 and would pull its mean
    # to 1.40 < 1.50, which an all-seed grid would wrongly call best.
    recs = [dict(_rec("X", 0, 1.60), lr=1e-3), dict(_rec("X", 1, 1.30), lr=1e-3), dict(_rec("X", 2, 1.30), lr=1e-3),
            dict(_rec("X", 0, 1.50), lr=2e-3)]
    row = next(line for line in T.lr_grid_table(recs, grid_seed=0).splitlines() if line.startswith("| X "))
    assert row == "| X | 1.600 | **1.500** | 0.002 | 1.500 (1 seed) |"
    mixed = next(line for line in T.lr_grid_table(recs).splitlines() if line.startswith("| X "))
    assert mixed == "| X | **1.400 ± 0.173** | 1.500 | 0.001 |"
    recs.append(dict(_rec("X", 1, 1.46), lr=2e-3))
    row = next(line for line in T.lr_grid_table(recs, grid_seed=0).splitlines() if line.startswith("| X "))
    assert row.endswith("| 0.002 | 1.480 ± 0.028 (2 seeds) |")
