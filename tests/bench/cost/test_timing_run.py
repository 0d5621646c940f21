"""dobb_bench.cost.timing_run: the timing runner end to end on a tiny matrix set (JSON lines,
table, plot), its refresh bookkeeping, slow optimizers, the FSDP2 meter against the derived
payload and data-parallel statistics."""
import json

import pytest

from dobb_bench.cli import main
from dobb_bench.cost import payload_command
from dobb_bench.cost import timing_run as T
from dobb_bench.cost.shapes import matrix_shapes


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("timing")
    rc = main(["timing", "--preset", "tiny", "--repeats", "2", "--refresh-every", "3", "--blocks", "4",
               "--device", "cpu", "--optimizers", "torch-adamw", "torch-muon", "dion:rank_fraction=1/4", "dobb",
               "dobb:stagger=false", "--out", str(out)])
    assert rc == 0
    lines = [json.loads(ln) for ln in (out / "timing.jsonl").read_text().splitlines()]
    return out, lines


def test_timing_writes_json_lines_table_and_plot(smoke):
    out, lines = smoke
    kinds = [ln["kind"] for ln in lines]
    assert kinds[0] == "run" and kinds.count("summary") == 6
    summaries = {ln["label"]: ln for ln in lines if ln["kind"] == "summary"}
    assert set(summaries) == {"torch-adamw", "torch-adamw-fused", "torch-muon", "dion:rank_fraction=1/4", "dobb",
                              "dobb:stagger=false"}
    for s in summaries.values():
        assert s["amortized_ms"]["n"] == 2 and s["amortized_ms"]["median"] > 0
        assert s["amortized_ms"]["q25"] <= s["amortized_ms"]["median"] <= s["amortized_ms"]["q75"]
    assert summaries["torch-adamw"]["ratio_to_adamw"]["median"] == 1.0
    assert summaries["torch-adamw-fused"]["ratio_to_fused_adamw"]["median"] == 1.0  # the second reference
    assert all(s["ratio_to_fused_adamw"]["median"] > 0 for s in summaries.values())
    # derived state (buffer sizes) equals the measured state tensors for the exact-size optimizers
    for label in ("torch-muon", "dobb", "dion:rank_fraction=1/4"):
        assert summaries[label]["state_bytes"] == summaries[label]["derived_state_bytes"]
    table = (out / "timing.md").read_text()
    assert "| Model | device | DP | FS | TP | procs |" in table and "| dobb |" in table
    assert (out / "timing.png").read_bytes()[:4] == b"\x89PNG"


def test_dobb_cycles_start_at_a_refresh(smoke):
    _, lines = smoke
    reps = [ln for ln in lines if ln["kind"] == "rep"]
    plain = [r for r in reps if r["label"] == "dobb:stagger=false"]
    assert len(plain) == 2 and all(r["refresh"] == [True, False, False] for r in plain)
    # staggered (the default): 12 matrices spread over 3 offsets, so every step refreshes some of them
    assert all(all(r["refresh"]) for r in reps if r["label"] == "dobb")
    # cheap one-step optimizers run the longest cycle per repeat, interleaved with Dobb's steps
    assert all(len(r["steps_ms"]) == 3 for r in reps if r["label"] == "torch-adamw")
    s = next(ln for ln in lines if ln.get("label") == "dobb:stagger=false" and ln["kind"] == "summary")
    assert s["cycle"] == 3 and s["refresh_ms"]["n"] == 2 and s["nonrefresh_ms"]["n"] == 2
    # amortized is the cycle mean: (Refresh + (T-1) Non-refresh) / T within each repeat
    for r in plain:
        ms = r["steps_ms"]
        assert sum(ms) / 3 == pytest.approx((ms[0] + 2 * (ms[1] + ms[2]) / 2) / 3)


def test_cycle_covers_the_longest_refresh_period():
    """refresh_width lengthens wide matrices' periods: the timed cycle is their lcm, not refresh_every."""
    import torch
    from torch import nn
    import dobb

    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))  # input widths 8 and 32
    mats = [model[0].weight, model[1].weight]
    plain = dobb.Dobb(mats, model, lr=0.1, refresh_every=3)
    wide = dobb.Dobb(mats, model, lr=0.1, refresh_every=3, refresh_width=8)  # periods 3 and 3 * 4
    assert T.cycle_length(plain) == 3 and T.cycle_length(wide) == 12
    assert T.cycle_length(dobb.Dobb(mats, model, lr=0.1, refresh_every=3, refresh_width=16)) == 6  # 3, 3 * 2
    assert T.cycle_length(torch.optim.AdamW(model.parameters())) == 1
    assert T.cycle_length(dobb.MuonBP(mats, lr=0.1, period=5, blocks=1)) == 5  # one full step per cycle
    assert T.cycle_length(dobb.MuonBP(mats, lr=0.1, period=0, blocks=1)) == 1
    # the periodic refreshes of SPlus (eigh of both bases), DASH (inverse roots) and SOAP (QR) are amortized
    assert T.cycle_length(dobb.build_optimizer("splus", model, lr=0.1, inverse_every=7)) == 7
    assert T.cycle_length(dobb.build_optimizer("dash", model, lr=0.1, precondition_every=4)) == 4
    assert T.cycle_length(dobb.build_optimizer("soap", model, lr=0.1, precondition_frequency=6)) == 6


def test_slow_optimizers_run_one_cycle_per_repeat(tmp_path):
    cfg = T.TimingConfig(preset="tiny", layers="1", optimizers=("torch-adamw", "dobb"), repeats=1, refresh_every=2,
                         blocks=2, rep_seconds=0.0, log=False)
    result = T.run_timing(cfg)
    steps = {s["label"]: s["steps_per_repeat"] for s in result["summaries"]}
    assert steps == {"torch-adamw": 1, "torch-adamw-fused": 1, "dobb": 2}
    assert {r["label"]: len(r["steps_ms"]) for r in result["reps"]} == steps


@pytest.mark.slow
def test_fsdp2_meter_matches_derived_payload():
    """Two gloo ranks, FSDP2 FS=2: Dobb's step moves nothing, Dobb-ell2's moves its n column norms."""
    # stagger off: its refresh step refreshes every matrix (staggered, each step moves about 1/T of it)
    result = payload_command.measure_fsdp_payload(["adamw", "dobb:stagger=false", "dobb-l2:stagger=false"], "tiny", "1", 2,
                                                  fused_qkv=True)
    by = {s["label"]: s["metered"] for s in result["summaries"]}
    assert by["torch-adamw"]["step"]["bytes"] == 0
    shapes = matrix_shapes("tiny", "1", fused_qkv=True)  # the measured bank has the derived table's matrices
    # Dobb's refresh moves only its statistic mean (n^2/B per matrix, fp32, tagged "stat"; at most a
    # row count per matrix besides), in the capture pass or the step; a non-refresh step moves nothing
    stat = sum(n * n // 2 for _, (m, n) in shapes) * 4
    dobb = by["dobb:stagger=false"]
    refresh = dobb["capture_stat"]["bytes"] + dobb["step"]["bytes"]
    assert dobb["step"]["refresh"] and stat <= refresh <= stat + 8 * len(shapes)
    assert dobb["capture_stat"]["bytes"] + dobb["step"]["stat_bytes"] == refresh
    assert not dobb["next_step"]["refresh"] and dobb["next_step"]["bytes"] == 0
    # Dobb-l2 (Table 7, output axis sharded): its n column norms in every step
    n_total = sum(n for _, (m, n) in shapes)
    assert by["dobb-l2:stagger=false"]["next_step"]["bytes"] == 4 * n_total


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_timing_averages_statistics_over_the_world(world):
    """Plain replicated tensors (--dp N): Dobb is given the world as its statistic group; a refresh
    (capture pass + step) averages the n^2/B statistic entries per matrix (plus at most a row count
    per matrix, wherever the library takes the mean) and a non-refresh step communicates nothing."""
    cfg = dict(preset="tiny", layers="1", optimizers=("dobb:stagger=false",), dp=world, repeats=1, warmup=1, meter=True,
               log=False, blocks=2, refresh_every=3)
    by = {s["label"]: s for s in payload_command.run_spawned(cfg, world)["summaries"]}
    assert "skipped" not in by["dobb:stagger=false"]
    metered = by["dobb:stagger=false"]["metered"]
    shapes = matrix_shapes("tiny", "1")
    stat = sum(n * n // 2 for _, (m, n) in shapes) * 4
    refresh_bytes = metered["capture_stat"]["bytes"] + metered["step"]["bytes"]
    assert metered["step"]["refresh"] and stat <= refresh_bytes <= stat + 8 * len(shapes)
    assert not metered["next_step"]["refresh"] and metered["next_step"]["bytes"] == 0
    assert len(by["dobb:stagger=false"]["per_rank"]) == world


def test_capture_kind_runs_a_backward_pass_for_two_sided_dobb():
    """side='both' from activations needs output gradients for its output side: the forward-only
    capture pass left it without a statistic, so its timed refreshes skipped that side."""
    import dobb
    from torch import nn

    from dobb_bench.cost.timing_run import capture_kind

    def kind(**kw):
        layer = nn.Linear(8, 8, bias=False)
        return capture_kind(dobb.Dobb([layer.weight], layer, lr=0.01, **kw))

    assert kind() == "forward"
    assert kind(side="both") == "backward"
    assert kind(side="output", source="output_grad") == "backward"
    assert kind(source="grad_gram") is None
    assert kind(side="both", source="grad_gram") is None


def test_ratio_range_is_the_per_repeat_ratio_span_around_the_median():
    """Each step ratio's spread within one run: min and max over repeats of the per-repeat ratio of
    cycle means, with the recorded median between them (hand timings)."""
    from types import SimpleNamespace as NS
    a = NS(spec=NS(label="a"), reps=[[(0, 2.0), (1, 4.0)], [(0, 6.0), (1, 6.0)], [(0, 5.0), (1, 5.0)]])
    b = NS(spec=NS(label="b"), reps=[[(0, 1.0), (1, 1.0)], [(0, 2.0), (1, 2.0)], [(0, 2.0), (1, 2.0)]])
    rng, med = T._ratio_range([a, b]), T._ratio_matrix([a, b])
    assert rng["a"]["b"] == [2.5, 3.0] and med["a"]["b"] == 3.0  # ratios 3.0, 3.0, 2.5
    assert rng["b"]["a"] == [1 / 3, 0.4] and rng["a"]["a"] == [1.0, 1.0]


def test_smoke_run_records_the_ratio_range(smoke):
    run = smoke[1][0]
    for a, row in run["ratio_matrix"].items():
        for b, med in row.items():
            lo, hi = run["ratio_range"][a][b]
            assert lo <= med <= hi


def test_product_dtype_sets_every_rows_products_and_keeps_labels(tmp_path):
    """--product-dtype float32 pins ns_dtype / product_dtype where a spec leaves them (labels as typed),
    leaves a spec's own setting alone, and a bad value is a one-line CLI error."""
    out = tmp_path / "t"
    rc = main(["timing", "--preset", "tiny", "--repeats", "2", "--device", "cpu", "--product-dtype", "float32",
               "--optimizers", "muon", "dobb-muon:blocks=2", "soap-muon:ns_dtype=bfloat16", "--out", str(out)])
    assert rc == 0
    got = {ln["label"]: ln["hparams"] for ln in map(json.loads, (out / "timing.jsonl").read_text().splitlines())
           if ln["kind"] == "summary"}
    assert got["muon"]["ns_dtype"] == "torch.float32"
    assert got["dobb-muon:blocks=2"]["ns_dtype"] == got["dobb-muon:blocks=2"]["product_dtype"] == "torch.float32"
    assert got["soap-muon:ns_dtype=bfloat16"]["ns_dtype"] == "torch.bfloat16"
    with pytest.raises(SystemExit):
        main(["timing", "--preset", "tiny", "--product-dtype", "float16", "--out", str(tmp_path / "u")])


def test_matrices_carry_gpt2_like_names_so_heads_is_timed(tmp_path):
    """The timed module names each matrix by its role (h0.attn.q, h0.attn.o_proj, h0.mlp.fc), the same
    layers as the bank's list, so an option that finds attention by name (heads) builds and is timed."""
    from dobb_bench.cost.matrices import MatrixBank
    import torch
    bank = MatrixBank(matrix_shapes("tiny", "1"), "cpu", torch.float32)
    names = [n for n, _ in bank.model.named_parameters()]
    assert names == ["h0.attn.q.weight", "h0.attn.k.weight", "h0.attn.v.weight", "h0.attn.o_proj.weight",
                     "h0.mlp.fc.weight", "h0.mlp.proj.weight"]
    assert all(a is b for a, b in zip(bank.model.parameters(), bank.parameters()))
    out = tmp_path / "t"
    assert main(["timing", "--preset", "tiny", "--layers", "1", "--repeats", "2", "--device", "cpu",
                 "--optimizers", "dobb-muon:blocks=2:heads=2", "--out", str(out)]) == 0
    got = [json.loads(ln) for ln in (out / "timing.jsonl").read_text().splitlines()]
    row = next(ln for ln in got if ln.get("label") == "dobb-muon:blocks=2:heads=2")
    assert "skipped" not in row and row["amortized_ms"]["median"] > 0
