"""The two-sided tables: two-sided Dobb (``side="both"``) beside the headline's AdamW, Muon and
one-sided Dobb rows, computed only from committed records (study ``two-sided`` plus the
``headline``, ``lr-grid``, ``muon-fp32``, ``family-soap`` (our SOAP) and ``own-lr`` records of the
same setting).

Registered in ``tables.TABLES`` as ``two-sided`` (every row at the shared lr, with its seeds and
the differences from Dobb B=1 and Muon under the project's noise rule, and the per-seed
differences from each: paired runs share data order and initial weights) and ``two-sided-lr`` (the
seed-0 lr grid of the two-sided rows beside Dobb B=1 and Muon-fp32 at their own grids).
"""
from __future__ import annotations

from dobb_bench.reports import records as R
from dobb_bench.reports.report import gap_closure
from dobb_bench.reports.tables import SHARED_LR, group_by, final_loss, muon_ref, fmt_ms, lr_grid_table, noise, setting_line, stats
from dobb_bench.studies.main_job import headline

REFS = ("AdamW", "Muon", "Muon-fp32", "NorMuon-fp32", "SOAP", "Dobb B=1", "Dobb B=4")
STUDY = "two-sided"
RAW_ADAM = "Two-sided-Adam unscaled B=1 Bo=1"


def _shared(r) -> bool:
    return abs(r["lr"] - SHARED_LR) < 1e-12


def records() -> list[dict]:
    """The study's runs at the shared lr and the reference rows, one record per (label, seed)."""
    out = {}
    for r in headline()[1] + R.load("muon-fp32") + R.load("family-soap"):
        if r["run"] in REFS and _shared(r):
            out[(r["run"], r["seed"])] = r
    for r in R.load(STUDY):
        if _shared(r):
            out[(r["run"], r["seed"])] = r
    # norm="adam" before the per-block-pair rescale (revision 1413aed), under a label of its own
    for r in R.load("two-sided-adam-raw"):
        out[(RAW_ADAM, r["seed"])] = dict(r, run=RAW_ADAM)
    return list(out.values())


def _vs(m, s, n, ref) -> str:
    if ref is None or not ref[2] or not n:
        return "—"
    d = m - ref[0]
    return f"{d:+.3f} ({'beyond' if abs(d) > noise(s, ref[1]) else 'within'} noise)"


def _paired(runs: list[dict], ref: dict) -> str:
    """Per-seed differences from the reference row (same seed: same data order and initial weights)."""
    diffs = [(r["seed"], final_loss(r) - ref[r["seed"]]) for r in sorted(runs, key=lambda r: r["seed"])
             if final_loss(r) is not None and ref.get(r["seed"]) is not None]
    return ", ".join(f"{d:+.3f}" for _, d in diffs) if diffs and ref is not None else "—"


def table(recs: list[dict]) -> str:
    by = group_by(recs, lambda r: r["run"])
    st = {k: stats([final_loss(r) for r in v]) for k, v in by.items()}
    adamw, muon, dobb = st.get("AdamW"), muon_ref(st), st.get("Dobb B=1")
    dobb_seeds = {r["seed"]: final_loss(r) for r in by.get("Dobb B=1", [])}
    muon_seeds = {r["seed"]: final_loss(r) for r in by.get("Muon", by.get("Muon-fp32", []))}
    rows = ["| optimizer | seeds | final val loss | gap closure | vs Dobb B=1 | per seed | vs Muon | per seed |",
            "|---|---|---|---|---|---|---|---|"]
    labels = [k for k in REFS if k in by] + sorted(k for k in by if k not in REFS)
    for label in labels:
        m, s, n = st[label]
        gc = gap_closure(m, adamw[0], muon[0]) if adamw and muon and n else None
        seeds = ",".join(str(r["seed"]) for r in sorted(by[label], key=lambda r: r["seed"]))
        rows.append(f"| {label} | {seeds} | {fmt_ms(m, s, n)} | {'—' if gc is None else f'{100 * gc:.0f}%'} | "
                    f"{'—' if label == 'Dobb B=1' else _vs(m, s, n, dobb)} | {'—' if label == 'Dobb B=1' else _paired(by[label], dobb_seeds)} | "
                    f"{'—' if label in ('Muon', 'Muon-fp32') else _vs(m, s, n, muon)} | "
                    f"{'—' if label in ('Muon', 'Muon-fp32') else _paired(by[label], muon_seeds)} |")
    return "\n".join(rows) + "\n" + setting_line(recs)


def lr_records() -> list[dict]:
    """Seed 0 at every lr: the study's labels that have a grid, Dobb B=1 and Muon-fp32 (own-lr)."""
    mine = [r for r in R.load(STUDY) if r["seed"] == 0]
    gridded = {r["run"] for r in mine if not _shared(r)}
    refs = [r for r in R.load("own-lr") if r["seed"] == 0 and r["run"] in ("Dobb B=1", "Muon-fp32")]
    return refs + [r for r in mine if r["run"] in gridded]


TABLES = {
    "two-sided": lambda: (table(recs := records()), recs),
    "two-sided-lr": lambda: (lr_grid_table(recs := lr_records(), ["Muon-fp32", "Dobb B=1"]), recs),
}
