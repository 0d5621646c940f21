"""dobb._hparams: the kind of a hyperparameter follows its default, each value rule refuses what it
should and accepts its bounds, and the typed options (frozen dataclasses) are validated configs from
which every optimizer's group defaults, registry hyperparameters and checks are read. Every refusal
is a ValueError that names the parameter (the message is what users read, so it is compared whole)."""
import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from dobb import _hparams as H
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


# ----------------------------------------------------------------------------- the value rules
@pytest.mark.parametrize("rule,value,message", [
    (H.fraction, 0.0, "x must be a number in (0, 1], got 0.0"),
    (H.fraction, True, "x must be a number in (0, 1], got True"),
    (H.unit_interval, 1.0, "x must lie in [0, 1), got 1.0"),
    (H.closed_unit_interval, 1.5, "x must lie in [0, 1], got 1.5"),
    (H.integer(1), 2.0, "x must be an integer >= 1, got 2.0"),
    (H.integer(1, 5), 0, "x must be an integer in [1, 5], got 0"),
    (H.integer(1, 5), 6, "x must be an integer in [1, 5], got 6"),
    (H.boolean, 1, "x must be True or False, got 1"),
    (H.positive, float("inf"), "x must be a finite number > 0, got inf"),
    (H.positive, 0, "x must be a finite number > 0, got 0"),
    (H.non_negative, -1e-9, "x must be a finite number >= 0, got -1e-09"),
    (H.one_of("a", "b"), "c", "x must be one of ('a', 'b'), got 'c'"),
    (H.optional(H.integer(1)), 0, "x must be None or an integer >= 1, got 0"),
    (H.positive.hint("1 is Muon"), -1.0, "x must be a finite number > 0 (1 is Muon), got -1.0"),
    (H.betas, (0.9, 1.0), "x must be two numbers in [0, 1), got (0.9, 1.0)"),
    (H.floating_dtype, torch.int8, "x must be a floating torch.dtype, got torch.int8"),
    (H.rate, -0.1, "x must be a finite number >= 0, got -0.1"),
    (H.rate, torch.tensor([0.1, 0.2]), "x given as a tensor must hold one real number, got tensor([0.1000, 0.2000])"),
])
def test_rules_name_the_option_and_the_valid_values(rule, value, message):
    with pytest.raises(ValueError) as err:
        rule("x", value)
    assert str(err.value) == message


@pytest.mark.parametrize("rule,value", [
    (H.fraction, 1.0), (H.fraction, 1), (H.unit_interval, 0.0), (H.closed_unit_interval, 1), (H.integer(1), 1),
    (H.integer(1, 5), 5), (H.boolean, False), (H.positive, 1e-30), (H.non_negative, 0.0),
    (H.one_of("a", "b"), "b"), (H.optional(H.integer(1)), None), (H.betas, [0, 0.999]),
    (H.floating_dtype, torch.bfloat16), (H.rate, 0.0), (H.rate, torch.tensor(0.1)),
])
def test_rules_accept_their_bounds(rule, value):
    rule("x", value)


# ----------------------------------------------------------------------------- the typed options
@dataclass(frozen=True, kw_only=True)
class _Opts(H.ScaledOptions):
    blocks: int = H.option(4, H.integer(1))
    mode: str = H.option("a", H.one_of("a", "b"))
    ratio: float = H.option(1.0, H.positive, adamw=True)
    hidden: bool = H.option(False, H.boolean, hparam=False)

    @classmethod
    def _check_together(cls, values):
        super()._check_together(values)
        if values["mode"] == "b" and values["blocks"] != 1:
            raise ValueError("mode='b' needs blocks=1")


def test_options_are_a_validated_typed_config():
    o = _Opts(lr=0.1, blocks=2)
    assert (o.blocks, o.mode, o.tau, o.adamw_betas, o.fused) == (2, "a", 0.2, (0.9, 0.95), None)
    with pytest.raises(ValueError, match=r"^blocks must be an integer >= 1, got 0$"):
        _Opts(lr=0.1, blocks=0)
    with pytest.raises(ValueError, match=r"^blocks must be an integer, got 2.0$"):  # the kind, first
        _Opts(lr=0.1, blocks=2.0)
    with pytest.raises(ValueError, match=r"^mode='b' needs blocks=1$"):  # a rule between options
        _Opts(lr=0.1, mode="b")
    with pytest.raises(ValueError, match=r"^fused=True: the matrix step has no fused kernel"):
        _Opts(lr=0.1, fused=True)
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got -1"):
        _Opts(lr=-1)
    with pytest.raises(TypeError):  # a typo is not an option
        _Opts(lr=0.1, blcks=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.blocks = 3


def test_defaults_hparams_and_groups_read_the_one_declaration():
    assert _Opts.defaults() == {"weight_decay": 0.0, "adamw_lr": None, "adamw_betas": (0.9, 0.95), "adamw_eps": 1e-8,
                                "fused": None,
                                "foreach": None, "transposed": False, "nonfinite": "raise", "tau": 0.2, "blocks": 4,
                                "mode": "a",
                                "ratio": 1.0, "hidden": False}
    assert set(_Opts.hparam_defaults()) == set(_Opts.defaults()) - {"weight_decay", "transposed", "hidden"}
    assert _Opts.own_defaults() == {"blocks": 4, "mode": "a", "ratio": 1.0, "hidden": False}
    group = {"params": ["not an option"], "lr": 0.5, **_Opts.defaults(), "blocks": 3}
    assert _Opts.from_group(group) == _Opts(lr=0.5, blocks=3)
    # an "adamw" group: only the options the AdamW part reads are checked
    _Opts.check({**group, "blocks": 0, "mode": "b"}, matrix=False)
    with pytest.raises(ValueError, match="^ratio must be"):
        _Opts.check({**group, "ratio": 0.0}, matrix=False)
    with pytest.raises(ValueError, match="^blocks must be"):
        _Opts.check({**group, "blocks": 0})
    _Opts.check({"blocks": 1, "mode": "b"})  # partial: the missing options take their defaults


def test_every_optimizer_declares_typed_options_that_fill_its_groups():
    """Every class' group defaults and ``matrix_defaults`` come from its ``Options`` (one source)."""
    import dobb
    from dobb import registry

    for entry in registry.OPTIMIZERS.values():
        if not entry.is_matrix:
            continue
        opts = entry.cls.Options
        assert dataclasses.is_dataclass(opts) and issubclass(opts, H.Options), entry.name
        assert all(f.type is not None and f.default is not dataclasses.MISSING
                   for f in dataclasses.fields(opts) if f.name != "lr"), entry.name
        assert entry.cls.matrix_defaults == opts.own_defaults()
        opt = dobb.build_optimizer(entry.name, torch.nn.Linear(4, 4), lr=0.1, total_steps=5) \
            if "total_steps" in opts.names() else dobb.build_optimizer(entry.name, torch.nn.Linear(4, 4), lr=0.1)
        for group in opt.param_groups:
            config = opts.from_group(group)
            assert all(group[k] == getattr(config, k) for k in opts.names()), entry.name
        getattr(opt, "remove_hooks", lambda: None)()
