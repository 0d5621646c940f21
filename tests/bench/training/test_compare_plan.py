"""compare's default rows and expected duration (issue 53, item 10): the README's recommended rows
beside AdamW, Muon, Dion and Dobb, each at the best lr its committed records give, with the
hyperparameters those records ran; the expected duration within the main job's 10 minutes.

The reference is read here from ``docs/results/records/*.jsonl`` directly (json, no bench code):
each row's runs are picked by optimizer and exact stored hyperparameters, the best lr is the lowest
seed-0 final loss of the 800-step, width-128 runs."""
import json
from pathlib import Path

import pytest

from dobb_bench.cli import main
from dobb_bench.specs import parse_spec
from dobb_bench.training import compare_plan as P
from dobb_bench.training import row_settings as RS

RECORDS = Path(__file__).resolve().parents[3] / "docs" / "results" / "records"

# label: (optimizer, the hyperparameters the records store, the studies holding that row's lr grid)
REFERENCE = {
    "AdamW": ("adamw", {}, ("lr-grid", "own-lr")),
    "Muon": ("muon", {"ns_dtype": "torch.float32"}, ("own-lr",)),
    "Dion rho=1/16": ("dion", {"rank_fraction": "0.0625"}, ("own-lr",)),
    "Row-block Muon R=4": ("block-muon", {"axis": "0", "blocks": "4", "ns_dtype": "torch.float32"}, ("shard-local",)),
    "Dobb-Muon B=4 Bo=4": ("dobb-muon", {"blocks": "4", "out_blocks": "4", "ns_dtype": "torch.float32",
                                         "product_dtype": "torch.float32"}, ("dobb-forms",)),
    "MuonBP R=4 P=10": ("muonbp", {"axis": "0", "blocks": "4", "period": "10", "ns_dtype": "torch.float32"},
                        ("shard-local",)),
    "SOAP": ("soap", {}, ("family-soap",)),
    "Dobb B=1": ("dobb", {"blocks": "1"}, ("own-lr",)),
    "Dobb B=4": ("dobb", {"blocks": "4"}, ("own-lr",)),
}


def _records(study):
    return [json.loads(x) for x in (RECORDS / f"{study}.jsonl").read_text().splitlines() if x.strip()]


def _reference_best(label):
    name, hp, studies = REFERENCE[label]
    seed0 = {}
    for study in studies:
        for r in _records(study):
            m = r["model"]
            if (r["optimizer"] == name and r["hparams"] == hp and r["seed"] == 0 and r["steps"] == 800
                    and m["width"] == 128 and m["layers"] == 2 and r["final_val_loss"] is not None):
                seed0.setdefault(float(f"{r['lr']:.4g}"), r["final_val_loss"])
    assert len(seed0) >= 2, (label, seed0)  # a grid, not one lr
    return min(seed0, key=seed0.get), hp


def _default_specs():
    from dobb_bench.training.commands_train import split_specs

    return [parse_spec(s) for s in split_specs(P.DEFAULT_COMPARE)]


def test_the_default_rows_are_the_recommended_ones_beside_the_references():
    specs = _default_specs()
    assert [s.label for s in specs] == list(REFERENCE)
    names = {s.name for s in specs}
    # the README's recommended rows (row-block Muon, Dobb-Muon, MuonBP, SOAP) and the references
    assert {"block-muon", "dobb-muon", "muonbp", "soap", "adamw", "muon", "dion", "dobb"} == names
    rb = next(s for s in specs if s.name == "block-muon")
    assert rb.hparams == {"axis": 0, "blocks": 4}  # row blocks, as FSDP2 shards them
    dm = next(s for s in specs if s.name == "dobb-muon")
    assert dm.hparams == {"blocks": 4, "out_blocks": 4}  # its 20-tokens row's B=4 Bo=4


def test_each_default_row_runs_at_its_records_best_lr_with_their_hyperparameters():
    specs = _default_specs()
    lrs, source = RS.row_lrs(specs, None)
    for s in specs:
        best, hp = _reference_best(s.label)
        assert lrs[s.label] == pytest.approx(best, rel=1e-3), (s.label, lrs[s.label], best)
        assert source[s.label].startswith("recorded best"), (s.label, source[s.label])
        # the spec sets what those runs set (their dtype keys are the product-dtype rule's)
        assert {k: str(v) for k, v in s.hparams.items()} == {k: v for k, v in hp.items() if not k.endswith("_dtype")}


def test_a_row_without_a_recorded_lr_grid_is_no_default_and_is_announced():
    specs = _default_specs()
    assert all(RS.recorded_lr(s) is not None for s in specs)
    extra = [parse_spec("rmnp"), parse_spec("dion:rank_fraction=1/4")]
    _, source = RS.row_lrs(specs + extra, None)
    notes = P.shared_lr_warnings(specs + extra, source)
    assert len(notes) == 2 and "'RMNP' has no recorded lr grid" in notes[0] and "0.00354" in notes[0]


def _default_configs():
    from dobb_bench.training.model import config_from_preset
    from dobb_bench.training.train import TrainConfig

    model = config_from_preset("small-cpu", layers=2, seq_len=64, vocab_size=256)
    return model, TrainConfig(steps=800, batch_size=16, eval_every=50, eval_seqs=64)


def test_the_default_set_fits_ten_minutes_on_two_cores_by_the_records():
    model, train = _default_configs()
    specs = _default_specs()
    lrs, _ = RS.row_lrs(specs, None)
    jobs = [(s, lrs[s.label]) for s in specs]

    def no_probe(*a, **k):
        raise AssertionError("every default row has step records of this setting")

    est = P.estimate_jobs(jobs, model, train, no_probe)
    assert all(e.source.startswith("records:") for e in est)
    total = P.schedule(jobs, [e.seconds for e in est], 2)
    assert total <= P.BUDGET_S, total
    # independent: 800 steps x (the row's median optimizer step + the median rest) from the records
    soap = [r for r in _records("family-soap") + _records("shard-local")
            if r["optimizer"] == "soap" and r["hparams"] == {} and r["steps"] == 800]
    assert soap
    i = [s.label for s in specs].index("SOAP")
    opt = sorted(r["opt_ms_per_step"] for r in soap)
    assert est[i].source.startswith(f"records: {opt[len(opt) // 2] if len(opt) % 2 else (opt[len(opt) // 2 - 1] + opt[len(opt) // 2]) / 2:.1f} ms")


def test_the_schedule_follows_run_many():
    """Newton-Schulz rows first, each run to the first free slot; the longest slot is the duration."""
    a, m, d = parse_spec("adamw"), parse_spec("muon"), parse_spec("dobb")
    jobs = [(a, 1.0), (d, 1.0), (m, 1.0)]
    assert P.schedule(jobs, [10.0, 10.0, 30.0], 2) == 30.0  # muon alone on one slot, adamw + dobb on the other
    assert P.schedule(jobs, [10.0, 10.0, 30.0], 1) == 50.0
    assert P.schedule(jobs, [30.0, 10.0, 10.0], 2) == 30.0


SMALL = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--steps", "3",
         "--batch-size", "4", "--eval-every", "3", "--eval-seqs", "4", "--no-progress"]


def test_compare_says_its_duration_before_it_starts_and_dry_run_stops_there(capsys, tmp_path, text_dir, cache_dir):
    out = tmp_path / "cmp"
    argv = ["compare", "--optimizers", "adamw,rmnp", "--data", str(text_dir), "--cache-dir", str(cache_dir),
            "--out", str(out), "--dry-run"] + SMALL
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "compare: 2 runs, 2 at a time; expected duration about" in said
    assert "'RMNP' has no recorded lr grid" in said
    assert "timed here on cpu" in said  # another setting than the records': timed here
    assert not out.exists()
    assert main(argv[:-len(SMALL) - 1] + SMALL + ["--no-isolate"]) == 0
    said = capsys.readouterr().out
    assert said.index("expected duration") < said.index("[1/2]")
    assert (out / "results.md").exists()
