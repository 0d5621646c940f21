"""dobb_bench.reports.best_row: a "best row" sentence must name its table's lowest row and its lr.

Each test plants a sentence beside a small hand-written table whose lowest row is known, so a
check that picks the wrong column, the wrong table or the wrong row fails here.
"""
from __future__ import annotations

from types import SimpleNamespace

from dobb_bench.reports import best_row as B

SEEDS = """<!-- table:t -->
| optimizer | lr | block widths | seeds | final val loss | gap closure | vs AdamW |
|---|---|---|---|---|---|---|
| AdamW | 0.00354 | — | 0,1,2 | 1.998 ± 0.215 | 0% | — |
| Muon | 0.00354 | — | 0,1,2 | 1.671 ± 0.045 | 100% | -0.327 (within noise) |
| Block Muon B=16 | 0.00354 | 8 / 32 | 0,1,2 | 1.813 ± 0.038 | 57% | -0.185 (within noise) |
| NorMuon-fp32 | 0.00354 | — | 0,1,2 | 1.643 ± 0.048 | 109% | -0.356 (within noise) |
| SOAP | 0.00354 | 128 / 512 | 0,1,2 | 1.599 ± 0.044 | 122% | -0.399 (within noise) |

Setting: 2 layers.
<!-- /table -->
"""

# lr grid: A is lowest at the shared lr (0.00354), B at its own best lr (0.01)
GRID = """<!-- table:g -->
| optimizer | lr 0.0025 | lr 0.00354 | lr 0.005 | lr 0.01 | best |
|---|---|---|---|---|---|
| A | 1.900 | **1.700** | 1.800 |  | 0.00354 |
| B | 1.950 | 1.750 | 1.690 | **1.600** | 0.01 |
<!-- /table -->
"""


def doc(*parts: str) -> str:
    return "# Page\n\n" + "\n".join(parts)


def problems(text: str) -> list[str]:
    return [p for _, _, p in B.check_text(text)]


def test_a_planted_contradiction_fails_and_the_lowest_row_passes():
    bad = doc("## Headline\n", SEEDS, "Three seeds. At the shared lr Muon (1.671 ± 0.045) is the best row.\n")
    hits = B.check_text(bad)
    assert len(hits) == 1 and "SOAP (1.599)" in hits[0][2] and hits[0][0] == bad.splitlines().index(
        "Three seeds. At the shared lr Muon (1.671 ± 0.045) is the best row.") + 1
    assert problems(doc("## Headline\n", SEEDS, "At the shared lr SOAP (1.599) is the best row.\n")) == []


def test_the_sentence_must_say_at_which_lr():
    hits = problems(doc("## H\n", SEEDS, "SOAP gives the lowest loss.\n"))
    assert hits == ["table 't': say at which lr (e.g. 'at the shared lr')"]
    assert problems(doc("## H\n", SEEDS, "SOAP gives the lowest loss at its own lr.\n")) == []


def test_claim_phrases_and_non_claims():
    for claim in ("SOAP is best (1.599) at this lr.", "At this lr, the best loss is SOAP's.",
                  "SOAP, the lowest row at this lr, leads.", "At this lr SOAP is best of all."):
        assert problems(doc("## H\n", SEEDS, claim + "\n")) == [], claim
        assert problems(doc("## H\n", SEEDS, claim.replace("SOAP", "Muon") + "\n")), claim
    # which lr each row prefers is not a ranking of rows
    assert problems(doc("## H\n", SEEDS, "AdamW and Muon are best at the shared lr.\n")) == []
    assert problems(doc("## H\n", SEEDS, "Muon is best above it, at 1e-2.\n")) == []


def test_a_longer_label_does_not_name_a_shorter_one_and_short_forms_do():
    table = SEEDS.replace("| SOAP | 0.00354 | 128 / 512 | 0,1,2 | 1.599 ± 0.044 | 122% | -0.399 (within noise) |\n", "")
    table = table.replace("| NorMuon-fp32 | 0.00354 | — | 0,1,2 | 1.643 ± 0.048 | 109% | -0.356 (within noise) |\n", "")
    # lowest is now Muon (1.671): "Block Muon B=16" contains "Muon" but is another row
    assert problems(doc("## H\n", table, "At the shared lr Block Muon B=16 is the best row.\n"))
    assert problems(doc("## H\n", table, "At the shared lr Muon is the best row.\n")) == []
    # NorMuon-fp32 lowest: "NorMuon" names it, "Muon" does not
    no_soap = SEEDS.replace("| SOAP | 0.00354 | 128 / 512 | 0,1,2 | 1.599 ± 0.044 | 122% | -0.399 (within noise) |\n", "")
    assert problems(doc("## H\n", no_soap, "At the shared lr NorMuon is the best row.\n")) == []
    assert problems(doc("## H\n", no_soap, "At the shared lr Muon is the best row.\n"))


def test_lr_grid_tables_use_the_shared_column_only_when_the_sentence_says_so():
    own = "At each row's own best lr B is the best row.\n"
    assert problems(doc("## G\n", GRID, own)) == []
    assert problems(doc("## G\n", GRID, own.replace("B is", "A is")))
    assert problems(doc("## G\n", GRID, "At the shared lr A is the best row.\n")) == []
    assert problems(doc("## G\n", GRID, "At the shared lr B is the best row.\n"))
    assert B.row_losses(GRID.split("\n", 1)[1]) == {"A": 1.7, "B": 1.6}
    assert B.row_losses(GRID.split("\n", 1)[1], shared_lr=True) == {"A": 1.7, "B": 1.75}


def test_loss_column_preference_and_ties():
    body = ("| optimizer | seeds (stuck) | final val loss: median | mean ± std |\n|---|---|---|---|\n"
            "| AdamW | 3 | 1.880 | 1.998 ± 0.215 |\n| Muon | 3 | 1.645 | 1.671 ± 0.045 |\n"
            "| Muon, DTensor layout | 3 | 1.645 | 1.671 ± 0.045 |\n| Dobb B=2 | 3 | 1.769 | 1.600 ± 0.033 |\n")
    assert B.row_losses(body) == {"AdamW": 1.88, "Muon": 1.645, "Muon, DTensor layout": 1.645, "Dobb B=2": 1.769}
    table = "<!-- table:op -->\n" + body + "<!-- /table -->\n"
    # the median column decides (Dobb B=2's mean is lower); either tied row may be named
    assert problems(doc("## O\n", table, "At the shared lr Muon is best (median 1.645).\n")) == []
    assert problems(doc("## O\n", table, "At the shared lr Dobb B=2 is best (mean 1.600).\n"))


def test_which_table_a_sentence_is_checked_against():
    other = GRID.replace("table:g", "table:g2")
    # the last table above in the section: the grid, where B (own best) is lowest, not SOAP
    assert problems(doc("## H\n", SEEDS, other, "At its own lr B is the best row.\n")) == []
    # no table above: the first below
    assert problems(doc("## H\n", "At the shared lr SOAP is the best row.\n", SEEDS, other)) == []
    assert problems(doc("## H\n", "At the shared lr Muon is the best row.\n", SEEDS))
    # another section (a subsection counts) has no table: nothing to check against
    assert problems(doc("## H\n", SEEDS, "### Sub\n", "At the shared lr Muon is the best row.\n")) == []
    # list items are sentences of their own
    text = doc("## H\n", SEEDS, "- At the shared lr SOAP is first\n- Muon is the best row at the shared lr.\n")
    assert [ln for ln, _, _ in B.check_text(text)] == [text.splitlines().index("- Muon is the best row at the shared lr.") + 1]


def test_tables_with_repeated_labels_or_no_loss_column_are_not_checked():
    pairs = ("<!-- table:p -->\n| row | against | row's loss |\n|---|---|---|\n| SOAP | Muon | 1.599 |\n"
             "| SOAP | Dobb | 1.599 |\n<!-- /table -->\n")
    assert problems(doc("## P\n", pairs, "At the shared lr Muon is the best row.\n")) == []
    costs = "<!-- table:c -->\n| optimizer | ms |\n|---|---|\n| Muon | 3.0 |\n| Dobb | 1.0 |\n<!-- /table -->\n"
    assert problems(doc("## C\n", costs, "At the shared lr Muon is the best row.\n")) == []


def test_the_docs_pass():
    assert B.scan() == {}


def test_report_check_fails_on_a_best_row_claim(monkeypatch, capsys):
    from dobb_bench.studies import docs_tables as D

    monkeypatch.setattr(D, "regenerate_docs", lambda write=True, used=None: {})
    monkeypatch.setattr(D, "scan", lambda: {})
    monkeypatch.setattr(D.claims_check, "scan", lambda: {})  # this test is about best_row's claims only
    monkeypatch.setattr(D.best_row, "scan", lambda: {"results.md": [(106, "Muon is the best row.", "table 'h': ...")]})
    args = SimpleNamespace(docs=None, plots=None, collect=None, check=True, strict_figures=False)
    assert D.cmd_report(args) == 1
    assert "best-row claim: docs/results.md:106" in capsys.readouterr().out
    monkeypatch.setattr(D.best_row, "scan", lambda: {})
    assert D.cmd_report(args) == 0
