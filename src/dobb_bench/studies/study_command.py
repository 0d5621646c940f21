"""`dobb-bench study list` and `dobb-bench study NAME show|run|status|collect`: the declared studies
(``dobb_bench.studies.catalog``), one declaration shown, run in parts under its rule, where it
stands, or its finished runs collected."""
from __future__ import annotations

from dobb_bench.errors import CliError
from dobb_bench.studies.catalog import STUDIES
from dobb_bench.studies import host_check, one_revision, past_horizon
from dobb_bench.studies.define import REPO, Driver, RunsFolder, Study, collect, grid_lr, plan_status, rule


def describe(study: Study) -> list[str]:
    """What a study declares, a line each: its setting and rule, then its rows."""
    s = study.setting
    lines = [f"{study.name}: {study.title + '; ' if study.title else ''}rule {study.rule}, seeds {list(study.seeds)}, "
             f"records {study.records}, {s.steps} steps, width {s.width or 128}, {s.layers} layers, context {s.context}, "
             f"eval every {s.eval_every}, products {s.product_dtype or 'by compare rule'}"
             + (f", {' '.join(s.extra)}" if s.extra else "") + f"; folders {s.kind}-*"]
    for r in study.rows:
        lrs = ", ".join(f"{grid_lr(j):.3g}" for j in study.first_lrs(r)) or "none here"
        if study.rule == "fixed":
            later = sorted({j for j, sd in study.planned(r) if sd != 0})
            seeds = f"; later seeds at {', '.join(f'{grid_lr(j):.3g}' for j in later) or 'none here'}"
        else:
            seeds = "; then the rule"
        extra = (f" [{r.runner}]" if r.runner != "compare" else "") + (f" (paper {r.paper})" if r.paper else "")
        ref = " (reference)" if r.label == study.reference else ""
        lines.append(f"  {r.label}: {r.spec}{extra}{ref}; seed 0 at {lrs}{seeds}")
    return lines


def _status(study: Study, runs: RunsFolder) -> None:
    if study.rule == "fixed":
        kind = study.setting.kind
        for r in study.rows:
            plan = study.planned(r)
            done = [(j, sd) for j, sd in plan if runs.loss(kind, r.label, j, sd) is not None]
            print(f"{r.label}: {len(done)} of {len(plan)} runs finished"
                  + "".join(f"; j{j} seed {sd}: {runs.loss(kind, r.label, j, sd):.4f}" for j, sd in done))
        return
    for s in plan_status(study, runs):
        lrs = ", ".join(f"j{j}: {v:.4f}" if v is not None else f"j{j}: —" for j, v in s["lrs"].items())
        where = ("not started" if s["best"] is None else f"best j{s['best']}"
                 + (f", next out j{s['edge']}" if s["edge"] is not None else ", bracketed"))
        chosen = "" if s["chosen"] is None else f"; chosen j{s['chosen']}, seeds {s['seeds']}"
        print(f"{s['row']}: {where}{chosen} ({lrs})")


def cmd_study(args) -> int:
    if args.name == "list":
        for name, st in STUDIES.items():
            print(f"{name}: {st.rule}, {len(st.rows)} rows, seeds {list(st.seeds)}, {st.setting.steps} steps, "
                  f"records {st.records}" + (f" ({st.title})" if st.title else ""))
        return 0
    if args.name not in STUDIES:
        raise CliError(f"no study {args.name!r}: one of {', '.join(STUDIES)} (or list)")
    study = STUDIES[args.name]
    if args.action in (None, "show"):
        print("\n".join(describe(study)))
        return 0
    if not args.runs:
        raise CliError(f"study {args.action} needs --runs: the runs folder, one --out per run")
    runs = RunsFolder.of(args.runs, args.repo)
    if args.action == "status":
        _status(study, runs)
        return 0
    if args.action == "collect":
        print(f"{len(collect(study, runs))} records added to {study.records}")
        # re-evaluations with their own record, by the records study the runs go to
        own = {"one-revision": (one_revision.collect_reevals, one_revision.REEVAL),
               "past-horizon": (past_horizon.collect_reevals, past_horizon.REEVAL),
               "host-check": (host_check.collect_reevals, host_check.REEVAL),
               "one-revision-amd": (one_revision.collect_reevals_amd, one_revision.AMD_REEVAL)}.get(study.records)
        if own is not None:
            print(f"{own[0](runs.root)} re-evaluations added to docs/results/{'/'.join(own[1][1:])}")
        return 0
    if not args.worktree:
        raise CliError("study run needs --worktree: a clean worktree of the revision to measure")
    Driver(runs, args.worktree, {study.setting.kind: study.setting}, args.reeval_worktree or args.worktree,
           args.workers, windows=study.windows).drive(rule(study))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("study", help="list the declared studies; show, run in parts, show where one stands, or collect it")
    p.add_argument("name", help=f"list, or one of {', '.join(STUDIES)}")
    p.add_argument("action", nargs="?", choices=("show", "run", "status", "collect"), help="default: show")
    p.add_argument("--runs", help="the runs folder: one --out per run (run, status, collect)")
    p.add_argument("--worktree", help="a clean worktree of the revision to measure (run)")
    p.add_argument("--reeval-worktree", help="a clean worktree holding scripts/reeval_windows.py (default --worktree)")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (run; default 2: two cores)")
    p.add_argument("--repo", default=REPO, help="the checkout whose docs hold the committed re-evaluation "
                   "record (default: this package's)")
    p.set_defaults(func=cmd_study)
