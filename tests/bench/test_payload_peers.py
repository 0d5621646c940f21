"""dobb_bench.payload's rows for the strongest peers (owner-compute Muon, owner placement, NorMuon,
Dion3), moved out of the library's tests/test_peers.py (a library test should not import the bench)."""
from __future__ import annotations

import pytest


def test_payload_rows_of_the_peers():
    """Derived per-step payload (dobb-bench payload): owner compute twice Muon's dense count, owner
    placement nothing in the step and 2 mn in forward/backward, NorMuon as Muon, Dion3 as Dion2."""
    P = pytest.importorskip("dobb_bench.payload")

    m, n = 24, 8
    assert P.payload_entries("owner-muon", m, n) == 2 * P.payload_entries("muon", m, n) == 2 * m * n
    assert P.payload_entries("owner-placement", m, n) == 0
    assert P.forward_backward_entries("owner-placement", m, n) == 2 * m * n
    assert P.forward_backward_entries("owner-placement", m, n, shards=1) == 0
    assert P.payload_entries("normuon", m, n) == m * n
    k = round(dion3_fraction() * m)
    assert P.payload_entries("dion3", m, n) == P.payload_entries("dion2", m, n) == k * n
    assert P.derived_state_bytes("normuon", m, n) == m * n * 4 + m * 4


def dion3_fraction():
    from dobb.baselines import Dion3

    return Dion3.matrix_defaults["fraction"]
