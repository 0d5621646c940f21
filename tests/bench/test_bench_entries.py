"""dobb_bench.bench_entries: one bench entry for every dobb.registry name, and none for another name,
so an optimizer added to the registry without its bench entry (or removed from it with one left
behind) fails here."""
import ast
from pathlib import Path

import pytest

import dobb
from dobb_bench import bench_entries as BE
from dobb_bench.bench_entries import BENCH_ENTRIES, BenchEntry, bench_entry, mismatches
from dobb_bench.cost import payload as P

LIBRARY = Path(dobb.__file__).resolve().parent


def test_every_registry_name_has_a_bench_entry_and_no_other():
    missing, extra = mismatches()
    assert missing == [], f"registry names without an entry in dobb_bench.bench_entries: {missing}"
    assert extra == [], f"bench entries naming no registered optimizer: {extra}"
    assert list(BENCH_ENTRIES) == list(dobb.registry.OPTIMIZER_NAMES)  # the registry's order


def test_a_name_missing_from_the_table_is_found(monkeypatch):
    monkeypatch.setattr(BE, "BENCH_ENTRIES", {k: v for k, v in BENCH_ENTRIES.items() if k != "splus"}
                        | {"adamx": BenchEntry("none", "adamw")})
    assert BE.mismatches() == (["splus"], ["adamx"])
    with pytest.raises(ValueError, match="'splus' has no entry in dobb_bench.bench_entries"):
        BE.bench_entry("splus")


def test_entries_name_known_formulas_and_axes():
    for name, entry in BENCH_ENTRIES.items():
        assert entry.payload in P.PAYLOAD_FORMULAS and entry.state in P.STATE_FORMULAS, name
        assert entry.blocks_side in (None, "input", "output"), name
    assert bench_entry("dobb-g").blocks_side == "output" and bench_entry("muon").blocks_side is None
    assert bench_entry("soap") == BenchEntry("owner", "soap", "input")


def test_the_registry_holds_no_bench_field_and_the_library_never_imports_the_bench():
    fields = set(dobb.registry.Entry.__dataclass_fields__)
    assert not fields & {"payload", "state", "blocks_side"}, fields
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "dobb_bench" for n in names), path
