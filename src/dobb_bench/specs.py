"""The one optimizer-spec grammar of ``compare``, ``sweep``, ``ablate``, ``timing`` and ``payload``.

``NAME[:key=value[:key=value]...][@Label]``, e.g. ``dion:rank_fraction=1/16`` or
``dobb:blocks=4:norm=l2@Mine``. Values are typed (``parse_value``): ``true``/``false``, fractions
``a/b``, Python literals (``4``, ``1e-3``, ``(0.9,0.99)``), ``*_dtype`` names as torch dtypes, else
strings. Hyperparameters are separated by ``:`` only: a comma inside a value is part of it (a
tuple), so the older ``name:k=v,k=v`` form is refused with the spelling to use instead, rather
than silently read as one string.

Errors are ``ValueError``s naming the spec (the CLI prints them as one line, exit code 2).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from fractions import Fraction

import torch

import dobb.registry

__all__ = ["OptimizerSpec", "parse_spec", "parse_hparams", "parse_value", "default_label", "PRETTY", "registry_entry",
           "refreshes", "recorded_adamw_part", "recorded_refresh"]

# Display names: each optimizer's label in dobb.registry (declared there once).
PRETTY = {name: entry.label for name, entry in dobb.registry.OPTIMIZERS.items()}
HP_SHORT = {"blocks": "B", "rank_fraction": "rho"}
# The timing bench's torch references (``torch.optim.AdamW(foreach=True)``, ``AdamW(fused=True)``,
# ``torch.optim.Muon``): not library optimizers, so not in the registry; each stands for the
# registry entry it times against.
TORCH_REFERENCES = {"torch-adamw": "adamw", "torch-adamw-fused": "adamw", "torch-muon": "muon"}
# The two AdamW references every timing ratio is taken against: torch's foreach kernel (the
# bench's reference since its first records) and torch's fused kernel (the fastest torch has).
ADAMW_REFERENCES = ("torch-adamw", "torch-adamw-fused")
_KEY = re.compile(r"[A-Za-z_]\w*")
_COMMA_KEY = re.compile(r",\s*[A-Za-z_]\w*\s*=")  # ",qr=" inside a value: the old comma grammar


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    hparams: dict = field(default_factory=dict)
    label: str = ""
    text: str = ""  # the spec as typed (timing and payload tables label rows with it)


def parse_value(key: str, text: str):
    """``4`` -> int, ``1e-3`` -> float, ``1/4`` -> 0.25, ``true`` -> True, ``*_dtype`` -> torch dtype."""
    if key.endswith("_dtype"):
        if text == "auto":  # Dobb's product_dtype rule
            return text
        dtype = getattr(torch, text.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"hyperparameter {key}={text}: not a torch dtype")
        return dtype
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"\s*[-+]?\d+\s*/\s*\d+\s*", text):
        num, den = text.split("/")
        if int(den) == 0:
            raise ValueError(f"hyperparameter {key}={text}: division by zero")
        return int(num) / int(den)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_hparams(items: list[str], where: str) -> dict:
    """``["blocks=4", "norm=l2"]`` -> ``{"blocks": 4, "norm": "l2"}``; ``where`` names the source in errors."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _KEY.fullmatch(key.strip()) or not value.strip():
            raise ValueError(f"malformed {where} {item!r}: expected key=value")
        out[key.strip()] = parse_value(key.strip(), value.strip())
    return out


def default_label(name: str, hparams: dict) -> str:
    """``"Dion rho=1/16"``: the display name and the hyperparameters, short keys for B and rho."""
    parts = []
    for k, v in hparams.items():
        if k == "rank_fraction" and isinstance(v, float) and 0 < v <= 1:
            v = str(Fraction(v).limit_denominator(256))
        parts.append(f"{HP_SHORT.get(k, k)}={v}")
    return " ".join([PRETTY.get(name, name)] + parts)


def _comma_keys(text: str) -> list[int]:
    """Positions of the commas outside brackets that start a ``,key=`` (the old comma grammar)."""
    depth, flat = 0, []
    for ch in text:
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        flat.append(ch if depth == 0 else " ")
    return [m.start() for m in _COMMA_KEY.finditer("".join(flat))]


def parse_spec(text: str) -> OptimizerSpec:
    """``"dobb:blocks=4:norm=l2@Mine"`` -> ``OptimizerSpec("dobb", {"blocks": 4, "norm": "l2"}, "Mine")``."""
    text = str(text).strip()
    body, _, label = text.partition("@")
    name, *items = body.strip().split(":")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"malformed optimizer spec {text!r}: empty name (expected NAME[:key=value...])")
    commas = _comma_keys(body.strip())
    if commas:
        fixed = "".join(":" if i in commas else ch for i, ch in enumerate(body.strip()))
        raise ValueError(f"optimizer spec {text!r}: separate hyperparameters with ':', not ',' (e.g. {fixed!r})")
    hparams = parse_hparams(items, f"hyperparameter in {text!r}")
    return OptimizerSpec(name, hparams, label.strip() or default_label(name, hparams), text)


def registry_entry(name: str) -> "dobb.registry.Entry | None":
    """The ``dobb.registry`` entry of an optimizer name (a torch reference: the entry it stands for);
    ``None`` for a name the registry does not know. The bench asks the registry what an optimizer
    is (its class, preset) instead of reading it from the name's prefix."""
    return dobb.registry.OPTIMIZERS.get(TORCH_REFERENCES.get(name, name))


def refreshes(name: str) -> bool:
    """Whether ``name`` is Dobb or one of its presets (a basis refreshed every ``refresh_every`` steps)."""
    entry = registry_entry(name)
    return entry is not None and entry.refreshes


# Builder defaults that changed after records were made, pinned to what those records ran: the bench
# keeps reproducing its records, and a spec that sets the option itself still wins.
RECORDED_DEFAULTS = {"dobb-muon": {"nesterov": False}}  # Nesterov became Dobb-Muon's default (issue 55)


def recorded_refresh(name: str, hparams=None) -> dict:
    """The refresh the bench's records were made with, made explicit for ``dobb.build_optimizer(name,
    ...)``: ``split_refresh=False`` (every rank solves every block; the library's default since issue
    54 splits the refresh over a statistic group of several ranks where that is bitwise the unsplit
    refresh, which adds the basis broadcasts to a step's metered collectives and moves its timings).
    For Dobb and its presets (``refreshes``) under a process group; the same bits and collectives
    without one. Empty for every other name and when ``hparams`` sets ``split_refresh`` itself."""
    if not refreshes(name) or "split_refresh" in (hparams or {}):
        return {}
    return {"split_refresh": False}


def recorded_adamw_part(name: str, model, hparams=None) -> dict:
    """The AdamW-part options the bench's records were made with, made explicit for
    ``dobb.build_optimizer(name, model, ...)``: every AdamW-part parameter decays, the 1-D ones
    (biases, norm weights) included (``decay_names`` = every trainable name; the library's default
    since issue 53 leaves 1-D parameters undecayed), at the matrix lr (``adamw_lr`` left ``None``).
    Empty for ``adamw`` (``torch.optim.AdamW``: every parameter decays by default, unchanged) and
    for names outside the registry; ``decay_names`` left out when ``hparams`` sets it itself. Also
    the builder defaults of ``RECORDED_DEFAULTS`` that ``hparams`` does not set (Dobb-Muon's plain
    momentum, its default before Nesterov), and ``nonfinite="off"`` for the baselines (Dobb's forms
    checked gradients before, as now)."""
    entry = dobb.registry.OPTIMIZERS.get(name)
    if entry is None or not entry.is_matrix:
        return {}
    out = {k: v for k, v in RECORDED_DEFAULTS.get(name, {}).items() if k not in (hparams or {})}
    if not entry.refreshes and "nonfinite" not in (hparams or {}):
        # the baselines checked no gradient before issue 53 ("raise" adds a host read and, sharded, a
        # flag all-reduce to their step): their timing and kernel records ran without it
        out["nonfinite"] = "off"
    if "decay_names" not in (hparams or {}):
        out["decay_names"] = [n for n, p in model.named_parameters() if p.requires_grad]
    return out
