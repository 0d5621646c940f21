"""``dobb.core.update``: the update's kernel choice, read on its own.

The update's numbers (one-sided, two-sided, ``norm="muon"``, whole-matrix steps) are checked against
the float64 reference through the class in ``tests/core/test_optimizer.py`` and
``tests/core/test_dobb_muon.py``; here: the optimizer re-exports these names, and the fused-decay
rule reads this module's threshold; the direction cache changes no number.
"""
from __future__ import annotations

import pytest
import torch

from dobb.core import optimizer, update
from dobb.placement import layout_for


def test_the_optimizer_re_exports_the_update():
    for name in ("FUSE_MIN_BLOCK_WORK", "OneSided", "TwoSided", "decay_in_update", "apply_directions",
                 "apply_two_sided", "apply_preconditioned_muon", "precondition"):
        assert getattr(optimizer, name) is getattr(update, name), name


def test_decay_in_update_reads_the_threshold_of_this_module(monkeypatch):
    w = torch.zeros(64, 64)
    lay = layout_for(w, "input", 2, None)
    kw = dict(lr=0.1, basis_dtype=torch.float32, product_dtype="auto")
    work = 64 * 32 * 32  # rows * smallest block ** 2
    monkeypatch.setattr(update, "FUSE_MIN_BLOCK_WORK", work)
    assert update.decay_in_update(w, lay, **kw)
    monkeypatch.setattr(update, "FUSE_MIN_BLOCK_WORK", work + 1)
    assert not update.decay_in_update(w, lay, **kw)
    assert not update.decay_in_update(w, lay, **dict(kw, lr=torch.tensor(0.1)))  # a tensor lr: never fused


def test_whole_step_owner_has_no_state():
    """Dobb's whole steps hold the distribution layer's strategy, not an optimizer (issue 54)."""
    from dobb.distribution import OwnerCompute

    owner = update.whole_step_owner()
    assert type(owner) is OwnerCompute and vars(owner) == {"replicated_group": "default"}


def _pair_steps(monkeypatch, steps, *, mutate=None, **options):
    """Weights after ``steps`` steps of two equal Dobbs on equal models, one through the direction cache
    (the CPU default), one through ``apply_directions`` (the cache switched off); ``mutate(opt, model,
    step)`` runs before each step on both."""
    import dobb
    from dobb.core import optimizer as core_optimizer

    out = []
    for cached in (True, False):
        if not cached:
            monkeypatch.setattr(update, "cacheable", lambda params: False)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(40, 40, bias=False),
                                    torch.nn.Linear(40, 9, bias=False))
        opt = dobb.Dobb(model.parameters(), model, lr=0.02, weight_decay=0.1, refresh_every=2, **options)
        for t in range(steps):
            if mutate is not None:
                mutate(opt, model, t)
            model(torch.randn(16, 24)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        out.append(([p.detach().clone() for p in model.parameters()], opt, model))
    return out


@pytest.mark.parametrize("options", [dict(blocks=3), dict(blocks=2, norm="l2"), dict(blocks=3, side="output", source="output_grad"),
                                     dict(blocks=1)])
def test_cached_directions_are_the_plain_path_bitwise(monkeypatch, options):
    """``DirectionCache`` (views and constants kept across steps, the kernels' views among them) changes no
    number: weights after steps with a changing lr, with the fused decay on and off, equal the uncached
    path bit for bit."""
    monkeypatch.setattr(update, "FUSE_MIN_BLOCK_WORK", 16 * 13 * 13)  # some matrices fuse the decay, some do not

    def lr_schedule(opt, model, t):
        opt.param_groups[0]["lr"] = 0.02 / (1 + t)

    (cached, opt, _), (plain, _, _) = _pair_steps(monkeypatch, 5, mutate=lr_schedule, **options)
    assert len(opt._directions.entries) == 3  # the cache was used
    # and every run's kernel took the views kept from its first step (``_kernel_views``)
    assert all(isinstance(v, dict) and v for e in opt._directions.entries.values() for v in e.views)
    if options == dict(blocks=3):
        assert {e.fuse for e in opt._directions.entries.values()} == {True, False}
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


@pytest.mark.parametrize("options", [dict(blocks=1), dict(blocks=2, norm="l2")])
def test_cached_directions_without_the_fused_decay_are_the_plain_path_bitwise(monkeypatch, options):
    """The third kernel of ``add_directions_`` (a product and a strided add: the decay not fused, blocks
    over ``SMALL_BLOCK`` or ell2), through its kept views: the uncached path bit for bit."""
    monkeypatch.setattr(update, "FUSE_MIN_BLOCK_WORK", 1 << 40)
    (cached, opt, _), (plain, _, _) = _pair_steps(monkeypatch, 4, **options)
    assert {k for e in opt._directions.entries.values() for v in e.views for k in v} == {"plain"}
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


def test_direction_cache_follows_new_storage_settings_and_loads(monkeypatch):
    """A weight given new storage, a changed ``tau`` and a loaded state are prepared again: the step
    still writes the weight the model holds, with the group's settings."""
    def mutate(opt, model, t):
        if t == 2:
            w = model[1].weight
            w.data = w.data.clone()  # new storage behind the same parameter
        if t == 3:
            opt.param_groups[0]["tau"] = 0.1
        if t == 4:
            opt.load_state_dict(opt.state_dict())

    (cached, opt, model), (plain, _, _) = _pair_steps(monkeypatch, 6, mutate=mutate, blocks=2)
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))
    assert all(e.tensors[0] is p for p, e in zip(model.parameters(), opt._directions.entries.values()))


def test_two_sided_sign_views_are_kept_per_matrix_and_change_no_number(monkeypatch):
    """``side="both"`` sign keeps each matrix's ``SignViews`` across steps (``DirectionCache.signs``, by
    plan), made again after a load and for a weight given new storage: the weights equal those of views
    made afresh every step, bit for bit."""
    import dobb

    def mutate(opt, model, t):
        if t == 2:
            model[1].weight.data = model[1].weight.data.clone()
        if t == 3:
            opt.load_state_dict(opt.state_dict())

    out = []
    for kept in (True, False):
        if not kept:
            monkeypatch.setattr(update.DirectionCache, "sign_views",
                                lambda self, plan, w, u, rows, cols: update.sign_views(w, u, rows, cols))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(40, 40, bias=False))
        opt = dobb.Dobb(model.parameters(), model, lr=0.02, weight_decay=0.1, refresh_every=2, side="both",
                        blocks=2, out_blocks=1)
        for t in range(5):
            mutate(opt, model, t)
            model(torch.randn(16, 24)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
        if kept:
            views = list(opt._directions.signs.values())
            assert len(views) == 2 and views[1].ptrs[0] == model[1].weight.data_ptr()  # the new storage
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("row_sizes,col_sizes", [([12], [20]), ([12], [5, 5, 5, 5]), ([4, 4, 4], [20]),
                                                 ([5, 4, 3], [7, 7, 6])])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_two_sided_sign_is_the_functional_update_bitwise(row_sizes, col_sizes, w_dtype):
    """``two_sided_sign_`` (bases converted once, no copy of a whole-axis product) writes the same bits
    as ``functional.two_sided_update_`` with ``norm="sign"``: bf16 bases, fp32 products, every mix of
    one block and several per axis."""
    from dobb import functional as F

    gen = torch.Generator().manual_seed(0)
    r, k = sum(row_sizes), sum(col_sizes)

    def basis(sizes):
        out = torch.zeros(sum(sizes), max(sizes))
        start = 0
        for s in sizes:
            out[start : start + s, :s] = torch.linalg.qr(torch.randn(s, s, generator=gen)).Q
            start += s
        return out.bfloat16()

    rows, cols = F.BlockBasis(basis(row_sizes), row_sizes), F.BlockBasis(basis(col_sizes), col_sizes)
    u = torch.randn(r, k, generator=gen)
    w = torch.randn(r, k, generator=gen).to(w_dtype)
    w0, w_ref = w.clone(), w.clone()
    update.two_sided_sign_(w, u, rows, cols, factor=-0.37, dtype=torch.float32)
    F.two_sided_update_(w=w_ref, u=u, g=u, rows=rows, cols=cols, factor=-0.37, dtype=torch.float32, norm="sign")
    assert not torch.equal(w, w0)
    assert torch.equal(w, w_ref)
