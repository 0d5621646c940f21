"""dobb_bench.reports.report, the main job's reading aids: block widths, gap closure and the
plain-words summary (issue 14 items 1, 3, 6)."""
import pytest

from dobb_bench.cost.payload import relative_payload
from dobb_bench.reports import report


def test_block_widths_per_matrix_kind():
    model = {"width": 128}
    assert report.block_widths("dobb", {"blocks": "4"}, model) == "32 / 128"  # d/B, 4d/B
    assert report.block_widths("dobb", {"blocks": "16"}, model) == "8 / 32"
    assert report.block_widths("dobb", {}, model) == "128 / 512"  # B=1: whole input axis
    assert report.block_widths("dobb-g", {"blocks": "4"}, model) == "32 / 128 / 96"  # output side
    assert report.block_widths("block-muon", {"blocks": "16"}, model) == "8 / 32"
    assert report.block_widths("block-muon", {"blocks": "4", "axis": "0"}, model) == "32 / 128 / 96"
    assert report.block_widths("muonbp", {}, model) == "32 / 128 / 96"  # default 4 row blocks
    assert report.block_widths("muonbp", {"blocks": "2", "axis": "1"}, model) == "64 / 256"
    assert report.block_widths("adamw", {}, model) is None
    # two-sided: the input side's widths, then the output side's at out_blocks (default 1)
    assert report.block_widths("dobb", {"side": "both"}, model) == "128 / 512 in, 128 / 512 / 384 out"
    assert report.block_widths("dobb", {"side": "both", "blocks": "4", "out_blocks": "2"}, model) == \
        "32 / 128 in, 64 / 256 / 192 out"
    assert report.block_width_note("dobb", {"side": "both"}).startswith("input axis: attention and MLP-in / MLP-out; output")
    assert report.block_width_note("dobb", {"side": "output"}).startswith("output axis")


def test_gap_closure_and_summary():
    assert report.gap_closure(1.8, 2.0, 1.5) == pytest.approx(0.4)
    assert report.gap_closure(2.1, 2.0, 1.5) == pytest.approx(-0.2)
    assert report.gap_closure(1.8, 1.5, 2.0) is None  # no AdamW-Muon gap to normalise by
    model = {"width": 128, "layers": 2}

    def row(run, name, loss, ms=None, **hp):
        return {"run": run, "optimizer": name, "hparams": {k: str(v) for k, v in hp.items()},
                "final_val_loss": loss, "diverged": False, "model": model, "opt_ms_per_step": ms}

    finals = [row("AdamW", "adamw", 2.0, 4.0), row("Muon", "muon", 1.5, 20.0),
              row("Dion rho=1/16", "dion", 2.2, rank_fraction=1 / 16), row("Dion rho=1/4", "dion", 1.9, rank_fraction=0.25),
              row("Dobb B=4", "dobb", 1.95, 10.0, blocks=4), row("Dobb B=1", "dobb", 1.7, blocks=1),
              row("Two-sided B=1 Bo=1", "dobb", 1.479, side="both")]
    shapes = [(384, 128), (128, 128), (512, 128), (128, 512)] * 2
    text = report.plain_summary(finals, shapes, payload=relative_payload)
    assert text.startswith("Summary (one seed, each row at its lr above; by the Findings' noise rule a "
                           "difference under 0.1 nats is within noise):")
    line = next(x for x in text.splitlines() if x.startswith("- Dobb B=4"))
    assert "blocks 32 / 128 wide" in line
    # 0.05 from AdamW: within the one-seed noise, so no lead and no gap closure is claimed
    assert "within noise of AdamW (-0.050; one seed cannot tell apart less than 0.1 nats)" in line
    assert "gap closure 10% is not resolved by one seed (within 0.1 nats of AdamW)" in line and "closes" not in line
    assert "0.450 behind Muon (beyond one-seed noise)" in line
    # Dobb's payload is 0, so the nearest Dion row in payload is rho=1/16 (1.5/16 of Muon's)
    assert "0.250 ahead of Dion rho=1/16" in line and "vs 0.000" in line
    # loss and cost on one line: ms/step against the same run's AdamW and Muon, payload against Muon's
    assert line.endswith("; cost: optimizer step 10.0 ms (2.50x AdamW's, 0.50x Muon's in this run), "
                         "FSDP payload 0.000 of Muon's.")
    untimed = next(x for x in text.splitlines() if x.startswith("- Dobb B=1"))
    assert untimed.endswith("; cost: optimizer step not timed, FSDP payload 0.000 of Muon's.")
    assert "; closes 60% of the AdamW-Muon gap (one seed; beyond noise of both)" in untimed
    # 0.021 below Muon at one seed: "within noise", never "ahead of Muon" or "closes 104% of the gap"
    two = next(x for x in text.splitlines() if x.startswith("- Two-sided B=1 Bo=1"))
    assert "within noise of Muon (-0.021;" in two and "ahead of Muon" not in two
    assert "closes" not in two and "gap closure 104% is not resolved by one seed (within 0.1 nats of Muon)" in two


def test_summary_tells_a_missing_row_from_a_diverged_one():
    model = {"width": 128, "layers": 2}
    finals = [{"run": "Muon", "optimizer": "muon", "hparams": {}, "final_val_loss": float("nan"),
               "diverged": True, "model": model},
              {"run": "Dobb B=4", "optimizer": "dobb", "hparams": {"blocks": "4"}, "final_val_loss": 1.9,
               "diverged": False, "model": model}]
    line = next(x for x in report.plain_summary(finals, [(128, 128)], payload=relative_payload).splitlines() if x.startswith("- Dobb"))
    assert "AdamW: not in this run" in line and "Muon: no finite result" in line


def test_summary_names_the_dtype_each_row_ran():
    model = {"width": 128, "layers": 2}

    def row(run, name, groups):
        return {"run": run, "optimizer": name, "hparams": {}, "final_val_loss": 1.9, "diverged": False,
                "model": model, "optimizer_groups": groups}

    finals = [row("AdamW", "adamw", [{"algorithm": "adamw"}]),
              row("Muon", "muon", [{"algorithm": "muon", "ns_dtype": "auto", "ns_dtype_resolved": "torch.float32"},
                                   {"algorithm": "adamw", "ns_dtype_resolved": "torch.bfloat16"}]),
              row("Dobb B=4", "dobb", [{"algorithm": "dobb", "product_dtype_resolved": "torch.float32"}]),
              row("Old", "dobb", [])]
    last = report.plain_summary(finals, [(128, 128)], payload=relative_payload).splitlines()[-1]
    assert last.startswith("- Product dtype: every matrix row's products ran in float32, so the optimizer "
                           "step costs above compare like with like")
    finals[2]["optimizer_groups"][0]["product_dtype_resolved"] = "torch.bfloat16"  # Dobb's products in bf16, Muon's in fp32
    last = report.plain_summary(finals, [(128, 128)], payload=relative_payload).splitlines()[-1]
    assert "different dtypes (Muon float32, Dobb B=4 bfloat16)" in last and "do not compare like with like" in last
    assert "AdamW" not in last and "Old" not in last


def test_results_table_marks_a_one_seed_gap_closure_within_noise():
    """One seed: a row within 0.1 nats of Muon (or AdamW) gets its gap closure marked, never bare."""
    model, train = {"width": 128, "layers": 2}, {"seed": 0, "steps": 800}

    def row(run, name, loss, lr):
        return {"run": run, "optimizer": name, "hparams": {}, "final_val_loss": loss, "diverged": False,
                "model": model, "train": train, "lr": lr}

    finals = [row("AdamW", "adamw", 2.0, 0.003536), row("Muon", "muon", 1.5, 0.01),
              row("Two-sided B=1 Bo=1", "dobb", 1.479, 0.005), row("Dobb B=4", "dobb", 1.7, 0.003536)]
    md = report.results_markdown(finals, grid=False, shared_lr=None, row_lrs={f["run"]: f["lr"] for f in finals})
    assert "| Two-sided B=1 Bo=1 | 0.005 | 1.4790 | 104% (within noise) |" in md
    assert "| Dobb B=4 | 0.00354 | 1.7000 | 60% |" in md
    assert "at each row's own lr (one seed: a loss difference under 0.1 nats" in md
