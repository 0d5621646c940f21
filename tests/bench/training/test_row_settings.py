"""dobb_bench.training.row_settings: compare's rows at their recorded best lr, one product dtype
for every row (issue 39 item 5)."""
import json

import pytest
import torch

from dobb_bench.cli import main
from dobb_bench.reports import records as R
from dobb_bench.specs import parse_spec
from dobb_bench.training import row_settings as RS


def test_the_lr_table_follows_the_committed_records():
    assert RS.mismatches() == []


def test_a_record_that_moves_a_best_lr_fails_the_table(monkeypatch):
    """A seed-0 Dobb B=4 run at 0.005 with the lowest loss moves its best lr off the table's 0.00354."""
    load = R.load

    def patched(study, *a, **k):
        recs = load(study, *a, **k)
        if study == "own-lr":
            recs = [dict(r, final_val_loss=0.5) if r["run"] == "Dobb B=4" and r["seed"] == 0
                    and abs(r["lr"] - 0.005) < 1e-6 else r for r in recs]
        return recs

    monkeypatch.setattr(R, "load", patched)
    bad = RS.mismatches()
    assert len(bad) == 1 and bad[0].startswith("dobb:blocks=4: the records give lr 0.005")


def test_a_spec_finds_its_row_by_value_not_by_spelling():
    two = RS.recorded_lr(parse_spec("dobb:side=both@Mine"))  # blocks=1, out_blocks=1 are the defaults
    assert two.label == "Two-sided B=1 Bo=1" and two.lr == 0.005
    assert RS.recorded_lr(parse_spec("muon:ns_dtype=bfloat16")).lr == 0.01  # the dtype key is the rule's
    assert RS.recorded_lr(parse_spec("block-muon:blocks=4:axis=0")).label == "Row-block Muon-fp32 R=4"
    assert RS.recorded_lr(parse_spec("block-muon:blocks=4")) is None  # column blocks: no recorded grid
    assert RS.recorded_lr(parse_spec("rmnp")) is None
    specs = [parse_spec(x) for x in ("adamw", "dobb:blocks=4", "rmnp")]
    lrs, source = RS.row_lrs(specs, None)
    # the grid point itself, exactly as the recorded runs ran it (5e-3 * 2**-0.5, not 0.003536)
    assert lrs == {"AdamW": RS.SHARED_LR, "Dobb B=4": RS.SHARED_LR, "RMNP": RS.SHARED_LR}
    assert RS.on_grid(0.01414) == 5e-3 * 2 ** 1.5 and RS.on_grid(0.08) == 0.08 and RS.on_grid(0.0123) == 0.0123
    assert source["RMNP"] == "shared lr: no recorded lr grid" and "own-lr" in source["Dobb B=4"]
    assert RS.row_lrs(specs, 2e-3)[0] == {"AdamW": 2e-3, "Dobb B=4": 2e-3, "RMNP": 2e-3}


def test_one_product_dtype_rule_for_every_row():
    assert RS.product_dtype("cpu", native=True) is torch.bfloat16
    assert RS.product_dtype("cpu", native=False) is torch.float32
    assert RS.product_dtype("cuda:0") is torch.bfloat16 and RS.product_dtype("mps") is torch.float32
    muon, dobb, adamw = (RS.with_product_dtype(parse_spec(s), torch.bfloat16) for s in ("muon", "dobb:blocks=4", "adamw"))
    assert muon.hparams == {"ns_dtype": torch.bfloat16} and muon.label == "Muon"
    # Dobb has both keys (ns_dtype is its Newton-Schulz under norm="muon"): both follow the rule
    assert dobb.hparams == {"blocks": 4, "product_dtype": torch.bfloat16, "ns_dtype": torch.bfloat16}
    assert dobb.label == "Dobb B=4"
    assert adamw.hparams == {}
    mine = RS.with_product_dtype(parse_spec("muon:ns_dtype=float32"), torch.bfloat16)
    assert mine.hparams == {"ns_dtype": torch.float32}  # a spec's own dtype is kept


SMALL = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--steps", "2",
         "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "4", "--no-progress", "--no-isolate"]


def test_compare_runs_each_row_at_its_recorded_lr_and_names_the_dtype(tmp_path, text_dir, cache_dir):
    common = ["compare", "--optimizers", "adamw,dobb:blocks=1,rmnp", "--data", str(text_dir),
              "--cache-dir", str(cache_dir)] + SMALL

    def finals(out):
        rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        return {r["run"]: r for r in rows if r["type"] == "final"}

    assert main(common + ["--out", str(tmp_path / "own"), "--product-dtype", "bfloat16"]) == 0
    got = finals(tmp_path / "own")
    assert {k: f["lr"] for k, f in got.items()} == pytest.approx(
        {"AdamW": RS.SHARED_LR, "Dobb B=1": 0.005, "RMNP": RS.SHARED_LR}, abs=0)
    assert got["Dobb B=1"]["hparams"]["product_dtype"] == "torch.bfloat16"
    md = (tmp_path / "own" / "results.md").read_text()
    assert "learning rate: each row at its own best lr in the committed records" in md
    assert "RMNP 0.00354 (shared lr: no recorded lr grid)" in md
    assert "product dtype: bfloat16 (--product-dtype)" in md
    assert "Gap closure = (AdamW - x) / (AdamW - Muon) at each row's own lr (one seed:" in md
    assert main(common + ["--out", str(tmp_path / "one"), "--lr", "0.002", "--product-dtype", "float32"]) == 0
    got = finals(tmp_path / "one")
    assert {f["lr"] for f in got.values()} == {0.002}
    assert got["Dobb B=1"]["hparams"]["product_dtype"] == "torch.float32"
    assert "learning rate: every row at --lr 0.002" in (tmp_path / "one" / "results.md").read_text()
