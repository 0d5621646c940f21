"""dobb_bench.studies.shard_local: the zero-communication frontier's best-lr rule and cost columns,
against hand-computed values."""
import pytest

from dobb_bench.studies import shard_local as S

MN = 4 * 768 * 768 + 2 * 3072 * 768  # GPT-2 Small layer 0: four 768 x 768, MLP in and out


def _rec(loss, diverged=False):
    return {"final_val_loss": loss, "diverged": diverged}


def test_best_lr_is_the_seed0_minimum_and_says_whether_it_is_bracketed():
    runs = {(0.01, 0): _rec(1.7), (0.02, 0): _rec(1.6), (0.04, 0): _rec(1.65), (0.02, 1): _rec(1.0)}
    assert S.best_lr(runs) == (0.02, True, [0.01, 0.02, 0.04])
    edge = {(0.01, 0): _rec(1.7), (0.02, 0): _rec(1.6), (0.04, 0): _rec(2.0, diverged=True)}
    assert S.best_lr(edge) == (0.02, False, [0.01, 0.02])  # a diverged lr is not a bracket
    assert S.best_lr({}) == (None, False, [])


def test_communication_hand_values():
    assert S.communication("adamw") == (0.0, "none")
    assert S.communication("block-muon:axis=0:blocks=4") == (0.0, "none")
    assert S.communication("dion2:select=shard:blocks=4") == (0.0, "none")
    # Dobb B=4: the statistic mean of 4 diagonal blocks per matrix, every 9 steps, fp32
    stat = 5 * 4 * 192 ** 2 + 4 * 768 ** 2
    assert S.communication("dobb:blocks=4") == (pytest.approx(4 * stat / 9), "periodic")
    # MuonBP: the owner's full step (shards there and back, 2 mn) every P-th step
    assert S.communication("muonbp:blocks=4:period=5") == (pytest.approx(4 * 2 * MN / 5), "periodic")
    # owner-compute Muon: 2 mn every step; row blocks under Shard(1) span every shard: mn every step
    assert S.communication(S.OWNER) == (pytest.approx(4 * 2 * MN), "every step")
    assert S.communication("block-muon:axis=0:blocks=4", "input") == (pytest.approx(4 * MN), "every step")


def test_state_per_parameter_hand_values():
    assert S.state_per_param("adamw") == pytest.approx(8.0)  # two fp32 moments
    assert S.state_per_param(S.OWNER) == pytest.approx(4.0)  # fp32 momentum
    # Dobb B=4: momentum plus 6 k^2/B bytes of fp32 statistic and bf16 basis per matrix
    extra = 5 * 6 * 768 ** 2 / 4 + 6 * 3072 ** 2 / 4
    assert S.state_per_param("dobb:blocks=4") == pytest.approx(4.0 + extra / MN)


def test_communication_tells_periodic_from_every_step():
    # columns sharded: Dobb B=1's one block spans every shard (gathered each step); SPlus Bo=4's whole
    # input basis likewise; MuonBP's blocks follow the shards, so only its full step communicates
    assert S.communication("dobb:blocks=1", "input")[1] == "every step"
    assert S.communication("splus:out_blocks=4", "input")[1] == "every step"
    assert S.communication("splus:out_blocks=4", "output")[1] == "periodic"
    assert S.communication("muonbp:blocks=4:period=5", "input")[1] == "periodic"
    assert S.communication("dash:block_size=32", "input") == (0.0, "none")


def test_paired_gap_is_a_paired_t_test():
    """Seed-by-seed gaps; beyond noise when |mean| exceeds t(n-1) standard errors (4.303 at 3 seeds):
    a steady small gap is beyond, a larger but erratic one within, and unpaired seeds are skipped."""
    mean, d, beyond = S.paired_gap([1.026, 1.033, 1.015], [1.0, 1.0, 1.0])
    assert d == pytest.approx([0.026, 0.033, 0.015]) and mean == pytest.approx(0.074 / 3) and beyond
    mean, d, beyond = S.paired_gap([1.005, 1.049, 1.047], [1.0, 1.0, 1.0])  # t = 2.4 < 4.303
    assert mean == pytest.approx(0.101 / 3) and not beyond
    assert S.paired_gap([1.1, None, 1.2], [1.0, 1.0, None]) is None  # one seed in common
    assert S.paired_text([1.1, 1.2], [1.0, 1.0]) == ("+0.150 (+0.100 / +0.200), within noise "
                                                     "(same sign at every seed)")  # t(1) = 12.7
    assert S.paired_text([1.1, 0.9], [1.0, 1.0]) == "+0.000 (+0.100 / -0.100), within noise"


def test_the_reading_names_the_lowest_row_that_sends_nothing():
    """MuonBP's full steps are periodic traffic: a lower MuonBP row is named apart, never as the
    lowest zero-communication row (issue 39 item 6)."""
    from dobb_bench.studies import shard_local as S

    results = {"Row-block Muon R=4": (1.609, 0.040, 3), "MuonBP R=4 P=5": (1.608, 0.031, 3),
               "Dobb B=4": (1.801, 0.038, 3), "DASH, 32 x 32 tiles": (1.762, 0.036, 3)}
    text = S._reading(results)
    assert text.startswith("\nLowest row with no step communication: **Row-block Muon R=4** (1.609). "
                           "Lowest of the group, periodic communication included: MuonBP R=4 P=5 (1.608; periodic, ")
    assert "MuonBP R=4 P=5 -0.001 (within noise)" in text and "DASH, 32 x 32 tiles +0.153" in text
    results["MuonBP R=4 P=5"] = (1.700, 0.031, 3)
    assert "Lowest of the group" not in S._reading(results)
