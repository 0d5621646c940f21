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
    shutil.copy(R.DOCS.parent / "README.md", tmp_path / "README.md")
    results = (R.DOCS / "results.md").read_text()
    assert "varies by 0.047" in results
    (tmp_path / "docs" / "results.md").write_text(results.replace("varies by 0.047", "varies by 0.048", 1))
    assert main(["report", "--check", "--docs", str(tmp_path / "docs")]) == 1
    out = capsys.readouterr().out
    assert "prose claim: docs/results.md:" in out and "quotes 0.048 for the spread of a 64-window eval" in out
    (tmp_path / "docs" / "results.md").write_text(results)
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


# ----- issue 55 item 7: the kinds the audit found ------------------------------------------------------
WIDE = """| row | communication under `Shard(0)` | lrs run: seed-0 loss, common windows | best lr | seeds at best: loss | mean ± std (n) | gap to Muon, paired by seed | bytes per step |
|---|---|---|---|---|---|---|---|
| Row-block Muon R=4 | none | 0.00354: 1.288, 0.005: 1.277, 0.00707: 1.287 | 0.005 | x | 1.279 ± 0.002 (3) | -0.005 (-0.009, -0.003, -0.001), within noise (t = -2.0) | 0 |
| Two-sided B=1 Bo=4 | periodic | 0.0025: 1.281, 0.00354: 1.278, 0.005: 1.280 | 0.00354 | x | 1.269 ± 0.010 (3) | -0.015 (-0.008, -0.026, -0.011), within noise (t = -2.6) | 0 |
| Dion2 1/4 per shard R=4 | none | 0.01: 1.368, 0.0141: 1.361, 0.02: 1.384 | 0.0141 | x | 1.369 ± 0.012 (3) | +0.086 (+0.075, +0.099, +0.084), beyond noise (t = 12.0; seeds 1+ alone t = 11.9) | 0 |
| DASH 32 | none | 0.0025: 1.328, 0.00354: 1.324, 0.005: 1.325 | 0.005 | x | 1.324 ± 0.003 (3) | +0.040 (+0.039, +0.036, +0.045), beyond noise (t = 14.2; seeds 1+ alone t = 8.3) | 0 |
| AdamW | none | 0.0025: 1.378, 0.00354: 1.379 | 0.0025 (edge) | x | 1.373 ± 0.005 (3) | +0.090 (+0.092, +0.084, +0.093), beyond noise (t = 32.7; seeds 1+ alone t = 20.3) | 0 |
| Muon | every step | 0.0025: 1.297, 0.00354: 1.286, 0.005: 1.288 | 0.00354 | x | 1.284 ± 0.003 (3) |  | 56.62 MB |
"""
WIDE_BEST = """| setting | row | lrs run: loss on the common windows (seed 0) | best lr | gap to Muon at its best lr [+- 2 SE] | other seeds at both best lrs: gap to Muon; mean over seeds |
|---|---|---|---|---|---|
| 8300 steps, width 128 | DASH 32 | 0.0025: 1.328, 0.00354: **1.324**, 0.005: 1.325 | 0.00354 | +0.038 [+0.034, +0.043] | seed 1: +0.042; mean +0.040 |
| 8300 steps, width 128 | Muon | 0.0025: 1.297, 0.00354: **1.286**, 0.005: 1.288 | 0.00354 |  | seed 1, seed 2 |
"""


def test_a_closeness_claim_scoped_to_rows_it_does_not_hold_for_fails():
    """(f): "within about 0.02 of Muon" said of the rows of a table where Dion2 is +0.086 (issue 55);
    the same words about the rows it holds for pass."""
    tables = {"frontier-20": WIDE}

    def bad(text):
        return [p for _, _, p in C.check_text(text, tables)]
    got = bad("At 20 tokens per parameter the matrix rows end within about 0.02 of Muon.")
    assert got == ["says every row end within 0.02 of Muon; table 'frontier-20' (mean over seeds) has "
                   "Dion2 1/4 per shard R=4 +0.086, DASH 32 +0.040"]  # AdamW is not a matrix row
    assert bad("At 20 tokens per parameter all rows end within 0.1 of Muon.") == []
    assert bad("At 20 tokens per parameter every row ends within 0.05 of Muon.")  # AdamW +0.090
    assert bad("At 20 tokens per parameter the top two rows end within 0.015 of Muon.") == []
    assert bad("At 20 tokens per parameter the first three rows end within 0.015 of Muon.")  # Dion2 is third
    assert bad("At 20 tokens per parameter row-block Muon and two-sided Dobb B=1 Bo=4 end within 0.015 of "
               "owner-compute Muon.") == []
    assert bad("At 20 tokens per parameter row-block Muon and DASH 32 end within 0.015 of Muon.")
    # seed 0 and "of each other"
    assert bad("At 20 tokens per parameter, seed 0, the top three rows end within 0.01 of Muon.") == []  # -0.009, -0.008, 0
    got = bad("At 20 tokens per parameter the matrix rows end within 0.015 nats of each other.")
    assert got and "Two-sided B=1 Bo=4 -0.015 and Dion2 1/4 per shard R=4 +0.086" in got[0]
    assert bad("At 20 tokens per parameter the top three rows end within 0.015 nats of each other.") == []


def test_an_unmarked_edge_and_two_best_lrs_for_one_row_fail():
    """(g) a best lr at an end of its lrs run without "(edge)" (DASH's 0.005 with none at 0.00707);
    (h) long-horizon-best and frontier-20 giving one row different best lrs (DASH 0.00354 / 0.005)."""
    got = C.table_problems({"frontier-20": WIDE, "long-horizon-best": WIDE_BEST})
    assert ("frontier-20", "DASH 32: best lr 0.005 is at an end of the lrs run (0.0025-0.005) and not marked (edge)") in got
    assert ("frontier-20", "DASH 32 (8300 steps, width 128): best lr 0.005 in table 'frontier-20', 0.00354 in table "
            "'long-horizon-best': one best lr per row across the tables") in got
    assert len(got) == 2  # AdamW's edge is marked; Muon's lr agrees; Row-block Muon is bracketed
    logged = """| row | lr 0.005 | lr 0.01 | best lr |
|---|---|---|---|
| Muon | 1.35 | **1.34** | 0.01 |
| SOAP | **1.33** | 1.36 | 0.005 (edge) |
"""
    assert C.table_problems({"long-horizon": logged}) == [
        ("long-horizon", "Muon: best lr 0.01 is at an end of the lrs run (0.005-0.01) and not marked (edge)")]


def _dt(run, lr, seed, dtype, algorithm="dobb"):
    return {"run": run, "lr": lr, "seed": seed, "steps": 8300, "model": {"width": 128},
            "hparams": {"product_dtype": f"torch.{dtype}"} if dtype else {},
            "optimizer_groups": [{"algorithm": "adamw", "product_dtype_resolved": "torch.float32"},
                                 {"algorithm": algorithm, "product_dtype_resolved": f"torch.{dtype}" if dtype else None}]}


def test_a_row_that_mixes_product_dtypes_fails():
    """(i) table:common-windows held Dobb-Muon's bf16 run beside its fp32 runs (issue 55)."""
    recs = [_dt("Dobb-Muon B=4 Bo=4", 0.005, 0, "bfloat16"), _dt("Dobb-Muon B=4 Bo=4", 0.005, 1, "float32"),
            _dt("Dobb-Muon B=4 Bo=4", 0.00354, 0, "float32"), _dt("Muon", 0.00354, 0, "float32", "muon")]
    got = C.mixed_dtypes("common-windows", recs)
    assert got == ["table 'common-windows': row Dobb-Muon B=4 Bo=4 (8300 steps, width 128) mixes product dtypes "
                   "(bfloat16: lr 0.005 seed 0; float32: lr 0.00354 seed 0, lr 0.005 seed 1)"]
    assert C.mixed_dtypes("x", recs[1:]) == []
    # "auto" resolved to fp32 on a host without native bf16: the resolved dtype decides, not the setting
    auto = _dt("Muon", 0.005, 1, None, "muon")
    auto["optimizer_groups"][1]["ns_dtype_resolved"] = "torch.float32"
    assert C.mixed_dtypes("x", [recs[3], auto]) == []


SYNTHETIC_DOC = """# Results

## The frontier

<!-- table:frontier-20 -->
{frontier}<!-- /table -->

At 20 tokens per parameter the matrix rows end within about 0.02 of Muon (`table:frontier-20`).

<!-- table:long-horizon-best -->
{best}<!-- /table -->
"""


def test_report_check_fails_on_each_kind_the_audit_found(tmp_path, monkeypatch, capsys):
    """A synthetic doc with a scoped closeness claim, an unmarked edge, two best lrs for one row; and
    a table generator that mixes dtypes: ``report --check`` fails on each and names it."""
    from dobb_bench.studies import docs_tables as D
    frontier = WIDE
    body = SYNTHETIC_DOC.format(frontier=frontier, best=WIDE_BEST)
    (tmp_path / "results.md").write_text(body)
    found = C.check_text(body, {"frontier-20": frontier, "long-horizon-best": WIDE_BEST})
    assert any("within 0.02 of Muon" in p for _, _, p in found)
    problems_ = C.table_problems(C.docs_tables(tmp_path))
    assert any("not marked (edge)" in p for _, p in problems_) and any("one best lr per row" in p for _, p in problems_)
    # report --check on that folder: the tables are rendered by stand-in generators that give the
    # synthetic tables back (so no table differs), one of them from mixed-dtype records
    mixed = [_dt("Dobb-Muon B=4 Bo=4", 0.005, 0, "bfloat16"), _dt("Dobb-Muon B=4 Bo=4", 0.005, 1, "float32")]
    monkeypatch.setattr(D, "TABLES", {"frontier-20": lambda: (frontier, mixed), "long-horizon-best": lambda: (WIDE_BEST, [])})
    monkeypatch.setattr(R, "DOCS", tmp_path)
    monkeypatch.setattr(R, "check_all", lambda: None)
    monkeypatch.setattr(D, "scan", lambda: {})
    monkeypatch.setattr(D.best_row, "scan", lambda: {})
    args = type("A", (), {"docs": None, "plots": None, "collect": None, "check": True, "strict_figures": True})()
    assert D.cmd_report(args) == 1
    out = capsys.readouterr().out
    assert "results.md:16: says every row end within 0.02 of Muon" in out  # the line after the table
    assert "results.md:5: DASH 32: best lr 0.005 is at an end of the lrs run" in out and "one best lr per row" in out  # at the marker
    assert "mixed-dtype row: table 'frontier-20': row Dobb-Muon B=4 Bo=4" in out
