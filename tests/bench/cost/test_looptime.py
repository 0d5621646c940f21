"""dobb_bench.cost.looptime: the state each optimizer allocates in the training loop equals the
derived formula, and the profile split of a step on synthetic events."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dobb_bench.cost import looptime as L, roofline as R


def test_derived_state_bytes_equal_allocated_buffers():
    cases = [("torch-adamw", {}), ("dobb", {"blocks": 4}), ("muon", {}), ("dion", {"rank_fraction": 0.25}),
             ("dobb-muon", {"blocks": 4, "out_blocks": 4})]
    for text, hp in cases:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=True))
        spec = text + "".join(f":{k}={v}" for k, v in hp.items())
        _, opt = L.build(spec, model, 1e-3, 0.1)
        model(torch.randn(8, 32)).square().sum().backward()
        opt.step()  # torch AdamW creates its state lazily
        shapes, other = L._matrix_split(opt)
        derived = R.set_cost(text, shapes, hp, other)["state_bytes"]
        measured = L.state_bytes(opt)
        scalars = sum(1 for st in opt.state.values() for k, v in st.items()
                      if isinstance(v, torch.Tensor) and v.dim() == 0) * 4  # AdamW's step counters
        assert measured - scalars == pytest.approx(derived, rel=0, abs=0), text


def test_profile_split():
    """Self times by class; an aten op inside a product or QR (``geqrf``'s copy of its input) is QR
    time, one under a Python frame or an element-wise op stays element-wise."""
    ev = lambda name, us, parent=None: SimpleNamespace(name=name, self_cpu_time_total=us, cpu_parent=parent)
    step = ev("Optimizer.step#Dobb.step", 999.0)
    geqrf = ev("aten::geqrf", 60.0, step)
    to = ev("aten::to", 5.0, step)
    events = [step, ev("aten::bmm", 300.0, step), geqrf, ev("aten::copy_", 40.0, geqrf),
              ev("aten::lerp_", 150.0, step), to, ev("aten::copy_", 45.0, to)]
    out = L.classify_profile(events, 1000.0)
    assert out["matmul_qr"] == pytest.approx(0.4) and out["elementwise"] == pytest.approx(0.2)
    assert out["overhead"] == pytest.approx(0.4)
    # the dearest non-product calls, each charged what it ran: lerp_ 150, to 5 + its copy 45
    assert L.non_product_ops(events) == [["aten::lerp_", "[]", 1, 150.0], ["aten::to", "[]", 1, 50.0]]


def test_profile_split_of_a_real_qr_counts_its_copy_as_qr():
    """On a real profile of ``householder_product(*geqrf(P))`` of a row-major ``P`` (LAPACK copies it
    into column-major), every aten microsecond is QR time."""
    from torch.profiler import profile

    p = torch.randn(1, 64, 64)
    with profile() as prof:
        torch.linalg.householder_product(*torch.geqrf(p))
    assert any(e.name == "aten::copy_" for e in prof.events())  # the nested copy is there
    out = L.classify_profile(prof.events(), 1e9)
    assert out["matmul_qr"] > 0 and out["elementwise"] == 0.0


def test_compiled_rows_time_the_compiled_step_beside_the_eager_one(monkeypatch):
    """--compile adds a compiled twin of every row but torch's AdamW, built on its own model copy,
    whose timed call is ``torch.compile(opt.step)``; a warmup that does not cover the cycle and the first
    step is refused, and Dynamo's recompile limit covers the cycle (one graph per refresh pattern)."""
    compiled_fns = []
    real = torch.compile

    def spy(fn, **kw):
        compiled_fns.append((fn, kw))
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    # torch's own patch restores the limit; monkeypatch (pytest >= 9.2) would delete the config entry,
    # which hides it from Dynamo for every later test in the process
    with torch._dynamo.config.patch(recompile_limit=8):
        rec = L.run_looptime(["torch-adamw", "dobb:blocks=2:stagger=false"], preset="tiny", vocab=64, batch=2,
                             seq_len=8, layers=1, cycles=2, cycle_len=2, warmup=3, compile_backend="aot_eager",
                             log=lambda *a: None)
        assert rec["config"]["recompile_limit"] == torch._dynamo.config.recompile_limit == 8
        specs = [s["spec"] for s in rec["summaries"]]
        assert specs == ["torch-adamw", "torch-adamw-fused", "dobb:blocks=2:stagger=false",
                         "dobb:blocks=2:stagger=false compiled"]
        assert [s["compiled"] for s in rec["summaries"]] == [None, None, None, "aot_eager"]
        assert len(compiled_fns) == 1 and compiled_fns[0][1] == {"backend": "aot_eager"}
        assert type(compiled_fns[0][0].__self__).__name__ == "Dobb"  # the optimizer's own step
        # the compiled row trained the same data to the same loss as the eager one (aot_eager: the same
        # kernels, but the AdamW part: fused eager, foreach traced — rounding apart)
        eager, comp = rec["summaries"][2], rec["summaries"][3]
        assert comp["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-5)
        # a longer cycle: one graph per refresh pattern, and the first step's (warmup by default)
        rec = L.run_looptime(["dobb:blocks=2"], preset="tiny", vocab=64, batch=2, seq_len=8, layers=1, cycles=2,
                             cycle_len=12, compile_backend="aot_eager", log=lambda *a: None)
        assert rec["config"]["warmup"] == 13 and rec["config"]["recompile_limit"] == 16
        with pytest.raises(ValueError, match="--warmup > --cycle-len"):
            L.run_looptime(["dobb"], preset="tiny", vocab=64, batch=2, seq_len=8, layers=1, cycles=2, cycle_len=3,
                           warmup=3, compile_backend="aot_eager", log=lambda *a: None)


def test_the_recompile_limit_covers_every_compiled_optimizer():
    """Two compiled Dobb optimizers' graphs share one cache (the same wrapped ``step`` code): the
    limit covers both cycles, where one cycle's worth ran the second optimizer's later patterns
    eagerly."""
    assert L.recompile_limit_for(1, 9) == 13
    assert L.recompile_limit_for(2, 9) == 26
    assert L.recompile_limit_for(0, 9) == 13


def test_products_floor_column():
    """The floor column is the matmul/QR share of a row's amortized time over AdamW's amortized time
    (6 ms x 0.5 / 2 ms = 1.5x); rows without a profile show a dash."""
    q = lambda v: {"median": v, "q25": v, "q75": v, "n": 1}
    row = lambda spec, ms, prof: {"spec": spec, "amortized_ms": q(ms), "ratio_to_adamw": q(ms / 2.0),
                                  "max_over_median": q(1.0), "state_bytes_measured": 80, "params": 10,
                                  "derived": None, "profile": prof}
    rec = {"summaries": [row("torch-adamw", 2.0, {"matmul_qr": 0.0, "elementwise": 0.8, "overhead": 0.2}),
                         row("dobb:blocks=1", 6.0, {"matmul_qr": 0.5, "elementwise": 0.3, "overhead": 0.2}),
                         row("muon", 4.0, None)]}
    assert L.products_floor(rec["summaries"][1], rec["summaries"][0]) == pytest.approx(1.5)
    lines = L.looptime_markdown(rec).splitlines()
    assert lines[0].endswith("| matmul/QR alone, x AdamW |")
    assert lines[3].endswith("| 1.50 |") and lines[4].endswith("| – |") and lines[2].endswith("| 0.00 |")


def test_top_level_ops_count_each_call_once():
    """``x.to(float64)`` dispatches ``to -> _to_copy -> empty_strided, copy_``: one call; ``add_`` and
    ``mm`` one each. The profiler's own event list of a real run, not synthetic events."""
    from torch.profiler import profile

    x = torch.randn(4, 4)
    with profile() as prof:
        y = x.to(torch.float64)
        y.add_(1.0)
        torch.mm(x, x)
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert "aten::_to_copy" in names and "aten::copy_" in names  # the nested calls are there
    assert L.top_level_ops(prof.events()) == 3


def test_profile_records_every_step_of_the_cycle_split_by_refresh():
    """``--profile`` records each step of one cycle: its refresh flag (Dobb's schedule), the milliseconds
    of each class summing to its wall, and its aten calls; the markdown splits refresh from plain."""
    rec = L.run_looptime(["dobb:blocks=2:stagger=false"], preset="tiny", vocab=64, batch=2, seq_len=8, layers=1,
                         cycles=2, cycle_len=3, profile=True, log=lambda *a: None)
    dobb_row = rec["summaries"][2]
    steps = dobb_row["profile"]["steps"]
    assert len(steps) == 3 and [t["refresh"] for t in steps] == [True, False, False]
    for t in steps:
        assert t["matmul_qr_ms"] + t["elementwise_ms"] + t["overhead_ms"] == pytest.approx(t["wall_ms"], rel=1e-6)
        assert t["aten_ops"] > 0
        assert t["non_product_ops"] and all(not L._is_product(op) for op, *_ in t["non_product_ops"])
    assert steps[0]["aten_ops"] > steps[1]["aten_ops"]  # the refresh step calls the QR and its products
    assert all(not t["refresh"] for t in rec["summaries"][0]["profile"]["steps"])  # torch AdamW
    table = L.steps_markdown(rec).splitlines()
    assert table[0].startswith("| optimizer | steps refreshing / plain |")
    row = next(r for r in table if r.startswith("| dobb:blocks=2:stagger=false |"))
    assert "| 1 / 2 |" in row and row.endswith(f"| {steps[0]['aten_ops']} / "
                                                 f"{(steps[1]['aten_ops'] + steps[2]['aten_ops']) / 2:.0f} |")


def test_two_compiled_rows_raise_the_limit_for_both(monkeypatch):
    """``run_looptime`` counts every compiled row: two Dobb rows of a 2-step cycle need
    ``recompile_limit_for(2, 2)`` = 12, one row 6 (below the 8 in force). ``torch.compile`` is
    replaced by the identity here, so nothing compiles; only the limit set before compiling is read."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    kw = dict(preset="tiny", vocab=64, batch=2, seq_len=8, layers=1, cycles=2, cycle_len=2, warmup=3,
              compile_backend="aot_eager", log=lambda *a: None)
    with torch._dynamo.config.patch(recompile_limit=8):
        assert L.run_looptime(["dobb:blocks=2"], **kw)["config"]["recompile_limit"] == 8
    with torch._dynamo.config.patch(recompile_limit=8):
        rec = L.run_looptime(["dobb:blocks=2", "dobb:blocks=1"], **kw)
        assert rec["config"]["recompile_limit"] == L.recompile_limit_for(2, 2) == 12


def test_skip_guards_row_times_the_compiled_step_with_its_guards_skipped(monkeypatch):
    """``skip_guards`` adds a third row per optimizer (``SPEC compiled, guards skipped``), compiled on its
    own model copy, whose timed calls, and only those (not the warmup's, which compile the graphs), run
    under ``set_stance(skip_guard_eval_unsafe=True)``; it trains to the compiled row's loss, bit for bit.
    Without a compile backend it is refused (the CLI prints the ``ValueError`` as one line, exit 2)."""
    stances = []
    real = torch.compiler.set_stance

    def spy(*a, **kw):
        stances.append(kw.get("skip_guard_eval_unsafe", False))
        return real(*a, **kw)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    # graphs other tests cached for torch's step wrapper would count against the limit (as the bench's
    # own process has none): past it, a frame runs eagerly and the unguarded stance refuses to recompile
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8):
        rec = L.run_looptime(["dobb:blocks=2:stagger=false"], preset="tiny", vocab=64, batch=2, seq_len=8,
                             layers=1, cycles=2, cycle_len=2, warmup=3, compile_backend="aot_eager",
                             skip_guards=True, log=lambda *a: None)
    specs = [s["spec"] for s in rec["summaries"]]
    assert specs[2:] == ["dobb:blocks=2:stagger=false", "dobb:blocks=2:stagger=false compiled",
                         "dobb:blocks=2:stagger=false compiled, guards skipped"]
    assert [s["guards_skipped"] for s in rec["summaries"]] == [False, False, False, False, True]
    assert stances == [True] * (2 * 2)  # the four timed steps of the one unguarded row
    comp, ung = rec["summaries"][3], rec["summaries"][4]
    assert ung["final_loss"] == comp["final_loss"]
    with pytest.raises(ValueError, match=r"needs --compile \(compile_backend\)"):
        L.run_looptime(["dobb"], preset="tiny", vocab=64, batch=2, seq_len=8, layers=1, cycles=2, cycle_len=2,
                       warmup=3, skip_guards=True, log=lambda *a: None)


def test_skip_guards_counts_in_the_recompile_limit(monkeypatch):
    """One Dobb row with ``skip_guards`` compiles two steps (compiled, unguarded): the limit is raised as
    for two compiled optimizers."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    with torch._dynamo.config.patch(recompile_limit=8):
        rec = L.run_looptime(["dobb:blocks=2"], preset="tiny", vocab=64, batch=2, seq_len=8, layers=1, cycles=2,
                             cycle_len=2, warmup=3, compile_backend="aot_eager", skip_guards=True,
                             log=lambda *a: None)
        assert rec["config"]["recompile_limit"] == L.recompile_limit_for(2, 2) == 12
