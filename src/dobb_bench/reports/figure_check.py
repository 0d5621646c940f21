"""Figures outside the regenerated tables: each must name its record or say it was not measured here.

Why: ``dobb-bench report --check`` compares the marked tables with their
regeneration, but prose and hand-written tables quote measurements too. ``--strict-figures`` fails
on any figure in README.md or docs/**/*.md that a reader cannot trace.

**What is a figure.** A number followed by a measurement unit: ``ms``, ``us``/``µs``, ``s``,
``sec``, ``min``, ``minutes``, ``hours``, ``ms/step``, ``s/step``, ``%``, ``nats``, ``degrees``/``°``,
``bytes``, ``B/param``, ``KB``/``KiB``/``MB``/``MiB``/``GB``/``GiB``/``TB``, ``GB/s``,
``GFLOP/s``, ``TFLOP/s``, ``tok/s``, or a ratio ``0.13x`` / ``2.05×`` (the ``x`` written right
after the number). The unit may follow after a line break. Not figures:
- dimension products: ``4 x 768``, ``3 x heads`` (a space before the ``x``), ``192x64``,
  ``768×3072`` (a number right after the ``x``);
- numbers glued to a word, a dot, a colon, a slash, ``=``, ``#``, ``{`` or ``,`` on their left, or
  to a letter and a hyphen: version numbers (``2.13.0``), line numbers (``figure_check.py:42``),
  hex revisions (``67562ed``), ``B=16``, ``GPT-2``, ``lr 3e-3`` exponents, dates;
- test tolerances: a number right after ``tol``/``atol``/``rtol``/``tolerance`` (``=``, ``:``,
  ``of`` allowed between) or right before ``tolerance``;
- anything in inline code, fenced (``` or ~~~) or indented (4 spaces after a blank line, not
  inside a list) code blocks: commands and their lr values are code, not claims;
- anything in a regenerated table (between ``<!-- table:NAME -->`` and ``<!-- /table -->``),
  which ``report --check`` compares with its records instead.

**When a figure is sourced.** Text is cut into *blocks*: a heading, a paragraph, a list item
(its indented continuation paragraphs included), or a table. A figure is sourced when its block,
or a block it inherits from, either
(a) names a record: a path that resolves (against the repository root, ``docs/``, or the file's
    own folder; ``{a,b}`` and ``*`` expanded) to an existing file or folder under
    ``docs/results/`` (``runs/`` is not committed, so it never counts), or a study whose records
    exist (``docs/results/records/<study>.jsonl``) written within three words of ``study``,
    ``studies``, ``record``, ``records`` or ``--study``; or
(b) marks it as not ours: "not measured here", "issue N's figure" or "not a record of ours"
    (any whitespace, line breaks included, between the words).
A block inherits from every heading above it in the heading tree (a ``###`` from its ``##`` and
``#``), a nested list item or continuation paragraph from the list items that enclose it, and a
list or table from the paragraph that introduces it (the paragraph right before it, ending in
``:``), and a table from its caption (the paragraph right after it, when that begins with
"Record" or "Records"). A mention of ``.json`` or of some other block's record does not source a figure.

**Which files.** README.md and every docs/**/*.md, hand-written files in record folders included
(``docs/results/checks/numerics.md``, ``docs/results/peers/README.md``, ...). A markdown file
is generated, and skipped, when a record with the same stem sits beside it (``timing.md`` beside
``timing.jsonl``, ``payload-fs2.md`` beside ``payload-fs2.json``): the tool that wrote the record
rendered it, and its figures are that record's.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

from dobb_bench.reports.records import ROOT

_UNIT = (r"(?:ms/step|s/step|ms\b|us\b|µs|sec\b|s\b(?!\^)|min\b|minutes?\b|hours?\b|%|nats?\b|degrees?\b|°|"
         r"bytes?\b|B/param\b|[KMGT]i?B/s|[KMGT]iB\b|[KMGT]B\b|kB\b|[GT]FLOP/s|tok/s|"
         r"x\b(?![ \t]*\d)|×(?![ \t]*\d))")
_NUM = r"(?<![\w.,:/#={])(?<![A-Za-z_]-)(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# "x"/"×" only right after the number (a space before it reads as a product: "4 x 768")
FIGURE = re.compile(_NUM + r"(?:(?=[x×])|[ \t\u00a0]?\n?[ \t]*(?![x×]))" + _UNIT)
_TOLERANCE = re.compile(r"\b[ar]?tol(?:erance)?\s*[=:]?\s*(?:of\s+)?$", re.I)
_TOLERANCE_AFTER = re.compile(r"\s*tolerance\b", re.I)
MARK = re.compile(r"not\s+measured\s+here|issue\s+#?\d+(?:'|’)s\s+figures?|not\s+a\s+record\s+of\s+ours", re.I)
_PATH = re.compile(r"[\w.{},*/-]*(?:results/[\w.{},*/-]+|[\w{},*-]+\.(?:jsonl?|md|txt|csv))")
_STUDY_WORD = re.compile(r"^(?:stud(?:y|ies)|records?|--study)$", re.I)
_TABLE = re.compile(r"<!-- table:[\w.-]+ -->\n.*?<!-- /table -->", re.S)
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*", re.S | re.M)
_INLINE = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
_LIST = re.compile(r"^([ \t]*)(?:[-*+]|\d+[.)])[ \t]+")
_HEADING = re.compile(r"^(#{1,6})[ \t]")
_CAPTION = re.compile(r"^\(?Records?\b")


def blank_out(m: re.Match) -> str:
    """Same line count, no content: keeps line numbers right after a region is skipped."""
    return re.sub(r"[^\n]", " ", m.group(0))


def _indented_code(lines: list[str]) -> list[str]:
    """Blank 4-space indented code blocks: after a blank line, outside a list (there it is the item's text)."""
    out, in_list, prev_blank, in_code = list(lines), False, True, False
    for i, ln in enumerate(lines):
        if not ln.strip():
            prev_blank = True
            continue
        indented = ln.startswith(("    ", "\t"))
        if indented and (in_code or (prev_blank and not in_list)):
            in_code, out[i] = True, ""
        else:
            in_code = False
            if _LIST.match(ln):
                in_list = True
            elif not indented and not ln.startswith((" ", "\t")):
                in_list = False  # an unindented paragraph or heading ends the list
        prev_blank = False
    return out


def figures(text: str) -> list[re.Match]:
    """The figures of a stretch of prose (inline code already blanked), test tolerances left out."""
    return [m for m in FIGURE.finditer(text)
            if not _TOLERANCE.search(text[:m.start()]) and not _TOLERANCE_AFTER.match(text[m.end():])]


def _names_record(text: str, root: Path, here: Path) -> bool:
    results = (root / "docs" / "results").resolve()
    for p in _PATH.findall(text):
        p = p.rstrip(".,").removeprefix("./")
        for base in (root, root / "docs", here):
            for cand in _braces(p):
                for hit in glob.glob(str(base / cand)):
                    r = Path(hit).resolve()
                    if results in r.parents and r != results / "records":  # a record, not the folder of all
                        return True
    words = re.findall(r"[\w.-]+|--study", text.replace("`", " "))
    for i, w in enumerate(words):
        stem = w.strip(".").lower()
        if stem and (results / "records" / f"{stem}.jsonl").exists() and any(
                _STUDY_WORD.match(v.strip(".")) for v in words[max(0, i - 3):i + 4]):
            return True
    return False


def _braces(p: str) -> list[str]:
    """``timing_fs{2,4}`` -> timing_fs2, timing_fs4 (one level, as the docs write it)."""
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return [x for alt in m.group(1).split(",") for x in _braces(p[:m.start()] + alt + p[m.end():])]


def text_blocks(lines: list[str]) -> list[dict]:
    """Headings, paragraphs, list items, tables: {first, lines, kind, parents (indices of blocks it inherits from)}."""
    blocks: list[dict] = []
    headings: list[tuple[int, int]] = []  # (level, block) of the headings above
    items: list[tuple[int, int]] = []  # (indent, block) of the list items of the open list
    cur, after_blank, run_lead = None, True, None  # open block; a blank line before; the open list's introduction

    def intro() -> int | None:
        """The paragraph right before, if it ends in ':' (it introduces the list or table that follows)."""
        if blocks and blocks[-1]["kind"] == "para" and blocks[-1]["lines"][-1].rstrip().endswith(":"):
            return len(blocks) - 1
        return None

    def new(i: int, kind: str, parents: list[int]) -> int:
        blocks.append({"first": i, "kind": kind, "lines": [lines[i]],
                       "parents": [h for _, h in headings] + [p for p in parents if p is not None]})
        return len(blocks) - 1

    for i, ln in enumerate(lines):
        if not ln.strip():
            cur, after_blank = None, True
            continue
        indent = len(ln) - len(ln.lstrip())
        h, li, row = _HEADING.match(ln), _LIST.match(ln), ln.lstrip().startswith("|")
        if h:
            level = len(h.group(1))
            headings = [(lv, j) for lv, j in headings if lv < level]
            items, run_lead = [], None
            headings.append((level, new(i, "heading", [])))
            cur = None
        elif li:
            if not items:
                run_lead = intro()
            items = [(ind, j) for ind, j in items if ind < indent]
            cur = new(i, "item", [j for _, j in items] + [run_lead])
            items.append((indent, cur))
        elif row and cur is not None and blocks[cur]["kind"] == "table":
            blocks[cur]["lines"].append(ln)
        elif row:
            cur = new(i, "table", [j for ind, j in items if ind < indent] + [intro()])
        elif cur is not None and not after_blank and blocks[cur]["kind"] in ("para", "item"):
            blocks[cur]["lines"].append(ln)  # the paragraph or item goes on (a lazy continuation line)
        elif items and indent > 0:
            cur = new(i, "para", [j for ind, j in items if ind < indent] + [run_lead])  # an item's own paragraph
        else:
            items, run_lead = [], None  # an unindented paragraph ends the list
            cur = new(i, "para", [])
            if len(blocks) > 1 and blocks[-2]["kind"] == "table" and _CAPTION.match(ln):
                blocks[-2]["parents"].append(cur)  # "Records: ..." right after a table is its caption
        after_blank = False
    return blocks


def unsourced(text: str, root: Path = ROOT, here: Path | None = None) -> list[tuple[int, str]]:
    """(line number, line) of every figure that no record names and no mark covers (rules above).

    ``root``: the checkout whose docs/results/ holds the records; ``here``: the file's folder
    (relative record paths resolve against it too)."""
    here = root / "docs" if here is None else here
    body = FENCE.sub(blank_out, _TABLE.sub(blank_out, text))
    lines = _indented_code(body.split("\n"))
    blocks = text_blocks(lines)
    original = text.split("\n")
    memo: dict[int, bool] = {}

    def sourced(j: int) -> bool:
        if j not in memo:
            own = "\n".join(blocks[j]["lines"])
            memo[j] = bool(MARK.search(own)) or _names_record(own, root, here) or any(
                sourced(p) for p in blocks[j]["parents"])
        return memo[j]

    out = []
    for j, b in enumerate(blocks):
        prose = _INLINE.sub(blank_out, "\n".join(b["lines"]))  # inline code spans may cross a line break
        found = sorted({b["first"] + prose.count("\n", 0, m.start()) for m in figures(prose)})
        if found and not sourced(j):
            out += [(i + 1, original[i].strip()) for i in found]
    return out


def is_generated(p: Path) -> bool:
    """A markdown file rendered beside its own record (timing.md next to timing.jsonl)."""
    return any((p.parent / (p.stem + ext)).exists() for ext in (".json", ".jsonl"))


def markdown_files(root: Path = ROOT) -> list[Path]:
    docs = sorted((root / "docs").rglob("*.md"))
    return [p for p in [root / "README.md", *docs] if p.exists() and not is_generated(p)]


def scan(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """{relative path: unsourced figures} for README.md and docs/**/*.md (generated renderings skipped)."""
    found = {}
    for p in markdown_files(root):
        hits = unsourced(p.read_text(), root=root, here=p.parent)
        if hits:
            found[str(p.relative_to(root))] = hits
    return found
