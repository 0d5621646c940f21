"""The docs tables as rows, and the checks of tables against each other and their records, beside
``claims`` (moved here from it to keep each file under 500 lines; ``claims`` re-exports every name,
and ``claims``'s docstring states the rules): ``docs_tables`` and ``table_rows`` read the marked tables;
``table_problems`` finds (g) an unmarked edge and (h) two best lrs for one row
(``CHOSEN_LR_TABLES``); ``mixed_dtypes`` (with ``product_dtype``) finds (i) a mixed-dtype row.
This module does not import ``claims`` (which imports it)."""
from __future__ import annotations

import re
from pathlib import Path

from dobb_bench.reports import records as R
from dobb_bench.reports.best_row import parse_table

_NUM = re.compile(r"[+-]?\d+\.\d+")
# the tables that choose a row's lr on the common windows, with the setting of one that has no setting column
CHOSEN_LR_TABLES = {"long-horizon-best": None, "frontier-20": "8300 steps, width 128"}


# ----- the tables, as rows -----------------------------------------------------------------------------
def docs_tables(docs: Path | None = None) -> dict[str, str]:
    """{table name: body} of every marked table in docs/*.md."""
    docs = Path(R.DOCS if docs is None else docs)
    out = {}
    for md in sorted(docs.glob("*.md")):
        for m in R.TABLE.finditer(md.read_text()):
            out[m.group(2)] = m.group(3)
    return out


def table_rows(body: str) -> list[dict]:
    """Each data row as {label, setting, edge, seeds, mean, seed0} (None where the table does not say)."""
    head, rows = parse_table(body)
    if not head:
        return []
    col = {h: i for i, h in enumerate(head)}
    label_i = col.get("row", 0)
    other = next((i for i, h in enumerate(head) if h.startswith("other seeds")), None)
    gap = next((i for i, h in enumerate(head) if h.startswith("gap to Muon at its best lr")), None)
    # table:frontier-20: "mean ± std (n)" and "gap to Muon, paired by seed": mean (seed 0, seed 1, ...)
    n_col = next((i for i, h in enumerate(head) if h.startswith("mean ± std")), None)
    paired_gap = next((i for i, h in enumerate(head) if h.startswith("gap to Muon, paired by seed")), None)
    out = []
    for r in rows:
        if len(r) < len(head):
            continue
        cell = lambda i: r[i] if i is not None else ""
        label = r[label_i].replace("**", "").strip()
        seeds = None
        if "seeds" in col:
            seeds = len([x for x in r[col["seeds"]].split(",") if x.strip().isdigit()]) or None
        elif other is not None:
            seeds = 1 + len(re.findall(r"\bseed \d+", cell(other)))
        elif n_col is not None and paired_gap is not None:
            m = re.search(r"\((\d+)\)\s*$", cell(n_col))
            seeds = int(m.group(1)) if m else None
        seed0 = mean = None
        if paired_gap is not None:
            nums = _NUM.findall(cell(paired_gap))
            if nums:
                mean, seed0 = float(nums[0]), float(nums[1] if len(nums) > 1 else nums[0])
            elif label == "Muon":
                mean = seed0 = 0.0
        elif gap is not None:
            nums = _NUM.findall(cell(gap))
            seed0 = float(nums[0]) if nums else (0.0 if label == "Muon" else None)
            m = re.search(r"\bmean ([+-]?\d+\.\d+)", cell(other))
            mean = float(m.group(1)) if m else seed0
        best = _NUM.search(r[col["best lr"]]) if "best lr" in col else None
        runs = next((i for i, h in enumerate(head) if h.startswith("lrs run")), None)
        if runs is not None:
            lrs = [float(x) for x in re.findall(r"(\d+(?:\.\d+)?(?:e-?\d+)?):", r[runs].replace("**", ""))]
        else:
            lrs = [float(h[3:]) for i, h in enumerate(head) if re.fullmatch(r"lr \d+(?:\.\d+)?", h)
                   and r[i].replace("**", "").strip() not in ("", "—")]
        out.append({"label": label, "setting": r[col["setting"]] if "setting" in col else None,
                    "edge": "(edge)" in r[col["best lr"]] if "best lr" in col else False,
                    "seeds": seeds, "mean": mean, "seed0": seed0,
                    "best_lr": float(best.group(0)) if best else None, "lrs": lrs})
    return out


# ----- (g), (h), (i): tables against each other and their records --------------------------------------------
def table_problems(tables: dict[str, str]) -> list[tuple[str, str]]:
    """(table name, problem) for (g) an unmarked edge and (h) two best lrs for one row."""
    out = []
    chosen: dict = {}
    for name, body in tables.items():
        for r in table_rows(body):
            lr, lrs = r.get("best_lr"), r.get("lrs") or []
            if lr is not None and lrs and not r["edge"] and any(abs(lr - x) <= 5e-4 * x for x in (min(lrs), max(lrs))):
                where = f" ({r['setting']})" if r["setting"] else ""
                out.append((name, f"{r['label']}{where}: best lr {lr:g} is at an end of the lrs run "
                                  f"({min(lrs):g}-{max(lrs):g}) and not marked (edge)"))
            if name in CHOSEN_LR_TABLES and lr is not None:
                setting = r["setting"] or CHOSEN_LR_TABLES[name]
                chosen.setdefault((setting, r["label"]), {})[name] = lr
    for (setting, label), by in sorted(chosen.items()):
        if len({f"{v:.3g}" for v in by.values()}) > 1:
            out.append((sorted(by)[0], f"{label} ({setting}): best lr " + ", ".join(
                f"{v:g} in table {n!r}" for n, v in sorted(by.items())) + ": one best lr per row across the tables"))
    return out


def product_dtype(r: dict) -> str | None:
    """The dtype a record's matrix products ran in: as resolved in its ``optimizer_groups`` (not the
    AdamW group's), else as its hparams name it (``bfloat16`` / ``float32``); None when neither says."""
    for g in r.get("optimizer_groups") or []:
        for key in ("product_dtype_resolved", "ns_dtype_resolved"):
            if g.get(key) and g.get("algorithm") != "adamw":
                return str(g[key]).replace("torch.", "")
    hp = str(r.get("hparams") or {})
    return "bfloat16" if "bfloat16" in hp else "float32" if "float32" in hp else None


def mixed_dtypes(name: str, recs: list[dict]) -> list[str]:
    """(i) The rows of table ``name`` (run label and setting) whose records ran their matrix products
    in more than one dtype."""
    by: dict = {}
    for r in recs:
        if not isinstance(r, dict) or "run" not in r:
            continue
        m = r.get("model") or {}
        d = product_dtype(r)
        if d is not None:
            by.setdefault((r["run"], r.get("steps"), m.get("width")), {}).setdefault(d, []).append(r)
    out = []
    for (run, steps, width), kinds in by.items():
        if len(kinds) > 1:
            said = "; ".join(f"{k}: " + ", ".join(sorted({f"lr {x['lr']:.3g} seed {x.get('seed')}" for x in rs}))
                             for k, rs in sorted(kinds.items()))
            out.append(f"table {name!r}: row {run} ({steps} steps, width {width}) mixes product dtypes ({said})")
    return out
