"""dobb_bench.studies.main_job: the muon-variants table (each row's best seed-0 lr, every seed at
that lr, the difference from Muon-fp32 at *its* best lr under the project's noise rule;
hand-computed numbers) and the block-width points."""
import pytest

from dobb_bench.studies import main_job


def _rec(run, lr, seed, loss):
    return {"run": run, "optimizer": "muon", "hparams": {}, "lr": lr, "seed": seed, "steps": 10,
            "final_val_loss": loss, "diverged": False, "model": {"width": 128, "layers": 2, "seq_len": 8},
            "train": {"batch_size": 4, "micro_batches": 1}, "corpus": {"name": "c"},
            "provenance": {"git_rev": "abc1234", "git_dirty": False, "machine": {}}}


def test_best_lr_seeds_and_difference_from_muon_at_its_own_best():
    recs = [_rec("Muon-fp32", 1e-3, 0, 2.0), _rec("Muon-fp32", 2e-3, 0, 1.8),
            _rec("Muon-fp32", 2e-3, 1, 1.9), _rec("Muon-fp32", 1e-3, 1, 1.0),  # seed 1 never picks the lr
            _rec("SAMuon-fp32", 1e-3, 0, 1.5), _rec("SAMuon-fp32", 2e-3, 0, 1.7),
            _rec("SAMuon-fp32", 1e-3, 1, 1.6), _rec("SAMuon-fp32", 1e-3, 2, 1.7)]
    text = main_job.variants_table(recs)
    muon = next(x for x in text.splitlines() if x.startswith("| Muon-fp32"))
    sam = next(x for x in text.splitlines() if x.startswith("| SAMuon-fp32"))
    assert "| **1.800** | 0.002 (edge) | 0,1 | 1.850 ± 0.071 | — |" in muon  # best at an end of its two lrs
    # SAMuon at 1e-3: mean 1.6, std 0.1; Muon at 2e-3: 1.85; -0.25 against 2 x 0.1 = 0.2: beyond noise
    assert "| **1.500** | 1.700 | 0.001 (edge) | 0,1,2 | 1.600 ± 0.100 | -0.250 (beyond noise) |" in sam


def _record(run, loss, seed=0, dirty=False, optimizer="adamw", hparams=None):
    return {"run": run, "optimizer": optimizer, "hparams": hparams or {}, "lr": 1e-3, "seed": seed,
            "steps": 10, "final_val_loss": loss, "diverged": False, "model": {"width": 128, "layers": 2},
            "train": {"batch_size": 4, "micro_batches": 1}, "corpus": {"name": "c"},
            "provenance": {"git_rev": "abc1234", "git_dirty": dirty, "machine": {}}}


def test_width_points_and_fp32_muon_reference():
    """penalty / gap = (Dobb B - Dobb B=1) / (AdamW - Muon) on seed means; Muon-fp32 stands in for Muon."""
    from dobb_bench.reports import tables
    from dobb_bench.studies import main_job

    recs = [_record("AdamW", 2.2, s) for s in (0, 1)] + [_record("Muon-fp32", 1.6, s, optimizer="muon") for s in (0, 1)]
    recs += [_record("Dobb B=1", v, s, optimizer="dobb", hparams={"blocks": "1"}) for s, v in ((0, 1.7), (1, 1.8))]
    recs += [_record("Dobb B=8", v, s, optimizer="dobb", hparams={"blocks": "8"}) for s, v in ((0, 1.9), (1, 2.0))]
    (b1, w1, p1, *_), (b8, w8, p8, m8, _, n8) = main_job.width_points(recs)[128]
    assert (b1, w1, b8, w8, n8) == (1, 128, 8, 16, 2) and p1 == 0.0
    assert p8 == pytest.approx((1.95 - 1.75) / (2.2 - 1.6)) and m8 == pytest.approx(1.95)
    assert "| Dobb B=8 |" in tables.seeds_table(recs) and "42%" in tables.seeds_table(recs)  # (2.2-1.95)/0.6
