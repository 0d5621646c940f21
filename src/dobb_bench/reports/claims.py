"""Prose claims against the tables and records they rest on: six kinds of contradiction, and three
kinds of table that contradict each other or their records.

Why: ``dobb-bench report --check`` regenerates every marked table from its records, but the prose
around the tables quotes them, and drifts when a table changes (a figure rounded from an older
record, a row called bracketed that its table now marks "(edge)", "one seed" beside a table with
second seeds, a row said to end lowest that no longer does). This module checks those five kinds
of sentence in README.md and docs/*.md; each problem fails ``report --check``.

**Prose.** Text outside marked tables and fenced code, cut into blocks (paragraphs and list items,
as ``figure_check`` cuts them), blocks into sentences (``best_row``'s rule) and sentences into
clauses at ``;``.

**Which tables a sentence talks about.** The tables it cites (``table:NAME``); else the tables of
the setting it names: ``SCOPES`` maps a phrase ("width 256", "20 tokens per parameter", "8,300
steps") to the tables of that setting, each with the value of its ``setting`` column where one
table holds several settings. A sentence that names no setting takes it from its block, then from
the blocks that enclose it (an outer list item, the paragraph introducing a list); a level that
names two settings decides nothing. "common windows" in the sentence keeps only the tables judged
on the common windows, "own windows" or "logged" the others. A sentence with no table is not
checked.

**A row is named** when the clause contains its label or short form (``best_row.names``; "Dobb"
after "two-sided" is dropped first, so "two-sided Dobb B=1 Bo=4" names ``Two-sided B=1 Bo=4``).
The rows a claim is about are those named in its clause before the claim's words.

**The five kinds.**
(a) *A figure that differs from its source* (``FIGURES``): a phrase that quotes a value the
    tables or records give (the spread of a 64-window eval, how far a seed moves a gap to Muon)
    must quote it as the source rounds it.
(b) *"bracketed"* (not "bracketed:" defining it, not "not bracketed"): every row it is about
    ("every row" or "all rows": all of the setting's rows) has no "(edge)" in the ``best lr``
    column of any of the sentence's tables.
(c) *A seed count* ("one seed", "two seeds", "three seeds", "a single seed"; "any second seed"
    in a "Not measured" sentence counts as "one seed"): each row it is about has that many seeds
    in at least one of the sentence's tables; with no row named before or after it in its clause,
    or when it opens a clause after the first, it is about the sentence's rows; with no row at
    all, "one seed" is about every row of the setting and must hold in at least one table.
(d) *"ends lowest" / "the lowest"* (not "lowest lr", not "lowest of them"): the rows it is about
    are the lowest of their table by its gap to Muon: the mean over seeds where the table gives
    one ("over three seeds", "on average"), else the seed-0 gap (also when the sentence says
    "seed 0"); Muon is 0. Tables without a gap column are not used for (d).
(e) *A gap to Muon quoted for a row* ("0.005 below", "0.090 behind Muon", "0.004 above it"): the
    row named last before it in its clause has that gap, to the quoted decimals, as its mean over
    seeds or its seed-0 gap in one of the sentence's tables (below is negative). A gap followed by
    another row's name ("0.004 below AdamW") or by a noun phrase ("above the fp32 run") is against
    that, and a gap with another row's short form ("B=1 Bo=1") between it and the row named last
    is ambiguous: neither is checked. So is a gap after a short form ``names`` does not resolve
    ("MuonBP P=10" for ``MuonBP R=4 P=10``, whose base name two rows share).

(f) *A scoped closeness* ("end within about 0.02 of Muon", "within 0.015 nats of each other"):
    every row it is about is within that distance of Muon (its gap, rounded to the quoted
    decimals; the mean over seeds, or the seed-0 gap when the sentence says "seed 0"), or the rows
    span no more than it ("of each other", Muon at 0). The rows it is about: those named before it
    in its clause; else "the first N rows" (the table's first N) or "the top N rows" (the N
    nearest Muon); else "every row", "all rows" or "the rows" (every row of the table; "matrix
    rows" leaves AdamW out). A claim that holds for the first eight rows only fails for "the rows".

**Tables against each other and their records** (``table_problems``, ``mixed_dtypes``):
(g) *an unmarked edge*: a ``best lr`` at the lowest or highest lr its row lists (its ``lrs run``
    cell or its ``lr X`` columns) without "(edge)";
(h) *two best lrs for one row*: the tables that choose a row's lr on the common windows
    (``CHOSEN_LR_TABLES``) give that row, at one setting, different best lrs;
(i) *a mixed-dtype row*: a table's row (run label and setting) rests on records whose matrix
    products ran in different dtypes (bf16 beside fp32), ``mixed_dtypes`` over the records the
    table's generator used.

A table's seed count per row: its ``seeds`` column (``0,1,2``), or 1 plus the seeds named in its
``other seeds ...`` column (``seed 1: ..., seed 2: ...``).

The tables as rows (``docs_tables``, ``table_rows``) and the checks (g)-(i) moved to ``claims_rows``,
still importable from here.
"""
from __future__ import annotations

import re
from pathlib import Path

from dobb_bench.reports import records as R
from dobb_bench.reports.best_row import SENTENCE_END, names, parse_table  # noqa: F401  (parse_table: kept importable here)
from dobb_bench.reports.claims_rows import (CHOSEN_LR_TABLES, docs_tables, mixed_dtypes,  # noqa: F401
                                           product_dtype, table_problems, table_rows)  # noqa: F401
from dobb_bench.reports.figure_check import FENCE, blank_out, text_blocks

SCOPES = (
    (re.compile(r"\bwidth 256\b|\b3,?200 steps\b", re.I),
     (("width-256", None), ("long-horizon-best", "3200 steps, width 256"))),
    (re.compile(r"\b20 tokens per parameter\b|\b20-tokens\b|\b8,?300 steps\b", re.I),
     (("long-horizon", None), ("long-horizon-best", "8300 steps, width 128"), ("frontier-20", None))),
)
COMMON_WINDOW_TABLES = ("long-horizon-best", "frontier-20")  # tables judged on the common windows
_COMMON = re.compile(r"\bcommon windows\b", re.I)
_OWN = re.compile(r"\bown (?:64 )?windows\b|\blogged\b", re.I)
_CITE = re.compile(r"table:([\w.-]+)")
_BRACKETED = re.compile(r"(?<!not )(?<!un)\bbracketed\b(?!\s*:)", re.I)
_EVERY = re.compile(r"\bevery row(?:'s)?\b|\ball (?:the )?rows\b", re.I)
_SEEDS = re.compile(r"(?<!of )(?<!per )\b(one|two|three|a single) seeds?\b(?!['’-])", re.I)
_NO_SECOND = re.compile(r"\bany second seeds?\b", re.I)
_NOT_MEASURED = re.compile(r"\bnot measured\b", re.I)
_LOWEST = re.compile(r"\b(?:ends?|the|is|are)\s+lowest\b(?!\s+(?:lr|learning|grid|edge|seed|loss|row)\b)"
                     r"(?!\s+(?:of|among) them\b)", re.I)
_SEED0 = re.compile(r"\bseed 0\b", re.I)
# (e): "0.005 below", "0.090 behind Muon", "0.004 above it" (not "0.004 below AdamW": another row)
_AGAINST = re.compile(r"(?:the|its|a|an|their|this|that)\b", re.I)
_HPARAM = re.compile(r"\b[A-Z][a-z]?=\d")  # a row's short form: B=1 Bo=1, P=10 (not code's axis=0)
_GAP = re.compile(r"(?<![\d.+-])(\d\.\d{3})\s+(below|above|behind)\b(?:\s+(?:it|Muon|owner-compute Muon)\b)?", re.I)
_WORDS = {"one": 1, "a single": 1, "two": 2, "three": 3}
# (f): "within about 0.02 of Muon", "within 0.015 nats of each other"
_WITHIN = re.compile(r"\bwithin (?:about |roughly )?(\d+\.\d+)(?: nats?)? of (?:(?:owner-compute )?(Muon)\b|(each other)\b)",
                     re.I)
_NUMBER = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
           "eleven": 11, "twelve": 12}
_FIRST_N = re.compile(r"\b(first|top) (\d+|" + "|".join(_NUMBER) + r")\b", re.I)
_ALL_ROWS = re.compile(r"\bevery row\b|\ball (?:the )?(?:matrix )?rows\b|\bthe (?:matrix )?rows\b", re.I)
_MATRIX = re.compile(r"\bmatrix rows\b", re.I)


# ----- (a): figures quoted from a source -----------------------------------------------------------------
def _window_spread(tables: dict[str, str]) -> str | None:
    m = re.search(r"64-window eval of one checkpoint varies by (\d+\.\d+) nats", tables.get("common-windows", ""))
    return m.group(1) if m else None


def _seed_move(tables: dict[str, str]) -> str | None:
    """The largest change between seeds of one row's gap to Muon at one Muon lr (common-windows'
    per-seed gaps, each against Muon at the lr it ran at with the most seeds)."""
    body = tables.get("common-windows", "")
    moves = []
    for line in body.splitlines():
        gaps = [float(g) for g in re.findall(r"([+-]\d+\.\d+) \(seed \d+\)", line)]
        if len(gaps) > 1:
            moves.append(max(gaps) - min(gaps))
    return f"{max(moves):.3f}" if moves else None


def _seed_move_at(muon_lr: float):
    """The same against Muon at ``muon_lr`` (8,300 steps, width 128): from the re-evaluation record."""
    def value(_tables) -> str | None:
        recs = [r for r in R.reeval_records() if r["steps"] == 8300 and r["model"]["width"] == 128]
        muon = {r["seed"]: r["common_val_loss"] for r in recs if r["run"] == "Muon" and abs(r["lr"] - muon_lr) < 1e-4}
        by: dict = {}
        for r in recs:
            if r["run"] != "Muon" and r["seed"] in muon:
                by.setdefault((r["run"], round(r["lr"], 6)), []).append(r["common_val_loss"] - muon[r["seed"]])
        moves = [max(g) - min(g) for g in by.values() if len(g) > 1]
        return f"{max(moves):.3f}" if moves else None
    return value


FIGURES = (
    ("the spread of a 64-window eval (table common-windows)",
     re.compile(r"64-window eval\b[^.;]{0,60}?\bvar(?:y|ies) by (\d+\.\d+)", re.I), _window_spread),
    ("how far a seed moves a gap to Muon at one Muon lr (table common-windows)",
     re.compile(r"\bgap to Muon at one Muon lr moves by up to (\d+\.\d+)|\ba seed moves a gap by up to (\d+\.\d+)|"
                r"\bthe (\d+\.\d+) by which a seed moved a gap\b", re.I), _seed_move),
    ("how far a seed moves a gap to Muon at 0.01 (record docs/results/checks/reeval-windows/reeval.jsonl)",
     re.compile(r"\bgap against Muon at 0\.01 moved by up to (\d+\.\d+)", re.I), _seed_move_at(0.01)),
)


# ----- sentences and their tables --------------------------------------------------------------------------
_SHORT_RUN = re.compile(r"\b[28]00[ -]steps?\b", re.I)
_LONG_256 = re.compile(r"\b3,?200 steps\b", re.I)


def _scope(text: str) -> list[tuple[str, str | None]] | None:
    """The tables of the one setting ``text`` names; None if it names none, [] if several. Width
    256 at 800 or 200 steps (the block-width study, withdrawn runs) is not the long run's setting."""
    hits = [tables for pattern, tables in SCOPES if pattern.search(text)
            and not (tables is SCOPES[0][1] and _SHORT_RUN.search(text) and not _LONG_256.search(text))]
    return list(hits[0]) if len(hits) == 1 else ([] if hits else None)  # [] = ambiguous


def _sentence_tables(sentence: str, levels: list[str], tables: dict[str, str]) -> list[tuple[str, list[dict]]]:
    """(name, rows) of the tables a sentence talks about (rules in the module docstring)."""
    cited = [n for n in _CITE.findall(sentence) if n in tables]
    scope = None
    for text in [sentence, *levels]:
        scope = _scope(text)
        if scope is not None:
            break
    if cited:
        settings = {n: s for n, s in (scope or []) if n in cited}
        chosen = [(n, settings.get(n)) for n in dict.fromkeys(cited)]
    elif scope:
        chosen = scope
        if _COMMON.search(sentence) and not _OWN.search(sentence):
            chosen = [t for t in chosen if t[0] in COMMON_WINDOW_TABLES]
        elif _OWN.search(sentence) and not _COMMON.search(sentence):
            chosen = [t for t in chosen if t[0] not in COMMON_WINDOW_TABLES]
    else:
        return []
    out = []
    for name, setting in chosen:
        rows = [r for r in table_rows(tables.get(name, "")) if setting is None or r["setting"] == setting]
        if rows:
            out.append((name, rows))
    return out


def _normalize(text: str, labels: list[str]) -> str:
    """"two-sided Dobb" -> "two-sided"; a label's base name (its hyperparameters dropped: "row-block
    Muon" for ``Row-block Muon R=4``) -> the label, where no other label has that base."""
    text = re.sub(r"\b(two-sided)\s+Dobb\b", r"\1", text, flags=re.I)
    base = {x: re.sub(r"(?:\s+\S+=\S+)+$", "", x) for x in labels}
    for x, b in base.items():
        if b != x and list(base.values()).count(b) == 1 and b not in labels:
            text = re.sub(r"(?<![\w-])" + re.escape(b) + r"(?![\w-])(?!\s+\S+=)", x, text, flags=re.I)
    return text


def _named(text: str, labels: list[str]) -> list[str]:
    """The labels ``text`` names, in the order it names them."""
    text = _normalize(text, labels)
    hits = [(m.start(), x) for x in labels if names(text, x, labels)
            for m in [re.search(re.escape(x), text, re.I) or re.search(".", text)]]
    return [x for _, x in sorted(hits)]


def _lead(clause: str, end: int) -> str:
    """The words before a claim that its rows are named in: from the clause's last ':' on (not a
    colon inside a code span: `table:NAME`)."""
    head = clause[:end]
    blank = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), head)
    return head[blank.rfind(":") + 1:]


def _paren(clause: str, at: int) -> tuple[int, int] | None:
    """The innermost parentheses around position ``at``, or None."""
    depth, start = 0, None
    for i in range(at - 1, -1, -1):
        if clause[i] == ")":
            depth += 1
        elif clause[i] == "(":
            if depth == 0:
                start = i
                break
            depth -= 1
    if start is None:
        return None
    end = clause.find(")", at)
    return (start, len(clause) if end < 0 else end)


def _outside_parens(text: str) -> str:
    while True:
        new = re.sub(r"\([^()]*\)", " ", text)
        if new == text:
            return text
        text = new


def _clauses(sentence: str) -> list[str]:
    return [c for c in sentence.split(";") if c.strip()]


def _check_sentence(sentence: str, levels: list[str], tables: dict[str, str]) -> list[str]:
    problems = []
    for what, pattern, value in FIGURES:  # (a)
        for m in pattern.finditer(sentence):
            quoted = next(g for g in m.groups() if g)
            want = value(tables)
            if want is not None and quoted != want:
                problems.append(f"quotes {quoted} for {what}, which gives {want}")
    found = _sentence_tables(sentence, levels, tables)
    if not found:
        return problems
    labels = sorted({r["label"] for _, rows in found for r in rows})
    clauses = _clauses(sentence)
    for k, clause in enumerate(clauses):
        for m in _BRACKETED.finditer(clause):  # (b)
            about = _named(_lead(clause, m.start()), labels)
            every = bool(_EVERY.search(_lead(clause, m.start())))
            if not about and not every:
                continue
            for name, rows in found:
                edges = [r["label"] for r in rows if r["edge"] and (every or r["label"] in about)]
                if edges:
                    problems.append(f"calls {'every row' if every else ', '.join(about)} bracketed; table "
                                    f"{name!r} marks {', '.join(edges)} (edge)")
        seed_claims = [(m, _WORDS[m.group(1).lower()]) for m in _SEEDS.finditer(clause)]
        if _NOT_MEASURED.search(sentence):
            seed_claims += [(m, 1) for m in _NO_SECOND.finditer(clause)]
        for m, n in seed_claims:  # (c)
            opens = k > 0 and len(clause[:m.start()].split()) <= 2  # "...; one seed, and ...": the setting's
            about = []
            if not opens:
                group = _paren(clause, m.start())
                if group is not None:
                    about = _named(clause[group[0] + 1:group[1]], labels)
                if not about:
                    about = _named(_outside_parens(clause), labels)[:1]  # the clause's subject
            counts = {x: {r["seeds"] for _, rows in found for r in rows if r["label"] == x and r["seeds"]} for x in about}
            wrong = [f"{x} ({'/'.join(map(str, sorted(c)))})" for x, c in counts.items() if c and n not in c]
            if wrong:
                problems.append(f"says {m.group(0)!r}; the tables give {', '.join(wrong)} seeds")
            elif not about and n == 1:
                known = [(name, rows) for name, rows in found if any(r["seeds"] for r in rows)]
                if known and all(any((r["seeds"] or 1) != 1 for r in rows) for _, rows in known):
                    more = sorted({r["label"] for _, rows in known for r in rows if (r["seeds"] or 1) > 1})
                    problems.append(f"says {m.group(0)!r}; the tables give more seeds for {', '.join(more)}")
        for m in _LOWEST.finditer(clause):  # (d)
            about = _named(_lead(clause, m.start()), labels)
            if not about:
                continue
            key = "seed0" if _SEED0.search(sentence) else "mean"
            for name, rows in found:
                vals = {r["label"]: r[key] for r in rows if r[key] is not None}
                if not vals or not all(x in vals for x in about):
                    continue
                rest = [v for x, v in vals.items() if x not in about]
                if rest and max(vals[x] for x in about) > min(rest) + 1e-9:
                    low = sorted(vals, key=vals.get)[:len(about)]
                    problems.append(f"says {', '.join(about)} end{'s' if len(about) == 1 else ''} lowest; table "
                                    f"{name!r} ({'seed 0' if key == 'seed0' else 'mean over seeds'}) has "
                                    + ", ".join(f"{x} {vals[x]:+.3f}" for x in low) + " lowest")
        for m in _GAP.finditer(clause):  # (e)
            problem = _gap_claim(clause, m, labels, found)
            if problem:
                problems.append(problem)
        for m in _WITHIN.finditer(clause):  # (f)
            problems += _within_claim(sentence, clause, m, labels, found)
    return problems


def _within_claim(sentence: str, clause: str, m: re.Match, labels: list[str], found) -> list[str]:
    """(f) "within X of Muon / of each other": the rows it is about, in each of the sentence's tables
    with a gap column (rules in the module docstring); the problems."""
    lead = _lead(clause, m.start())
    about = _named(lead, labels)
    first = _FIRST_N.search(lead)
    every = bool(_ALL_ROWS.search(lead))
    if not about and not first and not every:
        return []
    quoted, decimals = float(m.group(1)), len(m.group(1).split(".")[1])
    key = "seed0" if _SEED0.search(sentence) else "mean"
    out = []
    for name, rows in found:
        vals = {r["label"]: r[key] for r in rows if r[key] is not None}
        if not vals:
            continue
        if about:
            if not all(x in vals for x in about):
                continue
            keep = about
        else:
            keep = [x for x in vals if not (_MATRIX.search(lead) and x == "AdamW")]
            if first:
                n = int(first.group(2)) if first.group(2).isdigit() else _NUMBER[first.group(2).lower()]
                keep = keep[:n] if first.group(1).lower() == "first" else sorted(keep, key=lambda x: abs(vals[x]))[:n]
        scope = ", ".join(about) if about else (f"the {first.group(1)} {first.group(2)} rows" if first else "every row")
        if m.group(3):  # of each other
            spread = max(vals[x] for x in keep) - min(vals[x] for x in keep)
            if round(spread, decimals) > quoted + 1e-12:
                lo, hi = min(keep, key=vals.get), max(keep, key=vals.get)
                out.append(f"says {scope} end within {m.group(1)} of each other; table {name!r} "
                           f"({'seed 0' if key == 'seed0' else 'mean over seeds'}) has {lo} {vals[lo]:+.3f} "
                           f"and {hi} {vals[hi]:+.3f}")
        else:
            far = [x for x in keep if round(abs(vals[x]), decimals) > quoted + 1e-12]
            if far:
                out.append(f"says {scope} end within {m.group(1)} of Muon; table {name!r} "
                           f"({'seed 0' if key == 'seed0' else 'mean over seeds'}) has "
                           + ", ".join(f"{x} {vals[x]:+.3f}" for x in far))
    return out


def _last_named(text: str, labels: list[str]) -> tuple[str, str] | None:
    """The label ``text`` names last (the mention that starts last, outside code spans and not inside
    a longer label's mention: "Muon" in "Row-block Muon R=4") and the text after that mention, code
    spans blanked; None if it names none."""
    norm = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), _normalize(text, labels))
    spans = [(h.start(), h.end(), x) for x in labels if names(norm, x, labels)
             for h in re.finditer(r"(?<![\w-])" + re.escape(x) + r"(?![\w-])", norm, re.I)]
    spans = [a for a in spans if not any(b[0] <= a[0] and a[1] <= b[1] and b[1] - b[0] > a[1] - a[0] for b in spans)]
    if not spans:
        return None
    _, end, label = max(spans)
    return label, norm[end:]


def _gap_claim(clause: str, m: re.Match, labels: list[str], found) -> str | None:
    """(e) "X below / above / behind [Muon]" after a row's name: the row's gap to Muon, as one of the
    sentence's tables gives it (rules in the module docstring); the problem, or None."""
    rest = _normalize(clause[m.end():], labels).lstrip()
    if any(rest.lower().startswith(x.lower()) for x in labels if x != "Muon") or _AGAINST.match(rest):
        return None  # against another row or run ("below AdamW", "above the fp32 run")
    named = _last_named(clause[:m.start()], labels)
    if named is None or named[0] == "Muon" or _HPARAM.search(named[1]):
        return None  # no row, or another row's short form stands between ("and B=1 Bo=1 (0.012 below")
    row = named[0]
    quoted = float(m.group(1)) * (-1 if m.group(2).lower() == "below" else 1)
    given = [(name, r[k]) for name, rows in found for r in rows if r["label"] == row
             for k in ("mean", "seed0") if r[k] is not None]
    if not given or any(abs(round(v, 3) - quoted) < 5e-4 for _, v in given):
        return None
    return (f"quotes {m.group(0)!r} for {row}; the tables give "
            + ", ".join(sorted({f"{v:+.3f} ({name})" for name, v in given})))


def check_text(text: str, tables: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, sentence, problem) for every claim in ``text`` that its tables contradict."""
    body = FENCE.sub(blank_out, R.TABLE.sub(blank_out, text))
    lines = body.split("\n")
    blocks = text_blocks(lines)
    full = ["\n".join(b["lines"]) for b in blocks]
    flat = [re.sub(r"\s+", " ", x) for x in full]  # a setting's words may cross a line break
    out = []
    for j, b in enumerate(blocks):
        if b["kind"] not in ("para", "item"):
            continue
        levels, seen, stack = [flat[j]], set(), list(reversed(b["parents"]))
        while stack:  # enclosing items and introducing paragraphs, nearest first (not headings)
            p = stack.pop(0)
            if p in seen or blocks[p]["kind"] == "heading":
                continue
            seen.add(p)
            levels.append(flat[p])
            stack += list(reversed(blocks[p]["parents"]))
        pos, running = 0, []  # running: the last sentence of this block that named one setting
        for piece in SENTENCE_END.split(full[j]):
            start = full[j].index(piece, pos)
            pos = start + len(piece)
            sentence = re.sub(r"\s+", " ", piece).strip()
            if not sentence:
                continue
            line = b["first"] + full[j].count("\n", 0, start) + 1
            out += [(line, sentence, p) for p in _check_sentence(sentence, running + levels, tables)]
            if _scope(sentence):
                running = [sentence]
    return out


def scan(root: Path | None = None) -> dict[str, list[tuple[int, str, str]]]:
    """{path relative to the checkout: problems} over README.md and docs/*.md."""
    docs = Path(R.DOCS)
    root = docs.parent if root is None else root
    tables = docs_tables(docs)
    found = {}
    bad = table_problems(tables)
    for md in [root / "README.md", *sorted(docs.glob("*.md"))]:
        if md.exists():
            text = md.read_text()
            hits = check_text(text, tables)
            for m in R.TABLE.finditer(text):  # (g), (h): at the table's marker
                hits += [(text.count("\n", 0, m.start()) + 1, f"table:{m.group(2)}", p)
                         for name, p in bad if name == m.group(2) and md.parent == docs]
            if hits:
                found[str(md.relative_to(root))] = hits
    return found

