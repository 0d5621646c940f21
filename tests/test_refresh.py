"""``dobb._refresh.fold_side``: the one refresh rule of every matrix (a 2-D matrix is a stack of one).
Reference: the rule written out per matrix in float64 (count on due and seen; copy on the first
capture, else the EMA; eigh on the first capture with init_basis="eigh"; kept where not chosen)."""
from __future__ import annotations

import torch

import dobb.functional as F
from dobb._refresh import fold_side
from dobb.experts import expert_layout
from dobb.layout import ReducedStat, plain_layout

F64 = torch.float64
GROUP = dict(stat_decay=0.9, eigh=False, init_eigh=True)  # basis="orthogonal_iteration", init_basis="eigh"


def _state(layout, like):
    return {"stat": layout.new_block_state(F64, identity=False, like=like),
            "basis": layout.new_block_state(F64, identity=True, like=like)}


def _fold(state, lay, counts, due, new, requests):
    fold_side(new, layout=lay, stat=state["stat"], basis=state["basis"], counts=counts, due=due, requests=requests,
              **GROUP)


def _solve(requests):
    for (a, q0, exact, put), q in zip(requests, F.refresh_bases([r[:3] for r in requests])):
        put(q)


def test_a_matrix_counts_folds_and_takes_an_exact_first_basis():
    w = torch.zeros(4, 6, dtype=F64)
    lay = plain_layout(w, "input", 2)
    state = _state(lay, w)
    g = torch.Generator().manual_seed(0)
    new = [F.second_moment_blocks(torch.randn(8, 6, generator=g, dtype=F64), [3, 3], F64)[0] for _ in range(2)]
    counts, requests = [0], []
    _fold(state, lay, counts, [True], ReducedStat(new[0][None], [True]), requests)
    assert counts == [1] and torch.equal(state["stat"], new[0])  # first capture: a copy
    assert [r[2] for r in requests] == [True]  # exact eigh, both blocks in one batch
    _solve(requests)
    for b in range(2):
        a, q = new[0][3 * b : 3 * b + 3], state["basis"][3 * b : 3 * b + 3]
        assert (q.T @ a @ q - torch.diag((q.T @ a @ q).diagonal())).abs().max() < 1e-10
    requests = []
    _fold(state, lay, counts, [True], ReducedStat(new[1][None], [True]), requests)
    assert counts == [2] and [r[2] for r in requests] == [False]
    torch.testing.assert_close(state["stat"], 0.9 * new[0] + 0.1 * new[1], atol=1e-15, rtol=0)
    requests = []  # no rank saw a row: no count, statistic and basis kept
    before = {k: v.clone() for k, v in state.items()}
    _fold(state, lay, counts, [True], ReducedStat(new[0][None], [False]), requests)
    assert counts == [2] and not requests and all(torch.equal(state[k], before[k]) for k in state)


def test_a_stack_applies_the_rule_per_expert():
    """Expert 0: due and seen (EMA); 1: not due (kept, not counted); 2: first capture (copy, exact);
    3: due but no row (kept). One request per rule and run, covering only the chosen experts."""
    w = torch.zeros(4, 5, 6, dtype=F64)
    lay = expert_layout(w, "input", 2)
    state = _state(lay, w)
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, 3, generator=g, dtype=F64)
    state["stat"].copy_(old)
    new = torch.randn(4, 6, 3, generator=g, dtype=F64)
    counts, requests = [3, 3, 0, 3], []
    _fold(state, lay, counts, [True, False, True, True], ReducedStat(new, [True, True, True, False]),
              requests)
    assert counts == [4, 3, 1, 3]
    expected = torch.stack([0.9 * old[0] + 0.1 * new[0], old[1], new[2], old[3]])
    torch.testing.assert_close(state["stat"], expected, atol=1e-15, rtol=0)
    assert [(r[0].shape[0], r[2]) for r in requests] == [(2, True), (2, False)]  # expert 2 exact, expert 0 not
    _solve(requests)
    ident = F.identity_blocks([3, 3], dtype=F64)
    assert torch.equal(state["basis"][1], ident) and torch.equal(state["basis"][3], ident)
    assert not torch.equal(state["basis"][0], ident) and not torch.equal(state["basis"][2], ident)


def test_device_keep_flags_keep_statistic_and_basis_without_a_host_read():
    w = torch.zeros(2, 5, 6, dtype=F64)
    lay = expert_layout(w, "input", 1)
    state = _state(lay, w)
    old = torch.randn(2, 6, 6, dtype=F64)
    state["stat"].copy_(old)
    new = torch.randn(2, 6, 6, dtype=F64)
    counts, requests = [2, 2], []
    _fold(state, lay, counts, [True, True], ReducedStat(new, [True, True], torch.tensor([False, True])),
              requests)
    assert counts == [3, 3]  # counted: the host did not look
    _solve(requests)
    assert torch.equal(state["stat"][0], old[0]) and torch.equal(state["basis"][0], torch.eye(6, dtype=F64))
    torch.testing.assert_close(state["stat"][1], 0.9 * old[1] + 0.1 * new[1], atol=1e-15, rtol=0)
    assert not torch.equal(state["basis"][1], torch.eye(6, dtype=F64))
