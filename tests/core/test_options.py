"""dobb.core.options: each Dobb param-group option's valid values and the combinations refused, with the
whole message (a ValueError that names the option and what is valid), on group dicts and through Dobb."""
import pytest
import torch
from torch import nn

import dobb
from dobb.core import options as O


def _group(**over):
    g = {**dobb.Dobb.matrix_defaults, "params": [torch.zeros(4, 4)], **over}
    return g


def _check(group, has_model=True):
    O.check_group(group, lambda p, i: f"param {i}", has_model=has_model)


def test_the_defaults_pass_and_are_among_the_choices():
    _check(_group())
    for key, options in O.CHOICES.items():
        assert dobb.Dobb.matrix_defaults[key] in options, key
    assert set(O.HOOK_SOURCES) < set(O.CHOICES["source"]) and "grad_gram" not in O.HOOK_SOURCES


@pytest.mark.parametrize("over,message", [
    (dict(norm="linf"), "norm must be one of ('sign', 'l2', 'adam', 'muon'), got 'linf'"),
    (dict(blocks=0), "blocks must be an integer >= 1, got 0"),
    (dict(out_blocks=True), "out_blocks must be an integer, got True"),  # its kind, checked first
    (dict(stat_decay=1.0), "stat_decay must lie in [0, 1), got 1.0"),
    (dict(eps=0.0), "eps must be a finite number > 0, got 0.0"),
    (dict(side="output"), "source='activation' gives an n x n statistic: it needs side='input' (or 'both')"),
    (dict(side="both", norm="l2"), "norm='l2' normalizes one side's coefficient columns; side='both' takes norm='sign' or 'adam'"),
    (dict(norm="adam"), "norm='adam' is the second moment of the two-sided coefficients: it needs side='both'"),
    (dict(source="output_grad"), "source='output_grad' gives an m x m statistic: it needs side='output' (Dobb-G)"),
    (dict(basis_dtype=torch.int8), "basis_dtype must be a floating torch.dtype, got torch.int8"),
    (dict(product_dtype="fast"), "product_dtype must be one of"),
])
def test_each_refusal_names_the_option_and_what_is_valid(over, message):
    with pytest.raises(ValueError) as err:
        _check(_group(**over))
    assert str(err.value).startswith(message)


def test_stacks_and_hooks_are_refused_where_they_cannot_work():
    stack = _group(params=[torch.zeros(2, 4, 4)], side="both")  # hooks would read routed output gradients
    with pytest.raises(ValueError, match=r"^param 0 is an expert stack .* use source='grad_gram' for side='both'"):
        _check(stack)
    _check(_group(params=[torch.zeros(2, 4, 4)], side="both", source="grad_gram"))  # two-sided stacks: grad_gram
    routed = _group(params=[torch.zeros(2, 4, 4)], side="output", source="output_grad")
    with pytest.raises(ValueError, match=r"^param 0 is an expert stack .* use source='grad_gram' for side='output'"):
        _check(routed)
    with pytest.raises(ValueError, match=r"^source='activation' captures statistics with hooks: pass model="):
        _check(_group(), has_model=False)
    _check(_group(source="grad_gram"), has_model=False)  # no hooks, no model needed


@pytest.mark.parametrize("kwargs,match", [
    (dict(norm="linf"), "norm"), (dict(side="left"), "side"), (dict(source="weights"), "source"),
    (dict(basis="svd"), "basis"), (dict(qr="givens"), "qr"), (dict(capture="last"), "capture"),
    (dict(blocks=0), "blocks"), (dict(blocks=17), "blocks=17"), (dict(refresh_every=0), "refresh_every"),
    (dict(lr=-1.0), "lr"), (dict(weight_decay=-0.1), "weight_decay"), (dict(stat_decay=1.0), "stat_decay"),
    (dict(source="activation", side="output"), "side='input'"), (dict(bogus=1), "bogus"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    layer = nn.Linear(16, 8)
    kwargs = {"lr": 0.01, **kwargs}
    with pytest.raises(ValueError, match=match):
        dobb.Dobb([layer.weight], layer, **kwargs)
