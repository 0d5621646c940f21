"""dobb_bench.reports.claims: prose claims against the tables they rest on (issue 39 item 6).

Each test plants a sentence beside small hand-written tables shaped like the long-run tables
(``long-horizon``, ``width-256``, ``long-horizon-best``, ``common-windows``), whose edges, seeds and
order are known, so a claim that contradicts them must be reported and one that agrees must not.
"""
from __future__ import annotations

import shutil

from dobb_bench.cli import main
from dobb_bench.reports import claims as C
from dobb_bench.reports import records as R

LOGGED = """| row | lr 0.005 | lr 0.01 | best lr | rank | other seeds at best |
|---|---|---|---|---|---|
| Muon | 1.35 | **1.34** | 0.01 (edge) | 2 | seed 1: 1.24 |
| SOAP | **1.33** | 1.36 | 0.005 | 1 | seed 1: 1.22, seed 2: 1.20 |
| Two-sided B=1 Bo=4 | **1.32** | 1.34 | 0.005 | 3 |  |
"""
WIDTH = """| row | lr 0.0025 | lr 0.005 | best lr | other seeds at best |
|---|---|---|---|---|
| Muon | 1.34 | **1.33** | 0.005 (edge) |  |
| Dobb B=1 | **1.36** | 1.37 | 0.0025 | seed 1: 1.26 |
"""
BEST = """| setting | row | lrs run | best lr | gap to Muon at its best lr [+- 2 SE] | other seeds at both best lrs: gap to Muon; mean over seeds |
|---|---|---|---|---|---|
| 8300 steps, width 128 | Muon | x | 0.00354 |  | seed 1, seed 2 |
| 8300 steps, width 128 | SOAP | x | 0.005 | -0.014 [-0.016, -0.011] | seed 1: -0.016, seed 2: -0.026; mean -0.019 over 3 seeds |
| 8300 steps, width 128 | Two-sided B=1 Bo=1 | x | 0.005 | -0.014 [-0.018, -0.011] | seed 1: -0.014, seed 2: -0.007; mean -0.012 over 3 seeds |
| 8300 steps, width 128 | Two-sided B=1 Bo=4 | x | 0.00354 | -0.008 [-0.011, -0.005] | seed 1: -0.026, seed 2: -0.011; mean -0.015 over 3 seeds |
| 3200 steps, width 256 | AdamW | x | 0.00177 (edge) | +0.138 [+0.134, +0.143] | — |
| 3200 steps, width 256 | Muon | x | 0.005 |  | seed 1 |
| 3200 steps, width 256 | Dobb B=1 | x | 0.0025 | +0.024 [+0.021, +0.027] | seed 1: +0.023; mean +0.023 |
"""
COMMON = """| setting | row | lr | seeds | mean loss | gap to Muon per seed | mean gap |
|---|---|---|---|---|---|---|
| 8300 steps, width 128 | SOAP | 0.005 | 0, 1, 2 | 1.265 | -0.014 (seed 0), -0.016 (seed 1), -0.026 (seed 2) | -0.019 |

A 64-window eval of one checkpoint varies by 0.047 nats (median over the checkpoints).
"""
TABLES = {"long-horizon": LOGGED, "width-256": WIDTH, "long-horizon-best": BEST, "common-windows": COMMON}


def problems(text: str) -> list[str]:
    return [p for _, _, p in C.check_text(text, TABLES)]


def test_the_tables_are_read_as_rows():
    rows = {(r["setting"], r["label"]): r for r in C.table_rows(BEST)}
    assert rows[("8300 steps, width 128", "Muon")]["seeds"] == 3 and rows[("8300 steps, width 128", "Muon")]["mean"] == 0
    soap = rows[("8300 steps, width 128", "SOAP")]
    assert (soap["seeds"], soap["seed0"], soap["mean"], soap["edge"]) == (3, -0.014, -0.019, False)
    assert rows[("3200 steps, width 256", "AdamW")]["edge"] and rows[("3200 steps, width 256", "AdamW")]["seeds"] == 1
    logged = {r["label"]: r for r in C.table_rows(LOGGED)}
    assert logged["Muon"]["edge"] and logged["Muon"]["seeds"] == 2 and logged["SOAP"]["seeds"] == 3
    assert logged["SOAP"]["mean"] is None  # no gap column: not used to order rows


def test_a_figure_that_differs_from_its_table_fails():
    assert problems("A 64-window eval alone varies by 0.047 nats.") == []
    got = problems("A 64-window eval, which every loss above uses, varies by 0.048 nats.")
    assert got == ["quotes 0.048 for the spread of a 64-window eval (table common-windows), which gives 0.047"]
    # 0.026 - 0.014 = 0.012: agrees
    assert problems("Against Muon a gap to Muon at one Muon lr moves by up to 0.012 between seeds.") == []
    assert problems("Here a seed moves a gap by up to 0.018.")[0].startswith("quotes 0.018 for how far a seed")


def test_bracketed_beside_an_edge_fails():
    got = problems("At 20 tokens per parameter every row is bracketed.")
    assert got == ["calls every row bracketed; table 'long-horizon' marks Muon (edge)"]
    assert problems("At 20 tokens per parameter, on the common windows, every row is bracketed.") == []
    assert problems("At 20 tokens per parameter SOAP is bracketed.") == []
    assert problems("At 20 tokens per parameter Muon is bracketed.") == [
        "calls Muon bracketed; table 'long-horizon' marks Muon (edge)"]
    # a cited table decides alone, and the setting of an enclosing list item is inherited
    assert problems("Muon is bracketed (`table:long-horizon-best`).") == []
    assert problems("- **20 tokens per parameter.** Rows:\n  - Muon is bracketed.\n") == [
        "calls Muon bracketed; table 'long-horizon' marks Muon (edge)"]
    assert problems("Muon is bracketed.") == []  # no setting named: not checked
    assert problems("At width 256 the best lr (bracketed: a worse lr on each side) is used.") == []  # a definition


def test_a_seed_count_the_tables_do_not_give_fails():
    assert problems("At 20 tokens per parameter SOAP ran three seeds.") == []
    assert problems("At 20 tokens per parameter SOAP ran two seeds.") == [
        "says 'two seeds'; the tables give SOAP (3) seeds"]
    # "; one seed, ..." after a list of rows is about the setting's rows
    got = problems("At width 256 every gap shrank: AdamW +0.138, Dobb B=1 +0.024; one seed, and AdamW best at its lowest lr.")
    assert got and got[0].startswith("says 'one seed'; the tables give more seeds for Dobb B=1")
    assert problems("At width 256 AdamW (one seed) +0.138 and Dobb B=1 +0.024.") == []  # the clause's subject
    assert problems("At width 256 Dobb B=1 (one seed) +0.024.") == ["says 'one seed'; the tables give Dobb B=1 (2) seeds"]
    assert problems("Not measured here: any second seed at width 256.") != []
    assert problems("At width 256 the block-width study ran one seed at 800 steps.") == []  # another setting


def test_an_ordering_the_table_does_not_give_fails():
    got = problems("At 20 tokens per parameter SOAP and two-sided Dobb B=1 Bo=1 end lowest, over three seeds.")
    assert got == ["says SOAP, Two-sided B=1 Bo=1 end lowest; table 'long-horizon-best' (mean over seeds) has "
                   "SOAP -0.019, Two-sided B=1 Bo=4 -0.015 lowest"]
    assert problems("At 20 tokens per parameter SOAP ends lowest, 0.019 below Muon over three seeds.") == []
    # at seed 0 the two lead together
    assert problems("At 20 tokens per parameter, seed 0: two-sided Dobb B=1 Bo=1 -0.014 and SOAP -0.014, the lowest.") == []
    assert problems("At 20 tokens per parameter two-sided B=1 Bo=4 ends lowest of them.") == []  # "of them": not checked
    assert problems("At 20 tokens per parameter Muon has the lowest loss.") == []  # best_row's kind, not this one


def test_the_committed_docs_agree_with_their_tables():
    assert C.scan() == {}


def test_report_check_fails_on_a_contradicted_claim(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(R, "DOCS", R.DOCS)  # report --docs moves them; restored after the test
    monkeypatch.setattr(R, "RECORDS", R.RECORDS)
    shutil.copytree(R.DOCS, tmp_path / "docs")
    readme = (R.DOCS.parent / "README.md").read_text()
    assert "varies by 0.047" in readme
    (tmp_path / "README.md").write_text(readme.replace("varies by 0.047", "varies by 0.048"))
    assert main(["report", "--check", "--docs", str(tmp_path / "docs")]) == 1
    out = capsys.readouterr().out
    assert "prose claim: README.md:" in out and "quotes 0.048 for the spread of a 64-window eval" in out
    (tmp_path / "README.md").write_text(readme)
    assert main(["report", "--check", "--docs", str(tmp_path / "docs")]) == 0


FRONTIER = """| row | communication under `Shard(0)` | lrs run: seed-0 loss, common windows | best lr | seeds at best: loss | mean ± std (n) | gap to Muon, paired by seed | bytes per step |
|---|---|---|---|---|---|---|---|
| Dobb B=4 | periodic | 0.00177: 1.344 | 0.00177 (edge) | 1.344 (s0) | 1.344 (1) | +0.058 (+0.058), 1 seed: no verdict | 1.38 MB |
| Row-block Muon R=4 | none | x | 0.005 | 1.277 (s0), 1.281 (s1), 1.280 (s2) | 1.279 ± 0.003 (3) | -0.006 (-0.009, -0.003, -0.005), within noise (t = -2.0) | 0 |
| Muon | every step | x | 0.00354 | 1.286 (s0), 1.284 (s1), 1.281 (s2) | 1.284 ± 0.003 (3) |  | 56.62 MB |
"""


def test_frontier_20_claims_are_checked_against_its_table():
    """table:frontier-20 (issue 39): its seed counts, edges and gaps are read, so a sentence at 20
    tokens per parameter that contradicts it fails, and one that agrees does not."""
    rows = {r["label"]: r for r in C.table_rows(FRONTIER)}
    assert (rows["Dobb B=4"]["seeds"], rows["Dobb B=4"]["edge"], rows["Dobb B=4"]["seed0"]) == (1, True, 0.058)
    rb = rows["Row-block Muon R=4"]
    assert (rb["seeds"], rb["edge"], rb["mean"], rb["seed0"]) == (3, False, -0.006, -0.009)
    assert rows["Muon"]["mean"] == 0.0
    tables = {"frontier-20": FRONTIER}

    def bad(text):
        return [p for _, _, p in C.check_text(text, tables)]
    assert bad("At 20 tokens per parameter Dobb B=4 is bracketed.")
    assert bad("At 20 tokens per parameter Dobb B=4 has three seeds.")
    assert bad("At 20 tokens per parameter Dobb B=4 ends lowest.")
    assert not bad("At 20 tokens per parameter Row-block Muon R=4 ends lowest over three seeds.")
    assert not bad("At 20 tokens per parameter Row-block Muon R=4 is bracketed, with three seeds.")


def test_a_gap_to_muon_that_differs_from_its_table_fails():
    """(e): "X below / above / behind [Muon]" after a row's name must be that row's gap in the table
    (mean over seeds or seed 0); two stale figures of this kind stood in the docs (AdamW "0.088
    behind" against +0.090, found by hand)."""
    tables = {"frontier-20": FRONTIER}

    def bad(text):
        return [p for _, _, p in C.check_text(text, tables)]
    # row-block Muon: mean -0.006, seed 0 -0.009
    assert not bad("At 20 tokens per parameter row-block Muon ends 0.006 below Muon.")
    assert not bad("At 20 tokens per parameter row-block Muon (`x`, sending nothing) 0.009 below it at seed 0.")
    got = bad("At 20 tokens per parameter row-block Muon ends 0.005 below Muon.")
    assert got == ["quotes '0.005 below Muon' for Row-block Muon R=4; the tables give -0.006 (frontier-20), "
                   "-0.009 (frontier-20)"]
    assert bad("At 20 tokens per parameter row-block Muon ends 0.006 above Muon.")  # the sign
    assert bad("At 20 tokens per parameter Dobb B=4 (0.060 behind, one seed) is off the frontier.")
    assert not bad("At 20 tokens per parameter Dobb B=4 (0.058 behind) is off the frontier.")
    # against another row or run, or with another row's short form in between: not checked
    assert not bad("At 20 tokens per parameter row-block Muon ends 0.070 below Dobb B=4.")
    assert not bad("At 20 tokens per parameter row-block Muon ended 0.003 above the fp32 run.")
    assert not bad("At 20 tokens per parameter Dobb B=4 (0.058 behind) and R=4 (0.006 below) follow.")
    assert not bad("Row-block Muon R=4 ends 0.001 below Muon.")  # no setting named: no table
