"""dobb_bench.cost.roofline: derived step costs against hand counts and allocated buffers, the roofline
bound on known numbers, the profile split on synthetic events, and the two commands end to end."""
from __future__ import annotations

import json

import pytest

from dobb_bench.cli import main
from dobb_bench.cost import roofline as R


def test_adamw_and_muon_costs_are_hand_counts():
    c = R.step_cost("torch-adamw", 30, 20)
    assert c["bytes"] == 7 * 4 * 600 and c["state_bytes"] == 2 * 4 * 600 and c["flops"] == 0
    m = R.step_cost("muon", 30, 20)  # short side 20: per NS step 4*20*20*30 + 2*20**3
    assert m["flops"] == 5 * (4 * 20 * 20 * 30 + 2 * 20 ** 3) and m["bytes"] == 5 * 4 * 600


def test_dobb_cost_counts_blocks():
    m, n, B, T = 48, 64, 4, 8
    s = n // B
    c = R.step_cost("dobb", m, n, {"blocks": B, "refresh_every": T})
    # project + reconstruct: 2 products of (m x s)(s x s) per block = 4 m n s
    refresh = 2 * n * s * s + B * 4 / 3 * s ** 3
    assert c["flops"] == pytest.approx(4 * m * n * s + refresh / T)
    assert c["state_bytes"] == 4 * m * n + 6 * n * s  # Table 18: mn fp32 + fp32 stat + bf16 basis
    g = R.step_cost("dobb-g", m, n, {"blocks": B})  # output side blocks the m axis
    assert g["state_bytes"] == 4 * m * n + 6 * m * (m // B)
    # the blocked axis is the registry's (dobb-g: output) unless side= says otherwise: a side=output
    # Dobb costs what Dobb-G costs, and Dobb-G-l2 (no "dobb-g" prefix rule needed) blocks the m axis
    assert R.step_cost("dobb", m, n, {"blocks": B, "side": "output"}) == g
    assert R.step_cost("dobb-g-l2", m, n, {"blocks": B}) == g
    with pytest.raises(ValueError, match="no cost model"):
        R.step_cost("owner-muon", m, n)


def test_roofline_bound_and_fraction():
    peaks = {"bandwidth_gbs": 10.0, "matmul_gflops": {"float32": 100.0, "bfloat16": 1.0}}
    mem = R.roofline_fraction({"bytes": 1e9, "flops": 0, "flops_dtype": None}, 200.0, peaks)
    assert mem["bound"] == "memory" and mem["bound_ms"] == pytest.approx(100.0) and mem["fraction"] == pytest.approx(0.5)
    # an emulated bf16 matmul is bounded by the fp32 ceiling, not by the slow bf16 path
    mat = R.roofline_fraction({"bytes": 1e6, "flops": 1e10, "flops_dtype": "bfloat16"}, 400.0, peaks)
    assert mat["bound"] == "matmul" and mat["t_flop_ms"] == pytest.approx(100.0) and mat["fraction"] == pytest.approx(0.25)


def test_looptime_and_roofline_commands(tmp_path, capsys):
    out = tmp_path / "lt"
    rc = main(["looptime", "--optimizers", "torch-adamw", "dobb:blocks=2:stagger=false", "--preset", "tiny", "--vocab", "64",
               "--batch", "2", "--seq-len", "8", "--cycles", "2", "--cycle-len", "3", "--warmup", "0",
               "--out", str(out)])
    assert rc == 0
    rec = json.loads((out / "looptime.json").read_text())
    assert "git_rev" in rec["provenance"] and rec["config"]["threads"] == 1
    ref, fused, d = rec["summaries"]  # both AdamW references first: foreach, fused
    assert fused["spec"] == "torch-adamw-fused" and fused["ratio_to_fused_adamw"]["median"] == 1.0
    assert d["ratio_to_fused_adamw"]["median"] > 0
    assert ref["ratio_to_adamw"]["median"] == 1.0 and len(d["steps_ms"]) == 6
    assert d["refresh"] == [True] + [False] * 5  # unstaggered: the first step refreshes, then every 9th
    assert d["state_bytes_measured"] == pytest.approx(d["derived"]["state_bytes"] + 0, rel=1e-3)
    rc = main(["roofline", "--looptime", str(out / "looptime.json"), "--mb", "4", "--size", "64",
               "--out", str(tmp_path / "rf")])
    assert rc == 0
    rf = json.loads((tmp_path / "rf" / "roofline.json").read_text())
    assert [r["spec"] for r in rf["rows"]] == ["torch-adamw", "torch-adamw-fused", "dobb:blocks=2:stagger=false"]
    assert all(r["fraction"] > 0 for r in rf["rows"])


def test_roofline_missing_record_is_one_line_error(tmp_path, capsys):
    assert main(["roofline", "--looptime", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "no such record" in capsys.readouterr().err


def test_gpu_check_cpu_smoke(tmp_path):
    """scripts/gpu_check.py runs its whole path on CPU (tiny shapes): every optimizer timed, state
    bytes measured equal to derived, goals computed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--cpu-smoke", "--cycles", "1", "--slow-steps", "1", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["optimizer"]: r for r in rec["rows"]}
    assert set(rows) == {"torch-adamw", "dobb", "dobb-graph", "torch-muon", "dion"}
    assert rows["dobb"]["steps"] == 9 and rows["torch-muon"]["steps"] == 1
    for r in rows.values():
        scalars = 4 * rec["matrices"] if r["optimizer"] == "torch-adamw" else 0  # AdamW step counters
        assert r["state_bytes_measured"] - scalars == r["state_bytes_derived"], r["optimizer"]
    assert set(rec["goals"]) >= {"dobb / fused adamw <= 1.1", "torch muon / dobb >= 20"}
    assert "git_rev" in rec["provenance"]
