"""Every declared study, one registry: what ``dobb-bench study`` lists and runs, ``dobb-bench ablate``
takes its rows from, and the committed records are checked against.

- the long-horizon grids (``long_horizon_runs.STUDIES``: ``long-horizon``, ``width-256``,
  ``frontier-20``), under the bracket-and-seed rule;
- the 800-step studies that were run by hand (``compare --lr-grid``, ``scripts/family_rows.py``,
  the peer scripts), each declared as its records say it ran: a fixed study whose rows name the
  seed-0 lrs they ran and the lrs their later seeds ran at (``shard-local``, ``family-dash``,
  ``family-soap``, ``two-sided``, ``two-sided-adam-raw``, ``refresh-width``, ``dobb-forms`` and
  ``dobb-forms-fp32``);
- the ablations (``ablate-NAME``): the paper's Tables 11-19 and our own choices, one lr, the paper's
  value beside each row, no records yet.

``check`` reads a study's committed records against its declaration: every record must be a run the
declaration plans (label, spec, setting, lr, seed), and a fixed study must have a record for every
run it plans. The one kind of record a declaration sets aside is a run whose products were bf16 in
a study that pins fp32 products (``RunsFolder`` reads it as another row too).
"""
from __future__ import annotations

import math

from dobb_bench.specs import parse_spec
from dobb_bench.studies.define import Row, Setting, Study, grid_lr, spec_parts
from dobb_bench.studies.long_horizon_runs import STUDIES as LONG_HORIZON


def _grid(label: str, spec: str, lrs: tuple[int, ...], seeded: tuple[int, ...] | None = None, **kw) -> Row:
    """A row of a fixed study: seed 0 at ``lrs``, its later seeds at ``seeded`` (default ``lrs``)."""
    return Row(label, spec, (seeded or lrs or (0,))[0], lrs=lrs, seeded=seeded, **kw)


def _fixed(name: str, kind: str, rows: tuple[Row, ...], products: str | None = "float32", **kw) -> Study:
    """A study of the 800-step setting every table but the long-horizon ones shares (2 layers, width
    128, context 64, an eval every 50 steps), run without checkpoints or re-evaluation; fp32
    products unless ``products`` is None (compare's rule: bf16 where a host has it natively)."""
    setting = Setting(kind, steps=800, eval_every=50, checkpoint_every=None, product_dtype=products)
    return Study(name, setting, rows, rule="fixed", records=kw.pop("records", name), windows=None, **kw)


# ----------------------------------------------------------------------------- run by hand at 800 steps
# table:shard-local: its rows' own grids (the docs' earlier studies hold the other seeds: a row with
# no seed-0 lrs here took its grid from them, one with none seeded took its seeds from them)
SHARD_LOCAL = _fixed("shard-local", "sl", (
    _grid("Dobb B=1", "dobb:blocks=1", (), (0,)),  # grid: own-lr
    _grid("Two-sided B=1 Bo=4", "dobb:side=both:blocks=1:out_blocks=4", (), (0,)),  # grid: two-sided
    _grid("Two-sided B=4 Bo=4", "dobb:side=both:blocks=4:out_blocks=4", (-2, 0, 1), ()),  # seeds: two-sided
    _grid("Row-block Muon-fp32 R=4", "block-muon:axis=0:blocks=4:ns_dtype=float32", (-1, 0, 1, 2, 3), (2,)),
    _grid("MuonBP-fp32 R=4 P=5", "muonbp:blocks=4:axis=0:period=5:ns_dtype=float32", (1, 2, 3, 4), (3,)),
    # seeds 1 and 2 at both lrs: 0.0283 and 0.04 were level at seed 0
    _grid("MuonBP-fp32 R=4 P=10", "muonbp:blocks=4:axis=0:period=10:ns_dtype=float32", (1, 2, 3, 4, 5, 6, 7), (5, 6)),
    # the earlier SPlus setup (b2=0.999, its AdamW part at lr/50), on every other grid point
    _grid("SPlus Bo=4", "splus:out_blocks=4:adamw_lr_ratio=0.02", (4, 6, 8, 10, 12), (8,)),
    _grid("SPlus Bo=4 no average", "splus:out_blocks=4:adamw_lr_ratio=0.02:ema_rate=0.0", (8,), ()),
    _grid("SPlus Bo=4 no average T=10", "splus:out_blocks=4:adamw_lr_ratio=0.02:ema_rate=0.0:inverse_every=10",
          (8,), ()),
    _grid("SPlus Bo=4 authors", "splus:out_blocks=4:b2=0.95:adamw_lr_ratio=0.125", (6, 8, 10, 12), (10,)),
    _grid("Dion2-fp32 1/4 per shard R=4", "dion2:select=shard:blocks=4:ns_dtype=float32", (0, 2, 4, 6), (4,)),
    _grid("DASH 32", "dash:block_size=32", (0, 1, 2), (1,)),
    _grid("SOAP", "soap", (), (2,)),  # grid: family-soap
))

FAMILY_DASH = _fixed("family-dash", "fdash", (
    _grid("DASH", "dash", (-3, -1, 1, 3, 5), (-1,)),
    _grid("DASH 128", "dash:block_size=128", (-1,)),
    _grid("DASH 32", "dash:block_size=32", (-1,)),
    _grid("DASH 8", "dash:block_size=8", (-1,)),
    # the authors' DashGpu (ista-daslab-optimizers), scripts/peer_dash.py
    _grid("DASH package 128", "peer:ista_daslab_optimizers.DashGpu:block_size=128", (-1,), (), runner="peer-dash"),
))

# SOAP and Newton-Muon through scripts/family_rows.py (they were not in the registry yet)
FAMILY_SOAP = _fixed("family-soap", "fsoap", (
    _grid("SOAP", "soap", (-1, 0, 1, 2, 3), (-1,), runner="family-rows"),
    _grid("Newton-Muon-fp32", "newton-muon:ns_dtype=float32", (-1, 0, 1, 2, 3), (-1,), runner="family-rows"),
    _grid("SOAP sides=input B=1", "soap:sides=input:blocks=1", (-1,), (), runner="family-rows"),
    _grid("SOAP sides=input B=4", "soap:sides=input:blocks=4", (-1,), runner="family-rows"),
    _grid("Newton-Muon-fp32 B=4", "newton-muon:ns_dtype=float32:blocks=4", (-1,), runner="family-rows"),
    _grid("SOAP sides=input B=16", "soap:sides=input:blocks=16", (-1,), (), runner="family-rows"),
    # pytorch-optimizer's released SOAP over every parameter, scripts/peer_soap.py
    _grid("pytorch_optimizer.SOAP all params", "peer:pytorch_optimizer.SOAP", (-1,), (), runner="peer-soap"),
))

TWO_SIDED = _fixed("two-sided", "ts", (
    _grid("Two-sided B=1 Bo=1", "dobb:side=both:blocks=1:out_blocks=1", (-2, -1, 0, 1), (-1, 0)),
    _grid("Two-sided B=1 Bo=4", "dobb:side=both:blocks=1:out_blocks=4", (-1, 0, 1), (-1,)),
    _grid("Two-sided B=4 Bo=4", "dobb:side=both:blocks=4:out_blocks=4", (-1,)),
    _grid("Two-sided-Adam B=1 Bo=1", "dobb:side=both:norm=adam:blocks=1:out_blocks=1", (-1,)),
    _grid("Two-sided B=4 Bo=1", "dobb:side=both:blocks=4:out_blocks=1", (-1,)),
    _grid("Two-sided grad-Gram B=1 Bo=1", "dobb:side=both:source=grad_gram:blocks=1:out_blocks=1", (-1,), ()),
    _grid("Two-sided B=1 Bo=2", "dobb:side=both:blocks=1:out_blocks=2", (-1,), ()),
    _grid("Two-sided B=1 Bo=8", "dobb:side=both:blocks=1:out_blocks=8", (-1,), ()),
    _grid("Two-sided B=4 Bo=2", "dobb:side=both:blocks=4:out_blocks=2", (-1,), ()),
    _grid("Two-sided B=4 Bo=8", "dobb:side=both:blocks=4:out_blocks=8", (-1,), ()),
    _grid("Muon-fp32", "muon:ns_dtype=float32", (), (2,)),  # Muon at its own lr; grid: own-lr
))

# norm="adam" before the per-block-pair rescale (a revision before 1413aed): its own records study
TWO_SIDED_ADAM_RAW = _fixed("two-sided-adam-raw", "tsraw", (
    _grid("Two-sided-Adam B=1 Bo=1", "dobb:side=both:norm=adam:blocks=1:out_blocks=1", (-1,), ()),))

REFRESH_WIDTH = _fixed("refresh-width", "rw", (
    _grid("Dobb B=1 width-period", "dobb:blocks=1:refresh_width=128", (-1,)),))

# issue 40's Dobb forms on the 800-step frontier: first under compare's product rule (bf16 on their
# host), then Dobb-Muon B=4 Bo=4 with fp32 products: its lower lr and seeds 1 and 2 at 0.01 (for the
# frontier-20 grid), then its seed-0 grid again in fp32 up to 0.04 (the best, 0.02, had been at
# the grid's edge) and seeds 1 and 2 at 0.0141 and 0.02; both collect into the records study dobb-forms
DOBB_FORMS = _fixed("dobb-forms", "forms", (
    _grid("Dobb-Muon B=1 Bo=4", "dobb-muon:blocks=1:out_blocks=4", (1, 2, 3), ()),
    _grid("Dobb-Muon B=1 Bo=4 heads", "dobb-muon:blocks=1:out_blocks=4:heads=4", (2,), ()),
    _grid("Dobb-Muon B=4 Bo=4", "dobb-muon:blocks=4:out_blocks=4", (2, 3), ()),
    _grid("Dobb-Muon B=4 Bo=4 heads", "dobb-muon:blocks=4:out_blocks=4:heads=4", (2,), ()),
    _grid("Two-sided B=1 Bo=4 P=9", "dobb:side=both:blocks=1:out_blocks=4:whole_every=9", (0,), ()),
), products=None)
DOBB_FORMS_FP32 = _fixed("dobb-forms-fp32", "forms32", (
    _grid("Dobb-Muon B=4 Bo=4", "dobb-muon:blocks=4:out_blocks=4", (1, 2, 3, 4, 5, 6), (2, 3, 4)),), records="dobb-forms")


# ----------------------------------------------------------------------------- the ablations
P = "dobb:blocks=1"  # the principal Dobb setting (B=1 is the paper's ablation reference)
# name -> (title, [(spec, paper Small loss or None)], reference spec for the delta column)
ABLATIONS: dict[str, tuple[str, list[tuple[str, float | None]], str]] = {
    "normalization": ("Table 11: sign (Dobb) vs column l2 (Dobb-l2)", [
        (P, 3.017), ("dobb-l2:blocks=1", 3.043), ("dobb:blocks=4", 3.024), ("dobb-l2:blocks=4", 3.037),
        ("dobb:blocks=16", 3.026), ("dobb-l2:blocks=16", 3.036)], P),
    "source": ("Table 13: second-moment source", [
        (P, 3.017), ("dobb:blocks=1:source=grad_gram@Gram input", 3.027),
        ("dobb:blocks=1:source=grad_gram:side=output@Gram output", 3.055), ("dobb-g:blocks=1", 3.071),
        ("dobb-l2:blocks=1", 3.043), ("dobb-l2:blocks=1:source=grad_gram@Gram input l2", 3.042)], P),
    "basis": ("Table 12: output-gradient basis (Dobb-G) and its l2 variant", [
        ("dobb-g:blocks=1", 3.071), ("dobb-g-l2:blocks=1", 3.077), ("dobb-g:blocks=4", 3.067),
        ("dobb-g-l2:blocks=4", 3.071), ("dobb-g:blocks=16", 3.076), ("dobb-g-l2:blocks=16", 3.075)],
        "dobb-g:blocks=1"),
    "refresh": ("Table 14: refresh period T", [
        ("dobb:blocks=1:refresh_every=1", 3.005), ("dobb:blocks=1:refresh_every=4", 3.014), (P, 3.017),
        ("dobb:blocks=1:refresh_every=16", 3.017), ("dobb:blocks=1:refresh_every=100", 3.015)], P),
    "ortho": ("Table 15: orthogonal-iteration steps k and exact eigh", [
        (P, 3.017), ("dobb:blocks=1:ortho_steps=2", 3.019), ("dobb:blocks=1:ortho_steps=3", 3.017),
        ("dobb:blocks=1:basis=eigh", 3.015)], P),
    "qr": ("Table 16: QR routine", [
        (P, 3.017), ("dobb:blocks=1:qr=cholesky", 3.016), ("dobb:blocks=4", 3.024),
        ("dobb:blocks=4:qr=cholesky", 3.022)], P),
    "capture": ("Table 17: capture policy (needs --micro-batches > 1)", [
        (P, 3.017), ("dobb:blocks=1:capture=all", 3.021), ("dobb-g:blocks=1", 3.071),
        ("dobb-g:blocks=1:capture=all", 3.071)], P),
    "precision": ("Table 18: statistic / basis precision", [
        ("dobb:blocks=1:stat_dtype=float32:basis_dtype=float32@fp32/fp32", 3.023), (P, 3.017),
        ("dobb:blocks=1:stat_dtype=bfloat16:basis_dtype=float32@bf16/fp32", 3.028),
        ("dobb:blocks=1:stat_dtype=bfloat16@bf16/bf16", 3.027)], P),
    "nesterov": ("Table 19: Nesterov momentum", [
        (P, 3.017), ("dobb:blocks=1:nesterov=true", 3.014), ("dobb:blocks=4", 3.024),
        ("dobb:blocks=4:nesterov=true", 3.023), ("dobb:blocks=16", 3.026), ("dobb:blocks=16:nesterov=true", 3.030),
        ("muon:nesterov=false", 3.004), ("muon", 3.004), ("rmnp", 3.083), ("rmnp:nesterov=true", 3.072)], P),
    "choices": ("Our choices (SPEC [choice]): statistic EMA decay, first basis, momentum", [
        ("dobb:blocks=4:stat_decay=0.0", None), ("dobb:blocks=4:stat_decay=0.5", None), ("dobb:blocks=4", None),
        ("dobb:blocks=4:stat_decay=0.99", None), ("dobb:blocks=4:init_basis=identity", None),
        ("dobb:blocks=4:momentum=0.9", None), ("dobb:blocks=4:momentum=0.98", None)], "dobb:blocks=4"),
    "blocks": ("Block count B at this width (Table 11's Dobb column)", [
        (P, 3.017), ("dobb:blocks=2", None), ("dobb:blocks=4", 3.024), ("dobb:blocks=8", None),
        ("dobb:blocks=16", 3.026)], P),
}


def _ablation(name: str) -> Study:
    """``ablate-NAME``: each spec at grid lr j=-1 (``dobb-bench ablate``'s default), seed 0, in the
    800-step setting; Table 17 splits each step into 2 micro-batches (its own run folders)."""
    title, rows, ref = ABLATIONS[name]
    extra = ("--micro-batches", "2") if name == "capture" else ()
    setting = Setting("ablate-mb2" if extra else "ablate", steps=800, eval_every=50, checkpoint_every=None,
                      extra=extra)
    return Study(f"ablate-{name}", setting,
                 tuple(Row(parse_spec(s).label, s.split("@")[0], -1, lrs=(-1,), paper=v) for s, v in rows),
                 seeds=(0,), rule="fixed", records=f"ablate-{name}", windows=None, title=title,
                 reference=parse_spec(ref).label)


STUDIES: dict[str, Study] = {
    **LONG_HORIZON,
    **{s.name: s for s in (SHARD_LOCAL, FAMILY_DASH, FAMILY_SOAP, TWO_SIDED, TWO_SIDED_ADAM_RAW, REFRESH_WIDTH,
                           DOBB_FORMS, DOBB_FORMS_FP32)},
    **{f"ablate-{name}": _ablation(name) for name in ABLATIONS},
}


def settings() -> dict[str, Setting]:
    """``{kind: Setting}`` over every study (a kind names one setting: ``check_kinds``)."""
    return {s.setting.kind: s.setting for s in STUDIES.values()}


# ----------------------------------------------------------------------------- against the records
DTYPE_KEYS = ("ns_dtype", "product_dtype")


def spec_key(spec: str) -> tuple[str, dict[str, str]]:
    """A spec as records write it: the optimizer's name and its hyperparameters as strings."""
    name, text = spec_parts(spec)
    if name.startswith("peer:"):
        return name, dict(x.split("=", 1) for x in text.split(":") if x)
    s = parse_spec(spec)
    return s.name, {k: str(v) for k, v in s.hparams.items()}


def _pinned(hp: dict[str, str], setting: Setting) -> dict[str, str]:
    """Hyperparameters less what ``--product-dtype float32`` sets on its own (and SAMuon's run length)."""
    return {k: v for k, v in hp.items() if k != "total_steps"
            and not (setting.product_dtype == "float32" and k in DTYPE_KEYS and v == "torch.float32")}


def bf16_products(r: dict) -> bool:
    """Whether a record's matrix products ran in bf16 (its spec's dtypes or the resolved ones)."""
    resolved = [g.get(f"{k}_resolved") for g in r.get("optimizer_groups") or [] for k in DTYPE_KEYS]
    return "bfloat16" in str(r.get("hparams", {})) or "torch.bfloat16" in resolved


def _setting_of(r: dict) -> tuple:
    m, t = r.get("model") or {}, r.get("train") or {}
    return r.get("steps"), m.get("width"), m.get("layers"), m.get("seq_len"), t.get("eval_every")


def _declared(s: Setting) -> tuple:
    return s.steps, s.width or 128, s.layers, s.context, s.eval_every


def _where(r: dict) -> str:
    return f"{r.get('run')!r} lr {r.get('lr'):.4g} seed {r.get('seed')} ({r.get('steps')} steps)"


def _contiguous(js: set[int]) -> bool:
    return not js or max(js) - min(js) + 1 == len(js)


def grid_j(lr: float) -> int:
    """The grid index of a run's lr: a grid point, or one typed to 3 significant digits (0.0283 for
    0.028284, as some runs by hand were started); ValueError off the grid."""
    j = round(2 * math.log2(lr / 5e-3))
    if abs(lr / grid_lr(j) - 1) > 1e-3:
        raise ValueError(f"lr {lr!r} is not on the grid 5e-3 * 2 ** (j / 2)")
    return j


def _fault(st: Study, row: Row, r: dict) -> str | None:
    """Why ``r`` is not a run of ``row`` in ``st`` by its spec, products, lr or seed; None when it is."""
    name, hp = spec_key(row.spec)
    if (r.get("optimizer"), _pinned(r.get("hparams") or {}, st.setting)) != (name, _pinned(hp, st.setting)):
        return f"ran {r.get('optimizer')} {r.get('hparams')}, {st.name} declares {row.spec!r}"
    if st.setting.product_dtype == "float32" and bf16_products(r):
        return f"bf16 products, {st.name} pins fp32"
    try:
        grid_j(r["lr"])
    except ValueError as exc:
        return str(exc)
    if r.get("seed") not in st.seeds:
        return f"seed {r.get('seed')} is not one of {st.name}'s {st.seeds}"
    return None


def check(studies: list[Study], records: list[dict]) -> tuple[list[str], list[dict]]:
    """Problems of one records study against the declared ``studies`` that collect into it, and the
    records set aside (bf16 products where a study pins fp32). A record must fall to one study (its
    label a row's, its setting the study's), carry that row's spec, a grid lr and a declared seed,
    and be a run the study plans: a fixed study's ``planned``; under the bracket rule a seed-0 lr
    within the row's span, the row's seed-0 lrs one unbroken run of grid points through its first lr,
    a later seed only at an lr it ran at seed 0. A fixed study must have a record of every run it plans, unless it is ``running``."""
    problems, aside, seen = [], [], {}
    for r in records:
        home = [(st, row) for st in studies for row in st.rows
                if row.label == r.get("run") and _setting_of(r) == _declared(st.setting)]
        faults = [_fault(st, row, r) for st, row in home]
        if not home:
            problems.append(f"{_where(r)}: no declared study has this row at this setting")
        elif None in faults:
            st, row = home[faults.index(None)]
            seen.setdefault((st.name, row.label), set()).add((grid_j(r["lr"]), r["seed"]))
        elif bf16_products(r) and any(st.setting.product_dtype == "float32" for st, _ in home):
            aside.append(r)
        else:
            problems.append(f"{_where(r)}: {faults[0]}")
    for st in studies:
        for row in st.rows:
            got = seen.get((st.name, row.label), set())
            if st.rule == "fixed":
                plan = set(st.planned(row))
                problems += [f"{st.name}: {row.label!r} j{j} seed {sd} ran, not declared" for j, sd in sorted(got - plan)]
                if not st.running:
                    problems += [f"{st.name}: {row.label!r} j{j} seed {sd} declared, no record" for j, sd in sorted(plan - got)]
                continue
            zero = {j for j, sd in got if sd == 0}
            far = sorted(j for j, _ in got if abs(j - row.around) > st.span)
            if far:
                problems.append(f"{st.name}: {row.label!r} ran at j{far} beyond j{row.around} -+ {st.span}")
            if zero and not (_contiguous(zero) and st.first_lrs(row)[0] in zero):
                problems.append(f"{st.name}: {row.label!r} seed-0 lrs j{sorted(zero)} are not the rule's steps out "
                                f"from j{st.first_lrs(row)[0]}")
            lone = sorted((j, sd) for j, sd in got if sd != 0 and j not in zero)
            if lone:
                problems.append(f"{st.name}: {row.label!r} later seeds {lone} where seed 0 did not run")
    return problems, aside


def check_kinds() -> list[str]:
    """Kinds (run-folder prefixes) that two studies give different settings, and labels a kind
    gives two specs: either would make two runs share a folder."""
    out, kinds, specs = [], {}, {}
    for st in STUDIES.values():
        k = st.setting.kind
        if kinds.setdefault(k, st.setting) != st.setting:
            out.append(f"kind {k!r}: {st.name} declares another setting")
        for row in st.rows:
            if specs.setdefault((k, row.slug), row.spec) != row.spec:
                out.append(f"kind {k!r}: {row.label!r} of {st.name} is another spec under the same folder")
    return out


def by_records() -> dict[str, list[Study]]:
    """``{records study: [declared studies collecting into it]}``."""
    out: dict[str, list[Study]] = {}
    for st in STUDIES.values():
        out.setdefault(st.records, []).append(st)
    return out
