"""dobb_bench.cost.projection: each method's terms against hand-computed values on one small
matrix, the collective rules, the model shapes against published parameter counts, the committed
record against a rebuild from the committed inputs, and scripts/gpu_check.py --model-check on CPU."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from dobb_bench.cost import projection as PJ
from dobb_bench.cost.projection_costs import _selected

# round numbers, so every expected value below is done by hand
HW = PJ.Hardware(bf16_flops=1e12, fp32_flops=1e11, hbm=1e11, nvlink=1e10, internode=1e9, gpus_per_node=8,
                 lat_intra=1e-5, lat_inter=2e-5)
MAT = [PJ.Matrix("h0.q", 8, 4, True)]  # 8 x 4, column-parallel
LAY = PJ.Layout(fs=2)  # rank-local shard: 4 x 4 = 16 entries


def _k(pm=0, pg=0, ps=0, b=0.0, bs=0.0, **kw):
    """A hand-made trace entry: kernels per matrix / group / extra shape, bytes an entry, an entry of the statistic."""
    return {"per_matrix": pm, "per_group": pg, "per_shape": ps, "bytes_per_entry": b, "bytes_per_stat_entry": bs, **kw}


# hand-made traced counts, round numbers near the committed ones (those are traced and checked in
# tests/bench/cost/test_kernels.py), so that every expected value below is done by hand
HAND = {
    "adamw": {"steady": _k(8, b=80)},
    "muon": {"steady": _k(1, 24, 19, b=70, ns_bytes_per_entry=20)},  # 50 around Newton-Schulz, 20 in it
    "row-block-muon": {"steady": _k(b=70)}, "muonbp": {"steady": _k(b=70)}, "dion2": {"steady": _k(b=95)},
    "dion": {"steady": _k(b=48, bs=36, qr_per_matrix=1)},
    "dobb-b4": {"steady": _k(b=48, bs=4), "refresh": _k(b=48, bs=48)},
    "dobb-b4-fp32": {"steady": _k(b=52, bs=10), "refresh": _k(b=52, bs=54)},
    "dobb-both": {"steady": _k(b=72, bs=4), "refresh": _k(b=72, bs=48)},
    "dobb-g-l2": {"steady": _k(b=76, bs=4), "refresh": _k(b=76, bs=48)},
    "torch-muon-bf16": {"steady": _k(b=28)},
}


def _ms(seconds):
    return 1e3 * seconds


def test_adamw_bytes_an_entry_over_hbm():
    got = PJ.project({"kind": "adamw"}, MAT, 10, LAY, HW, counts=HAND)
    # 16 local matrix entries + 10 / 2 other entries, 80 bytes each (the traced 8 passes), over 1e11 B/s
    assert got["amortized_ms"] == pytest.approx(_ms(80 * (16 + 5) / 1e11))
    assert got["matmul_ms"] == 0 and got["link_ms"] == 0 and got["latency_ms"] == 0


def test_owner_muon_terms_by_hand():
    got = PJ.project({"kind": "owner-muon", "ns_bytes": 2}, MAT, 0, LAY, HW, counts=HAND)
    # momentum and update on the 16 local entries (70 - 20 = 50 B), Newton-Schulz's 20 B on the owned whole 32
    assert got["hbm_ms"] == pytest.approx(_ms((50 * 16 + 20 * 32) / 1e11))
    # NS5 on 8 x 4: a = 4, b = 8: 5 (4 a^2 b + 2 a^3) = 5 (512 + 128) = 3200; one matrix: the owner does all of it
    assert got["matmul_ms"] == pytest.approx(_ms(3200 / 1e12))
    # payload 2 m n = 64 entries; per rank 64 / 2 of it, half leaves the rank, 2 bytes: 32 B over NVLink
    assert got["link_ms"] == pytest.approx(_ms(32 / 1e10))
    assert got["latency_ms"] == pytest.approx(_ms(2 * 1e-5))  # there and back, one megabatch
    assert got["amortized_ms"] == pytest.approx(_ms(1.44e-8 + 3.2e-9 + 3.2e-9 + 2e-5))


def test_muonbp_amortizes_the_owner_full_step():
    block = PJ.project({"kind": "muonbp", "period": 5, "ns_bytes": 2}, MAT, 0, LAY, HW, counts=HAND)
    # block step: NS5 on the local 4 x 4: 5 (4 * 64 + 2 * 64) = 1920 FLOPs; 70 B an entry
    assert block["steady_ms"] == pytest.approx(_ms(70 * 16 / 1e11 + 1920 / 1e12))
    owner = PJ.project({"kind": "owner-muon", "ns_bytes": 2}, MAT, 0, LAY, HW, counts=HAND)
    assert block["periodic_ms"] == pytest.approx(owner["amortized_ms"])
    assert block["amortized_ms"] == pytest.approx((4 * block["steady_ms"] + owner["amortized_ms"]) / 5)


def test_dion2_per_shard_orthogonalizes_a_quarter_of_the_local_rows():
    got = PJ.project({"kind": "dion2-shard", "fraction": 0.25}, MAT, 0, LAY, HW)
    # k = round(0.25 * 4) = 1 row of 4: a = 1, b = 4: 5 (4 * 1 * 4 + 2) = 90 FLOPs, no collective
    assert got["matmul_ms"] == pytest.approx(_ms(90 / 1e12))
    assert got["link_ms"] == 0 and got["latency_ms"] == 0


def test_dobb_steady_refresh_and_statistic_by_hand():
    got = PJ.project({"kind": "dobb", "blocks": 2, "refresh_every": 4, "split_refresh": False}, MAT, 0, LAY, HW, counts=HAND)
    # local 4 x 4, blocks of s = 4 / 2 = 2 over the 4 columns: statistic and basis k s = 8 entries
    steady = (48 * 16 + 4 * 8) / 1e11 + 4 * 4 * 4 * 2 / 1e12  # traced bytes: 48 an entry, 4 a basis entry; 4 rows k s
    # refresh: A Q 2 k s^2 = 32, QR 2 x (4/3) 8 = 21.33 fp32 FLOPs; (48 - 4) B more a statistic entry = 352 B;
    # statistic all-reduce of sum s^2 = 8 fp32 entries over fs x dp = 2 ranks: 2 * 8 * 1/2 * 4 = 32 B
    refresh = (32 + 64 / 3) / 1e11 + 352 / 1e11 + 32 / 1e10 + 1e-5
    assert got["steady_ms"] == pytest.approx(_ms(steady))
    assert got["periodic_ms"] == pytest.approx(_ms(steady + refresh))
    assert got["amortized_ms"] == pytest.approx(_ms(steady + refresh / 4))
    no_sync = PJ.project({"kind": "dobb", "blocks": 2, "refresh_every": 4, "split_refresh": False}, MAT, 0, LAY, HW, stat_sync=False, counts=HAND)
    assert no_sync["periodic_ms"] == pytest.approx(_ms(steady + refresh - 32 / 1e10 - 1e-5))


def test_dobb_blocks_are_cut_at_tp_shard_boundaries():
    row_parallel = [PJ.Matrix("h0.o", 4, 8, False)]
    got = PJ.project({"kind": "dobb", "blocks": 1, "refresh_every": 1}, row_parallel, 0, PJ.Layout(fs=1, tp=2), HW)
    # TP 2 splits the 8 columns: local 4 x 4, one 4-wide block (not 8): 4 r k s = 256 bf16 FLOPs;
    # refresh 2 * 4 * 16 + (4/3) 64 fp32; statistic over fs x dp = 1 rank: no collective
    assert got["matmul_ms"] == pytest.approx(_ms(256 / 1e12 + (128 + 256 / 3) / 1e11))
    assert got["link_ms"] == 0


def test_two_sided_adds_the_output_side():
    one = PJ.project({"kind": "dobb", "blocks": 1, "refresh_every": 9, "split_refresh": False}, MAT, 0, LAY, HW, stat_sync=False, counts=HAND)
    both = PJ.project({"kind": "dobb-both", "blocks": 1, "out_blocks": 4, "refresh_every": 9}, MAT, 0, LAY, HW,
                      stat_sync=False, counts=HAND)
    # output blocks: min(8 / 4, 4 local rows) = 2: 4 k r s_out = 4 * 4 * 4 * 2 = 128 bf16 FLOPs. Bytes: one-sided
    # 48 x 16 + 4 x (4 x 4); two-sided (its own trace) 72 x 16 + 4 x (16 + 4 x 2): 416 B more
    assert both["steady_ms"] - one["steady_ms"] == pytest.approx(_ms(128 / 1e12 + 416 / 1e11))


def test_collective_rules():
    # ring inside a node (2 ranks): NVLink; across nodes (16 ranks, 8 a node): one ring per card,
    # 8 cards of 1e9 at once = 8e9 (under NVLink's 1e10)
    assert PJ.ring_time(1e6, 2, 1, HW) == (pytest.approx(1e6 / 1e10), 1e-5)
    assert PJ.ring_time(1e6, 16, 1, HW) == (pytest.approx(1e6 / 8e9), 2e-5)
    assert PJ.ring_time(1e6, 16, 2, HW)[0] == pytest.approx(1e6 / 4e9)  # stride 2: 4 of the group a node
    assert PJ.ring_time(1e6, 2, 8, HW)[0] == pytest.approx(1e6 / 1e9)  # stride 8: one rank per node, one card
    fat = HW.with_(internode=5e9)  # 8 cards of 5e9 would pass NVLink: NVLink caps the ring
    assert PJ.ring_time(1e6, 16, 1, fat)[0] == pytest.approx(1e6 / 1e10)
    # all-to-all over 16 ranks: 7 of 15 peers on the node, 8 off it, sent at once
    link, lat = PJ.all_to_all_time(15e6, 16, 1, HW)
    assert link == pytest.approx(max(7e6 / 1e10, 8e6 / 1e9)) and lat == 2e-5
    assert PJ.ring_time(1e6, 1, 1, HW) == (0.0, 0.0)


def test_model_shapes_match_published_parameter_counts():
    inputs = PJ.load_inputs()
    mats, other = PJ.model_matrices(inputs["models"]["llama3-8b"])
    assert len(mats) == 32 * 7
    assert sum(x.m * x.n for x in mats) + other == 8_030_261_248  # Meta's Llama-3-8B count
    mats, other = PJ.model_matrices(inputs["models"]["gpt2-xl"])
    assert sum(x.m * x.n for x in mats) + other == 1_557_611_200  # Hugging Face gpt2-xl
    assert {x.name.split(".")[1] for x in mats if not x.colwise} == {"o", "proj"}


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="fs"):
        PJ.Layout(fs=0)
    with pytest.raises(ValueError, match="unknown method kind"):
        PJ.project({"kind": "sgd"}, MAT, 0, LAY, HW)


def test_every_input_names_its_source():
    inputs = PJ.load_inputs()
    for hw in inputs["hardware"].values():
        assert all(v.get("source") for v in hw.values())
    assert all(m.get("source") for m in inputs["models"].values())


def test_committed_record_is_the_inputs_rebuilt():
    rec = json.loads(PJ.RECORD.read_text())
    fresh = PJ.build(PJ.load_inputs())
    assert rec["inputs"] == PJ.load_inputs()
    for key in ("rows", "calibration"):
        assert len(rec[key]) == len(fresh[key])
        for a, b in zip(rec[key], fresh[key]):
            for k, v in b.items():
                if isinstance(v, float):
                    assert a[k] == pytest.approx(v, rel=1e-12), (key, k)
                elif k != "terms":
                    assert a[k] == v, (key, k)
    assert rec["provenance"]["git_dirty"] is False and rec["provenance"]["git_rev"]


def test_project_command_writes_record_table_and_plot(tmp_path):
    from dobb_bench.cli import main

    assert main(["project", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "projection.json").read_text())
    assert (tmp_path / "projected_step.png").stat().st_size > 0
    assert "| gpt2-xl | Dobb B=4 |" in PJ.projection_markdown(rec)
    assert all(math.isfinite(c["ratio"]) for c in rec["calibration"])


def test_gpu_check_model_check_cpu(tmp_path):
    path = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--cpu-smoke", "--model-check", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "model_check.json").read_text())
    inputs = PJ.load_inputs()
    hw = PJ.Hardware.from_inputs(inputs["hardware"]["h100-sxm"], PJ.fit_constants(inputs))
    ns = [r for r in rec["rows"] if r["quantity"].startswith("NS5")]
    assert len(ns) == len(mod.SMOKE_SHAPES)
    # 64 x 64: 5 (4 * 64^3 + 2 * 64^3) FLOPs at 60% of the H100's bf16 peak (989.4 TFLOP/s)
    assert ns[0]["model_ms"] == pytest.approx(1e3 * 5 * 6 * 64 ** 3 / (0.6 * 989.4e12))
    assert all(r["measured_ms"] > 0 for r in rec["rows"])
    # the per-kernel and per-QR costs beside the fitted constants; a step of every method
    assert rec["kernel"]["kernel_ms"] > 0 and rec["kernel"]["kernel_model_ms"] == pytest.approx(1e3 * hw.kernel_s)
    assert [s["method"] for s in rec["steps"]] == [m[0] for m in mod.STEP_METHODS]
    dobb_row = next(s for s in rec["steps"] if s["method"] == "Dobb B=1")
    assert dobb_row["steady_ms"] > 0 and dobb_row["refresh_ms"] > 0 and dobb_row["model_refresh_ms"] > dobb_row["model_steady_ms"]
    adamw = next(s for s in rec["steps"] if s["method"].startswith("AdamW"))
    assert adamw["model_kernels"] == 8 * len(rec["step_shapes"])  # single-tensor AdamW, weight decay on: 8 a matrix
    assert rec["provenance"]["git_rev"]


# ----------------------------------------------------------------------------- the launch, QR and owner terms
COUNTS = {  # hand-made kernel counts (per matrix, per group, per extra shape) and HAND's bytes
    "adamw": {"steady": _k(7, b=80)},
    "muon": {"steady": _k(1, 20, 10, b=70, ns_bytes_per_entry=20)},
    "dobb-b4": {"steady": _k(5, 6, b=48, bs=4), "refresh": _k(8, 10, b=48, bs=48)},
}
HWK = PJ.Hardware(bf16_flops=1e12, fp32_flops=1e11, hbm=1e11, nvlink=1e10, internode=1e9, gpus_per_node=8,
                  lat_intra=1e-5, lat_inter=2e-5, bf16_eff=0.5, fp32_eff=0.25, kernel_s=1e-6, qr_s=3e-6)


def test_adamw_launch_term_counts_every_tensor():
    got = PJ.project({"kind": "adamw"}, MAT, 10, LAY, HWK, counts=COUNTS, tensors=2)
    # 7 kernels a tensor: 1 matrix + 2 other tensors = 21 kernels at 1 us
    assert got["launch_ms"] == pytest.approx(_ms(21e-6))
    assert got["amortized_ms"] == pytest.approx(_ms(80 * (16 + 5) / 1e11 + 21e-6))


def test_efficiency_divides_the_peak():
    got = PJ.project({"kind": "owner-muon", "ns_bytes": 2}, MAT, 0, LAY, HWK, counts=COUNTS)
    # NS5 on 8 x 4: 3200 FLOPs at half the bf16 peak; kernels: 20 a group + 1 a matrix
    assert got["matmul_ms"] == pytest.approx(_ms(3200 / 0.5e12))
    assert got["launch_ms"] == pytest.approx(_ms(21e-6))


def test_dobb_refresh_charges_one_qr_a_block():
    got = PJ.project({"kind": "dobb", "blocks": 2, "refresh_every": 4, "split_refresh": False}, MAT, 0, LAY, HWK, stat_sync=False,
                     counts=COUNTS)
    # local 4 x 4, blocks of 2: 2 QR factorizations in the refresh step, 3 us each; refresh kernels
    # (10 + 8) - (6 + 5) = 7 more than the steady step's 11
    steady = (48 * 16 + 4 * 8) / 1e11 + 4 * 4 * 4 * 2 / 0.5e12 + 11e-6
    refresh = (32 + 64 / 3) / 0.25e11 + 352 / 1e11 + 7e-6 + 2 * 3e-6
    assert got["steady_ms"] == pytest.approx(_ms(steady))
    assert got["periodic_ms"] == pytest.approx(_ms(steady + refresh))
    assert got["qr"] == pytest.approx(2 / 4)  # amortized: 2 factorizations every 4 steps


def test_owner_plan_is_the_busiest_rank_not_the_mean():
    mats = [PJ.Matrix("a", 8, 8, True), PJ.Matrix("b", 4, 4, True), PJ.Matrix("c", 4, 4, True)]
    mine, owners = PJ.owner_plan(mats, 2)
    assert mine == [0] and owners == 2  # the 8 x 8 alone outweighs both 4 x 4s
    got = PJ.project({"kind": "owner-muon", "ns_bytes": 2}, mats, 0, PJ.Layout(fs=2), HWK, counts=COUNTS)
    # busiest owner: NS5 on 8 x 8 = 5 * 6 * 512 = 15360 FLOPs (the mean would be (15360 + 2 * 1920) / 2)
    assert got["matmul_ms"] == pytest.approx(_ms(15360 / 0.5e12))


def test_fit_solves_the_named_points_exactly():
    rec = PJ.build(PJ.load_inputs())
    fitted = [c for c in rec["calibration"] if c["fitted"]]
    assert sorted(c["fitted"] for c in fitted) == ["kernel_s", "qr_s"]
    assert all(c["ratio"] == pytest.approx(1.0) for c in fitted)
    assert rec["summary"]["unfitted"] == len(rec["calibration"]) - 2


def _tiny_inputs(tmp_path):
    inputs = PJ.load_inputs()
    inputs["hardware"] = {"round": {"bf16_flops": 1e12, "fp32_flops": 1e11, "hbm_bytes_per_s": 1e11,
                                    "nvlink_bytes_per_s": 1e10, "internode_bytes_per_s": 1e9, "gpus_per_node": 8,
                                    "latency_intra_s": 1e-5, "latency_inter_s": 2e-5,
                                    "bf16_efficiency": 0.5, "fp32_efficiency": 0.25}}
    inputs["fit"] = []
    inputs["fixed"] = {"kernel_s": 1e-6, "qr_s": 3e-6}
    inputs["kernels"]["methods"] = {**inputs["kernels"]["methods"], **COUNTS}
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(inputs))
    cfg = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 10, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return inputs, path


def test_user_config_adamw_and_share_by_hand(tmp_path):
    inputs, _ = _tiny_inputs(tmp_path)
    spec = PJ.config_spec(str(tmp_path / "config.json"), inputs)
    res = PJ.user_projection(spec, gpus=2, tp=1, dtype="bf16", mfu=0.5, tokens=1000, inputs=inputs, hardware="round")
    # q, k, v, o 8 x 8; gate, up 16 x 8; down 8 x 16: 640 entries in 7 matrices; other: tied
    # embedding 10 x 8 + 3 RMSNorms of 8 = 104 entries in 4 tensors (2 norms, embedding, final norm)
    assert res["params"] == 744 and res["matrices"] == 7 and res["other_tensors"] == 4
    adamw = next(r for r in res["rows"] if r["method"] == "build_optimizer('adamw')")
    # HBM: 80 B x 744 / 2 ranks over 1e11 B/s; launch: 7 kernels x 11 tensors x 1 us
    assert adamw["amortized_ms"] == pytest.approx(_ms(80 * 372 / 1e11 + 77e-6))
    # forward + backward: 6 x 744 x 1000 / (2 x 1e12 x 0.5) s
    assert res["fwd_bwd_ms"] == pytest.approx(_ms(6 * 744 * 1000 / 1e12))
    assert adamw["share"] == pytest.approx(adamw["amortized_ms"] / (adamw["amortized_ms"] + res["fwd_bwd_ms"]))


def test_project_config_command_and_its_errors(tmp_path, capsys):
    from dobb_bench.cli import main

    _, path = _tiny_inputs(tmp_path)
    cfg = str(tmp_path / "config.json")
    assert main(["project", "--inputs", str(path), "--hardware", "round", "--config", cfg, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "Assumptions:" in out and "| build_optimizer('adamw') | AdamW |" in out
    assert "| build_optimizer('dobb') | Dobb B=1 |" in out and "| build_optimizer('owner-muon') | owner-compute Muon |" in out
    assert "MFU 0.4" in out
    for bad in (["--config", cfg, "--gpus", "3", "--tp", "2"], ["--config", str(tmp_path / "none.json"), "--gpus", "2"],
                ["--config", cfg], ["--config", cfg, "--gpus", "2", "--dtype", "fp8"],
                ["--config", cfg, "--gpus", "2", "--mfu", "0"]):
        assert main(["project", "--inputs", str(path), "--hardware", "round", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dobb-bench project: error:"), err
    (tmp_path / "zero.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                     "num_hidden_layers": 0}))
    assert main(["project", "--config", str(tmp_path / "zero.json"), "--gpus", "2"]) == 2
    assert "positive integers" in capsys.readouterr().err
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["project", "--config", str(tmp_path / "bert.json"), "--gpus", "2"]) == 2
    assert "not supported" in capsys.readouterr().err


# ----------------------------------------------------------------------------- issue 43 audit fixes
def test_fused_qkv_gpt2_has_four_matrices_a_layer_and_the_same_entries():
    inputs = PJ.load_inputs()
    split, other_s = PJ.model_matrices(inputs["models"]["gpt2-xl"])
    fused, other_f = PJ.model_matrices(inputs["models"]["gpt2-xl-paper"])
    assert len(split) == 48 * 6 and len(fused) == 48 * 4
    assert sum(x.m * x.n for x in fused) + other_f == 1_557_611_200 == sum(x.m * x.n for x in split) + other_s
    assert {(x.m, x.n) for x in fused if x.name.endswith(".qkv")} == {(4800, 1600)}
    # AdamW's other tensors: 4 biases + 2 LayerNorms (4 tensors) a layer, + wte, wpe, ln_f (2) = 8 L + 4
    assert PJ.other_tensors(inputs["models"]["gpt2-xl-paper"]) == 8 * 48 + 4
    assert PJ.other_tensors(inputs["models"]["gpt2-xl"]) == 10 * 48 + 4


def test_ns_steps_scale_the_newton_schulz_flops():
    # NS on 8 x 4: a = 4, b = 8: 4 a^2 b + 2 a^3 = 640 a step; two steps 1280, five 3200
    for kind in ("owner-muon", "placement-muon", "gather-muon"):
        two = PJ.project({"kind": kind, "ns_steps": 2, "ns_bytes": 2}, MAT, 0, LAY, HW)
        assert two["matmul_ms"] == pytest.approx(_ms(1280 / 1e12)), kind
    assert PJ.ns_flops(8, 4) == 3200 and PJ.ns_flops(8, 4, 2) == 1280


def test_dtensor_muon_by_hand():
    got = PJ.project({"kind": "dtensor-muon", "ns_steps": 2, "kernels": "torch-muon-bf16"}, MAT, 0, LAY, HW,
                     counts=HAND)
    # 1280 NS FLOPs shared by the 2 ranks; element-wise: torch.optim.Muon's bf16 passes, 28 B x 16 local entries
    assert got["matmul_ms"] == pytest.approx(_ms(640 / 1e12))
    assert got["hbm_ms"] == pytest.approx(_ms(28 * 16 / 1e11))
    # a step gathers X^T (32), A (16), X (32) = 80 entries; 2 steps = 160; half arrives from the
    # other rank, 2 bytes: 160 B over NVLink; 3 gathers a step + one norm all-reduce = 7 latencies
    assert got["link_ms"] == pytest.approx(_ms(160 / 1e10))
    assert got["latency_ms"] == pytest.approx(_ms(7e-5))


def test_dobb_products_in_fp32_move_to_the_fp32_peak():
    same = {"kind": "dobb", "blocks": 2, "refresh_every": 4, "kernels": "dobb-b4"}  # one trace: FLOPs alone differ
    bf16 = PJ.project(same, MAT, 0, LAY, HW, stat_sync=False, counts=HAND)
    fp32 = PJ.project({**same, "product_dtype": "fp32"}, MAT, 0, LAY, HW, stat_sync=False, counts=HAND)
    # the steady products 4 rows k s = 4 * 4 * 4 * 2 = 128 FLOPs: 1e12 -> 1e11 FLOP/s
    assert fp32["steady_ms"] - bf16["steady_ms"] == pytest.approx(_ms(128 / 1e11 - 128 / 1e12))
    assert fp32["periodic_ms"] - fp32["steady_ms"] == pytest.approx(bf16["periodic_ms"] - bf16["steady_ms"])
    # by default fp32 products take the fp32 trace: (52 - 48) B x 16 entries + (10 - 4) B x 8 basis entries more
    traced = PJ.project({"kind": "dobb", "blocks": 2, "refresh_every": 4, "product_dtype": "fp32"}, MAT, 0, LAY, HW,
                        stat_sync=False, counts=HAND)
    assert traced["steady_ms"] - fp32["steady_ms"] == pytest.approx(_ms((4 * 16 + 6 * 8) / 1e11))
    with pytest.raises(ValueError, match="product_dtype"):
        PJ.project({"kind": "dobb", "blocks": 2, "refresh_every": 4, "product_dtype": "fp8"}, MAT, 0, LAY, HW)


def test_matrixfsdp_benchmark_model_shapes():
    mats, other = PJ.model_matrices(PJ.load_inputs()["models"]["matrixfsdp-32x4096"])
    d = 4096
    assert len(mats) == 32 * 7
    # q, k, v, proj d^2 each; up0, up1 (f/2) d each; down d f (f = 16384): 4 d^2 + 2 * 2 d^2 + 4 d^2 = 12 d^2
    assert sum(x.m * x.n for x in mats) == 32 * 12 * d * d
    assert other == 32 * 4 * d + 2 * d  # two LayerNorms a layer and a final one, weight and bias


def test_calibration_reads_the_published_setups():
    inputs = PJ.load_inputs()
    cases = {c["label"]: c for c in inputs["calibration"]}
    for label, c in cases.items():
        if label.startswith("Dobb paper") and "GPT-2" in label:
            assert c["model"].endswith("-paper") and c["stat_sync_in_step"] is False, label
        if "Qwen3" in label:
            assert c["stat_sync_in_step"] is True, label
        for pt in c["points"]:
            if label.startswith("Dobb paper") and pt["method"]["kind"] in ("dobb", "dobb-g"):
                assert pt["method"]["product_dtype"] == "fp32", (label, pt["published"])
                assert pt["method"]["kernels"].endswith("-fp32"), (label, pt["published"])  # its trace multiplies in fp32
            if label.startswith("MatrixFSDP"):  # both rows step the matrices with torch.optim.Muon on a bf16 model
                assert pt["method"]["ns_steps"] == 2 and pt["method"]["kernels"] == "torch-muon-bf16"


# ----------------------------------------------------------------------------- issue 43's audit: the added sources
def test_gram_newton_schulz_flops_by_hand():
    # 8 x 4: a = 4, b = 8. Two X X^T and two Q X (2 a^2 b = 256 each), 14 a x a products (2 a^3 = 128 each);
    # SYRK halves the symmetric ones (the two X X^T and the 14): 128 + 128 + 512 + 896 = 1664
    assert PJ.gram_ns_flops(8, 4) == pytest.approx(1664)
    assert PJ.gram_ns_flops(4, 8) == pytest.approx(1664)
    assert PJ.gram_ns_flops(8, 4, syrk=False) == pytest.approx(4 * 256 + 14 * 128)


def test_dmuon_owner_plan_by_hand():
    # q, o: 6M entries each (q squarer: more Gram NS FLOPs); k, v: 1M and 2M (under 5M: merged a layer)
    q, o, a, b = (2500, 2400), (3000, 2000), (1000, 1000), (2000, 1000)
    mats = [PJ.Matrix(f"h{i}.{nm}", *shape, True) for i in range(2)
            for nm, shape in (("q", q), ("o", o), ("k", a), ("v", b))]
    # units 6M x 4 (layer order), then the two 3M merges. q0 -> 0; o0 -> 1 (0 used in layer 0); q1 -> 0
    # (least loaded, first); o1 -> 1; k0 + v0 -> 0 (both used in layer 0, 12M each); k1 + v1 -> 1 (12M < 15M)
    assert PJ.dmuon_owners(mats, 2) == [0, 1, 0, 0, 0, 1, 1, 1]
    # the busiest owner by Gram NS FLOPs sets the step: rank 0 holds q0, q1, k0, v0
    got = PJ.project({"kind": "placement-muon", "partition": "dmuon", "ns": "gram-syrk"}, mats, 0, PJ.Layout(fs=2), HW)
    flops = [PJ.gram_ns_flops(x.m, x.n) for x in mats]
    assert flops[0] + flops[4] + flops[2] + flops[3] > flops[1] + flops[5] + flops[6] + flops[7]
    assert got["matmul_ms"] == pytest.approx(_ms((flops[0] + flops[4] + flops[2] + flops[3]) / 1e12))


def test_benchmark_loops_select_matrices_and_count_their_own_kernels():
    mats = [PJ.Matrix("h0.q", 8, 4, True), PJ.Matrix("h0.k", 2, 4, True)]
    hw = HW.with_(kernel_s=1e-6)
    hp = {"kind": "gather-muon", "grad_bytes": 4, "select": {"min_entries": 16}, "kernels_per_matrix": 66,
          "loop_bytes": {"whole": 100, "gram": 70, "local": 18},
          "other_update": {"bytes_per_entry": 12, "kernels_per_tensor": 1}}
    got = PJ.project(hp, mats, 10, LAY, hw, tensors=3)
    # q (32 entries) is gathered and orthogonalized; k (8 < 16) takes the add_ with the 10 other entries.
    # The loop's bytes: 100 a whole entry of q (32), 70 a Gram entry (4 x 4), 18 a local entry (16)
    assert got["matmul_ms"] == pytest.approx(_ms(3200 / 1e12))
    assert got["hbm_ms"] == pytest.approx(_ms((100 * 32 + 70 * 16 + 18 * 16 + 12 * 8 / 2 + 12 * 10 / 2) / 1e11))
    assert got["launch_ms"] == pytest.approx(_ms((66 + 1 + 3) * 1e-6))  # q's loop, k's add_, 3 other tensors
    # one gather of q's 32 fp32 entries over 2 ranks: half arrives, 64 B over NVLink, one latency
    assert got["link_ms"] == pytest.approx(_ms(64 / 1e10)) and got["latency_ms"] == pytest.approx(_ms(1e-5))
    # DDP (fs = 1): nothing to gather, every rank orthogonalizes every whole matrix
    ddp = PJ.project({"kind": "gather-muon", "kernels_per_matrix": 46}, mats, 0, PJ.Layout(fs=1, dp=8), hw)
    assert ddp["link_ms"] == 0 and ddp["latency_ms"] == 0
    assert ddp["matmul_ms"] == pytest.approx(_ms((3200 + PJ.ns_flops(2, 4)) / 1e12))
    assert ddp["launch_ms"] == pytest.approx(_ms(2 * 46 * 1e-6))


def test_dobb_g_output_side_by_hand():
    got = PJ.project({"kind": "dobb-g", "norm": "l2", "blocks": 2, "refresh_every": 4}, MAT, 0, LAY, HW, counts=HAND)
    # local 4 x 4 (rows 4 of 8); blocks min(8 / 2, 4) = 4 rows: one local block, its statistic 4 x 4 = 16 entries.
    # Steady: 76 B x 16 + 4 B x 16 (traced); products 4 rows k s = 4 * 4 * 4 * 4 = 256 (rows = the 4 columns, k = s = 4)
    steady = (76 * 16 + 4 * 16) / 1e11 + 256 / 1e12
    # refresh of the one local block: A Q 2 k s^2 = 128, QR (4/3) 64 fp32; (48 - 4) B x 16 = 704 B more;
    # the statistic of the whole 8-row axis (the FSDP shards sit on data-parallel ranks), 8 x 4 = 32 fp32
    # entries, all-reduced over 2 ranks: 2 * 32 * 1/2 * 4 = 128 B, one latency
    refresh = (128 + 256 / 3) / 1e11 + 704 / 1e11 + 128 / 1e10 + 1e-5
    assert got["steady_ms"] == pytest.approx(_ms(steady))
    assert got["periodic_ms"] == pytest.approx(_ms(steady + refresh))
    assert got["amortized_ms"] == pytest.approx(_ms(steady + refresh / 4))


def test_dobb_g_l2_sums_norms_over_tp_on_row_parallel_matrices():
    row_parallel = [PJ.Matrix("h0.o", 4, 8, False)]
    lay = PJ.Layout(fs=1, tp=2)
    l2 = PJ.project({"kind": "dobb-g", "norm": "l2", "blocks": 1, "refresh_every": 9}, row_parallel, 0, lay, HW)
    sign = PJ.project({"kind": "dobb-g", "blocks": 1, "refresh_every": 9}, row_parallel, 0, lay, HW)
    # TP splits the input axis: the 4 local rows' norms, fp32, all-reduced over 2 ranks every step:
    # 2 * 4 * 4 * 1/2 = 16 B over NVLink, one latency
    assert l2["steady_ms"] - sign["steady_ms"] == pytest.approx(_ms(16 / 1e10 + 1e-5))
    col = PJ.project({"kind": "dobb-g", "norm": "l2", "blocks": 1, "refresh_every": 9}, MAT, 0, lay, HW)
    assert col["latency_ms"] == 0  # column-parallel: whole rows on each rank, nothing to sum


def test_qwen2_shapes_match_published_parameter_counts(tmp_path):
    inputs = PJ.load_inputs()
    for name, count in (("qwen2.5-1.5b", 1_543_714_304), ("qwen2.5-7b", 7_615_616_512),
                        ("llama3.2-3b-dmuon", 3_606_752_256)):
        mats, other = PJ.model_matrices(inputs["models"][name])
        assert sum(x.m * x.n for x in mats) + other == count, name
    # 28 layers x (2 norms + q, k, v biases) + tied embedding + final norm
    assert PJ.other_tensors(inputs["models"]["qwen2.5-1.5b"]) == 28 * 5 + 2
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
                               "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
                               "vocab_size": 151936, "tie_word_embeddings": True}))
    spec = PJ.config_spec(str(cfg), inputs)
    assert spec["qkv_bias"] is True
    assert sum(x.m * x.n for x in PJ.model_matrices(spec)[0]) + PJ.model_matrices(spec)[1] == 1_543_714_304


def test_dion_on_qwen3_counts_one_reading_and_shows_the_other():
    inputs = PJ.load_inputs()
    rec = PJ.build(inputs)
    dion = [c for c in rec["calibration"] if "Qwen3" in c["case"] and c["published"].startswith("Dion")]
    # counted: the rank fraction 1/FS, one point a table row (Qwen3-8B FS 8, 16; Qwen3-32B FS 32, 64 x TP 2)
    assert [c["published_ms"] for c in dion] == [159.5, 146.1, 1307.7, 1287.5]
    assert all(c["reading"] == "rank fraction 1/FS" and not c["fitted"] for c in dion)
    points = {c["label"]: c for c in inputs["calibration"]}
    fs = [points[c["case"]]["layout"]["fs"] for c in dion]
    assert fs == [8, 16, 32, 64] and [next(p for p in points[c["case"]]["points"] if p["published"] == c["published"])
                                      ["method"]["rank_fraction"] for c in dion] == [1 / f for f in fs]
    # the other reading, a rank of 1024/FS, beside the table, not counted
    entry = next(e for e in rec["not_calibrated"] if "Dion on Qwen3" in e["label"])
    assert [r["label"] for r in entry["reading_ratios"]] == ["rank 1024/FS"]
    case = points[entry["cases"][0]["label"]]  # Qwen3-8B, FS 8
    hw = PJ.Hardware.from_inputs(inputs["hardware"][case["hardware"]], rec["fitted"])
    mats, other = PJ.model_matrices(inputs["models"][case["model"]])
    tensors = PJ.other_tensors(inputs["models"][case["model"]])
    ms = PJ.project({"kind": "dion", "rank": 128}, mats, other, PJ.Layout(8), hw, True, inputs["kernels"]["methods"],
                    tensors)["amortized_ms"]
    assert entry["reading_ratios"][0]["ratios"][0] == pytest.approx(ms / 159.5)
    # the summary counts them; without them, the 55 points that rest on no chosen reading
    s = rec["summary"]
    assert s["unfitted"] == s["without_readings"]["unfitted"] + 4 == len(rec["calibration"]) - 2
    assert s["within_2x"] - s["without_readings"]["within_2x"] == sum(0.5 <= c["ratio"] <= 2 for c in dion)


def test_benchmark_loop_bytes_of_the_owner_step_by_hand():
    # DMuon's owner step: 60 B an owned entry and 8 a Gram entry (its loop, counted from its source); its
    # AdamW loop 88 B an entry. Two 8 x 4 matrices on 2 ranks: each rank owns one (32 entries, a = 4)
    mats = [PJ.Matrix("h0.q", 8, 4, True), PJ.Matrix("h1.q", 8, 4, True)]
    hp = {"kind": "placement-muon", "loop_bytes": {"owned": 60, "gram": 8}, "kernels_per_matrix": 33,
          "other_update": {"bytes_per_entry": 88, "kernels_per_tensor": 9}}
    got = PJ.project(hp, mats, 10, LAY, HW)
    assert got["hbm_ms"] == pytest.approx(_ms((60 * 32 + 8 * 16 + 88 * 10 / 2) / 1e11))


def test_dmuon_benchmark_points_read_its_setup():
    inputs = PJ.load_inputs()
    dm = [c for c in inputs["calibration"] if c["label"].startswith("DMuon LLM benchmark")]
    assert sum(len(c["points"]) for c in dm) == 14  # 4 models x AdamW, FSDP2+Muon, DMuon; DDP+Muon on two
    for c in dm:
        assert c["hardware"] == "a800-sxm" and "cfa7703" in c["source"]
        assert c["layout"] == ({"fs": 1, "tp": 1, "dp": 8} if "DDP" in c["label"] else {"fs": 8, "tp": 1, "dp": 1})
        for pt in c["points"]:
            m = pt["method"]
            if pt["published"] == "DMuon":
                assert m["partition"] == "dmuon" and m["ns"] == "gram-syrk" and m["kernels_per_matrix"] == 33
            if pt["published"] == "FSDP2+Muon":  # bench_llm.py: numel >= 1024 * 1024 and rows <= 20000
                assert m["select"] == {"min_entries": 1048576, "max_rows": 20000} and m["grad_bytes"] == 4
    # Qwen2.5-1.5B's k and v (256 x 1536) fall under the FSDP2+Muon baseline's size cut
    mats, _ = PJ.model_matrices(inputs["models"]["qwen2.5-1.5b"])
    sel = {"select": {"min_entries": 1048576, "max_rows": 20000}}
    assert {x.name.split(".")[1] for x in mats if not _selected(x, sel)} == {"k", "v"}
