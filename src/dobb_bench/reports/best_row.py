""""Best row" sentences must name their table's lowest row and say at which lr.

Why: a ranking sentence drifts from the table it talks about when the table is regenerated (it
names a row that is no longer the lowest, or says no row moved beyond noise beside a table where
one did). ``dobb-bench report --check`` compares the marked tables with their records; this module
compares a ranking sentence with the table it talks about. The rule, applied to every ``docs/*.md``
(the files whose marked tables ``report`` regenerates):

**A claim** is a sentence (prose cut at ``.``, ``!`` or ``?`` followed by a space and a capital,
a quote, a parenthesis or ``*``, and at every blank line and list item; tables, fenced code and
headings are not prose) that contains "best row", "lowest row", "best loss" or "lowest loss", or
"is best" / "are best" followed by punctuation, a parenthesis or "of" ("Muon is best (median
<its loss>)"; not "are best at the shared lr", which says which lr each row prefers, not which row wins).

**Its table** is the last marked table (``<!-- table:NAME -->``) above the sentence in the same
section (the text between two headings of any level); without one, the first marked table below it
in that section. A sentence in a section without a marked table is not checked.

**The table's loss of a row**, by the first rule that applies:
1. the sentence says "at the shared lr" and the table has a column ``lr 0.00354`` (the shared lr
   3.54e-3, as the lr-grid tables print it): that column;
2. a loss column, in this order of preference: ``final val loss: median``, ``median``,
   ``final val loss``, ``loss at best``, ``all seeds at best``;
3. columns named ``lr ...`` (an lr-grid table): the row's lowest cell, its own best lr.
A cell's value is its first decimal number (``1.671 ± 0.045`` -> 1.671, ``**1.629**`` -> 1.629);
rows without one are left out. A table with no such column, or whose first-column labels repeat
(pair tables, the block-width tables keyed by model width), is not checked.

**The check.** The sentence must (a) name a row whose loss is the table's lowest (ties: any of
them), and (b) contain the word "lr". A sentence names a row when it contains the row's label
(first column, ``**`` stripped) or its short form (``-fp32`` and ``rho=`` removed: "NorMuon" for
``NorMuon-fp32``, "Dion 1/16" for ``Dion rho=1/16``), case-insensitive, not inside a longer word,
after the table's other labels that contain it are removed from the sentence ("Block Muon B=16"
does not name ``Muon``).
"""
from __future__ import annotations

import re
from pathlib import Path

from dobb_bench.reports import records as R

CLAIM = re.compile(r"\b(?:best|lowest) (?:row|loss)\b|\b(?:is|are) best(?=\s*[(.,;:]|\s+of\b)", re.I)
SHARED_LR_WORDS = re.compile(r"\bat the shared lr\b", re.I)
SHARED_LR_COLUMN = "lr 0.00354"
LOSS_COLUMNS = ("final val loss: median", "median", "final val loss", "loss at best", "all seeds at best")
_LR_WORD = re.compile(r"\blr\b", re.I)
_HEADING = re.compile(r"^#{1,6}[ \t]", re.M)
_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*", re.S | re.M)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*\"(\[])")
_NUMBER = re.compile(r"-?\d+\.\d+")
_ITEM = r"[ \t]*(?:[-*+]|\d+[.)])[ \t]+"
# a paragraph or list item: non-blank lines, each further one not starting a new list item
_PARAGRAPH = re.compile(r"[^\n]*\S[^\n]*(?:\n|$)(?:(?!" + _ITEM + r")[^\n]*\S[^\n]*(?:\n|$))*")


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def parse_table(body: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, data rows) of a markdown table body (the separator row dropped)."""
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in body.splitlines()
            if ln.lstrip().startswith("|")]
    return (rows[0], [r for r in rows[2:]]) if len(rows) >= 2 else ([], [])


def _value(cell: str) -> float | None:
    m = _NUMBER.search(cell.replace("*", ""))
    return float(m.group(0)) if m else None


def row_losses(body: str, shared_lr: bool = False) -> dict[str, float] | None:
    """{row label: the table's loss of that row} (rules 1-3 above), or None when it is not checked."""
    head, rows = parse_table(body)
    labels = [r[0].replace("**", "").strip() for r in rows]
    if not head or len(set(labels)) != len(labels):
        return None
    cols = None
    if shared_lr and SHARED_LR_COLUMN in head:
        cols = [head.index(SHARED_LR_COLUMN)]
    else:
        named = next((c for c in LOSS_COLUMNS if c in head), None)
        cols = [head.index(named)] if named else [i for i, h in enumerate(head) if h.startswith("lr ")]
    if not cols:
        return None
    out = {}
    for label, r in zip(labels, rows):
        vals = [v for v in (_value(r[i]) for i in cols if i < len(r)) if v is not None]
        if vals:
            out[label] = min(vals)
    return out or None


def _short(label: str) -> str:
    return re.sub(r"\s+", " ", label.replace("-fp32", "").replace("rho=", "")).strip()


def _word(name: str) -> re.Pattern:
    return re.compile(r"(?<![\w-])" + re.escape(name) + r"(?![\w])", re.I)


def names(sentence: str, label: str, labels: list[str]) -> bool:
    """Whether the sentence names ``label`` (or its short form), other labels containing it removed."""
    text = sentence
    for other in sorted(labels, key=len, reverse=True):
        if other != label and any(_word(x).search(other) for x in {label, _short(label)}):
            for form in {other, _short(other)}:
                if form.lower() not in {label.lower(), _short(label).lower()}:
                    text = _word(form).sub(" ", text)
    return any(_word(x).search(text) for x in {label, _short(label)})


def _sentences(prose: str, start: int):
    """(offset, sentence) of each sentence of a stretch of prose (paragraphs cut at blank lines)."""
    for para in _PARAGRAPH.finditer(prose):
        pos = para.start()
        for piece in SENTENCE_END.split(para.group(0)):
            off = prose.index(piece, pos)
            pos = off + len(piece)
            if piece.strip():
                yield start + off, re.sub(r"\s+", " ", piece).strip()


def check_text(text: str) -> list[tuple[int, str, str]]:
    """(line, sentence, problem) of every claim that breaks the rule above."""
    tables = [(m.start(), m.end(), m.group(2), m.group(3)) for m in R.TABLE.finditer(text)]
    prose = _FENCE.sub(_blank, R.TABLE.sub(_blank, text))
    bounds = [m.start() for m in _HEADING.finditer(text)] + [len(text)]
    bounds = [0] + bounds if not bounds or bounds[0] != 0 else bounds
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        section = [t for t in tables if lo <= t[0] < hi]
        body = prose[lo:hi]
        first_nl = body.find("\n") if _HEADING.match(text, lo) else -1  # the heading line is not prose
        start = lo + first_nl + 1 if first_nl >= 0 else lo
        for off, sentence in _sentences(prose[start:hi], start):
            if not CLAIM.search(sentence) or not section:
                continue
            above = [t for t in section if t[1] <= off]
            name, tbody = (above[-1] if above else section[0])[2:]
            losses = row_losses(tbody, shared_lr=bool(SHARED_LR_WORDS.search(sentence)))
            line = text.count("\n", 0, off) + 1
            if losses is None:
                continue
            low = min(losses.values())
            lowest = [k for k, v in losses.items() if v <= low + 1e-12]
            if not any(names(sentence, k, list(losses)) for k in lowest):
                out.append((line, sentence, f"table {name!r}: its lowest row is {' / '.join(lowest)} ({low:.3f}), "
                                            "which the sentence does not name"))
            if not _LR_WORD.search(sentence):
                out.append((line, sentence, f"table {name!r}: say at which lr (e.g. 'at the shared lr')"))
    return out


def scan(docs: Path | None = None) -> dict[str, list[tuple[int, str, str]]]:
    """{file name: problems} over ``docs/*.md``."""
    docs = Path(R.DOCS if docs is None else docs)
    found = {}
    for md in sorted(docs.glob("*.md")):
        hits = check_text(md.read_text())
        if hits:
            found[md.name] = hits
    return found
