"""``dobb.resume`` on one process: the registry label of an optimizer, and ``check_resume``
refusing a distributed checkpoint whose optimizer state has another layout, before anything loads
(the FSDP2 routes, 2 and 4 ranks, are in tests/distributed/test_checkpoint_registry.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from dobb import build_optimizer
from dobb.resume import check_resume, optimizer_label


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))


@pytest.mark.parametrize("name, label", [("dobb", "Dobb"), ("dobb-g", "Dobb-G"), ("dobb-g-l2", "Dobb-G-l2"),
                                         ("dash", "DASH"), ("shampoo", "Shampoo"), ("cmuon", "CMuon"),
                                         ("muon", "Muon"), ("adamw", "AdamW")])
def test_label_is_the_registry_entry(name, label):
    assert optimizer_label(build_optimizer(name, _model(), lr=0.01)) == label


def _save(tmp_path, opt, model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path)


def test_check_resume_refuses_another_layout_before_loading(tmp_path):
    model = _model()
    saved = build_optimizer("dash", model, lr=0.01, block_size=8)
    _save(tmp_path, saved, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_resume(model, build_optimizer("dash", model, lr=0.01, block_size=8), tmp_path)  # same layout
        other = build_optimizer("dash", model, lr=0.01, block_size=12)  # other tile shapes
        before = {k: v.clone() for k, v in other.state[model[0].weight].items() if isinstance(v, torch.Tensor)}
        with pytest.raises(ValueError, match=r"DASH cannot resume .* state 'L' of 0\.weight was saved on 1 shard"
                                             r".*resume on 1 ranks"):
            check_resume(model, other, tmp_path)
    after = other.state[model[0].weight]
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing loaded


def test_check_resume_needs_a_checkpoint():
    model = _model()
    with pytest.raises(ValueError, match="checkpoint_id"):
        check_resume(model, build_optimizer("muon", model, lr=0.01))
