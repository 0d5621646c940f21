"""Committed run records: collected from run folders, checked, loaded.

Why: a number in docs/ is only worth reading if it can be traced to the run that produced it.
``dobb-bench report --collect RUN_DIR --study NAME`` turns a ``compare``/``sweep`` output folder
into compact records (final values, the eval curve, every hyperparameter, provenance) appended to
``docs/results/records/NAME.jsonl``; ``dobb-bench report`` rewrites every table in ``docs/*.md``
that sits between ``<!-- table:NAME -->`` and ``<!-- /table -->`` from those records
(``TABLE`` below; the generators by name in ``dobb_bench.studies.docs_tables``). ``tests/bench/test_docs_tables.py`` fails when a docs table
differs from its regeneration or rests on a record from a dirty tree.

``report`` checks every record and renders every table before it writes a byte (a bad record in one
study must not leave another file half-regenerated), and ``--docs DIR`` points it at another docs
folder (its ``*.md`` and its ``results/records``), so it edits the source tree only when asked.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # src/dobb_bench/reports/records.py -> the checkout
RECORDS = ROOT / "docs" / "results" / "records"  # read at call time: use_docs() moves both
DOCS = ROOT / "docs"
_KEEP = ("run", "optimizer", "hparams", "lr", "weight_decay", "steps", "tokens", "diverged",
         "final_val_loss", "final_val_bpb", "best_val_loss", "final_train_loss", "tokens_per_s",
         "eval_weights",  # "iterate-ema": validated with the optimizer's averaged weights (SPlus)
         "opt_ms_per_step", "train_wall_s", "train_cpu_s", "threads", "world", "device", "dist",
         "n_params", "model", "train", "optimizer_groups", "corpus", "provenance")
TABLE = re.compile(r"(<!-- table:([\w.-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def compact(final: dict, evals: list[dict]) -> dict:
    """A committed record: the final record without per-step losses, plus the eval curve."""
    rec = {k: final.get(k) for k in _KEEP if k in final}
    rec["seed"] = (final.get("train") or {}).get("seed")
    rec["curve"] = [[e["step"], None if e.get("val_loss") is None else round(e["val_loss"], 5)]
                    for e in evals]
    if any("weight_norms" in e for e in evals):
        # [step, largest matrix RMS, largest top singular value] on the raw weights
        rec["norm_curve"] = [[e["step"], _r(e["weight_norms"].get("max_rms")), _r(e["weight_norms"].get("max_top_sv"))]
                             for e in evals if "weight_norms" in e]
        normed = [e for e in evals if "weight_norms" in e]
        # each matrix's [rms, top singular value] at the first eval (the initial weights), halfway
        # and at the last: the growth of each matrix, and whether it is still growing at the end
        rec["norms_by_matrix"] = {
            k: [[e["step"], _r(e["weight_norms"]["matrices"][k][0]), _r(e["weight_norms"]["matrices"][k][1])]
                for e in (normed[0], normed[len(normed) // 2], normed[-1])]
            for k in normed[-1]["weight_norms"]["matrices"]}
    if any(e.get("eval_weights", "raw") != "raw" and "val_loss_raw" in e for e in evals):
        rec["raw_curve"] = [[e["step"], _r(e.get("val_loss_raw"))] for e in evals if "val_loss_raw" in e]
    losses = final.get("train_losses") or []
    stride = max(1, len(losses) // 50)  # ~50 points of the train curve are enough to plot it
    rec["train_curve"] = [[i + 1, round(v, 4)] for i, v in enumerate(losses)
                          if (i + 1) % stride == 0 and v is not None and math.isfinite(v)]
    return rec


def _r(v, digits: int = 5):
    return None if v is None or not math.isfinite(v) else round(v, digits)


def record_key(rec: dict) -> str:
    """What makes two records the same run: a rerun replaces its record; a run under the same label
    with other hyperparameters (bf16 products, say) is another run and is kept beside it."""
    t = rec.get("train") or {}
    return json.dumps([rec.get("run"), rec.get("lr"), rec.get("seed"), rec.get("steps"), rec.get("model"),
                       (rec.get("corpus") or {}).get("name"), t.get("micro_batches"), t.get("batch_size"),
                       rec.get("hparams")], sort_keys=True)


def read_run_dir(out_dir: Path) -> list[dict]:
    """Compact records of every finished run under a compare/sweep output folder."""
    out = []
    for metrics in sorted(Path(out_dir).glob("runs/*/metrics.jsonl")):
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        if not lines or lines[-1].get("type") != "final":
            continue
        out.append(compact(lines[-1], [r for r in lines[:-1] if r.get("type") == "eval"]))
    return out


def use_docs(docs) -> None:
    """Points this module's readers and writers at another docs folder (``report --docs DIR``)."""
    global DOCS, RECORDS
    docs = Path(docs)
    if not docs.is_dir():
        raise ValueError(f"--docs {docs}: no such folder (it should hold the *.md files and results/records)")
    DOCS, RECORDS = docs, docs / "results" / "records"


# What every table generator may rely on: key -> accepted types (None: the value may be null).
_REQUIRED = {"run": (str,), "optimizer": (str,), "hparams": (dict,), "lr": (int, float), "seed": (int,),
             "steps": (int,), "diverged": (bool,), "final_val_loss": (int, float, type(None)),
             "model": (dict,), "train": (dict,), "corpus": (dict,), "provenance": (dict,)}


def check_record(rec, where: str) -> None:
    """A ValueError naming ``where`` (file:line) and the key, if ``rec`` is not a usable record."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    for key, types in _REQUIRED.items():
        if key not in rec:
            raise ValueError(f"{where}: record {rec.get('run')!r} has no {key!r}; fix or remove that line")
        value = rec[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"{where}: record {rec.get('run')!r} has {key}={value!r} "
                             f"(expected {' or '.join(t.__name__ for t in types)}); fix or remove that line")


def collect(out_dir, study: str, records_dir: Path | None = None, runs: list[str] | None = None) -> list[dict]:
    """Adds the runs in ``out_dir`` to ``records_dir/study.jsonl`` (a rerun replaces its record);
    ``runs``: only the runs with these labels (a folder may hold rows that belong to other studies)."""
    if not re.fullmatch(r"[\w.-]+", study):
        raise ValueError(f"study name {study!r}: use letters, digits, '.', '_' or '-'")
    new = read_run_dir(Path(out_dir))
    if runs is not None:
        missing = set(runs) - {r.get("run") for r in new}
        if missing:
            raise ValueError(f"no finished run labelled {sorted(missing)} under {out_dir} "
                             f"(labels there: {sorted({r.get('run') for r in new})})")
        new = [r for r in new if r.get("run") in runs]
    if not new:
        raise ValueError(f"no finished runs under {out_dir}/runs/*/metrics.jsonl")
    records_dir = RECORDS if records_dir is None else records_dir
    for r in new:
        check_record(r, f"{out_dir} run {r.get('run')!r}")
    path = Path(records_dir) / f"{study}.jsonl"
    old = load(study, records_dir) if path.exists() else []
    merged = {record_key(r): r for r in old}
    merged.update({record_key(r): r for r in new})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in merged.values()))
    return new


def load(study: str, records_dir: Path | None = None) -> list[dict]:
    """The study's records, each checked (a bad line is a ValueError naming file and line)."""
    path = Path(RECORDS if records_dir is None else records_dir) / f"{study}.jsonl"
    if not path.exists():
        raise ValueError(f"no records for study {study!r} ({path})")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc}); fix or remove that line") from None
        check_record(rec, f"{path}:{n}")
        out.append(rec)
    return out


def check_all(records_dir: Path | None = None) -> int:
    """Checks every record of every study; returns how many there are."""
    folder = Path(RECORDS if records_dir is None else records_dir)
    return sum(len(load(p.stem, folder)) for p in sorted(folder.glob("*.jsonl")))


def reeval_path() -> Path:
    """The record of ``scripts/reeval_windows.py`` (read at call time: ``use_docs`` moves the docs)."""
    return Path(DOCS) / "results" / "checks" / "reeval-windows" / "reeval.jsonl"


def reeval_records() -> list[dict]:
    """Every re-evaluated checkpoint of ``reeval_path()`` (one JSON object a line)."""
    path = reeval_path()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def clean(rec: dict) -> bool:
    p = rec.get("provenance") or {}
    return bool(p.get("git_rev")) and p.get("git_dirty") is False
