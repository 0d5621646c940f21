"""Figures outside the regenerated tables: each must name its record or say it was not measured here.

Why (issue 23 item 7): ``dobb-bench report --check`` compares the marked tables with their
regeneration, but prose and hand-written tables quote measurements too. This scan covers README.md
and every markdown file under docs/. A *figure* is a number with a measurement unit (ms, s, nats,
%, x, GB/s, GFLOP/s, MB, tok/s). It counts as sourced when its paragraph or its section (the text
under the nearest heading) names a record: a path under ``docs/results/`` or a ``.json``/``.jsonl``
file, a ``record`` word next to a path, a regenerated table marker, or the words "not measured here".
The rule is deliberately coarse (section level): it finds figures with no source anywhere near
them, the failure a reader cannot repair, without flagging every number of a sourced section.
Marked tables and fenced code blocks are skipped (tables are checked against their records).
"""
from __future__ import annotations

import re
from pathlib import Path

from dobb_bench.reports.records import ROOT

FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms\b|s/step|s\b|nats?\b|%|x\b|×|GB/s|GFLOP/s|MB\b|tok/s)")
SOURCE = re.compile(r"docs/results/|results/[\w./-]+\.(?:jsonl?|md)|\.jsonl?\b|<!-- table:|records?/|"
                    r"[Rr]ecords?:|in the (?:run )?records|not measured here", re.S)
_TABLE = re.compile(r"<!-- table:[\w.-]+ -->\n.*?<!-- /table -->", re.S)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _blank(m: re.Match) -> str:
    """Same line count, no content: keeps line numbers right after a region is skipped."""
    return "\n" * m.group(0).count("\n")


def unsourced(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every figure whose paragraph and section name no record."""
    body = _FENCE.sub(_blank, _TABLE.sub(_blank, text))
    lines = body.split("\n")
    out = []
    # sections: from one heading to the next; paragraphs: blank-line separated blocks
    starts = [i for i, ln in enumerate(lines) if ln.startswith("#")] + [len(lines)]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    original = text.split("\n")
    for a, b in zip(starts, starts[1:]):
        section = "\n".join(original[a:b])  # the original text: a section may cite its record in code
        if SOURCE.search(section):
            continue
        for i in range(a, b):
            if FIGURE.search(lines[i]) and not lines[i].startswith("#"):
                out.append((i + 1, lines[i].strip()))
    return out


def markdown_files(root: Path = ROOT) -> list[Path]:
    docs = sorted((root / "docs").rglob("*.md"))
    return [p for p in [root / "README.md", *docs] if p.exists()]


def scan(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """{relative path: unsourced figures} for README.md and docs/**/*.md."""
    found = {}
    for p in markdown_files(root):
        if any(p.parent.glob("*.json*")):  # a record's own rendering (timing.md beside timing.jsonl)
            continue
        hits = unsourced(p.read_text())
        if hits:
            found[str(p.relative_to(root))] = hits
    return found
