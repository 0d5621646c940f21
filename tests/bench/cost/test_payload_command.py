"""dobb_bench.cost.payload_command (``dobb-bench payload``): the printed Figure 1 ratio."""
import json


from dobb_bench.cli import main


def test_payload_command_prints_figure1_ratio(capsys, tmp_path):
    assert main(["payload", "--preset", "xl", "--optimizers", "muon", "dion:rank_fraction=1/16", "dobb:blocks=16",
                 "dobb-l2:blocks=16", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| dion:rank_fraction=1/16 | 3.2e+05 | 8e+05 | 8e+05 | 0.0938 |" in text
    assert "| dobb:blocks=16 | 0 | 0 | 0 | 0.0000 |" in text
    data = json.loads((tmp_path / "payload.json").read_text())
    assert data["derived"]["rows"][0]["relative_to_muon"] == 1.0


def test_payload_table_gets_a_basis_column_only_with_split_refresh(capsys, tmp_path):
    assert main(["payload", "--preset", "xl", "--optimizers", "muon", "dobb:blocks=16", "--out", str(tmp_path)]) == 0
    assert "DP basis broadcast per refresh" not in capsys.readouterr().out
    assert main(["payload", "--preset", "xl", "--optimizers", "dobb:blocks=16",
                 "dobb:blocks=16:split_refresh=true", "--out", str(tmp_path / "split")]) == 0
    text = capsys.readouterr().out
    assert "DP basis broadcast per refresh" in text
    rows = json.loads((tmp_path / "split" / "payload.json").read_text())["derived"]["rows"]
    assert rows[0]["dp_basis_per_refresh"] == 0
    # every XL matrix's input axis (1600 or 6400 wide) in 16 even blocks: the whole statistic's entries
    assert rows[1]["dp_basis_per_refresh"] == rows[1]["dp_stat_per_refresh"] > 0
