"""What the bench knows of each optimizer of ``dobb.registry``, keyed by its registry name.

The registry holds what the library needs (class, label, preset, defaults); this table holds what
only the bench reads:

- ``payload``: the name of its formula in ``dobb_bench.cost.payload.PAYLOAD_FORMULAS`` (cross-shard
  entries per step);
- ``state``: the name of its formula in ``STATE_FORMULAS`` (state bytes per matrix);
- ``blocks_side``: the matrix axis the optimizer cuts into ``blocks`` (``"input"``/``"output"``;
  its ``side``/``axis`` hyperparameters override it), ``None`` when it does not block.

Every registry name has one entry here and every entry names a registered optimizer
(``tests/bench/test_bench_entries.py``): adding an optimizer touches its module, the registry and
this table (docs/CONTRIBUTING.md, "Adding an optimizer").
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import dobb.registry

__all__ = ["BenchEntry", "BENCH_ENTRIES", "bench_entry", "mismatches"]


@dataclass(frozen=True)
class BenchEntry:
    """The bench's fields of one registry optimizer (see the module docstring)."""
    payload: str
    state: str
    blocks_side: str | None = None


_E = BenchEntry
BENCH_ENTRIES: Mapping[str, BenchEntry] = MappingProxyType({
    "adamw": _E("none", "adamw"),
    "muon": _E("dense", "momentum"),
    "owner-muon": _E("owner", "momentum"),
    "dion": _E("dion", "dion"),
    "rmnp": _E("rmnp", "momentum"),
    "pr-muon": _E("pr-muon", "momentum"),
    "block-muon": _E("block-muon", "momentum", "input"),
    "dion2": _E("selected-rows", "momentum"),
    # block steps on each shard (no exchange), owner-computed whole matrices every period-th step
    "muonbp": _E("muonbp", "momentum", "output"),
    "normuon": _E("dense", "momentum+rows"),
    "dion3": _E("selected-rows", "momentum+rows"),
    "cmuon": _E("dense", "momentum"),
    "samuon": _E("dense", "samuon"),
    "samuon-lite": _E("dense", "samuon"),
    "dobb": _E("dobb", "dobb", "input"),
    "dobb-l2": _E("dobb", "dobb", "input"),
    "dobb-g": _E("dobb", "dobb", "output"),
    "dobb-g-l2": _E("dobb", "dobb", "output"),
    "dobb-muon": _E("dobb", "dobb", "input"),
    # block Shampoo as DASH does it: tiles within shards, no cross-shard exchange
    "dash": _E("none", "dash"),
    "shampoo": _E("none", "dash"),
    # SOAP: sharded matrices owner-computed (shards to the owner, the update back), as owner-muon;
    # Newton-Muon: whole matrices, not sharded here; a sharded step would gather each matrix as
    # Muon does, hence "dense"
    "soap": _E("owner", "soap", "input"),
    # SOAP-Muon: SOAP's owner compute and state (the update back from the first step on)
    "soap-muon": _E("owner", "soap", "input"),
    "newton-muon": _E("dense", "newton-muon", "input"),
    # SPlus: sign of the momentum in the eigenbases of G G^T and G^T G (blocks within shards)
    "splus": _E("splus", "splus", "input"),
})


def bench_entry(name: str) -> BenchEntry:
    """The bench entry of registry name ``name``; ``ValueError`` when the table has none."""
    entry = BENCH_ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"optimizer {name!r} has no entry in dobb_bench.bench_entries.BENCH_ENTRIES "
                         f"(every dobb.registry name needs one)")
    return entry


def mismatches() -> tuple[list[str], list[str]]:
    """``(registry names without a bench entry, bench entries naming no registered optimizer)``."""
    names = dobb.registry.OPTIMIZER_NAMES
    return [n for n in names if n not in BENCH_ENTRIES], [n for n in BENCH_ENTRIES if n not in names]
