"""`dobb-bench study NAME run|status|collect`: a defined study (``dobb_bench.studies.define``) run
in parts under the bracket-and-seed rule, where it stands, or its finished runs collected."""
from __future__ import annotations

from dobb_bench.errors import CliError
from dobb_bench.studies.define import REPO, Driver, RunsFolder, collect, plan_status, rule
from dobb_bench.studies.long_horizon_runs import STUDIES


def cmd_study(args) -> int:
    studies = STUDIES
    if args.name not in studies:
        raise CliError(f"no study {args.name!r}: one of {', '.join(studies)}")
    study = studies[args.name]
    runs = RunsFolder.of(args.runs, args.repo)
    if args.action == "status":
        for s in plan_status(study, runs):
            lrs = ", ".join(f"j{j}: {v:.4f}" if v is not None else f"j{j}: —" for j, v in s["lrs"].items())
            where = ("not started" if s["best"] is None else f"best j{s['best']}"
                     + (f", next out j{s['edge']}" if s["edge"] is not None else ", bracketed"))
            chosen = "" if s["chosen"] is None else f"; chosen j{s['chosen']}, seeds {s['seeds']}"
            print(f"{s['row']}: {where}{chosen} ({lrs})")
        return 0
    if args.action == "collect":
        print(f"{len(collect(study, runs))} records added to {study.records}")
        return 0
    if not args.worktree:
        raise CliError("study run needs --worktree: a clean worktree of the revision to measure")
    Driver(runs, args.worktree, {study.setting.kind: study.setting}, args.reeval_worktree or args.worktree,
           args.workers, windows=study.windows).drive(rule(study))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("study", help="run a defined study in parts, show where it stands, or collect it")
    p.add_argument("name", help=f"one of {', '.join(STUDIES)}")
    p.add_argument("action", choices=("run", "status", "collect"))
    p.add_argument("--runs", required=True, help="the runs folder: one --out per run")
    p.add_argument("--worktree", help="a clean worktree of the revision to measure (run)")
    p.add_argument("--reeval-worktree", help="a clean worktree holding scripts/reeval_windows.py (default --worktree)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repo", default=REPO, help="the checkout whose docs hold the committed re-evaluation "
                   "record (default: this package's)")
    p.set_defaults(func=cmd_study)
