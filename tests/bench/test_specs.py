"""dobb_bench.specs: the one optimizer-spec grammar shared by compare, ablate, timing and payload."""
import pytest
import torch

from dobb_bench import specs
from dobb_bench.cost import payload_command, timing_run
from dobb_bench.cost import timing_run as T
from dobb_bench.specs import parse_spec, recorded_refresh
from dobb_bench.training import commands_train


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


# ----------------------------------------------------------------------------- recorded_refresh
# The bench keeps the refresh its records were made with: where it builds Dobb (or a preset) for a
# run that may hold a process group (``timing``, ``train``), it passes ``split_refresh=False`` unless
# the spec sets it (``dobb_bench.specs.recorded_refresh``), so the library's default split (issue 54)
# adds no basis broadcast to a committed record's metered collectives and moves none of its timings.


@pytest.mark.parametrize("name", ["dobb", "dobb-l2", "dobb-g", "dobb-g-l2", "dobb-muon"])
def test_dobb_and_its_presets_keep_the_unsplit_refresh(name):
    assert recorded_refresh(name) == {"split_refresh": False}
    assert recorded_refresh(name, {"blocks": 4}) == {"split_refresh": False}
    for value in (True, False):  # a spec that sets it keeps its own
        assert recorded_refresh(name, {"split_refresh": value}) == {}


@pytest.mark.parametrize("name", ["adamw", "torch-adamw", "muon", "owner-muon", "soap", "no-such-optimizer"])
def test_other_optimizers_get_nothing(name):
    assert recorded_refresh(name) == {}


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("spec, split", [("dobb", False), ("dobb-muon:blocks=2", False),
                                         ("dobb:split_refresh=true", True), ("dobb:split_refresh=false", False)])
def test_timing_and_train_build_dobb_with_the_recorded_refresh(spec, split):
    s = parse_spec(spec)
    assert T.make_optimizer(s, _model(), 1e-3, 0.1).split_refresh is split
    assert commands_train.make_optimizer(s.name, dict(s.hparams), 1e-3, 0.1, _model()).split_refresh is split


@pytest.mark.slow
def test_fsdp2_timing_run_broadcasts_bases_only_when_its_spec_splits():
    """Two gloo ranks, FSDP2: the default spec's step moves only the statistic (the records'
    collectives); ``split_refresh=true`` adds the basis broadcasts."""
    result = payload_command.measure_fsdp_payload(["dobb:stagger=false", "dobb:stagger=false:split_refresh=true"],
                                                  "tiny", "1", 2)
    by = {s["label"]: s["metered"] for s in result["summaries"]}
    plain, split = by["dobb:stagger=false"], by["dobb:stagger=false:split_refresh=true"]
    assert plain["step"]["refresh"] and "broadcast" not in plain["step"]["by_op"]
    assert plain["step"]["bytes"] == plain["step"]["stat_bytes"]
    assert split["step"]["by_op"]["broadcast"]["count"] > 0
    assert split["step"]["stat_bytes"] == plain["step"]["stat_bytes"]
