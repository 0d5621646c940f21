"""dobb.baselines.shampoo_family.dash: Dash (block Shampoo as DASH does it) against independent references: explicit
tile slicing, a float64 loop over tiles of the DASH equations, the polar factor, Adam's update
norm, and the authors' package ``ista-daslab-optimizers`` (module ``dash``) on CPU when it is
installed. The inverse roots are tested in test_matrix_roots.py."""
from __future__ import annotations

import copy
import importlib.util
import math
import sys
import types

import pytest
import torch

from _compare import max_diff
from dobb.baselines.shampoo_family.dash import Dash, from_tiles, tile_specs, to_tiles

SHAPES = [(40, 37), (48, 40), (16, 16), (8, 20)]  # both remainders, one, none, smaller than a tile


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_are_the_block_partition(shape):
    m, n = shape
    x = torch.arange(m * n, dtype=torch.float64).reshape(m, n)
    tiles = to_tiles(x, 16)
    assert [(t.shape[0], t.shape[1], t.shape[2]) for t in tiles] == tile_specs(m, n, 16)
    # the same tiles by explicit slicing, in to_tiles' order
    rows = [(i, min(i + 16, m)) for i in range(0, m, 16)]
    cols = [(j, min(j + 16, n)) for j in range(0, n, 16)]
    seen = {}
    for (r0, r1) in rows:
        for (c0, c1) in cols:
            seen.setdefault((r1 - r0, c1 - c0), []).append(x[r0:r1, c0:c1])
    full, right, bottom, corner = (16, 16), (16, n % 16), (m % 16, 16), (m % 16, n % 16)
    expected = [torch.stack(seen[k]) for k in (full, right, bottom, corner) if k in seen]
    assert max_diff(tiles, expected) == 0
    assert torch.equal(from_tiles(tiles, m, n, 16), x)


# ----------------------------------------------------------------------------- float64 reference
def _root(x, eps):
    vals, vecs = torch.linalg.eigh(x + eps * torch.eye(x.shape[0], dtype=x.dtype))
    vals = vals + eps - min(vals.min().item(), 0.0)
    return (vecs * vals.pow(-0.25)) @ vecs.T


def reference(w, grads, lr, wd, B, beta_lr=0.95, beta_g=0.9, beta_graft=0.95, graft="adam", every=10,
              eps=1e-10, eps_graft=1e-8, tau=0.2):
    """The DASH equations in float64, one tile at a time by explicit slicing (no batching)."""
    w = w.clone().double()
    m_, n_ = w.shape
    cuts = [((i, min(i + B, m_)), (j, min(j + B, n_))) for i in range(0, m_, B) for j in range(0, n_, B)]
    L = {c: torch.zeros(c[0][1] - c[0][0], c[0][1] - c[0][0], dtype=torch.float64) for c in cuts}
    R = {c: torch.zeros(c[1][1] - c[1][0], c[1][1] - c[1][0], dtype=torch.float64) for c in cuts}
    Li, Ri = {}, {}
    M, A = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        g = g.double()
        M = beta_g * M + (1 - beta_g) * g
        A = beta_graft * A + (1 - beta_graft) * g * g
        upd = torch.zeros_like(w)
        for c in cuts:
            (r0, r1), (c0, c1) = c
            gt = g[r0:r1, c0:c1]
            if beta_lr == 1:
                L[c], R[c] = L[c] + gt @ gt.T, R[c] + gt.T @ gt
            else:
                L[c] = beta_lr * L[c] + (1 - beta_lr) * gt @ gt.T
                R[c] = beta_lr * R[c] + (1 - beta_lr) * gt.T @ gt
            if t == 1 or t % every == 0:
                bias = 1 - beta_lr ** t if graft == "none" and beta_lr < 1 else 1.0
                Li[c], Ri[c] = _root(L[c] / bias, eps), _root(R[c] / bias, eps)
            bc_g = 1 - beta_g ** t if beta_g > 0 else 1.0
            u = Li[c] @ M[r0:r1, c0:c1] @ Ri[c]
            if graft == "adam":
                adam = (M[r0:r1, c0:c1] / bc_g) / ((A[r0:r1, c0:c1] / (1 - beta_graft ** t)).sqrt() + eps_graft)
                u = u * adam.norm() / (u.norm() + 1e-16)
            else:
                u = u * tau * math.sqrt(max(r1 - r0, c1 - c0)) / bc_g
            upd[r0:r1, c0:c1] = u
        w = (1 - lr * wd) * w - lr * upd
    return w


def run(shapes, grads_per, dtype=torch.float64, **kw):
    ws = [torch.nn.Parameter(w.clone().to(dtype)) for w in shapes]
    opt = Dash(ws, **kw)
    for step_grads in grads_per:
        for w, g in zip(ws, step_grads):
            w.grad = g.to(dtype)
        opt.step()
    return [w.detach() for w in ws], opt


def problem(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(steps)]
    return ws, grads


@pytest.mark.parametrize("kw", [
    dict(), dict(graft="none"), dict(beta_lr=1.0, beta_g=0.0), dict(precondition_every=2, beta_graft=0.5),
    dict(graft="none", beta_g=0.0, precondition_every=3)])
def test_matches_float64_reference(kw):
    ws, grads = problem(SHAPES, 4)
    # eps 1e-3: the remainder tiles' factors (16 x 5 tiles: rank 5 of 16) stay well conditioned, so
    # rounding is not amplified by eps^{-1/4} and the comparison is of the equations
    out, _ = run(ws, grads, lr=0.05, weight_decay=0.1, block_size=16, eps_inv_root=1e-3, **kw)
    ref_kw = {"graft": kw.get("graft", "adam"), "beta_lr": kw.get("beta_lr", 0.95),
              "beta_g": kw.get("beta_g", 0.9), "beta_graft": kw.get("beta_graft", 0.95),
              "every": kw.get("precondition_every", 10), "eps": 1e-3}
    for w, o, i in zip(ws, out, range(len(ws))):
        expected = reference(w, [g[i] for g in grads], 0.05, 0.1, 16, **ref_kw)
        assert max_diff(o, expected) < 1e-11, (SHAPES[i], kw)


def test_stacked_tiles_equal_looped_tiles():
    """All matrices of a group in one optimizer (tiles of equal shape batched across matrices, one
    batched root per factor size) equal each matrix in its own optimizer."""
    shapes = [(32, 48), (48, 32), (32, 32), (40, 37)]
    ws, grads = problem(shapes, 3, seed=3)
    together, opt = run(ws, grads, lr=0.05, weight_decay=0.1, block_size=16, precondition_every=2)
    apart = [run([w], [[g[i]] for g in grads], lr=0.05, weight_decay=0.1, block_size=16,
                 precondition_every=2)[0][0] for i, w in enumerate(ws)]
    assert max_diff(together, apart) < 1e-12
    assert sorted(opt.state[opt.param_groups[0]["params"][0]]) == ["L", "L_root", "R", "R_root", "graft_sq",
                                                                    "momentum", "step"]


@pytest.mark.parametrize("shape", SHAPES)
def test_one_step_without_ema_is_the_tile_polar_factor(shape):
    """graft="none", no EMA, one step: each tile moves by lr * tau*sqrt(max(r, c)) * U V^T
    (``(G G^T)^{-1/4} G (G^T G)^{-1/4} = U V^T``), from the SVD of the tile."""
    (w,), ((g,),) = problem([shape], 1, seed=5)
    (out,), _ = run([w], [[g]], lr=0.1, weight_decay=0.0, block_size=16, graft="none", beta_lr=0.0,
                    beta_g=0.0, eps_inv_root=1e-14)
    step = (w - out) / 0.1
    m, n = shape
    for i in range(0, m, 16):
        for j in range(0, n, 16):
            u, _, vh = torch.linalg.svd(g[i:i + 16, j:j + 16], full_matrices=False)
            tile = step[i:i + 16, j:j + 16]
            s = 0.2 * math.sqrt(max(tile.shape))
            assert max_diff(tile, s * u @ vh) < 1e-6


def test_adam_graft_gives_each_tile_the_adam_update_norm():
    """graft="adam": at step 1 (bias-corrected Adam is g/(|g| + eps)) each tile's update has the
    Frobenius norm of that tile's Adam update; weight decay is AdamW's decoupled one."""
    (w,), ((g,),) = problem([(40, 37)], 1, seed=7)
    (out,), _ = run([w], [[g]], lr=0.01, weight_decay=0.5, block_size=16)
    step = ((1 - 0.01 * 0.5) * w - out) / 0.01
    adam = g / (g.abs() + 1e-8)
    for i in range(0, 40, 16):
        for j in range(0, 37, 16):
            assert abs(step[i:i + 16, j:j + 16].norm() - adam[i:i + 16, j:j + 16].norm()) < 1e-9


def test_zero_gradient_tile_gives_no_update():
    w = torch.nn.Parameter(torch.ones(16, 32))
    opt = Dash([w], lr=0.1, block_size=16)
    w.grad = torch.zeros(16, 32)
    w.grad[:, :16] = 1.0
    opt.step()
    assert torch.isfinite(w).all() and torch.equal(w[:, 16:], torch.ones(16, 16))


@pytest.mark.parametrize("key,value,match", [
    ("block_size", 0, "block_size"), ("beta_lr", 1.5, "beta_lr"), ("beta_g", 1.0, "beta_g"),
    ("graft", "adagrad", "graft must be one of"), ("inverse_root", "svd", "inverse_root must be one of"),
    ("eps_inv_root", -1.0, "eps_inv_root"), ("precondition_every", 0, "precondition_every"),
    ("newton_steps", 0, "newton_steps"), ("eps_graft", 0.0, "eps_graft")])
def test_bad_hyperparameters_raise(key, value, match):
    with pytest.raises(ValueError, match=match):
        Dash([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, **{key: value})


def test_bf16_weights_keep_fp32_factors_and_resume():
    ws, grads = problem([(32, 24)], 4, seed=9)
    a, opt = run(ws, grads[:2], dtype=torch.bfloat16, lr=0.01, block_size=16)
    p = opt.param_groups[0]["params"][0]
    assert opt.state[p]["L"].dtype == torch.float32
    sd = copy.deepcopy(opt.state_dict())  # torch's load keeps same-dtype tensors: do not share them
    b = torch.nn.Parameter(p.detach().clone())
    opt2 = Dash([b], lr=0.01, block_size=16)
    opt2.load_state_dict(sd)
    assert opt2.state[b]["L_root"].dtype == torch.float32 and opt2.state[b]["step"] == 2
    for (g,) in grads[2:]:
        p.grad, b.grad = g.bfloat16(), g.bfloat16()
        opt.step()
        opt2.step()
    assert torch.equal(p, b)
    with pytest.raises(ValueError, match="saved state"):
        Dash([torch.nn.Parameter(p.detach().clone())], lr=0.01, block_size=8).load_state_dict(sd)


# ----------------------------------------------------------------------------- the authors' package
def _triton_only(*args, **kwargs):
    raise AssertionError("a Triton kernel of the package was called on the fp32 CPU path")


@pytest.fixture
def dash_package(monkeypatch):
    """The package's ``dash`` module on CPU. Its top-level ``__init__`` imports the optimizers built
    on its CUDA extensions (``micro_adam``: ``ista_daslab_cuda_tools``), which cannot be installed
    without CUDA, so only the ``dash`` subpackage is loaded. Its two Triton kernel modules
    (``utils.triton_kernels``: a fused factor update that ``DashGpu`` leaves commented out;
    ``utils.newton_schulz_triton``: the bf16/fp16 coupled-Newton powers) import ``triton``, which has
    no CPU backend: they are replaced by modules whose kernels raise if called (the fp32 path calls
    neither). ``wandb`` (logging only) is replaced likewise when it is not installed."""
    spec = importlib.util.find_spec("ista_daslab_optimizers")
    if spec is None:
        pytest.skip("ista-daslab-optimizers is not installed (pip install --no-deps ista-daslab-optimizers==1.1.15)")
    for name in [k for k in sys.modules if k.startswith("ista_daslab_optimizers")]:
        monkeypatch.delitem(sys.modules, name)
    pkg = types.ModuleType("ista_daslab_optimizers")
    pkg.__path__ = list(spec.submodule_search_locations)
    monkeypatch.setitem(sys.modules, "ista_daslab_optimizers", pkg)
    for name, kernels in (("utils.triton_kernels", ("update_dash_preconditioner",)),
                          ("utils.newton_schulz_triton", ("ns_line_1", "ns_line_2"))):
        stub = types.ModuleType(f"ista_daslab_optimizers.{name}")
        for k in kernels:
            setattr(stub, k, _triton_only)
        monkeypatch.setitem(sys.modules, stub.__name__, stub)
    if importlib.util.find_spec("wandb") is None:
        monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    return importlib.import_module("ista_daslab_optimizers.dash")


PKG_ROOTS = {"eigh": "EVD", "newton-db": "NDB", "coupled-newton": "CN"}


def tilewise_well_conditioned(shape, gen, B=16):
    """A gradient whose every ``B x B`` tile has singular values in [0.5, 1.5]: each tile factor has
    a condition number the iterative roots resolve in 10 steps whatever their scaling (the
    package's is a random power iteration in bf16, ours the Frobenius norm), so the roots agree
    within float32 rounding."""
    g = torch.empty(shape)
    for i in range(0, shape[0], B):
        for j in range(0, shape[1], B):
            q1, _ = torch.linalg.qr(torch.randn(B, B, generator=gen))
            q2, _ = torch.linalg.qr(torch.randn(B, B, generator=gen))
            g[i:i + B, j:j + B] = q1 @ torch.diag(0.5 + torch.rand(B, generator=gen)) @ q2.T
    return g


def _against_package(D, shapes, grads, root, **kw):
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in ws]
    theirs = [torch.nn.Parameter(w.clone()) for w in ws]
    cfg = D.DashConfig(block_size=16, inv_root_method=getattr(D.DashInverseRootMethodType, PKG_ROOTS[root]),
                       inv_root_freq=2, **{k: v for k, v in kw.items() if k == "eps_inv_root"})
    opt_theirs = D.DashGpu([{"params": theirs}], lr=0.02, weight_decay=0.1, config=cfg)
    opt_ours = Dash(ours, lr=0.02, weight_decay=0.1, block_size=16, inverse_root=root, precondition_every=2, **kw)
    for step_grads in grads:
        for a, b, g in zip(ours, theirs, step_grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
        moved = max(max_diff(a, w) for a, w in zip(ours, ws))
        assert max_diff(ours, theirs) < 1e-4 * moved, (root, max_diff(ours, theirs), moved)


@pytest.mark.parametrize("root", list(PKG_ROOTS))
def test_matches_authors_package_on_cpu(dash_package, root):
    """Three steps (roots refreshed at steps 1 and 2) of ``DashGpu``, the package's batched
    optimizer, and of ``Dash`` at the package's defaults (betas, eps, Adam grafting), square tiles."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 48), (48, 32), (32, 64)]
    _against_package(dash_package, shapes, [[tilewise_well_conditioned(s, gen) for s in shapes] for _ in range(3)], root)


def test_matches_authors_package_with_remainder_tiles(dash_package):
    """Remainder tiles (the package needs one side divisible by ``block_size``: no corner tile) on
    random gradients. A 16 x 8 tile's left factor has rank 8 of 16: at DASH's eps 1e-10 its null
    space gets eigenvalue ~1e-10 and weight 1e-10^{-1/4} = 316 on float32 rounding noise, which
    two implementations round differently; eps 1e-3 on both sides compares the equations."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(48, 40), (40, 32)]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    _against_package(dash_package, shapes, grads, "eigh", eps_inv_root=1e-3)


# ----------------------------------------------------------------------------- Shampoo
@pytest.mark.parametrize("shape", [(12, 8), (8, 12), (10, 10)])
def test_shampoo_matches_pytorch_optimizer(shape):
    """``Shampoo`` (one tile per matrix) against ``pytorch_optimizer.Shampoo`` 4.1.0, the original
    Shampoo (factors summed from ``eps I``, inverse fourth roots by SVD every step, no grafting,
    no momentum), on three float64 steps. Matched settings: ``beta_lr=1`` (sum), ``beta_g=0``,
    ``graft="none"``, ``precondition_every=1``, ``tau = 1/sqrt(max(m, n))`` (protocol scale 1, its
    update is ``lr * L^{-1/4} G R^{-1/4}``), decoupled weight decay, and ``eps_inv_root = eps/2``:
    our eigh adds the damping twice (Distributed Shampoo's shift), theirs starts the sum at ``eps I``.
    heavyball's Shampoo is not the reference: it changes the algorithm (compile-first
    preconditioner schedule and update tweaks) more than settings can undo."""
    po = pytest.importorskip("pytorch_optimizer")
    from dobb.baselines.shampoo_family.dash import Shampoo

    (w,), grads = problem([shape], 3, seed=11)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    eps = 1e-6
    opt_ours = Shampoo([ours], lr=0.1, weight_decay=0.1, graft="none", beta_lr=1.0, beta_g=0.0,
                       precondition_every=1, tau=1 / math.sqrt(max(shape)), eps_inv_root=eps / 2)
    opt_theirs = po.Shampoo([theirs], lr=0.1, weight_decay=0.1, weight_decouple=True, matrix_eps=eps)
    for (g,) in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
        assert max_diff(ours, theirs) < 1e-10 * max(1.0, max_diff(ours, w))
    assert max_diff(ours, w) > 0.1  # it moved


def test_newton_db_against_the_authors_newton_db_on_the_same_inputs(dash_package):
    """The authors' Newton-DB (DASH package, fp32, its fixed ``newton_steps``) and ours on one batch
    of ill-conditioned factors, both against the float64 root: at the package's 10 steps both are far
    from it; ours with the tolerance is not; with 30 fixed steps the package gets close."""
    from dobb.baselines.shampoo_family._matrix_roots import inverse_root_newton_db
    D = dash_package
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3, 32, 32, generator=gen, dtype=torch.float64))
    lam = 2.0 * torch.logspace(0, -4, 32, dtype=torch.float64)  # condition number 1e4
    a, expected = (q * lam) @ q.mT, (q * lam.pow(-0.25)) @ q.mT

    def _rel_err(out, ref):
        return ((out.double() - ref).norm() / ref.norm()).item()

    errs = {}
    for steps in (10, 30):
        cfg = D.DashConfig(block_size=32, newton_steps=steps, eps_inv_root=0.0,
                           inv_root_method=D.DashInverseRootMethodType.NDB)
        cfg.matrix_scaling_type = type(cfg.matrix_scaling_type).FRO  # Frobenius, as ours: same inputs
        out = torch.empty_like(a.float())
        ndb = importlib.import_module("ista_daslab_optimizers.dash.invertors.inv_ndb").DashRootInvNewtonDB
        ndb._matrix_root_inv_newton_db(a.float(), out, cfg, 4)
        errs[steps] = _rel_err(out, expected)
    ours = _rel_err(inverse_root_newton_db(a.float(), 4, 0.0, 100, 1e-4), expected)
    # package: 10 steps 0.27 off, 30 steps 1.4e-3 (its bf16-rounded scale); ours 2e-5
    assert errs[10] > 0.05 and errs[30] < 1e-2 and ours < 1e-3 and ours < errs[30]


# ----------------------------------------------------------------------------- in place, same bits
class _PlainDash(Dash):
    """Step 3 as plain expressions on whole matrices (the Adam direction over the whole matrix, its
    tiles by ``to_tiles``, the update reassembled by ``from_tiles`` and added whole): the form the
    in-place step replaced, kept to pin its bits."""

    def _matrix_step(self, group, active):
        from dobb.baselines import _common as C
        from dobb.baselines.shampoo_family.dash import NORM_EPS, _factor_views, _flat
        captured = {}
        apply = C.apply_protocol
        C.apply_protocol = lambda *a: captured.setdefault("call", a)  # steps 1-2 as Dash runs them
        try:
            super()._matrix_step(group, active)
        finally:
            C.apply_protocol = apply
        b_g, b_a, graft = group["beta_g"], group["beta_graft"], group["graft"]
        updates = []
        for p in active:
            st, m = self.state[p], self.state[p]["momentum"]
            t, B = st["step"], self._block_size(group, p.shape)
            specs = tile_specs(*p.shape, B)
            roots = {k: _factor_views(_flat(st[k]), specs, 1 if k[0] == "L" else 2) for k in ("L_root", "R_root")}
            bc_g = 1 - b_g ** t if b_g > 0 else 1.0
            m32 = m.to(_flat(st["L"]).dtype)
            if graft == "adam":
                adam = (m32 / bc_g) / ((st["graft_sq"].to(m32.dtype) / (1 - b_a ** t)).sqrt() + group["eps_graft"])
                norms = [torch.linalg.matrix_norm(a, keepdim=True) for a in to_tiles(adam, B)]
            tiles = []
            for i, (mt, lr_, rr_) in enumerate(zip(to_tiles(m32, B), roots["L_root"], roots["R_root"])):
                u = lr_ @ mt @ rr_
                if graft == "adam":
                    u = u * (norms[i] / (torch.linalg.matrix_norm(u, keepdim=True) + NORM_EPS))
                else:
                    u = u * (C.update_scale(mt.shape[1], mt.shape[2], group["tau"]) / bc_g)
                tiles.append(u)
            updates.append(from_tiles(tiles, *m.shape, B, like=m32))
        apply(list(active), list(active), updates, [1.0] * len(active), group["lr"], group["weight_decay"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(graft="none"), dict(beta_g=0.0, beta_lr=1.0)])
def test_in_place_step_equals_the_plain_expressions_bitwise(dtype, kw):
    """Every tile layout (full tiles with one and with several tile columns, right and bottom
    remainders, corner, a matrix smaller than a tile), 12 steps (two refreshes): the in-place step's
    weights and state are the plain whole-matrix expressions' bit for bit."""
    shapes = [(40, 37), (48, 40), (32, 48), (16, 20), (8, 20), (20, 16)]
    ws, grads = problem(shapes, 12, seed=5)
    results = []
    for cls in (Dash, _PlainDash):
        params = [torch.nn.Parameter(w.to(dtype)) for w in ws]
        opt = cls(params, lr=0.05, weight_decay=0.1, block_size=16, precondition_every=5, **kw)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = (0.01 * g).to(dtype)
            opt.step()
        results.append([p.detach().clone() for p in params] + [v for p in params for v in opt.state[p].values()
                                                                if torch.is_tensor(v)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
