"""dobb._hparams: the kind of a hyperparameter follows its default; every mismatch is a ValueError
that names the parameter (the message is what users read, so it is compared whole)."""
import math

import pytest
import torch

from dobb._hparams import check_kind, check_kinds


@pytest.mark.parametrize("default,good", [
    (True, [False, True]),
    (4, [1, 0, -3]),
    (0.9, [0, 1, 0.5, -2.0, math.inf, torch.tensor(0.1)]),
    ((0.9, 0.95), [(0.8, 0.9), [0, 1]]),
    ("sign", ["l2", None, 3]),  # strings, dtypes, None: left to the class' own check
    (torch.float32, ["float32", torch.bfloat16]),
    (None, ["anything", 1]),
])
def test_values_of_the_default_kind_pass(default, good):
    for value in good:
        check_kind("x", value, default)


@pytest.mark.parametrize("default,bad,message", [
    (True, 1, "x must be True or False, got 1"),
    (4, 4.0, "x must be an integer, got 4.0"),
    (4, True, "x must be an integer, got True"),
    (0.9, "0.9", "x must be a real number, got '0.9'"),
    (0.9, False, "x must be a real number, got False"),
    (0.9, math.nan, "x must be a real number, got nan"),
    (0.9, torch.tensor([0.1, 0.2]), "x must be a real number, got tensor([0.1000, 0.2000])"),
    ((0.9, 0.95), (0.9,), "x must be 2 real numbers, e.g. (0.9, 0.95), got (0.9,)"),
    ((0.9, 0.95), (0.9, "0.95"), "x must be 2 real numbers, e.g. (0.9, 0.95), got (0.9, '0.95')"),
])
def test_values_of_another_kind_are_value_errors_naming_the_parameter(default, bad, message):
    with pytest.raises(ValueError) as err:
        check_kind("x", bad, default)
    assert str(err.value) == message


def test_check_kinds_checks_only_keys_with_defaults():
    check_kinds({"blocks": 2, "params": ["not", "checked"]}, {"blocks": 1})
    with pytest.raises(ValueError, match="^blocks must be an integer"):
        check_kinds({"blocks": "2"}, {"blocks": 1})
