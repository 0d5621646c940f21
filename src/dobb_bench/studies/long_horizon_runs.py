"""The long-horizon grids as ``define.Study`` definitions, and the orders the grid was run in.

Two settings: 8,300 steps (about 20 tokens per parameter, folders ``lh-*``) and width 256 at
3,200 steps (``w256-*``); ``dobb_bench.studies.long_horizon`` makes their tables. Three row lists:

- ``LH``: the issue's 20-tokens rows, each starting at its 800-step best grid index;
- ``W256``: five of them at width 256;
- ``FR``: table:frontier-20's rows never run at 20 tokens (issue 39) and the new Dobb forms, their
  800-step grid index where the shard-local study found each best, started ``SHIFT`` grid steps
  lower (the 20-tokens best lrs sat one to three grid steps below the 800-step ones).

``MODES`` are what ``scripts/long_horizon.py WORKTREE RUNS_DIR MODE`` runs: ``frontier`` is the
bracket-and-seed rule of ``define`` over FR; ``bracket`` and ``close`` are the orders the LH and
W256 grids were run in (kept so a restarted driver picks what it picked before), written on the
same ``best_j``/``edge``; ``seed1``, ``noise-first``, ``lh`` and ``w256`` are the first, static lists.
"""
from __future__ import annotations

import concurrent.futures as cf

from dobb_bench.studies.define import Driver, Row, RunsFolder, Setting, Study, best_j, edge, stages

LH = (
    Row("AdamW", "adamw", -1),
    Row("Muon", "muon", 2),
    Row("SOAP", "soap", 2),
    Row("MuonBP R=4 P=5", "muonbp:blocks=4:period=5", 3),
    Row("Row-block Muon R=4", "block-muon:axis=0:blocks=4", 2),
    Row("Dobb B=1", "dobb:blocks=1", 0),
    Row("Two-sided B=1 Bo=1", "dobb:side=both", 0),
    Row("Two-sided B=1 Bo=4", "dobb:side=both:blocks=1:out_blocks=4", 0),
)
# Products are fp32 on every FR row (ns_dtype=float32): the earlier long-horizon rows ran on a host
# whose "auto" meant fp32.
# In the order the rule serves them (each stage row by row): first the rows that could answer the
# question (level with Muon at 800 steps or never run here), then the cheap rows behind it at seed 0.
FR = (
    # issue 40's Dobb form on the 800-step frontier (best 0.01, j2); fp32 products like every row
    Row("Dobb-Muon B=4 Bo=4", "dobb-muon:blocks=4:out_blocks=4", 2),
    # the second form the 800-step screen sent here (next best by loss at a step no dearer than
    # two-sided B=1 Bo=4's): per-head row blocks, one per head of the bench model (4)
    Row("Dobb-Muon B=4 Bo=4 heads", "dobb-muon:blocks=4:out_blocks=4:heads=4", 2),
    Row("MuonBP R=4 P=10", "muonbp:blocks=4:period=10:ns_dtype=float32", 6),
    # as its authors run it: b2=0.95, and its AdamW part at lr/8. Its 800-step best in this setup
    # is 0.16 (j10, bracketed in table:shard-local); centred at j6 (0.04), where its first run here
    # started (from the earlier setup's 0.08), and the rule moves out from there
    Row("SPlus Bo=4 authors", "splus:out_blocks=4:b2=0.95:adamw_lr_ratio=0.125", 10, centre=6),
    Row("Dobb B=4", "dobb:blocks=4", -1),
    Row("Two-sided B=4 Bo=4", "dobb:side=both:blocks=4:out_blocks=4", -1),
    Row("DASH 32", "dash:block_size=32", 1),
    Row("Dion2 1/4 per shard R=4", "dion2:select=shard:blocks=4:ns_dtype=float32", 4),
)
SHIFT = 2
# Issue 55's reruns at one revision and one host kind: owner-compute Muon (the reference of every
# gap), Dobb-Muon with Muon's Nesterov momentum (the library's default since issue 55; the bench
# pins plain momentum unless a spec sets it, so it is set here) and SOAP-Muon (the field's record
# holder, never run at 20 tokens), five seeds each, each bracketed from its earlier best (Muon
# 0.00354, Dobb-Muon 0.005; SOAP-Muon from SOAP's 0.005). Their own records study, apart from the
# runs of earlier revisions and hosts.
ONE_REV = (
    Row("Muon", "muon", -1),
    Row("Dobb-Muon B=4 Bo=4 Nesterov", "dobb-muon:blocks=4:out_blocks=4:nesterov=true", 0),
    Row("SOAP-Muon", "soap-muon", 0),
    # the README's first pick under FSDP2 (sends nothing), bracketed from its table:frontier-20 best 0.005
    Row("Row-block Muon R=4", "block-muon:axis=0:blocks=4", 0),
)
# Issue 55's runs past the horizon: twice the 20-tokens steps (16,600, its schedule stretched over
# them), seed 0, each row at its chosen 20-tokens lr (Muon and Dobb-Muon from table:one-revision,
# the Muon-family rows from table:frontier-20), norms at every eval: does row-block Muon's faster
# norm growth keep going, and does it reach the loss? The longest runs first, two at a time.
PAST = (
    Row("Dobb-Muon B=4 Bo=4 Nesterov", "dobb-muon:blocks=4:out_blocks=4:nesterov=true", -1, lrs=(-1,)),
    Row("Muon", "muon", -1, lrs=(-1,)),
    Row("MuonBP R=4 P=10", "muonbp:blocks=4:period=10:ns_dtype=float32", 0, lrs=(0,)),
    Row("Row-block Muon R=4", "block-muon:axis=0:blocks=4", 0, lrs=(0,)),
)
# Issue 55's host check: the one-revision runs (57db80f, an Intel Xeon host with AMX) repeated at the
# same revision on another host kind, seeds 0-2 of Muon and SOAP-Muon at their chosen lrs: the
# numerics digest differs between the two hosts (fp32 BLAS kernels round differently), so how far
# does a host move a 20-tokens loss, against the seed spread, and may a row run on one host be paired
# with a reference run on the other?
HOST = (
    Row("Muon", "muon", -1, lrs=(-1,)),
    Row("SOAP-Muon", "soap-muon", -1, lrs=(-1,)),
)
# Issue 55's one revision on a second host kind: table:frontier-20's FR rows ran every run at
# a94277a on AMD EPYC hosts with AVX512-BF16, where a94277a computes 57db80f's numbers bit for bit
# (numerics digest, and a 40-step run of every row's command: scripts/same_numbers.py). Those runs
# count at one revision; these are the runs the rule still needs there, made at 57db80f on that host
# kind: the bracket runs whose only run was at a revision not shown equal (DASH 0.00354) or never made
# (DASH 0.00707, Dobb B=4 0.005), and the seed-2 runs of the Dobb-Muon rows' close neighbour
# (0.00354). Dion2's 0.01 (1658d62) is not needed: its runs at 0.00707 and 0.02 bracket its 0.0141.
COUNTED_REVS = ("a94277a", "57db80f")
COUNTED_HOST = "AMD EPYC (avx512_bf16)"
ONE_REV_AMD = (
    Row("DASH 32", "dash:block_size=32", 0, lrs=(-1, 1), seeded=()),
    # 0.005's seed-0 run (j0) beat 0.00354 by less than the window noise: 0.00707 brackets it, and
    # study one-revision-amd-seed1 makes 0.005's seed 1
    Row("Dobb B=4", "dobb:blocks=4", 0, lrs=(0, 1), seeded=()),
    Row("Dobb-Muon B=4 Bo=4", "dobb-muon:blocks=4:out_blocks=4", -1, lrs=(), seeded=(-1,)),
    Row("Dobb-Muon B=4 Bo=4 heads", "dobb-muon:blocks=4:out_blocks=4:heads=4", -1, lrs=(), seeded=(-1,)),
)
# The seeds 3 and 4 that table:one-revision asks of a row within 0.01 of Muon, on the AMD host kind:
# Muon (the reference there, seeds 0-2 in study host-check), MuonBP P=10, SPlus and Dobb-Muon at their
# settled lrs (Dobb-Muon's moved to 0.00354 with its seed-2 run there; the per-head form's stayed)
ONE_REV_AMD_SEEDS = (
    Row("Muon", "muon", -1, lrs=(), seeded=(-1,)),
    Row("MuonBP R=4 P=10", "muonbp:blocks=4:period=10:ns_dtype=float32", 0, lrs=(), seeded=(0,)),
    Row("Dobb-Muon B=4 Bo=4", "dobb-muon:blocks=4:out_blocks=4", -1, lrs=(), seeded=(-1,)),
    Row("SPlus Bo=4 authors", "splus:out_blocks=4:b2=0.95:adamw_lr_ratio=0.125", 10, lrs=(), seeded=(10,)),
    # its lr stayed 0.005 (j0 here) when its seed-2 run at 0.00354 lost
    Row("Dobb-Muon B=4 Bo=4 heads", "dobb-muon:blocks=4:out_blocks=4:heads=4", 0, lrs=(), seeded=(0,)),
)
# Issue 55 item 5's second Dobb form at 20 tokens: the 800-step screen's lowest row of one seed set
# (`all3` in study dobb-muon-screen: Nesterov, an fp32 basis, the basis refreshed every third step with
# the statistic's memory kept at 0.9 per 9 steps), bracketed from Nesterov Dobb-Muon's 20-tokens lr
# (0.00354, j-1 here) and run to five seeds on the AMD host kind, where Muon has five
# the seed-1 runs the close-neighbour rule asks for on the AMD host kind
ONE_REV_AMD_SEED1 = (
    Row("Dobb B=4", "dobb:blocks=4", 0, lrs=(), seeded=(0,)),
)
AMD_FORMS = (
    Row("Dobb-Muon B=4 Bo=4 Nesterov fp32 basis refresh 3",
        "dobb-muon:blocks=4:out_blocks=4:nesterov=true:basis_dtype=float32:refresh_every=3:stat_decay=0.965", -1),
)
W256 = tuple(r for r in LH if r.label in ("AdamW", "Muon", "Row-block Muon R=4", "Dobb B=1", "Two-sided B=1 Bo=4"))

TWENTY_TOKENS = Setting("lh", steps=8300, eval_every=250)
WIDTH_256 = Setting("w256", steps=3200, eval_every=200, width=256)
ONE_REVISION = Setting("rev", steps=8300, eval_every=250)
PAST_HORIZON = Setting("ph", steps=16600, eval_every=250)
HOST_CHECK = Setting("hk", steps=8300, eval_every=250)
ONE_REVISION_AMD = Setting("ra", steps=8300, eval_every=250)
SETTINGS = {s.kind: s for s in (TWENTY_TOKENS, WIDTH_256, ONE_REVISION, PAST_HORIZON, HOST_CHECK, ONE_REVISION_AMD)}

STUDIES = {
    "long-horizon": Study("long-horizon", TWENTY_TOKENS, LH),
    "width-256": Study("width-256", WIDTH_256, W256),
    # span 8: MuonBP P=10's best moved from its 800-step centre (j6) down to j0, and its bracket
    # below needs j-1, which the default span of 6 would not see (the driver ran it, then read it
    # as missing)
    "frontier-20": Study("frontier-20", TWENTY_TOKENS, FR, shift=SHIFT, span=8),
    "one-revision": Study("one-revision", ONE_REVISION, ONE_REV, seeds=(0, 1, 2, 3, 4), records="one-revision"),
    "past-horizon": Study("past-horizon", PAST_HORIZON, PAST, seeds=(0,), rule="fixed", records="past-horizon",
                          title="twice the 20-tokens horizon, seed 0", reference="Muon"),
    "host-check": Study("host-check", HOST_CHECK, HOST, seeds=(0, 1, 2), rule="fixed", records="host-check",
                        title="one-revision's runs on another host kind", reference="Muon", running=True),
    "one-revision-amd": Study("one-revision-amd", ONE_REVISION_AMD, ONE_REV_AMD, seeds=(0, 2), rule="fixed",
                              records="one-revision-amd", title="the rule's missing runs of the rows run at a94277a",
                              running=True),
    "one-revision-amd-seeds": Study("one-revision-amd-seeds", ONE_REVISION_AMD, ONE_REV_AMD_SEEDS, seeds=(3, 4),
                                    rule="fixed", records="one-revision-amd", running=True,
                                    title="seeds 3 and 4 of the rows within 0.01 of Muon, on the a94277a host kind"),
    "one-revision-amd-seed1": Study("one-revision-amd-seed1", ONE_REVISION_AMD, ONE_REV_AMD_SEED1, seeds=(1,),
                                    rule="fixed", records="one-revision-amd", running=True,
                                    title="the rule's seed-1 runs of the rows run at a94277a"),
    "one-revision-amd-forms": Study("one-revision-amd-forms", ONE_REVISION_AMD, AMD_FORMS, seeds=(0, 1, 2, 3, 4),
                                    records="one-revision-amd", running=True,
                                    title="the screen's second Dobb-Muon form at 20 tokens, on the a94277a host kind"),
}


# ----------------------------------------------------------------------------- the orders run before
def first_tasks():
    """Each row at its 800-step best; then neighbours below, above (seed 0)."""
    yield from (("lh", r, r.j, 0) for r in LH)
    yield from (("w256", r, r.j, 0) for r in W256)
    yield from (("lh", r, r.j - 1, 0) for r in LH)
    yield from (("lh", r, r.j + 1, 0) for r in LH)
    yield from (("w256", r, r.j - 1, 0) for r in W256)
    yield from (("w256", r, r.j + 1, 0) for r in W256)


def seed1(runs: RunsFolder):
    """Seed 1 at each row's best finished seed-0 lr (logged losses)."""
    for kind, rows in (("lh", LH), ("w256", W256)):
        for r in rows:
            done = [(runs.loss(kind, r.label, j, 0), j) for j in range(r.j - 3, r.j + 4)]
            done = [(v, j) for v, j in done if v is not None]
            if done:
                yield kind, r, min(done)[1], 1


def _turns(d: Driver, a, b, strict: bool):
    """The first pending of ``a`` and of ``b``, taking turns between the two settings."""
    a, b = d.pending(a), d.pending(b)
    lh, w = d.started.get("lh", 0), d.started.get("w256", 0)
    return a if b is None or (a is not None and (lh < w if strict else lh <= w)) else b


def next_bracket(d: Driver):
    """`bracket`: the issue's 20-tokens grid first; then the 20-tokens outward steps and the width-256
    grid, taking turns (rows whose best lr keeps moving would otherwise starve the width-256 grid);
    then the width-256 outward steps and second seeds."""
    R = d.runs
    grid = (("lh", r, j, 0) for r in LH for j in (r.j - 1, r.j, r.j + 1))
    # AdamW last: it is far behind every matrix row, so its bracket decides no ordering
    lh_out = [("lh", r, edge(R, "lh", r), 0) for r in LH[1:] + LH[:1] if edge(R, "lh", r) is not None]
    # width 256: the lower neighbours, then outward steps, then the higher neighbours
    w_out = [("w256", r, edge(R, "w256", r), 0) for r in W256[1:] + W256[:1] if edge(R, "w256", r) is not None]
    w_grid = [("w256", r, r.j - 1, 0) for r in W256] + w_out + [("w256", r, r.j + 1, 0) for r in W256]
    seeds = [("w256", r, best_j(R, "w256", r)[1], 1) for r in W256 if best_j(R, "w256", r) is not None]
    pick = d.pending(grid)
    if pick is None:
        pick = _turns(d, lh_out, w_grid, strict=True)
    return d.take(pick or d.pending(w_out) or d.pending(seeds))


def leads(R: RunsFolder, seeds=(0, 1), margin=-0.01):
    """Muon and the 20-tokens rows that lead it at every one of ``seeds`` (each row at its seed-0 best
    lr, paired on the common windows) by ``margin`` on average: the leads a third seed should test.
    Empty until every such run has been re-evaluated."""
    muon = next(r for r in LH if r.label == "Muon")
    mj = (best_j(R, "lh", muon) or (None, None))[1]
    ref = [R.common("lh", "Muon", mj, sd) for sd in seeds]
    if mj is None or None in ref:
        return []
    out = []
    for r in LH:
        got = best_j(R, "lh", r)
        if r is muon or got is None or edge(R, "lh", r) is not None:
            continue
        mine = [R.common("lh", r.label, got[1], sd) for sd in seeds]
        if None not in mine:
            gaps = [a - b for a, b in zip(mine, ref)]
            if max(gaps) < 0 and sum(gaps) / len(gaps) <= margin:
                out.append((r, got[1]))
    return [(muon, mj)] + out if out else []


def next_close(d: Driver):
    """`close`: taking turns between the two settings, the third width-256 lr of each row that has
    fewer than three and a second 20-tokens seed at each bracketed row's best lr; then a third seed
    for Muon and each row that leads it at both seeds (``leads``); then the outward steps of the
    matrix rows at either setting; then the second seeds of the rows bracketed by then; AdamW's
    outward steps last (its bracket decides no ordering)."""
    R = d.runs

    def n_lrs(kind, r):
        got = best_j(R, kind, r)
        return 0 if got is None else len(got[0])

    def seed_at_best(kind, rows, bracketed):
        out = []
        for r in rows:
            got = best_j(R, kind, r)
            if got is not None and (edge(R, kind, r) is None) == bracketed:
                out.append((kind, r, got[1], 1))
        return out

    w_third = [("w256", r, edge(R, "w256", r), 0) for r in W256
               if n_lrs("w256", r) < 3 and edge(R, "w256", r) is not None]
    lh_seed = seed_at_best("lh", LH, True)
    lh_out = [("lh", r, edge(R, "lh", r), 0) for r in LH[1:] if edge(R, "lh", r) is not None]
    w_out = [("w256", r, edge(R, "w256", r), 0) for r in W256 if r.label != "AdamW" and edge(R, "w256", r) is not None]
    adamw = [(k, r, edge(R, k, r), 0) for k, rows in (("lh", LH), ("w256", W256)) for r in rows
             if r.label == "AdamW" and edge(R, k, r) is not None]
    late = (seed_at_best("lh", LH, False) + seed_at_best("w256", W256, True) + adamw
            + seed_at_best("w256", W256, False))
    third = [("lh", r, j, 2) for r, j in leads(R)]
    pick = None
    for a, b in ((lh_seed, w_third), (third, []), (lh_out, w_out)):
        pick = _turns(d, a, b, strict=False)
        if pick is not None:
            break
    return d.take(pick or d.pending(late))


# the earlier rows with two seeds get a third at their bracketed best lr (their runs are in
# another runs folder, so the lr is named here; table:long-horizon-best gives it)
LH_SEED2 = (("Row-block Muon R=4", 0), ("MuonBP R=4 P=5", 0), ("Dobb B=1", -1), ("AdamW", -2))


def fp32(row: Row) -> Row:
    """The row with fp32 Newton-Schulz products, as its earlier runs had on a host without native
    bf16 (there "auto" meant fp32; on a host with AVX512-BF16 it means bf16)."""
    if row.spec.split(":")[0] in ("muon", "muonbp", "block-muon") and "ns_dtype" not in row.spec:
        return row._replace(spec=row.spec + ":ns_dtype=float32")
    return row


# The order the frontier grid is served in, after every row's centre lr: whole groups of rows, each
# through the bracket-and-seed rule, so the rows that decide the answer finish first; "third" is the
# third seeds of the earlier two-seed rows (LH_SEED2).
# the second Dobb form (issue 40) before the edges of MuonBP P=10 and SPlus: its three seeds decide
# an issue, theirs add rows
FRONTIER_ORDER = (("Dobb-Muon B=4 Bo=4",), "third", ("Dobb-Muon B=4 Bo=4 heads",),
                  ("MuonBP R=4 P=10", "SPlus Bo=4 authors"), None)  # None: the rows not named before


def next_frontier(d: Driver):
    """`frontier`: every FR row's centre lr, then FRONTIER_ORDER's groups, each through the
    bracket-and-seed rule (``define.stages``), the third seeds of ``LH_SEED2`` as one group."""
    st = STUDIES["frontier-20"]
    third = [("lh", fp32(r), j, 2) for label, j in LH_SEED2 for r in LH if r.label == label]
    named = {x for g in FRONTIER_ORDER if isinstance(g, tuple) for x in g}
    order = [stages(st, d.runs)[0]]
    for g in FRONTIER_ORDER:
        if g == "third":
            order.append(third)
        else:
            rows = [r for r in FR if (r.label in g if g else r.label not in named)]
            order += stages(st, d.runs, rows)
    return d.take(d.first(order))


PICKS = {"bracket": next_bracket, "close": next_close, "frontier": next_frontier}


def static(d: Driver, only: str | None) -> list:
    """The static lists of the first runs: ``seed1``, ``noise-first``, ``lh``, ``w256`` or all."""
    if only == "seed1":
        return list(seed1(d.runs))
    if only == "noise-first":
        return [("w256", r, r.j, 0) for r in W256] + [t for t in seed1(d.runs) if t[0] == "lh"] + list(first_tasks())
    return [t for t in first_tasks() if only is None or t[0] == only]


def main(worktree: str, runs: str, mode: str | None, repo: str, reeval_worktree: str | None = None,
         workers: int = 2) -> int:
    """``scripts/long_horizon.py``: ``mode`` one of ``PICKS`` (pulled one run at a time, each
    re-evaluated when done) or of the static lists."""
    d = Driver(RunsFolder.of(runs, repo), worktree, SETTINGS, reeval_worktree or worktree, workers)
    if mode in PICKS:
        d.drive(PICKS[mode])
        return 0
    with cf.ThreadPoolExecutor(workers) as ex:
        list(ex.map(d.run, static(d, mode)))
    print("DRIVER_DONE", flush=True)
    return 0

