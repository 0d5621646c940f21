"""dobb_bench.spectral.commands (``orthogonality``, ``spectrum``): the CLI's outputs and errors,
tiny end-to-end runs."""
import torch

from dobb_bench.cli import main


def test_cli_tables_and_errors(capsys, tmp_path, tiny_data):
    assert main(["orthogonality", "--table", "1a", "--size", "32", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 80% |" in out and "0.736" in out
    assert main(["orthogonality", "--table", "1b", "--size", "24", "--seeds", "1"]) == 0
    assert "column l2" in capsys.readouterr().out
    for argv, msg in ((["--table", "3"], "unknown table"),
                      (["--table", "2", "--checkpoint", str(tmp_path / "none.pt")], "does not exist"),
                      (["--table", "1a", "--size", "0"], "--size"),
                      (["--table", "2", "--blocks", "1,x"], "--blocks")):
        assert main(["orthogonality", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1
    bad = tmp_path / "bad.pt"
    torch.save({"weights": {}}, bad)
    assert main(["orthogonality", "--table", "2", "--checkpoint", str(bad)]) == 2
    assert "must hold 'model'" in capsys.readouterr().err


def test_cli_spectrum_end_to_end(capsys, tmp_path, tiny_data):
    out = tmp_path / "spec"
    argv = ["spectrum", "--preset", "tiny", "--steps", "4", "--optimizer", "adamw", "--batch-size", "4",
            "--probe-batches", "1", "--data", tiny_data, "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| >= 50% |" in text and "attn.v" in text
    assert (out / "spectrum_A.png").stat().st_size > 0 and (out / "spectrum_G.png").exists()
    assert main(["spectrum", "--from-json", str(out / "spectrum.json")]) == 0
    assert "| >= 50% |" in capsys.readouterr().out
    assert main(["spectrum", "--fractions", "50,150"]) == 2
    assert main(["spectrum", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
