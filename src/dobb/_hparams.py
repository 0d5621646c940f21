"""Typed options of every optimizer, and the one place where their values are checked.

Each matrix optimizer declares its param-group options once, as a frozen dataclass of typed fields
with defaults (``MuonOptions``, ``DobbOptions``, ...: ``cls.Options``). The class, the registry and
the factory all read that one declaration:

- the class fills every param group's missing keys from its defaults (``Options.defaults()``) and
  checks each group with ``Options.check(group)`` at construction and ``add_param_group``;
- ``dobb.registry`` lists an optimizer's hyperparameters and their defaults from it, and
  ``dobb.registry.validate`` builds the dataclass from a user's hyperparameters before any model
  or optimizer is built (``Options.check``), so a sweep's typo fails first;
- a user may build and pass a config: ``Muon(params, **vars(MuonOptions(lr=0.02, momentum=0.9)))``,
  or read one back from a group: ``MuonOptions.from_group(opt.param_groups[0])``.

A field's check has two parts, both ``ValueError``s that name the option and the value:

1. its *kind* follows its default (``check_kind``): a ``bool`` default takes only ``True``/``False``,
   an ``int`` default an integer, a ``float`` default a real number, a tuple of numbers as many
   numbers. Without it a string where a number belongs reaches a comparison (``"0.9" < 1``) and
   surfaces as a ``TypeError`` from deep inside one optimizer and a ``ValueError`` from another;
2. its *rule* (``option(default, rule)``): a range or a set of choices, written once below
   (``unit_interval``, ``positive``, ``integer(1)``, ``one_of(...)``, ...) and shared by every
   optimizer.

Rules that tie several options together (Dobb's ``side`` and ``source``) are the dataclass'
``_check_together``; rules that need the parameters (a block count that must divide a width) stay
in the class' ``_check_matrix_group``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable

import torch

__all__ = ["check_kind", "check_kinds", "option", "Options", "ScaledOptions", "Rule", "unit_interval",
           "closed_unit_interval", "fraction", "positive", "non_negative", "integer", "boolean", "one_of",
           "optional", "rate", "betas", "floating_dtype", "numbers_tuple", "NONFINITE_MODES", "layout_option"]


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- kinds
def check_kind(name: str, value: Any, default: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` has the kind of ``default``.

    Defaults of any other kind (strings, dtypes, ``None``, process groups) are left to the
    option's rule, which knows their valid values.
    """
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    elif isinstance(default, numbers.Integral):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    elif isinstance(default, numbers.Real):
        # a one-element tensor is a number too (schedulers may hold lr as a tensor)
        ok = _is_real(value) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                 and value.dtype.is_floating_point)
        if not ok:
            raise ValueError(f"{name} must be a real number, got {value!r}")
        if _is_real(value) and math.isnan(value):
            raise ValueError(f"{name} must be a real number, got nan")
    elif isinstance(default, tuple) and default and all(_is_real(d) for d in default):
        if not (isinstance(value, (tuple, list)) and len(value) == len(default) and all(_is_real(v) for v in value)):
            raise ValueError(f"{name} must be {len(default)} real numbers, e.g. {default!r}, got {value!r}")


def check_kinds(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """``check_kind`` for every key of ``values`` that has a default."""
    for key, value in values.items():
        if key in defaults:
            check_kind(key, value, defaults[key])


# ----------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """A value rule: ``rule(name, value)`` raises ``ValueError("<name> must <what>, got <value>")``.

    ``test(value)`` says whether the value is valid; ``what`` is the phrase of the message."""
    test: Callable[[Any], bool]
    what: str

    def __call__(self, name: str, value: Any) -> None:
        if not self.test(value):
            raise ValueError(f"{name} must {self.what}, got {value!r}")

    def hint(self, why: str) -> "Rule":
        """The same rule whose message adds ``(why)`` after what is valid."""
        return Rule(self.test, f"{self.what} ({why})")


def _real_in(low: float, high: float, *, low_open: bool, high_open: bool) -> Callable[[Any], bool]:
    def test(v) -> bool:
        if not _is_real(v):
            return False
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below
    return test


unit_interval = Rule(_real_in(0.0, 1.0, low_open=False, high_open=True), "lie in [0, 1)")
closed_unit_interval = Rule(_real_in(0.0, 1.0, low_open=False, high_open=False), "lie in [0, 1]")
fraction = Rule(_real_in(0.0, 1.0, low_open=True, high_open=False), "be a number in (0, 1]")
positive = Rule(lambda v: _is_real(v) and v > 0 and math.isfinite(v), "be a finite number > 0")
non_negative = Rule(lambda v: _is_real(v) and v >= 0 and math.isfinite(v), "be a finite number >= 0")
boolean = Rule(lambda v: isinstance(v, bool), "be True or False")
betas = Rule(lambda v: isinstance(v, (tuple, list)) and len(v) == 2
             and all(_is_real(b) and 0 <= b < 1 for b in v), "be two numbers in [0, 1)")
floating_dtype = Rule(lambda v: isinstance(v, torch.dtype) and v.is_floating_point, "be a floating torch.dtype")


def integer(low: int = 1, high: int | None = None) -> Rule:
    """An integer ``>= low`` (and ``<= high``); ``bool`` is not an integer here."""
    def test(v) -> bool:
        return (isinstance(v, int) and not isinstance(v, bool) and v >= low
                and (high is None or v <= high))
    return Rule(test, f"be an integer >= {low}" if high is None else f"be an integer in [{low}, {high}]")


def one_of(*choices: Any) -> Rule:
    return Rule(lambda v: v in choices, f"be one of {tuple(choices)}")


def optional(rule: Rule) -> Rule:
    """``None`` or a value ``rule`` accepts."""
    return Rule(lambda v: v is None or rule.test(v), f"be None or {rule.what.removeprefix('be ')}")


def numbers_tuple(n: int, what: str) -> Rule:
    """A tuple (or list) of ``n`` real numbers."""
    return Rule(lambda v: isinstance(v, (tuple, list)) and len(v) == n and all(_is_real(c) for c in v),
                f"be {what}")


def _rate_ok(value) -> bool:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return False
        value = float(value)
    return _is_real(value) and math.isfinite(value) and value >= 0


def _check_rate(name: str, value: Any) -> None:
    """``lr``/``weight_decay``: a finite number >= 0, or a one-element tensor holding one.

    A tensor is read on the host here, as ``torch.optim.AdamW.__init__`` does (``0.0 <= lr``):
    this runs at construction, ``add_param_group`` and ``load_state_dict``, never inside
    ``step()``. A value a scheduler writes into the tensor later (``fill_``) is not checked, as
    ``torch.optim.AdamW`` does not check it either: that would be a host read every step.
    """
    if isinstance(value, torch.Tensor) and (value.numel() != 1 or value.is_complex()):
        raise ValueError(f"{name} given as a tensor must hold one real number, got {value!r}")
    if not _rate_ok(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class _RateRule(Rule):
    def __call__(self, name: str, value: Any) -> None:
        _check_rate(name, value)


rate = _RateRule(_rate_ok, "be a finite number >= 0")


# ----------------------------------------------------------------------------- options
# What a step does with a non-finite gradient (``Options.nonfinite``).
NONFINITE_MODES = ("raise", "skip", "off")


def option(default: Any = MISSING, rule: Rule | None = None, *, adamw: bool = False,
           hparam: bool = True, kind: Any = MISSING) -> Any:
    """A typed option: its ``default``, its ``rule`` and where it applies.

    ``adamw``: also checked on ``"adamw"`` groups (options the AdamW part reads); ``hparam``: a
    hyperparameter the registry lists (``False``: set per group, e.g. ``transposed``, or an
    explicit argument of the builder, ``lr``); ``kind``: the kind of a required option (one
    without a default), e.g. ``0.0`` for a real number.
    """
    return dataclasses.field(default=default, metadata={
        "rule": rule, "adamw": adamw, "hparam": hparam, "kind": default if kind is MISSING else kind})


def layout_option(plain: Any, rule: Rule) -> Any:
    """An option whose default follows each matrix's layout (``blocks``, ``axis``, ``select``, ...).

    Its group default is ``None``: "follow the layout", resolved per matrix from the parameter's
    placement when the optimizer plans it (``dobb.placement.follow_layout``): on a DTensor the
    value that keeps the step on the local shard, on a plain tensor ``plain``, so an unsharded
    model steps exactly as with ``plain``. A value the user gives is kept and checked by ``rule``.
    The registry and ``matrix_defaults`` list ``plain`` (the value on an unsharded matrix).
    """
    # None passes silently (the default); any other value gets the rule's own message, as before
    follows = Rule(lambda v: v is None or rule.test(v), rule.what)
    return dataclasses.field(default=None, metadata={
        "rule": follows, "adamw": False, "hparam": True, "kind": plain, "plain": plain})


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of every group of every ``MatrixOptimizer``, AdamW groups included.

    ``lr``/``weight_decay``: finite numbers >= 0 (or one-element tensors, as schedulers keep
    them); ``adamw_lr``: the AdamW part's learning rate (``None``: the matrix ``lr``; given, it is
    the ``lr`` every ``"adamw"`` group that sets none of its own starts with, so a torch scheduler,
    which scales each group's own ``lr``, scales it like any group's); ``adamw_betas``/``adamw_eps``:
    the AdamW part's; ``fused``/``foreach``: torch's AdamW
    kernel flags, honoured by ``"adamw"`` groups as ``torch.optim.AdamW`` honours them (both
    ``None``: torch's fused kernel where it has one for the parameters' device and dtype, else its
    foreach kernel; ``dobb._base.adamw_kernel_flags``); a matrix group refuses ``fused=True`` (no matrix step
    has a fused kernel) and ``foreach=False`` (every matrix step is its foreach implementation). ``transposed``: the group's weights are stored ``(in, out)`` (set per group by
    ``dobb.param_groups``). ``nonfinite``: what a step does with a NaN/Inf gradient of the group
    (``"raise"``: refuse the step with a ``ValueError`` naming the parameter, every rank agreeing;
    ``"skip"``: skip the whole step on the device, without a host read; ``"off"``: no check; see
    ``dobb._base.MatrixOptimizer.step``).
    """
    lr: float = option(rule=rate, adamw=True, hparam=False, kind=0.0)
    weight_decay: float = option(0.0, rate, adamw=True, hparam=False)
    adamw_lr: float | None = option(None, optional(rate), adamw=True)
    adamw_betas: tuple[float, float] = option((0.9, 0.95), betas, adamw=True)
    adamw_eps: float = option(1e-8, positive, adamw=True)
    fused: bool | None = option(None, optional(boolean), adamw=True)
    foreach: bool | None = option(None, optional(boolean), adamw=True)
    transposed: bool = option(False, boolean, hparam=False)
    nonfinite: str = option("raise", one_of(*NONFINITE_MODES), adamw=True)

    def __post_init__(self):
        self.check(vars(self))

    # -------------------------------------------------------------- reading the declaration
    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option that has a default, with it (what a param group is filled with)."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def hparam_defaults(cls) -> dict[str, Any]:
        """The hyperparameters the registry lists (``None`` where the default has no checkable kind;
        a ``layout_option`` with its value on an unsharded matrix)."""
        return {f.name: f.metadata.get("plain", f.default) for f in fields(cls)
                if f.metadata["hparam"] and f.default is not MISSING}

    @classmethod
    def own_defaults(cls) -> dict[str, Any]:
        """The defaults of the options a class adds to the shared ones (``Options``, ``tau``): its
        ``matrix_defaults`` (a ``layout_option`` with its value on an unsharded matrix)."""
        shared = {f.name for f in fields(ScaledOptions)}
        return {f.name: f.metadata.get("plain", f.default) for f in fields(cls)
                if f.default is not MISSING and f.name not in shared}

    @classmethod
    def layout_names(cls) -> tuple[str, ...]:
        """The options whose default follows each matrix's layout (``layout_option``)."""
        return tuple(f.name for f in fields(cls) if "plain" in f.metadata)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> "Options":
        """The config of a param group (checked; keys that are not options, ``params``, are left out)."""
        return cls(**{k: group[k] for k in cls.names() if k in group})

    # -------------------------------------------------------------- checking
    @classmethod
    def check(cls, values: Mapping[str, Any], *, matrix: bool = True) -> None:
        """Raise ``ValueError`` naming the first invalid option of ``values`` (a param group, or
        any mapping: keys that are not options are not looked at, missing options are not
        required). ``matrix=False``: ``values`` is an ``"adamw"`` group, only the options the AdamW
        part reads are checked. Then the rules between options, on ``values`` over the defaults."""
        for f in fields(cls):
            if f.name not in values or not (matrix or f.metadata["adamw"]):
                continue
            value = values[f.name]
            if f.metadata["kind"] is not MISSING and not (value is None and "plain" in f.metadata):
                check_kind(f.name, value, f.metadata["kind"])
            if f.metadata["rule"] is not None:
                f.metadata["rule"](f.name, value)
        if matrix:
            cls._check_together({**cls.defaults(), **values})

    @classmethod
    def _check_together(cls, values: Mapping[str, Any]) -> None:
        """Rules between options of a matrix group (every option present); subclasses extend."""
        if values["fused"] is True:
            raise ValueError("fused=True: the matrix step has no fused kernel; fused applies to 'adamw' "
                             "groups (torch's AdamW kernel): leave it None or False on matrix groups")
        if values["foreach"] is False:
            raise ValueError("foreach=False: the matrix step has only its foreach implementation; foreach "
                             "applies to 'adamw' groups (torch's AdamW kernel): leave it None or True on "
                             "matrix groups")


@dataclass(frozen=True, kw_only=True)
class ScaledOptions(Options):
    """Options of the optimizers under the update-scale protocol ``lr * tau*sqrt(max(m, n)) * O``
    (every one but SOAP and SPlus, whose steps are Adam-scaled and sign-scaled)."""
    tau: float = option(0.2, positive, adamw=True)

