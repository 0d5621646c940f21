"""dobb_bench.specs: the one optimizer-spec grammar shared by compare, ablate, timing and payload."""
import pytest
import torch

from dobb_bench import specs
from dobb_bench.cost import payload_command, timing_run
from dobb_bench.specs import parse_spec


def test_values_are_typed():
    s = parse_spec("dobb:blocks=4:norm=l2:nesterov=true:momentum=0.9:basis_dtype=float32@Mine")
    assert s.name == "dobb" and s.label == "Mine"
    assert s.hparams == {"blocks": 4, "norm": "l2", "nesterov": True, "momentum": 0.9, "basis_dtype": torch.float32}
    assert type(s.hparams["blocks"]) is int and s.hparams["basis_dtype"] is torch.float32
    assert parse_spec("dion:rank_fraction=1/16").hparams == {"rank_fraction": 0.0625}
    assert parse_spec("muon:adamw_betas=(0.9,0.99)").hparams == {"adamw_betas": (0.9, 0.99)}
    assert parse_spec(" DION:rank_fraction=1/4 ").text == "DION:rank_fraction=1/4"


def test_default_labels():
    assert parse_spec("dion:rank_fraction=1/16").label == "Dion rho=1/16"
    assert parse_spec("dobb:blocks=4").label == "Dobb B=4"
    assert parse_spec("dobb-g-l2").label == "Dobb-G-l2"


@pytest.mark.parametrize("text, message", [
    ("dobb:blocks", "key=value"),
    (":blocks=4", "empty name"),
    ("dobb:=4", "key=value"),
    ("dobb:blocks=", "key=value"),
    ("dobb:stat_dtype=float99", "not a torch dtype"),
    ("dion:rank_fraction=1/0", "division by zero"),
    ("dion:rank_fraction=1/16,qr=rcqr", "dion:rank_fraction=1/16:qr=rcqr"),
    ("muon:adamw_betas=(0.9,0.99),nesterov=true", r"muon:adamw_betas=\(0.9,0.99\):nesterov=true"),
])
def test_bad_specs_raise_value_errors_naming_the_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_timing_and_payload_read_the_same_grammar():
    timed = timing_run.parse_optimizers(["dion:rank_fraction=1/16:qr=householder", "dobb:blocks=4@B4"])
    assert [(o.label, o.name, o.hparams) for o in timed] == [
        ("torch-adamw", "torch-adamw", {}),
        ("torch-adamw-fused", "torch-adamw-fused", {}),
        ("dion:rank_fraction=1/16:qr=householder", "dion", {"rank_fraction": 0.0625, "qr": "householder"}),
        ("B4", "dobb", {"blocks": 4, "refresh_every": 9})]
    table = payload_command.payload_rows(["dion:rank_fraction=1/16:qr=householder"], [("a", (8, 16))], "output", 4)
    assert table["rows"][0]["per_matrix"]["8x16"] == 1 * (8 + 16)  # r = round(8/16) = 1
    with pytest.raises(ValueError, match="':'"):
        payload_command.payload_rows(["dion:rank_fraction=1/16,qr=rcqr"], [("a", (8, 16))], "output", 4)
    assert specs.PRETTY["dobb-g"] == "Dobb-G"


def test_display_names_are_the_registry_labels():
    import dobb

    assert specs.PRETTY == {n: e.label for n, e in dobb.registry.OPTIMIZERS.items()}
    assert parse_spec("dobb-g-l2:blocks=4").label == dobb.registry.get("dobb-g-l2").label + " B=4"
    assert set(timing_run.DOBB_NAMES) == {n for n, e in dobb.registry.OPTIMIZERS.items() if issubclass(e.cls, dobb.Dobb)}


def test_what_an_optimizer_is_comes_from_the_registry():
    """``refreshes``/``registry_entry`` answer from dobb.registry's classes and presets, not a name's
    prefix: every Dobb preset refreshes and nothing else does (a Dobb-named optimizer that is not
    ``Dobb`` would be wrong under a prefix rule); the torch references stand for their entries."""
    import dobb

    for name, entry in dobb.registry.OPTIMIZERS.items():
        assert specs.refreshes(name) is issubclass(entry.cls, dobb.Dobb)
        assert specs.registry_entry(name) is entry
    assert specs.registry_entry("torch-adamw").cls is torch.optim.AdamW and not specs.refreshes("torch-adamw")
    assert specs.registry_entry("torch-muon").cls is dobb.Muon
    assert specs.registry_entry("dobbish") is None and not specs.refreshes("dobbish")


def test_spec_parsing():
    s = parse_spec("dion:rank_fraction=1/16")
    assert (s.name, s.hparams, s.label) == ("dion", {"rank_fraction": 0.0625}, "Dion rho=1/16")
    s = parse_spec("dobb:blocks=4:norm=l2:nesterov=true@Mine")
    assert s.hparams == {"blocks": 4, "norm": "l2", "nesterov": True} and s.label == "Mine"
    assert parse_spec("dobb:basis_dtype=float32").hparams["basis_dtype"] is torch.float32
    with pytest.raises(ValueError, match="malformed"):  # dobb_bench.specs: a ValueError, exit code 2 in the CLI
        parse_spec("dobb:blocks")
