"""dobb._schedule (refresh periods and stagger offsets) against hand-computed values, and Dobb's
``refresh_width`` option: each matrix's observed refresh steps against its hand-computed period
(2-D, transposed widths, expert stack, two-sided; B, stagger on/off), the option against a run
without it (equal periods: bitwise; longer periods: the same numbers as separate param groups with
those periods), and its validation. Sharded runs: tests/distributed/test_schedule_sharded.py."""
import pytest
import torch
from torch import nn

import dobb
from dobb import _schedule as S

F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64)


@pytest.mark.parametrize("every,width,widest,period", [
    (9, None, 3072, 9), (9, 768, 3072, 36), (9, 768, 768, 9), (9, 128, 512, 36), (9, 128, 128, 9),
    (9, 128, 40, 9),    # narrower than the width: never shorter than refresh_every
    (9, 128, 320, 18),  # 2.5 rounds half to even: 2
    (9, 128, 448, 36),  # 3.5: 4
    (3, 16, 200, 36),   # 12.5: 12
])
def test_refresh_period_hand_values(every, width, widest, period):
    assert S.refresh_period(every, width, widest) == period


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "128", 128.0])
def test_refresh_width_validation_names_the_parameter(bad):
    with pytest.raises(ValueError, match="refresh_width must be None or an integer >= 1"):
        S.check_refresh_width(bad)
    with pytest.raises(ValueError, match="refresh_width"):
        dobb.Dobb([nn.Linear(8, 8).weight], lr=0.1, source="grad_gram", refresh_width=bad)
    S.check_refresh_width(None)
    S.check_refresh_width(1)


def _old_offsets(works, T):
    """The schedule before ``refresh_width`` (one period ``T``): largest work first, the offset in
    ``range(T)`` with the least accumulated work, lowest on ties."""
    cost, out = [0] * T, [0] * len(works)
    for i in sorted(range(len(works)), key=lambda j: -works[j]):
        off = min(range(T), key=lambda o: cost[o])
        cost[off] += works[i]
        out[i] = off
    return out


def test_equal_periods_give_the_old_offsets():
    gen = torch.Generator().manual_seed(0)
    for T in (1, 2, 3, 9):
        for n in (1, 5, 13):
            works = torch.randint(1, 6, (n,), generator=gen).pow(3).tolist()  # ties included
            assert S.stagger_offsets(works, [T] * n) == _old_offsets(works, T)


def test_offsets_balance_the_longer_periods_by_hand():
    # bigs (work 8, period 4) first: 0, then 1 (step 0 is taken); smalls (period 2) hit steps
    # {0, 2} or {1, 3}: both carry max 8, sum 8 -> 0; then {0,2}: (9, 10) vs {1,3}: (8, 8) -> 1
    assert S.stagger_offsets([8, 8, 1, 1], [4, 4, 2, 2]) == [0, 1, 0, 1]
    # four layers of the bench model's shapes at refresh_width=128: qkv, proj, fc at width 128 (period 9),
    # mlp-out at 512 (period 36, 64x the work): each wide matrix alone on its refresh step
    works = [1, 1, 1, 64] * 4
    periods = [9, 9, 9, 36] * 4
    offs = S.stagger_offsets(works, periods)
    assert all(0 <= o < p for o, p in zip(offs, periods))
    load = [0] * 36
    for w, p, o in zip(works, periods, offs):
        for t in range(o, 36, p):
            load[t] += w
    # the wide ones take steps 0-3 (one each); the 12 narrow ones share the residues 4-8 mod 9
    # (3, 3, 2, 2, 2 of them), so no step carries a wide and a narrow refresh together
    assert [o for o, p in zip(offs, periods) if p == 36] == [0, 1, 2, 3]
    assert sorted(o for o, p in zip(offs, periods) if p == 9) == [4, 4, 4, 5, 5, 5, 6, 6, 7, 7, 8, 8]
    assert max(load) == 64 and sum(load) == 4 * 64 + 12 * 4


def test_cycle_and_offsets_are_deterministic():
    assert S.cycle([]) == 1 and S.cycle([9, 36, 18]) == 36 and S.cycle([4, 6]) == 12
    works, periods = [5, 5, 3, 3, 1], [6, 4, 6, 2, 4]
    assert S.stagger_offsets(works, periods) == S.stagger_offsets(list(works), list(periods))
    with pytest.raises(ValueError, match="one entry per matrix"):
        S.stagger_offsets([1, 2], [3])


class Mixed(nn.Module):
    """Input widths 16, 64, 16 (transposed storage: 64 wide on its dim 0), and an expert stack of input width 32."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(64, 16, generator=gen, dtype=torch.float64) / 4)
        self.b = nn.Parameter(torch.randn(16, 64, generator=gen, dtype=torch.float64) / 8)
        self.c = nn.Parameter(torch.randn(64, 8, generator=gen, dtype=torch.float64) / 8)   # (in, out)
        self.e = nn.Parameter(torch.randn(2, 8, 32, generator=gen, dtype=torch.float64) / 6)


def _groups(model, **kw):
    return [{"params": [model.a, model.b, model.e], **kw}, {"params": [model.c], "transposed": True, **kw}]


def _refresh_steps(model, opt, steps, seed=1):
    """The steps at which each parameter took a statistic (grad_gram: on its refresh steps only)."""
    gen = torch.Generator().manual_seed(seed)
    params = [model.a, model.b, model.e, model.c]
    seen = {id(p): [] for p in params}
    for t in range(steps):
        before = {id(p): repr(opt.state[p]["captures"]) for p in params}
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
        for p in params:
            if repr(opt.state[p]["captures"]) != before[id(p)]:
                seen[id(p)].append(t)
    return [seen[id(p)] for p in params]


@pytest.mark.parametrize("blocks,width,periods", [
    (1, 16, [3, 12, 6, 12]),   # widest blocks 16, 64, 32, 64
    (2, 16, [3, 6, 3, 6]),     # 8 (round(0.5) = 0 -> 1), 32, 16, 32
    (1, 40, [3, 6, 3, 6]),     # 16/40 -> 1, 64/40 = 1.6 -> 2, 32/40 -> 1
    (1, None, [3, 3, 3, 3]),
])
@pytest.mark.parametrize("stagger", [False, True])
def test_each_matrix_refreshes_on_its_hand_computed_period(blocks, width, periods, stagger):
    model = Mixed()
    opt = dobb.Dobb(_groups(model, blocks=blocks), lr=0.01, source="grad_gram", refresh_every=3, refresh_width=width,
                    stagger=stagger, **F64)
    steps = 25
    seen = _refresh_steps(model, opt, steps)
    params = [model.a, model.b, model.e, model.c]
    offsets = [opt._plans[p].offset for p in params]
    if not stagger:
        assert offsets == [0, 0, 0, 0]
    for got, period, off in zip(seen, periods, offsets):
        assert 0 <= off < period
        assert got == [0] + [t for t in range(1, steps) if (t - off) % period == 0]
    assert opt.refresh_cycle() == S.cycle(periods)


def test_two_sided_period_reads_the_widest_side():
    w = nn.Parameter(torch.randn(48, 16, dtype=torch.float64))  # output side 48 wide, input 16
    opt = dobb.Dobb([w], lr=0.01, source="grad_gram", side="both", refresh_every=2, refresh_width=16, stagger=False, **F64)
    assert opt._plans[w].period == 6


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in (model.a, model.b, model.e, model.c):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
    return [p.detach().clone() for p in (model.a, model.b, model.e, model.c)]


@pytest.mark.parametrize("stagger", [False, True])
def test_unset_or_all_narrow_is_bitwise_the_run_without_the_option(stagger):
    runs = []
    for kw in ({}, {"refresh_width": None}, {"refresh_width": 1000}):  # 64/1000 rounds to 0 -> period 3
        model = Mixed()
        opt = dobb.Dobb(_groups(model), lr=0.01, source="grad_gram", refresh_every=3, stagger=stagger, **kw)
        runs.append(_train(model, opt, 10))
    for other in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(runs[0], other))
    model = Mixed()  # a period that does change: the weights differ (the comparison can fail)
    opt = dobb.Dobb(_groups(model), lr=0.01, source="grad_gram", refresh_every=3, stagger=stagger, refresh_width=16)
    assert not all(torch.equal(x, y) for x, y in zip(runs[0], _train(model, opt, 10)))


def test_longer_periods_equal_groups_with_those_periods():
    """Unstaggered, the option is the same algorithm as one param group per period (float64)."""
    model = Mixed()
    opt = dobb.Dobb(_groups(model), lr=0.01, source="grad_gram", refresh_every=3, refresh_width=16, stagger=False, **F64)
    got = _train(model, opt, 26)
    ref_model = Mixed()
    m = ref_model
    groups = [{"params": [m.a], "refresh_every": 3}, {"params": [m.b], "refresh_every": 12},
              {"params": [m.e], "refresh_every": 6}, {"params": [m.c], "refresh_every": 12, "transposed": True}]
    ref = dobb.Dobb(groups, lr=0.01, source="grad_gram", stagger=False, **F64)
    want = _train(ref_model, ref, 26)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- the plan, the due rule, captures
def _plan(spans, period, offset):
    sides = tuple(S.Side(type("L", (), {"stack_span": n})()) for n in spans)
    return S.Plan(sides, period, offset)


def test_due_against_a_hand_written_schedule():
    """Period 3, offset 1: steps 0, 1, 4, 7, 10 refresh; a matrix (or a side) without a statistic
    yet is due every step; per member of a stack, any side's missing statistic makes it due."""
    plan = _plan([1], 3, 1)
    seen = [[2]]
    assert [t for t in range(12) if S.due(t, seen, plan) == [True]] == [0, 1, 4, 7, 10]
    assert all(S.due(t, [[0]], plan) == [True] for t in range(12))
    stack = _plan([3], 3, 1)
    assert S.due(2, [[1, 0, 4]], stack) == [False, True, False]
    assert S.due(4, [[1, 0, 4]], stack) == [True, True, True]
    both = _plan([2, 2], 2, 0)
    assert S.due(3, [[1, 1], [1, 0]], both) == [False, True]
    assert S.due(4, [[1, 1], [1, 1]], both) == [True, True]


def test_hooks_are_armed_exactly_when_the_fold_counts():
    """The capture hooks' arming and the statistic fold read the one rule: over a staggered run with
    a layer that skips some forward passes, a matrix counts a capture on a step iff its hooks were
    armed for it and it ran, and it is armed iff ``due`` says so."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6, dtype=torch.float64) for _ in range(3)])
    opt = dobb.Dobb([m.weight for m in model], model, lr=0.01, refresh_every=3, stagger=True, **F64)
    for t in range(12):
        skip = 1 if t in (0, 4) else None  # layer 1 unused on steps 0 and 4: stays due / counts nothing
        armed = {id(p) for p in opt._hooks.armed}
        for m in model:
            st = opt.state[m.weight]
            assert (id(m.weight) in armed) == any(S.due(st["step"], st["captures"], opt._plans[m.weight]))
        before = [opt.state[m.weight]["captures"][0][0] for m in model]
        x = torch.randn(5, 6, dtype=torch.float64)
        for i, m in enumerate(model):
            if i != skip:
                x = m(x)
        x.square().sum().backward()
        opt.step()
        opt.zero_grad()
        for i, m in enumerate(model):
            counted = opt.state[m.weight]["captures"][0][0] - before[i]
            assert counted == (id(m.weight) in armed and i != skip), (t, i)


def test_captures_from_every_saved_form():
    one, stack, both = _plan([1], 3, 0), _plan([3], 3, 0), _plan([1, 1], 3, 0)
    assert S.captures(4, one) == [[4]] and S.captures(torch.tensor(4), one) == [[4]]
    assert S.captures([[4]], one) == [[4]]
    assert S.captures([1, 0, 2], stack) == [[1, 0, 2]] and S.captures([[1, torch.tensor(0), 2]], stack) == [[1, 0, 2]]
    assert S.captures([3, 2], both) == [[3], [2]] and S.captures([[3], [2]], both) == [[3], [2]]
    got = S.captures([torch.tensor(3), torch.tensor(2)], both)
    assert got == [[3], [2]] and all(type(c) is int for side in got for c in side)
    for bad, plan in (([1, 2], one), (5, stack), ([1, 2, 3], both)):
        with pytest.raises(ValueError, match="saved capture counts"):
            S.captures(bad, plan)
