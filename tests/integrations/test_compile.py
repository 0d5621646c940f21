"""torch.compile: a compiled ``opt.step`` gives the eager numbers; ``step()`` issues no host
synchronisation (no ``.item()``/``bool(tensor)``) when ``check_finite=False``.

Most checks compile with the ``aot_eager`` backend (Dynamo tracing and AOTAutograd
functionalization of every in-place state update, seconds). The Inductor check generates and
compiles C++ (44 s on 2 CPU cores with an empty Inductor cache); it runs whenever the C++ compiler
Inductor uses is on the PATH, and ``DOBB_TEST_INDUCTOR=0`` opts out.
"""
import os
import shutil

import pytest
import torch
from torch import nn
from _hostsync import HostReads

import dobb

F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64, refresh_every=2, check_finite=False)


def _model(adamw_params):
    torch.manual_seed(0)
    # tanh, and 64 rows per batch for 16/32 features: full-rank statistics, so every basis vector is
    # determined by the data (a null-space direction is arbitrary and its coefficient's sign is noise)
    if not adamw_params:
        return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 16, bias=False),
                             nn.Linear(16, 4, bias=False)).double()
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4)).double()


def _run(name, kw, steps, compile_backend=None, adamw_params=False):
    model = _model(adamw_params)
    opt = dobb.build_optimizer(name, model, lr=1e-2, weight_decay=0.1, **kw)
    step = torch.compile(opt.step, backend=compile_backend) if compile_backend else opt.step
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=g, dtype=torch.float64)
        model(x).square().mean().backward()
        step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


# Dobb compiles in the test below (with AdamW groups); here the Muon family's NS chain, and SOAP,
# whose step count and bias correction stay symbolic in the compiled step (refreshes included)
CASES = {"muon": {}, "soap": {"precondition_frequency": 2}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_step_gives_the_eager_numbers(name):
    torch._dynamo.reset()
    eager = _run(name, CASES[name], 4)
    compiled = _run(name, CASES[name], 4, compile_backend="aot_eager")
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["muon", "block-muon"])
def test_compiled_muon_family_with_adamw_groups_gives_the_eager_numbers(name):
    """Muon's ``ns_dtype="auto"`` breaks the graph inside the matrix step, after which Dynamo runs step()
    eagerly and compiles the frames it calls, the AdamW kernel's among them: that kernel failed
    (capturable read in the eager frame) until ``dobb._base._adamw_kernel`` read it in its own."""
    torch._dynamo.reset()
    eager = _run(name, {}, 3, adamw_params=True)
    compiled = _run(name, {}, 3, compile_backend="aot_eager", adamw_params=True)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-6)


def test_compiled_step_with_adamw_groups_gives_the_eager_numbers():
    """Dobb's first, refresh and plain steps, with biases and a norm in the AdamW part, one graph each (no
    graph break). Compiled, torch's AdamW kernel computes its bias
    corrections from the float32 step tensor on the device (capturable form, as for a compiled
    torch.optim.AdamW) instead of a float64 host number: ~1e-7 relative, hence the tolerance."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _run("dobb", F64, 3, adamw_params=True)
    compiled = _run("dobb", F64, 3, compile_backend="aot_eager", adamw_params=True)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-6)
    # the AdamW part's inputs are gathered in the trace (torch's _init_group, which Dynamo disables, broke it)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def _with_torch_adamw(compiled, matrix_step_break=False, steps=3):
    """Dobb (float64, ``check_finite=True``) on a model with biases and a norm, its step compiled
    with ``aot_eager`` or eager, and beside it an eager ``torch.optim.AdamW`` (``fused``, as the AdamW
    part runs eagerly on CPU by default; traced, it takes the foreach kernel) on copies of the AdamW-handled parameters, fed the same gradients. Checks after
    every step that the AdamW part equals torch's (bitwise eager; compiled, the bias corrections come
    from the float32 step tensor: the tolerance of the test above); returns the weights, the step
    tensors of both and the reasons of Dynamo's graph breaks."""
    from torch._dynamo.utils import counters

    model = _model(adamw_params=True)
    opt = dobb.build_optimizer("dobb", model, lr=1e-2, weight_decay=0.1, **dict(F64, check_finite=True))
    if matrix_step_break:
        matrix_step = opt._matrix_step

        def broken(*args):
            torch._dynamo.graph_break()
            return matrix_step(*args)

        opt._matrix_step = broken  # runs inside ``with self._logical(group)``
    (group,) = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    mine = group["params"]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    ref = torch.optim.AdamW(theirs, lr=group["lr"], betas=group["adamw_betas"], eps=group["adamw_eps"],
                            weight_decay=group["weight_decay"], fused=True)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
    tol = dict(atol=1e-7, rtol=1e-6) if compiled else dict(atol=0, rtol=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(64, 16, generator=g, dtype=torch.float64)).square().mean().backward()
        for p, q in zip(mine, theirs):
            q.grad = p.grad.clone()
        step()
        ref.step()
        opt.zero_grad()
        for p, q in zip(mine, theirs):
            torch.testing.assert_close(p.detach(), q.detach(), **tol)
    return ([p.detach().clone() for p in model.parameters()], [opt.state[p]["step"] for p in mine],
            [ref.state[q]["step"] for q in theirs], list(counters["graph_break"]))


@pytest.mark.parametrize("where", ["prepare_step", "matrix_step"])
def test_compiled_step_decides_capturable_where_the_adamw_kernel_runs(where):
    """The AdamW part calls torch's kernel with ``capturable=torch.compiler.is_compiling()``, read in the
    frame that calls it (``dobb._base._adamw_kernel``): True compiled (Dynamo traces torch's capturable form), False eager (torch refuses
    capturable=True for CPU tensors outside a compile, and keeps the step on the CPU). Compiled, the step
    breaks the graph before the kernel only where ``check_finite=True`` reads the finiteness flags on the
    host, and resumes compiled (torch's ``_init_group``, which Dynamo disables, is not called: the
    lists are gathered in ``_adamw_inputs``, so it breaks nothing); a flag fixed
    at construction or to either value fails here, eager (True) or compiled (False). (Read where the
    inputs are gathered, ``_adamw_inputs``, it would pass: on torch 2.13 both run compiled or both
    eagerly here.) ``matrix_step``: a graph break inside the matrix step, after which Dynamo runs
    step() eagerly but compiles the kernel's frame (read in step() itself, the flag failed here)."""
    steps = 3
    eager, eager_steps, torch_steps = _with_torch_adamw(False, where == "matrix_step", steps)[:3]
    # an eager step leaves the AdamW state as torch.optim.AdamW does: float32 step tensors on the CPU
    for s, t in zip(eager_steps, torch_steps):
        assert (s.device, s.dtype, s.shape, s.item()) == (t.device, t.dtype, t.shape, t.item()) == \
            (torch.device("cpu"), torch.float32, torch.Size([]), steps)
    compiled, compiled_steps, _, breaks = _with_torch_adamw(True, where == "matrix_step", steps)
    assert not any("_init_group" in b for b in breaks) and any("tolist" in b for b in breaks), breaks
    for s in compiled_steps:
        assert (s.device, s.dtype, s.item()) == (torch.device("cpu"), torch.float32, steps)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-6)


def _inductor_cxx():
    """Inductor's CPU compiler candidates (``$CXX``, then ``torch._inductor.config.cpp.cxx``) and the
    first one on the PATH, or None."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    names = [c for c in (os.environ.get("CXX"), *(cxx if isinstance(cxx, (tuple, list)) else (cxx,))) if c]
    return names, next((shutil.which(c) for c in names if shutil.which(c)), None)


def test_inductor_compiled_step_gives_the_eager_numbers():
    if os.environ.get("DOBB_TEST_INDUCTOR") == "0":
        pytest.skip("DOBB_TEST_INDUCTOR=0: Inductor check opted out")
    names, found = _inductor_cxx()
    if found is None:
        pytest.skip(f"no C++ compiler for Inductor's CPU backend on the PATH (looked for {names})")
    torch._dynamo.reset()
    eager = _run("dobb", F64, 4)
    compiled = _run("dobb", F64, 4, compile_backend="inductor")
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)




@pytest.mark.parametrize("name", ["dobb", "dobb-l2", "dobb-g", "muon", "dion", "rmnp", "pr-muon", "block-muon", "dion2"])
def test_step_has_no_host_synchronisation_with_check_finite_false(name):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))
    # nonfinite="raise" (the default) reads the finiteness flags on the host: off here ("skip" reads
    # none inside its step either: tests/test_safety.py)
    kw = dict(check_finite=False, refresh_every=2) if name.startswith("dobb") else {"nonfinite": "off"}
    opt = dobb.build_optimizer(name, model, lr=1e-2, **kw)
    # torch's AdamW keeps its step counter as a CPU tensor (also for CUDA parameters) and reads it
    # on the host by design; those reads are not device synchronisations
    adamw_steps = [opt.state[p]["step"] for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
    hits = []
    for _ in range(3):  # a refresh step, a plain step, a refresh step
        model(torch.randn(32, 16)).square().mean().backward()
        with HostReads(adamw_steps) as spy:
            opt.step()
        hits += spy.hits
        opt.zero_grad()
    assert hits == []
    if name == "dobb":  # the check itself is one synchronisation per step, and the spy sees it
        opt.check_finite = True
        model(torch.randn(32, 16)).square().mean().backward()
        with HostReads(adamw_steps) as spy:
            opt.step()
        assert spy.hits


def _dobb_f32(kw, steps, compiled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 16, bias=False),
                          nn.Linear(16, 4, bias=False))
    opt = dobb.build_optimizer("dobb", model, lr=1e-2, refresh_every=3, check_finite=False, **kw)
    step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(64, 16, generator=g)).square().mean().backward()
        step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kw", [dict(blocks=1), dict(blocks=4), dict(blocks=4, stagger=False), dict(side="both"),
                                dict(source="grad_gram")], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_compiled_dobb_step_has_no_graph_break(kw):
    """``torch.compile(opt.step)`` over 30 fp32 steps with a refresh every 3 (the first step, refresh
    steps, plain steps; staggered or not): no graph break, at most 4 graphs (Dynamo specializes the
    step on which of its branches run, never on the step count: no recompilation storm), and the
    eager numbers bitwise (``aot_eager`` traces the same kernels; Inductor's fused fp32 kernels
    round differently, and a flipped sign of a near-zero coefficient moves a weight by one update,
    so the Inductor check above runs in float64)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _dobb_f32(kw, 30, compiled=False)
    compiled = _dobb_f32(kw, 30, compiled=True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_compiled_dobb_step_on_blocks_large_enough_for_the_fused_decay():
    """Eager, a large block's weight decay is the ``beta`` of its reconstruction ``baddbmm_`` into a
    strided view of W (``decay_in_update``); compiled, that in-place write into a view cannot be
    lowered by Inductor, so the step decays in a separate pass: the same update up to float rounding."""
    from dobb.core.optimizer import decay_in_update

    if os.environ.get("DOBB_TEST_INDUCTOR") == "0":
        pytest.skip("DOBB_TEST_INDUCTOR=0: Inductor check opted out")
    names, found = _inductor_cxx()
    if found is None:
        pytest.skip(f"no C++ compiler for Inductor's CPU backend on the PATH (looked for {names})")

    def run(compiled):
        torch.manual_seed(0)
        # (384, 128) in 4 column blocks of 32: the reconstruction writes a (384, 4, 32) view of W
        model = nn.Sequential(nn.Linear(128, 384, bias=False), nn.Tanh(), nn.Linear(384, 128, bias=False))
        # dobb-l2: a continuous update, so the two roundings stay within float tolerance; under the sign
        # a coefficient within rounding of zero flips (seen on an AMX host: 1% of entries off by 2*lr*s)
        opt = dobb.build_optimizer("dobb-l2", model, lr=1e-2, weight_decay=0.1, refresh_every=3, check_finite=False,
                                   blocks=4, basis_dtype=torch.float32)
        step = torch.compile(opt.step, backend="inductor") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            model(torch.randn(256, 128, generator=g)).square().mean().backward()
            step()
            opt.zero_grad()
        return model, opt

    model, opt = run(False)
    w = model[0].weight
    assert decay_in_update(w, opt._plans[w].sides[0].layout, lr=1e-2, basis_dtype=torch.float32,
                           product_dtype="auto")  # the eager step took the fused path
    torch._dynamo.reset()
    compiled, _ = run(True)
    for a, b in zip(model.parameters(), compiled.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- compile once (issue 53, item 7)
# Options that make each optimizer's cycle (refresh, period, warmup) 3 steps or shorter, so that 6
# steps pass through every branch of its step and 6 more repeat them.
CYCLE = {"pr-muon": {"period": 3}, "muonbp": {"period": 3}, "samuon": {"total_steps": 12},
         "samuon-lite": {"total_steps": 12}, "dash": {"precondition_every": 3}, "shampoo": {"precondition_every": 3},
         "soap": {"precondition_frequency": 3}, "newton-muon": {"refresh_every": 3},
         "splus": {"inverse_every": 3},
         **{n: {"refresh_every": 3} for n in dobb.OPTIMIZER_NAMES if dobb.registry.get(n).refreshes}}
# Names whose compiled step still makes a new graph every step with set_to_none=True, and why (none
# since issue 53; an entry here is a strict xfail, so a fix shows up as a failure to remove it).
RECOMPILE_EVERY_STEP: dict[str, str] = {}
# Over 15 s each on one CPU core (Dobb's refresh and SOAP's and SPlus' eigendecompositions traced).
SLOW_TO_COMPILE = {"soap", "splus", *(n for n in dobb.OPTIMIZER_NAMES if dobb.registry.get(n).refreshes)}


def _compile_case(name):
    marks = [pytest.mark.slow] if name in SLOW_TO_COMPILE else []
    if name in RECOMPILE_EVERY_STEP:
        marks.append(pytest.mark.xfail(reason=RECOMPILE_EVERY_STEP[name], strict=True))
    return pytest.param(name, marks=marks)


def _graphs_per_step(name: str, steps: int) -> list[int]:
    """Graphs Dynamo has made after each of ``steps`` compiled steps, ``zero_grad()`` (set_to_none)
    between them; the recompile limit raised so that a fallback to eager cannot hide a new graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = dobb.build_optimizer(name, model, lr=1e-2, weight_decay=0.1, **CYCLE.get(name, {}))
    made = []

    def counting(gm, example_inputs):
        made.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(opt.step, backend=counting)
    g = torch.Generator().manual_seed(1)
    counts = []
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        for _ in range(steps):
            model(torch.randn(32, 16, generator=g)).square().mean().backward()
            step()
            opt.zero_grad()  # set_to_none=True: a new gradient tensor every step
            counts.append(len(made))
    getattr(opt, "remove_hooks", lambda: None)()
    return counts


@pytest.mark.parametrize("name", [_compile_case(n) for n in dobb.OPTIMIZER_NAMES])
def test_compiled_step_compiles_once_with_the_default_zero_grad(name):
    """``torch.compile(opt.step)`` with the default ``zero_grad()``: after two cycles (every branch of
    the step seen) twelve steps make no new graph. A gradient first reached through a state key was
    guarded by its identity, so each new gradient recompiled the matrix step until Dynamo's limit
    (8), then ran eagerly (dobb._base.MatrixOptimizer._matrix_step)."""
    counts = _graphs_per_step(name, 12)
    assert counts[-1] == counts[5], counts
