"""The muon-variants study: its table (each row's best seed-0 lr, every seed at that lr, the
difference from Muon-fp32 at *its* best lr under the project's noise rule; hand-computed numbers)
and the bench passing the run's length to SAMuon."""
from dobb_bench import main_job


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
    assert "| **1.800** | 0.002 | 0,1 | 1.850 ± 0.071 | — |" in muon
    # SAMuon at 1e-3: mean 1.6, std 0.1; Muon at 2e-3: 1.85; -0.25 against 2 x 0.1 = 0.2: beyond noise
    assert "| **1.500** | 1.700 | 0.001 | 0,1,2 | 1.600 ± 0.100 | -0.250 (beyond noise) |" in sam


def test_the_bench_gives_samuon_the_runs_length():
    """A spec without total_steps gets the run's steps when the optimizer takes it; others unchanged."""
    from dobb_bench.commands_train import run_hparams
    from dobb_bench.specs import parse_spec

    assert run_hparams(parse_spec("samuon:gamma=4"), 800) == {"gamma": 4, "total_steps": 800}
    assert run_hparams(parse_spec("samuon-lite:total_steps=50"), 800) == {"total_steps": 50}
    assert run_hparams(parse_spec("muon:split_sizes=qkv"), 800) == {"split_sizes": "qkv"}
