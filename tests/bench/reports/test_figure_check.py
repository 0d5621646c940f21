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
