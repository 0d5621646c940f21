"""The bench keeps the refresh its records were made with: where it builds Dobb (or a preset) for a
run that may hold a process group (``timing``, ``train``), it passes ``split_refresh=False`` unless
the spec sets it (``dobb_bench.specs.recorded_refresh``), so the library's default split (issue 54)
adds no basis broadcast to a committed record's metered collectives and moves none of its timings."""
import pytest
import torch

from dobb_bench.cost import payload_command
from dobb_bench.cost import timing_run as T
from dobb_bench.specs import parse_spec, recorded_refresh
from dobb_bench.training import commands_train


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
