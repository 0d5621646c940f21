"""dobb_bench.reports.figure_check: a figure outside the regenerated tables must name its record
or say it was not measured here; the scan flags only unsourced sections."""
from __future__ import annotations

import pytest

from dobb_bench.reports import figure_check as FC


def test_figure_scan_flags_only_unsourced_sections():
    text = "\n".join([
        "# A", "Dobb takes 12.5 ms per step and 3x AdamW.", "",
        "# B", "Dobb B=4 loses 0.1 nats (record: `docs/results/records/headline.jsonl`).", "",
        "# C", "On an Intel host it took 553 ms (not measured here).", "",
        "# D", "<!-- table:x -->", "| a | 9.9 ms |", "<!-- /table -->", "",
        "# E", "```", "42 ms in a code block", "```", "Three seeds, no units."])
    hits = FC.unsourced(text)
    assert [ln for ln, _ in hits] == [2]


@pytest.mark.parametrize("snippet,is_figure", [("1.45x AdamW", True), ("78%", True), ("0.3 nats", True),
                                               ("30 s", True), ("B=16", False), ("issue 23", False),
                                               ("3 seeds", False), ("GPT-2", False)])
def test_figure_pattern(snippet, is_figure):
    assert bool(FC.FIGURE.search(snippet)) is is_figure


# ----- the six defects of the first version (issue 23 item 7); each of these failed on it --------
REC = "docs/results/records/headline.jsonl"  # a committed record of this checkout


def test_marks_across_line_breaks_and_issue_figures():
    text = "\n".join([
        "On an Intel host it took 553 ms (not measured", "here).", "",
        "The paper's B=1 closes 67% (issue 23's", "figure, not a record of ours).", "",
        "Its refresh took 808.6 ms (not a record", "of ours).", "",
        "Dobb takes 12.5 ms (measured, somewhere)."])
    assert [ln for ln, _ in FC.unsourced(text)] == [10]


def test_indented_code_is_skipped_but_list_text_is_not():
    text = "\n".join([
        "Run it:", "", "    dobb-bench timing --rep 30 s --budget 12 ms", "    echo 3x", "",
        "- an item", "", "    its own paragraph says 40 ms", "",
        "Back to prose."])
    assert [ln for ln, _ in FC.unsourced(text)] == [8]


def test_what_counts_as_a_figure():
    figures = ["1.45x AdamW", "0.13x", "2.05× AdamW", "78%", "0.3 nats", "30 s", "12 min", "9 degrees",
               "8 bytes", "49.5 MiB", "24.8 MB", "2 GB", "1.81 ms/step", "553\nms"]
    not_figures = ["4 x 768", "3 x heads", "192x64", "768×3072", "torch 2.13.0", "figure_check.py:42",
                   "revision 67562ed", "B=16", "GPT-2", "lr 3e-3", "2026-12-01", "issue 23", "3 seeds",
                   "eigh 2 s^3"]
    assert [f for f in figures if not FC.FIGURE.search(f)] == []
    assert [f for f in not_figures if FC.FIGURE.search(f)] == []
    # a test tolerance is a bound, not a measurement
    assert FC.unsourced("The test allows a 5% tolerance, atol 0.01 nats.") == []


def _tree(root, files):
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)


def test_hand_written_files_in_record_folders_are_checked(tmp_path):
    _tree(tmp_path, {
        "README.md": "No figures.\n",
        "docs/results/checks/numerics_abc.jsonl": "{}\n",
        "docs/results/checks/numerics.md": "# Numerics\n\nThe loop took 1.81 ms/step.\n",
        "docs/results/peers/timing_fs4/timing.jsonl": "{}\n",
        "docs/results/peers/timing_fs4/timing.md": "| dobb | 26.2 ms |\n",  # rendered beside its record
        "docs/results/peers/README.md": "Dobb was 30.3x faster (`timing_fs4/timing.jsonl`).\n"})
    found = FC.scan(tmp_path)
    assert found == {"docs/results/checks/numerics.md": [(3, "The loop took 1.81 ms/step.")]}


def test_a_citation_covers_its_block_and_the_headings_below_it():
    text = "\n".join([
        "# A", f"The loss comes from `{REC}`.", "", "Dobb takes 12 ms.", "",  # another paragraph: line 4
        "# B", "Written to out.json.", "", "Muon takes 3 ms.", "",  # any '.json': line 9
        "# C", "See docs/results/records/no-such-study.jsonl: 5 ms.", "",  # a record that does not exist
        f"## D (records: {REC})", "### D.1", "Dobb B=1 ends 1.7 nats.", "",  # inherited from ## D
        "#### D.1.1", "- B=4: 0.1 nats", "  - B=16: 0.2 nats", "",
        "# E", "From study `headline`:", "", "- Dobb 1.73 nats", "- Muon 1.64 nats", "",  # a list's lead-in
        "| a | b |", "|---|---|", "| x | 4 ms |", "",  # a table with no lead-in
        "The headline word alone gives 2 ms.", "",
        "| y | 5 ms |", "", f"Records: `{REC}`."])  # a caption after a table
    assert [ln for ln, _ in FC.unsourced(text)] == [4, 9, 12, 30, 32]
