"""Every docs table by name, and ``dobb-bench report``, which rewrites them from committed records.

A table in ``docs/*.md`` sits between ``<!-- table:NAME -->`` and ``<!-- /table -->``; ``TABLES``
maps each NAME to its generator in the study that owns it (``main_job``, ``operating_point``,
``family_dash``, ``family_soap``, ``two_sided``, ``refresh_width``; the projection's in
``dobb_bench.cost.projection``). ``report`` checks every record and renders every
table before it writes a byte, and ``--docs DIR`` points it at another docs folder.
``tests/bench/test_docs_tables.py`` fails when a docs table differs from its regeneration or rests
on a record from a dirty tree. To add a study's table: a generator ``() -> (markdown, records)``
in its study module's ``TABLES``, the module in ``_STUDIES`` below, the markers in the docs.
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from dobb_bench.cost import projection, projection_targets
from dobb_bench.cost.payload import relative_payload
from dobb_bench.reports import best_row
from dobb_bench.reports import claims as claims_check
from dobb_bench.reports import records as R
from dobb_bench.reports.figure_check import scan
from dobb_bench.reports.report import pyplot, typed_hparams
from dobb_bench.reports.tables import group_by, final_loss, stats
from dobb_bench.studies import (family_dash, family_soap, frontier, host_check, long_horizon, main_job, one_revision,
                                operating_point, past_horizon, refresh_width, shard_local, two_sided)

_STUDIES = (main_job, operating_point, family_dash, family_soap, two_sided, refresh_width, shard_local, long_horizon,
            frontier, one_revision, past_horizon, host_check, projection, projection_targets)
TABLES = {}
for _module in _STUDIES:
    _clash = set(TABLES) & set(_module.TABLES)
    if _clash:
        raise ValueError(f"docs table(s) {sorted(_clash)} declared twice ({_module.__name__})")
    TABLES.update(_module.TABLES)


# ----- docs tables ---------------------------------------------------------------------------------
def render(name: str) -> tuple[str, list[dict]]:
    fn = TABLES.get(name)
    if fn is None:
        raise ValueError(f"docs table {name!r} has no generator in dobb_bench.studies.docs_tables.TABLES")
    text, used = fn()
    return text.rstrip("\n") + "\n", used


def regenerate_text(text: str, where: str = "") -> tuple[str, list[tuple[str, list[dict]]]]:
    """``text`` with every marked table rewritten; also each table's name and records used."""
    used_by = []

    def sub(m):
        try:
            body, used = render(m.group(2))
        except (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as exc:
            raise ValueError(f"{where or 'docs'}: table {m.group(2)!r} cannot be generated from its records "
                             f"({type(exc).__name__}: {exc}); nothing was written") from None
        used_by.append((m.group(2), used))
        return m.group(1) + body + m.group(4)

    return R.TABLE.sub(sub, text), used_by


def regenerate_docs(docs: Path | None = None, write: bool = True,
                    used: dict[str, list[dict]] | None = None) -> dict[str, list[str]]:
    """Rewrites the marked tables of ``docs/*.md``; returns {file: [table names that changed]}.
    ``used``, when given, is filled with {table name: the records its generator used}.

    All or nothing: every record is checked and every table rendered first; only then are the
    changed files written (a bad record anywhere leaves every file as it was).
    """
    docs = Path(R.DOCS if docs is None else docs)
    R.check_all()
    changed, pending = {}, []
    for md in sorted(docs.glob("*.md")):
        text = md.read_text()
        new, used_by = regenerate_text(text, str(md))
        if used is not None:
            used.update(used_by)
        if new != text:
            old_bodies = {m.group(2): m.group(3) for m in R.TABLE.finditer(text)}
            new_bodies = {m.group(2): m.group(3) for m in R.TABLE.finditer(new)}
            changed[md.name] = [k for k in new_bodies if old_bodies.get(k) != new_bodies[k]]
            pending.append((md, new))
    if write:
        for md, new in pending:
            md.write_text(new)
    return changed


# ----- plots from records ---------------------------------------------------------------------------
LAYOUTS = (("output", "FSDP: output axis (rows) sharded over 4 ranks"),
           ("input", "input axis (columns) sharded over 4 ranks, B a multiple of 4"))


def plot_study(study: str, out_dir=None) -> list[str]:
    """Mean validation curves and loss vs payload (one panel per layout) for a study's records."""
    recs = main_job.headline()[1] if study == "headline" else [] if study == "operating-point" else R.load(study)
    out_dir = R.RECORDS.parent if out_dir is None else out_dir
    if study == "block-width":
        return [main_job.plot_block_width(recs, out_dir)]
    if study == "operating-point":
        return [operating_point.plot(out_dir)]
    plt = pyplot()
    by = group_by(recs, lambda r: r["run"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in by.items():
        steps = sorted({p[0] for r in runs for p in r["curve"]})
        mean = [statistics.fmean([v for r in runs for s2, v in r["curve"] if s2 == s and v is not None] or [math.nan])
                for s in steps]
        ax.plot(steps, mean, marker=".", label=f"{label} ({len(runs)} seed(s))")
    ax.set_ylim(None, 3.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss, mean over seeds (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    curves = out_dir / f"{study}_val_loss.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, (sharded, title) in zip(axes, LAYOUTS):
        for label, runs in by.items():
            r0 = runs[0]
            d = r0["model"]["width"]
            shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * r0["model"]["layers"]
            x = relative_payload(r0["optimizer"], typed_hparams(r0.get("hparams", {})), shapes, sharded=sharded, shards=4)
            m, sd, n = stats([final_loss(r) for r in runs])
            ax.errorbar([x], [m], yerr=[sd or 0], fmt="o", capsize=3)
            ax.annotate(label, (x, m), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer-specific cross-shard payload / Muon's")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss, mean ± std over seeds")
    fig.tight_layout()
    payload = out_dir / f"{study}_payload_vs_loss.png"
    fig.savefig(payload, dpi=110)
    plt.close(fig)
    return [str(curves), str(payload)]


# ----- the `report` subcommand --------------------------------------------------------------------
def cmd_report(args) -> int:
    if args.docs:  # another docs folder: its *.md and results/records (the default edits this checkout)
        R.use_docs(args.docs)
    if args.plots:
        for study in args.plots.split(","):
            print("report: wrote " + ", ".join(plot_study(study)))
        return 0
    if args.collect:
        new = R.collect(args.collect, args.study, runs=args.runs.split(",") if args.runs else None)
        print(f"report: {len(new)} record(s) from {args.collect} -> {R.RECORDS / (args.study + '.jsonl')}")
        return 0
    used: dict[str, list[dict]] = {}
    changed = regenerate_docs(write=not args.check, used=used)
    for name, tabs in changed.items():
        print(f"{'differs' if args.check else 'rewrote'}: docs/{name}: {', '.join(tabs)}")
    if args.check:  # figures outside the marked tables (README.md, docs/**/*.md): listed
        figures = scan()
        for path, hits in figures.items():
            for line, text in hits:
                print(f"unsourced figure: {path}:{line}: {text[:100]}")
        if figures:
            print(f"report: {sum(map(len, figures.values()))} figure(s) name no record and are not marked "
                  "'not measured here'" + ("" if args.strict_figures else " (listed; --strict-figures fails on them)"))
        claims = best_row.scan()  # "best row" sentences against their table
        for name, hits in claims.items():
            for line, sentence, problem in hits:
                print(f"best-row claim: docs/{name}:{line}: {problem}: {sentence[:100]}")
        if claims:
            print(f"report: {sum(map(len, claims.values()))} 'best row' claim(s) disagree with their table "
                  "(rule: dobb_bench.reports.best_row)")
        said = claims_check.scan()  # prose figures, "bracketed", seed counts, "ends lowest" against the tables
        for path, hits in said.items():
            for line, sentence, problem in hits:
                print(f"prose claim: {path}:{line}: {problem}: {sentence[:100]}")
        if said:
            print(f"report: {sum(map(len, said.values()))} prose claim(s) contradict their tables or records "
                  "(rule: dobb_bench.reports.claims)")
        mixed = [p for name, recs in used.items() for p in claims_check.mixed_dtypes(name, recs)]
        for problem in mixed:  # a row whose runs ran their products in different dtypes
            print(f"mixed-dtype row: {problem}")
        if mixed:
            print(f"report: {len(mixed)} table row(s) mix product dtypes (rule: dobb_bench.reports.claims.mixed_dtypes)")
        if changed or claims or said or mixed or (figures and args.strict_figures):
            return 1
    if not changed:
        print("report: every docs table matches its records")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("report", help="regenerate the docs tables from docs/results/records")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a table differs, a 'best row' "
                   "sentence does not name its table's lowest row, or a prose claim contradicts its table "
                   "(dobb_bench.reports.claims); also list figures in README.md and "
                   "docs/**/*.md that name no record")
    p.add_argument("--strict-figures", action="store_true", help="with --check: exit 1 on unsourced figures too")
    p.add_argument("--collect", metavar="RUN_DIR", help="add a compare/sweep output folder's runs to the records")
    p.add_argument("--study", help="records file to collect into (docs/results/records/STUDY.jsonl)")
    p.add_argument("--runs", metavar="LABEL[,LABEL]", help="with --collect: only the runs with these labels")
    p.add_argument("--plots", metavar="STUDY[,STUDY]", help="write curves and payload plots to docs/results/")
    p.add_argument("--docs", metavar="DIR", help="the docs folder to read records from and write tables to "
                   "(its *.md and results/records; default: this repository's docs/)")
    p.set_defaults(func=lambda a: (_need_study(a), cmd_report(a))[1])


def _need_study(args):
    if args.collect and not args.study:
        print("dobb-bench report: error: --collect needs --study NAME", file=sys.stderr)
        raise SystemExit(2)
