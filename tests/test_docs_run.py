"""The docs run as written: every ```python block of README.md and docs/*.md runs on its own, in a
fresh interpreter, in an empty folder; no relative link is broken; no machine path is cited; the
paper is named by title and authors where each file first mentions it.

A block that cannot run alone (it shows a method of a class the reader writes, or needs
``torchrun``) is marked on the line above its fence with ``<!-- fragment: <why> -->``; it must then
still parse, and the reason must be given.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FRAGMENT = re.compile(r"<!--\s*fragment:\s*(.*?)\s*-->\s*$")
PAPER_TITLE = "Dobb: Shard-Local Preconditioning in Block-Diagonal Eigenbases"
PAPER_AUTHORS = "Fong, Yu and Zhang"


def _blocks() -> list[tuple[str, int, str, str | None]]:
    """``(file, line, code, fragment reason or None)`` of every python block."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            frag = FRAGMENT.search(before)
            out.append((str(path.relative_to(ROOT)), line, m.group(1), frag.group(1) if frag else None))
    return out


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if b[3] is None]
FRAGMENTS = [b for b in BLOCKS if b[3] is not None]


def test_every_doc_has_its_blocks_found():
    # the collector itself: the README's quickstart and the integration examples are found
    files = {b[0] for b in BLOCKS}
    assert "README.md" in files and "docs/integrations.md" in files
    assert len(RUNNABLE) >= 8


@pytest.mark.parametrize("doc,line,code,why", FRAGMENTS, ids=[f"{b[0]}:{b[1]}" for b in FRAGMENTS])
def test_fragments_say_why_and_parse(doc, line, code, why):
    assert len(why) >= 10, f"{doc}:{line}: a fragment must say why it cannot run alone"
    ast.parse(code, filename=f"{doc}:{line}")


@pytest.mark.slow
@pytest.mark.parametrize("doc,line,code,why", RUNNABLE, ids=[f"{b[0]}:{b[1]}" for b in RUNNABLE])
def test_python_block_runs_alone(doc, line, code, why, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{doc}:{line} failed:\n{proc.stderr[-3000:]}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    heading = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#+\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _links(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        yield m.group(1)


LINKED = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_slug_rule():
    assert _slug("Mixture of experts (3-D expert stacks)") == "mixture-of-experts-3-d-expert-stacks"
    assert _slug("`dobb-bench compare`: the main job") == "dobb-bench-compare-the-main-job"


@pytest.mark.parametrize("path", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_no_broken_relative_link(path):
    broken = []
    for target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


MACHINE_PATHS = re.compile(r"(/work/|/root/|/home/\w|\.\./shared/)")


READ = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the pages (records keep their commands)


@pytest.mark.parametrize("path", READ, ids=[str(p.relative_to(ROOT)) for p in READ])
def test_no_machine_path(path):
    hits = [f"{i}: {line.strip()[:100]}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if MACHINE_PATHS.search(line)]
    assert not hits, f"{path.relative_to(ROOT)} cites paths of one machine: {hits}"


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "docs" / "algorithm.md", ROOT / "docs" / "results.md",
                          ROOT / "docs" / "baselines.md"],
                         ids=["README.md", "docs/algorithm.md", "docs/results.md", "docs/baselines.md"])
def test_paper_named_where_first_mentioned(path):
    text = " ".join(path.read_text().split())  # prose wraps: compare with single spaces
    first = re.search(r"\bpaper\b", text, re.I)
    assert first, f"{path.name} never mentions the paper"
    window = text[max(0, first.start() - 400): first.start() + 400]
    assert PAPER_TITLE in window and PAPER_AUTHORS in window, (
        f"{path.name}: the paper's first mention must give its title and authors")
