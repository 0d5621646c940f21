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
