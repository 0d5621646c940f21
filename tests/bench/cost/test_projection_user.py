"""``dobb-bench project --config``: a row for every optimizer the README recommends, priced by the
projection's cost model (issue 53 item 11, issue 54 item 1): Dobb-Muon and its per-head form, SOAP
owner-computed and Dobb's ``split_refresh`` by hand on one small matrix; rows the model cannot price
say "not projected" and why; the closing line names the least of the printed amortized column."""
import re

import pytest

from dobb_bench.cli import main
from dobb_bench.cost import projection as PJ

HW = PJ.Hardware(bf16_flops=1e12, fp32_flops=1e11, hbm=1e11, nvlink=1e10, internode=1e9, gpus_per_node=8,
                 lat_intra=1e-5, lat_inter=2e-5)
LAY = PJ.Layout(fs=2)


def _k(pm=0, pg=0, ps=0, b=0.0, bs=0.0, **kw):
    return {"per_matrix": pm, "per_group": pg, "per_shape": ps, "bytes_per_entry": b, "bytes_per_stat_entry": bs, **kw}


HAND = {"adamw": {"steady": _k(8, b=80)}, "dobb-muon": {"steady": _k(b=100, bs=4), "refresh": _k(b=100, bs=48)},
        "dobb-b4": {"steady": _k(b=48, bs=4), "refresh": _k(b=48, bs=48)},
        "soap": {"steady": _k(b=100, bs=50)}, "soap-refresh": {"steady": _k(b=150, bs=90)}}


def _ms(seconds):
    return 1e3 * seconds


def test_dobb_muon_by_hand():
    mat = [PJ.Matrix("h0.fc", 8, 4, True)]  # local 4 x 4 on each of 2 ranks
    hp = {"kind": "dobb-muon", "blocks": 2, "out_blocks": 4, "refresh_every": 4, "split_refresh": False}  # unsplit, by hand
    got = PJ.project(hp, mat, 0, LAY, HW, counts=HAND)
    # three products with 2-wide blocks: 6 r k s = 6 * 4 * 4 * 2 = 192; row blocks min(8 / 4, 4) = 2 rows:
    # 2 blocks of NS5 on 2 x 4: 5 (4 * 4 * 4 + 2 * 8) = 400 each; bytes 100 x 16 + 4 x (k s = 8)
    steady = (192 + 800) / 1e12 + (100 * 16 + 4 * 8) / 1e11
    # refresh as Dobb's input side: A Q 2 k s^2 = 32, QR 2 x (4/3) 8 fp32; 44 B more a statistic entry; the
    # statistic all-reduce 2 * 8 * 1/2 * 4 = 32 B over NVLink
    refresh = (32 + 64 / 3) / 1e11 + 44 * 8 / 1e11 + 32 / 1e10 + 1e-5
    assert got["steady_ms"] == pytest.approx(_ms(steady))
    assert got["periodic_ms"] == pytest.approx(_ms(steady + refresh))


def test_dobb_muon_per_head_blocks_follow_the_heads():
    q, o = PJ.Matrix("h0.q", 8, 8, True), PJ.Matrix("h0.o", 8, 8, False)
    lay = PJ.Layout(fs=1)
    base = {"kind": "dobb-muon", "blocks": 1, "out_blocks": 1, "refresh_every": 1}
    whole = PJ.project(base, [q], 0, lay, HW, counts=HAND)
    heads = PJ.project({**base, "heads": 4}, [q], 0, lay, HW, counts=HAND)
    # q: one NS row block per head, 8 / 4 = 2 rows: 4 blocks of NS5 on 2 x 8, not one on 8 x 8
    ns = lambda a, b: 5 * (4 * a * a * b + 2 * a ** 3)  # noqa: E731 (a <= b)
    assert heads["matmul_ms"] - whole["matmul_ms"] == pytest.approx(_ms((4 * ns(2, 8) - ns(8, 8)) / 1e12))
    # o: 4 input blocks of 2 columns (one a head): 4 QRs a refresh, and 6 r k s = 6 * 8 * 8 * 2
    o_heads = PJ.project({**base, "heads": 4}, [o], 0, lay, HW, counts=HAND)
    assert o_heads["qr"] == 4
    with pytest.raises(PJ.NotProjected, match="heads=3 does not divide"):
        PJ.project({**base, "heads": 3}, [q], 0, lay, HW, counts=HAND)


def test_dobb_muon_needs_whole_rows_under_tp():
    o = PJ.Matrix("h0.o", 8, 8, False)  # row-parallel: TP splits its input axis
    with pytest.raises(PJ.NotProjected, match="whole rows"):
        PJ.project({"kind": "dobb-muon", "blocks": 1, "out_blocks": 1, "refresh_every": 1}, [o], 0,
                   PJ.Layout(fs=1, tp=2), HW, counts=HAND)


def test_soap_owner_computed_by_hand():
    mats = [PJ.Matrix("h0.a", 8, 4, True), PJ.Matrix("h0.b", 4, 4, True)]
    hp = {"kind": "soap", "precondition_frequency": 10, "max_precondition_dim": 10000}
    got = PJ.project(hp, mats, 0, LAY, HW, counts=HAND)
    # owners by soap_cost m n (1 + m + n): 8 x 4 -> 416, 4 x 4 -> 144: one matrix each; the busiest owns 8 x 4.
    # Its products: 4 x 2 m n s per side: 4 * 2 * 32 * (8 + 4) = 3072 fp32; bytes 100 x 32 + 50 x (64 + 16)
    # all-to-all: 2 m n entries of both matrices (96), per rank 96 / 2, half leaves, 4 B: 96 B over NVLink, twice
    steady = 3072 / 1e11 + (100 * 32 + 50 * 80) / 1e11 + 96 / 1e10 + 2 * 1e-5
    assert got["steady_ms"] == pytest.approx(_ms(steady))
    # refresh (every 10): stat Q 2 s^3 a side (1024 + 128) fp32, 2 QRs; (150-100) x 32 + (90-50) x 80 B
    refresh = 1152 / 1e11 + (50 * 32 + 40 * 80) / 1e11
    assert got["periodic_ms"] == pytest.approx(_ms(steady + refresh))
    assert got["qr"] == pytest.approx(2 / 10)
    # a side over max_precondition_dim stays unpreconditioned: only n = 4 of the 8 x 4
    one = PJ.project({**hp, "max_precondition_dim": 4}, mats[:1], 0, PJ.Layout(fs=1), HW, counts=HAND)
    assert one["matmul_ms"] == pytest.approx(_ms((4 * 2 * 32 * 4 + 2 * 64 / 10) / 1e11))
    with pytest.raises(PJ.NotProjected, match="2-D mesh"):
        PJ.project(hp, mats, 0, PJ.Layout(fs=2, tp=2), HW, counts=HAND)


def test_split_refresh_divides_the_solve_and_broadcasts_the_bases():
    mats = [PJ.Matrix(f"h{i}.fc", 8, 4, True) for i in range(2)]
    hp = {"kind": "dobb", "blocks": 2, "refresh_every": 1}
    plain = PJ.project({**hp, "split_refresh": False}, mats, 0, LAY, HW, counts=HAND)
    split = PJ.project({**hp, "split_refresh": True}, mats, 0, LAY, HW, counts=HAND)
    # a row that does not set it (the paper's, the calibration's) is priced unsplit
    assert PJ.project(hp, mats, 0, LAY, HW, counts=HAND) == plain
    # 2 matrices x 2 blocks of 2 columns: 4 solves of 2 k s^2 / 2 + (4/3) s^3 = 16 + 32/3 each; 2 ranks own 2 each
    solve = 16 + 32 / 3
    assert plain["qr"] == 4 and split["qr"] == 2
    assert plain["matmul_ms"] - split["matmul_ms"] == pytest.approx(_ms(2 * solve / 1e11))
    # the bases (k s = 8 entries a matrix, 16 in all, bf16) broadcast: each rank gets half, 16 B, 2 owners
    assert split["link_ms"] - plain["link_ms"] == pytest.approx(_ms(16 / 1e10))
    assert split["latency_ms"] - plain["latency_ms"] == pytest.approx(_ms(2 * 1e-5))


RECOMMENDED = ("block-muon", "dobb-muon", "muonbp", "soap", "adamw", "owner-muon", "dobb")


def _table(out: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| build_optimizer(")]


def test_llama_at_64_gpus_has_every_recommended_row_and_names_the_cheapest(capsys):
    assert main(["project", "--config", "llama3-8b", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    names = [r[0] for r in rows]
    for name in RECOMMENDED:
        assert any(n.startswith(f"build_optimizer({name!r}") for n in names), name
    for call in ("build_optimizer('block-muon', axis=0, blocks=64)", "build_optimizer('muonbp')",
                 "build_optimizer('soap')", "build_optimizer('owner-muon')", "build_optimizer('dobb')",
                 "build_optimizer('dobb', blocks=4)", "build_optimizer('dobb', blocks=64)",
                 "build_optimizer('dobb', blocks=128)", "build_optimizer('dobb', split_refresh=False)",
                 "build_optimizer('dobb-muon', blocks=64, out_blocks=64)",
                 "build_optimizer('dobb-muon', blocks=64, out_blocks=64, heads=32)",
                 "build_optimizer('dobb-muon', blocks=128, out_blocks=64)",
                 "build_optimizer('dobb-muon', blocks=128, out_blocks=64, heads=32)"):
        assert call in names, call
    # every row is projected at this layout, and the closing line names the least amortized figure printed
    amortized = {r[0]: float(r[4]) for r in rows}
    # Dobb's default splits its refresh over the 64 ranks of the statistic group (any device):
    # cheaper than every rank solving every block
    assert amortized["build_optimizer('dobb')"] < amortized["build_optimizer('dobb', split_refresh=False)"] / 4
    low = min(amortized, key=amortized.get)
    lines = out.splitlines()
    closing = lines[lines.index(next(ln for ln in lines if ln.startswith("| build_optimizer(")))
                    + len(rows) + 1]
    assert closing.startswith(f"Cheapest at this scale: {low} ")
    assert f"{amortized[low]:g} ms" in closing or re.search(rf"\b{re.escape(rows[names.index(low)][4])} ms", closing)


def test_closing_line_adds_the_cheapest_row_without_per_step_communication():
    rows = [{"method": "a", "what": "A", "amortized_ms": 1.0, "per_step_communication": True},
            {"method": "b", "what": "B", "amortized_ms": 2.0, "per_step_communication": False},
            {"method": "c", "what": "C", "not_projected": "why"}]
    line = PJ.cheapest_line(rows)
    assert line.startswith("Cheapest at this scale: a (A), 1 ms") and "no per-step communication: b (B), 2 ms" in line
    rows[1]["amortized_ms"] = 0.5
    assert "no per-step communication: " not in PJ.cheapest_line(rows)


def test_rows_the_model_cannot_price_say_not_projected_and_why(capsys):
    assert main(["project", "--config", "llama3-8b", "--gpus", "16", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    soap = next(r for r in _table(out) if r[0] == "build_optimizer('soap')")
    assert soap[2].startswith("not projected: ") and "2-D mesh" in soap[2]
    dm = [r for r in _table(out) if r[0].startswith("build_optimizer('dobb-muon'")]
    assert dm and all(r[2].startswith("not projected: ") and "whole rows" in r[2] for r in dm)
    assert out.count("Cheapest at this scale:") == 1


def test_every_row_name_is_a_build_optimizer_call_the_library_takes():
    """Each row's name parses as ``build_optimizer(name, **options)`` with options the library's
    registry accepts for that name (``dobb.valid_hparams``)."""
    import ast

    import dobb

    spec = PJ.config_spec("llama3-8b", PJ.load_inputs())
    for name, _, _ in PJ.user_rows(spec, 64):
        call = ast.parse(name, mode="eval").body
        assert isinstance(call, ast.Call) and call.func.id == "build_optimizer", name
        opt = ast.literal_eval(call.args[0])
        assert opt in dobb.OPTIMIZER_NAMES, name
        assert {k.arg for k in call.keywords} <= set(dobb.valid_hparams(opt)), name


@pytest.mark.parametrize("config", ["gpt2-xl", "gpt2-large-paper"])
def test_a_named_gpt2_shape_takes_its_width_and_heads_from_the_preset(config, capsys):
    # a named GPT-2 shape carries its preset, not a width: the rows read it from dobb_bench.cost.shapes
    # (GPT-2 XL: width 1600, 25 heads; Large: 1280, 20), so Dobb's 32-column form is B = width / 32
    assert main(["project", "--config", config, "--gpus", "64"]) == 0
    names = [r[0] for r in _table(capsys.readouterr().out)]
    width, heads = {"gpt2-xl": (1600, 25), "gpt2-large-paper": (1280, 20)}[config]
    assert f"build_optimizer('dobb', blocks={width // 32})" in names
    assert f"build_optimizer('dobb-muon', blocks=64, out_blocks=64, heads={heads})" in names
