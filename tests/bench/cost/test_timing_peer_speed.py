"""scripts/peer_speed.py's same-numbers check and table (the script has no module in dobb_bench;
its test sits with dobb_bench.cost.timing), on a tiny model with no timing: the check
passes an identical peer, flags a perturbed or diverging one, and the table says so."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ps():
    spec = importlib.util.spec_from_file_location("peer_speed", ROOT / "scripts" / "peer_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _adamw(lr):
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


class _DropsGrads(torch.optim.SGD):
    """Sets ``p.grad = None`` after its step, as heavyball does: unwrapped, its next steps do nothing."""

    def step(self, closure=None):
        super().step()
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None


class _Diverging(torch.optim.Optimizer):
    """Writes NaN into the weights: a broken peer."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.data.fill_(math.nan)


def test_same_numbers_check_passes_an_identical_peer_and_flags_a_perturbed_one(ps):
    peers = {"identical": _adamw(ps.LR), "lr +5%": _adamw(1.05 * ps.LR),
             "diverging": lambda m: _Diverging(m.parameters()),
             "broken": lambda m: (_ for _ in ()).throw(RuntimeError("no such kernel")),
             "drops grads": lambda m: _DropsGrads(m.parameters(), lr=ps.LR)}
    res = ps.run_case("adamw", _adamw(ps.LR), peers, round_steps=1, rounds=0, log=lambda *a: None,
                      make_net=lambda: ps.Net(layers=1, width=16))
    p = res["peers"]
    assert p["identical"]["rel_diff_after_3_steps"] == 0 and p["identical"]["same_numbers"]
    assert p["lr +5%"]["rel_diff_after_3_steps"] > 10 * ps.SAME_TOL and not p["lr +5%"]["same_numbers"]
    assert not p["diverging"]["same_numbers"]  # NaN is never the same numbers
    assert p["broken"] == {"error": "RuntimeError: no such kernel"}
    assert "drops p.grad" in p["drops grads"]["error"]
    assert all(q["ratio"] is None for k, q in p.items() if "error" not in q)  # no timing without rounds


def test_the_table_marks_different_numbers_and_unexplained_ratios(ps):
    q = lambda v: {"median": v, "q25": v, "q75": v, "n": 2}  # noqa: E731
    rec = {"settings": {"layers": 1}, "results": [{
        "case": "adamw", "rounds": 2, "round_steps": 5, "ours_ms_per_step": q(10.0), "peers": {
            "A": {"ratio": q(1.2), "peer_ms_per_step": q(8.0), "rel_diff_after_3_steps": 0.0, "same_numbers": True},
            "B": {"ratio": q(1.3), "peer_ms_per_step": q(7.0), "rel_diff_after_3_steps": 0.5, "same_numbers": False},
            "C": {"error": "ValueError: x"}}}]}
    rows = ps.table([("r.json", rec)], {"adamw": {"B": "B takes fewer steps"}}).splitlines()[2:]
    assert "bitwise (0)" in rows[0] and "above 1.0x, not explained" in rows[0]
    assert "not the same numbers" in rows[1] and "B takes fewer steps" in rows[1]
    assert "failed: ValueError: x" in rows[2]
    assert ps.table([("r.json#muon", rec)], {}).count("\n") == 1  # a case filter that keeps nothing


def test_write_table_replaces_only_the_generated_block(ps, tmp_path):
    doc = tmp_path / "t.md"
    doc.write_text(f"before\n{ps.TABLE_START}\nold\n{ps.TABLE_END}\nafter\n")
    ps.write_table(doc, "| new |")
    assert doc.read_text() == f"before\n{ps.TABLE_START}\n| new |\n{ps.TABLE_END}\nafter\n"


def test_pair_hands_a_grad_dropping_peer_its_gradients_again(ps):
    m = ps.Net(layers=1, width=16)
    ps.set_grads(m)
    mats, rest = ps._matrices_and_rest(m)
    grads = [p.grad for p in mats]
    opt = ps.Pair(_DropsGrads(mats, lr=1.0), rest, regrad=True)
    w0 = [p.detach().clone() for p in mats]
    for _ in range(2):
        opt.step()
    assert all(torch.allclose(w - p, 2 * g, atol=1e-6) for w, p, g in zip(w0, mats, grads))  # two full steps
