"""The main job's per-row settings: each row's learning rate, and one product dtype for every row.

Why: ``compare`` used to run every row at one shared lr (3.54e-3), which is the best lr of AdamW
alone; at it a row whose own best lr is higher looked worse, and one whose best is lower looked
better, than the Findings (docs/results.md, study ``shard-local``), which take each row at its own
best lr. Its cost column compared Muon's Newton-Schulz in bf16 (``ns_dtype="auto"``: bf16 on a CPU
with native bf16) with Dobb's projection products in fp32 (``product_dtype="auto"``: fp32 on every
CPU), so the step times did not compare like with like.

**Learning rate.** ``RECORDED_BEST_LR`` is a committed table: per optimizer spec, the lr whose
seed-0 final loss is lowest over that row's lr grid in the committed 800-step records (2 layers,
width 128, 800 steps of 16 x 64 tokens), the rule of ``dobb_bench.studies.shard_local.best_lr``,
and whether a worse lr lies on each side (bracketed). ``tests/bench/training/test_row_settings.py``
recomputes every entry from the records, so the table cannot drift from them. A spec matches an
entry when its name and its hyperparameters, after the registry's defaults and without the
``*_dtype`` keys (set by the dtype rule below; Muon in bf16 and fp32 Newton-Schulz ends within
1e-3 nats, docs/results.md), are the same. A row without an entry runs at the shared lr and the
report says so; ``--lr`` puts every row at the given lr.

**Product dtype.** ``product_dtype(device)``: bf16 where the device multiplies bf16 natively (a
CUDA device; a CPU for which ``dobb.functional.cpu_native(torch.bfloat16)`` holds, i.e. oneDNN
reports AVX512-BF16 or AMX), fp32 on every other device. ``with_product_dtype`` gives it to every
row that has a product dtype (the Muon family's ``ns_dtype``, the Dobb family's
``product_dtype``) unless the spec sets one itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

import dobb.registry
from dobb.functional import cpu_native

from dobb_bench.specs import OptimizerSpec, parse_spec, parse_value

SHARED_LR = 5e-3 * 2 ** -0.5  # grid point j=-1: AdamW's own best lr, every row's lr before (table lr-grid)
DTYPE_KEYS = ("ns_dtype", "product_dtype")  # the keys the dtype rule sets, per optimizer family
RECORDS_SETTING = "2 layers, width 128, 800 steps of 16 x 64 tokens"


@dataclass(frozen=True)
class RecordedLr:
    spec: str  # the optimizer spec it applies to (dtype keys ignored)
    lr: float  # the best seed-0 lr of its grid in the records, 4 significant digits
    bracketed: bool  # a worse lr on each side of it
    label: str  # the records' run label
    studies: tuple[str, ...]  # the studies holding its runs (docs/results/records/<study>.jsonl)


RECORDED_BEST_LR = (
    RecordedLr("adamw", 0.003536, True, "AdamW", ("lr-grid", "headline")),
    RecordedLr("muon", 0.01, True, "Muon-fp32", ("own-lr", "muon-variants")),
    RecordedLr("muon:split_sizes=qkv", 0.01, True, "CMuon-fp32", ("muon-variants",)),
    RecordedLr("normuon", 0.01414, True, "NorMuon-fp32", ("own-lr", "muon-variants")),
    RecordedLr("newton-muon", 0.01, True, "Newton-Muon-fp32", ("family-soap",)),
    RecordedLr("dion3", 0.05657, True, "Dion3-fp32", ("own-lr",)),
    RecordedLr("dion:rank_fraction=1/16", 0.01414, False, "Dion rho=1/16", ("own-lr", "headline")),
    RecordedLr("block-muon:axis=0:blocks=4", 0.01, True, "Row-block Muon-fp32 R=4", ("shard-local",)),
    RecordedLr("block-muon:blocks=16", 0.003536, True, "Block Muon B=16", ("own-lr", "headline")),
    RecordedLr("muonbp:blocks=4:period=5", 0.01414, True, "MuonBP-fp32 R=4 P=5", ("shard-local",)),
    RecordedLr("muonbp:blocks=4:period=10", 0.04, True, "MuonBP-fp32 R=4 P=10", ("shard-local",)),
    RecordedLr("dion2:select=shard:blocks=4", 0.02, True, "Dion2-fp32 1/4 per shard R=4", ("shard-local",)),
    RecordedLr("dash", 0.01414, True, "DASH", ("family-dash",)),
    RecordedLr("dash:block_size=32", 0.007071, True, "DASH 32", ("family-dash", "shard-local")),
    RecordedLr("soap", 0.01, True, "SOAP", ("family-soap", "shard-local")),
    RecordedLr("splus:out_blocks=4:adamw_lr_ratio=0.02", 0.08, True, "SPlus Bo=4", ("shard-local",)),
    RecordedLr("splus:out_blocks=4:b2=0.95:adamw_lr_ratio=0.125", 0.16, True, "SPlus Bo=4 authors", ("shard-local",)),
    RecordedLr("dobb-muon:blocks=4:out_blocks=4", 0.02, True, "Dobb-Muon B=4 Bo=4", ("dobb-forms",)),
    RecordedLr("dobb:blocks=1", 0.005, True, "Dobb B=1", ("own-lr", "headline", "shard-local")),
    RecordedLr("dobb:blocks=4", 0.003536, True, "Dobb B=4", ("own-lr", "headline")),
    RecordedLr("dobb:blocks=16", 0.003536, True, "Dobb B=16", ("own-lr", "headline")),
    RecordedLr("dobb:side=both:blocks=1:out_blocks=1", 0.005, True, "Two-sided B=1 Bo=1", ("two-sided",)),
    RecordedLr("dobb:side=both:blocks=1:out_blocks=4", 0.005, True, "Two-sided B=1 Bo=4",
               ("two-sided", "shard-local")),
    RecordedLr("dobb:side=both:blocks=4:out_blocks=4", 0.003536, True, "Two-sided B=4 Bo=4",
               ("two-sided", "shard-local")),
)


def _norm(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return repr(v)
    return float(f"{v:.6g}")


def spec_key(name: str, hparams: dict) -> tuple | None:
    """An optimizer's name and every hyperparameter after its registry defaults, the dtype keys left
    out (string values, as records store them, typed by the spec grammar); None for a name the
    registry does not know (a peer's optimizer)."""
    try:
        defaults = dobb.registry.hparam_defaults(name)
    except (KeyError, ValueError):
        return None
    typed = {k: parse_value(k, v) if isinstance(v, str) else v for k, v in hparams.items()}
    merged = {**defaults, **typed}
    return (name, tuple(sorted((k, _norm(v)) for k, v in merged.items()
                               if not k.endswith("_dtype") and k != "total_steps")))


def recorded_lr(spec: OptimizerSpec) -> RecordedLr | None:
    """The committed table's entry for this spec, or None when the records hold no lr grid for it."""
    key = spec_key(spec.name, spec.hparams)
    if key is None:
        return None
    for entry in RECORDED_BEST_LR:
        s = parse_spec(entry.spec)
        if spec_key(s.name, s.hparams) == key:
            return entry
    return None


def row_lrs(specs: list[OptimizerSpec], lr: float | None) -> tuple[dict[str, float], dict[str, str]]:
    """``({label: lr}, {label: where the lr comes from})``: ``lr`` (the user's ``--lr``) for every
    row when given, else each row's recorded best lr, else the shared lr."""
    lrs, source = {}, {}
    for s in specs:
        if lr is not None:
            lrs[s.label], source[s.label] = lr, "--lr"
            continue
        entry = recorded_lr(s)
        if entry is None:
            lrs[s.label], source[s.label] = SHARED_LR, "shared lr: no recorded lr grid"
        else:
            lrs[s.label] = on_grid(entry.lr)
            source[s.label] = (f"recorded best (run {entry.label!r}, studies {', '.join(entry.studies)}"
                               + ("" if entry.bracketed else "; at the edge of its grid") + ")")
    return lrs, source


def on_grid(lr: float) -> float:
    """The paper's grid point ``5e-3 * 2**(j/2)`` that ``lr`` (4 significant digits) stands for,
    exactly as the recorded runs ran it; ``lr`` itself when no grid point is that close."""
    j = round(2 * math.log2(lr / 5e-3))
    point = 5e-3 * 2 ** (j / 2)
    return point if abs(point - lr) <= 1e-3 * lr else lr


def device_kind(device: str) -> str:
    """``"cuda"``, ``"cpu"`` or another torch device type; ``"auto"`` as the runs resolve it."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def product_dtype(device: str = "auto", native: bool | None = None) -> torch.dtype:
    """bf16 where ``device`` multiplies bf16 natively, fp32 elsewhere. ``native`` forces the answer
    (tests); None asks the device: CUDA yes, a CPU as oneDNN reports it, any other device no."""
    if native is None:
        kind = device_kind(device)
        native = kind == "cuda" or (kind == "cpu" and cpu_native(torch.bfloat16))
    return torch.bfloat16 if native else torch.float32


def with_product_dtype(spec: OptimizerSpec, dtype: torch.dtype) -> OptimizerSpec:
    """The spec with ``dtype`` for its products (``ns_dtype`` or ``product_dtype``, whichever the
    optimizer has) unless it sets it itself; the label is unchanged."""
    try:
        accepted = dobb.registry.hparam_defaults(spec.name)
    except (KeyError, ValueError):
        return spec
    keys = [k for k in DTYPE_KEYS if k in accepted and k not in spec.hparams]
    if not keys:
        return spec
    return replace(spec, hparams={**spec.hparams, **{k: dtype for k in keys}})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def mismatches() -> list[str]:
    """Entries of ``RECORDED_BEST_LR`` that the committed records do not give (recomputed with the
    shard-local study's rule); empty when the table follows the records."""
    from dobb_bench.studies.shard_local import best_lr, runs_of

    out = []
    for e in RECORDED_BEST_LR:
        runs = runs_of(e.label, e.studies)
        lr, bracketed, _ = best_lr(runs)
        s = parse_spec(e.spec)
        keys = {spec_key(r["optimizer"], r["hparams"]) for r in runs.values()}
        if keys != {spec_key(s.name, s.hparams)}:
            out.append(f"{e.spec}: the records of run {e.label!r} are another optimizer or setting")
        if lr is None or abs(lr - e.lr) > 1e-9 or bracketed != e.bracketed:
            out.append(f"{e.spec}: the records give lr {lr} (bracketed: {bracketed}), the table {e.lr} "
                       f"(bracketed: {e.bracketed})")
    return out
