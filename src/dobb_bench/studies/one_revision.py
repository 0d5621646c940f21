"""The 20-tokens rows rerun at one revision on one host kind (study ``one-revision``,
``table:one-revision``).

Why a table of its own: ``table:frontier-20`` pairs runs made at revisions up to 215 commits apart
on hosts with and without native bf16 (issue 55); a rerun of one of its seeds at a later revision
moved a loss by as much as the gaps it calls. Here every run of a row and of the reference (owner-
compute Muon) comes from one revision and one host kind, both named under the table with the
numerics digest of that revision (``scripts/numerics_digest.py``): a later revision whose digest
entry for an optimizer is bitwise equal computes the same numbers, so these runs stand for it.

The protocol is ``table:frontier-20``'s: the lr of each row chosen by the one rule
(``lr_rule.choose``) on the 2,048 common windows; its gap to Muon paired by seed, with the verdict
of ``frontier.verdict`` (over every seed, then over the seeds that did not choose the lr); the top
singular value of the hidden matrices from the same runs, every seed. Rows whose rule is still
waiting on runs say which.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from dobb_bench.reports import records as R
from dobb_bench.studies.frontier import ROWS as FRONTIER_ROWS, norm_stats, one_run, verdict
from dobb_bench.studies.long_horizon import AMD_REEVAL
from dobb_bench.studies.shard_local import OWNER
from dobb_bench.studies.long_horizon_runs import (AMD_FORMS, COUNTED_HOST, COUNTED_REVS, FR, HOST_CHECK, ONE_REV, ONE_REVISION,
                                                  ONE_REVISION_AMD, STUDIES, TWENTY_TOKENS)
from dobb_bench.studies.lr_rule import bf16, choose

STUDY = "one-revision"
REF = "Muon"
# the re-evaluations of this study's runs on the common windows, apart from reeval.jsonl (which
# table:frontier-20 reads whole: its Muon row must not take these runs)
REEVAL = ("results", "checks", "reeval-windows", "one-revision.jsonl")
# the re-evaluations of study host-check's runs (Muon's runs on the second host kind: the reference of
# its rows) and of study one-revision-amd's (the rule's runs left there)
HK_REEVAL = ("results", "checks", "reeval-windows", "host-check.jsonl")
DIGEST = ("results", "checks", "numerics-digest")
# the spec each row's FSDP2 step was timed as in the one timing run (table:frontier-20's): Muon is
# owner-computed under FSDP2
TIMED_AS = {"muon": OWNER, "block-muon:axis=0:blocks=4": "block-muon:axis=0:blocks=4:ns_dtype=float32"}


def lr_key(x: float) -> float:
    """An lr as the tables key it (four significant digits)."""
    return float(f"{x:.4g}")


def jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file, none where it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reeval_records() -> list[dict]:
    return jsonl(Path(R.DOCS).joinpath(*REEVAL))


def append_reevals(runs_root: str, kind: str, rel: tuple[str, ...]) -> int:
    """Appends the re-evaluations of the finished runs ``{kind}-*`` under ``runs_root`` (its
    ``reeval-scratch.jsonl``, where the driver writes them) to the committed record ``docs/{rel}``,
    each run once; returns how many."""
    path = Path(R.DOCS).joinpath(*rel)
    key = lambda r: (r["run_dir"], r["checkpoint_step"])  # noqa: E731
    have = {key(json.loads(line)) for line in (path.read_text().splitlines() if path.exists() else []) if line.strip()}
    scratch = Path(runs_root) / "reeval-scratch.jsonl"
    lines = scratch.read_text().splitlines() if scratch.exists() else []
    new = [line for line in lines if line.strip() and str(json.loads(line).get("run_dir", "")).startswith(f"{kind}-")
           and key(json.loads(line)) not in have]
    for line in new:
        have.add(key(json.loads(line)))
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("".join(line + "\n" for line in new))
    return len(new)


def collect_reevals(runs_root: str) -> int:
    """Appends the re-evaluations of this study's finished runs to the committed record."""
    return append_reevals(runs_root, ONE_REVISION.kind, REEVAL)


def collect_reevals_amd(runs_root: str) -> int:
    """Appends the re-evaluations of study one-revision-amd's finished runs to their committed record."""
    return append_reevals(runs_root, ONE_REVISION_AMD.kind, AMD_REEVAL)


def host_kind(rec: dict) -> str:
    """A record's host kind as the tables name it: the CPU and its native bf16 flags."""
    m = (rec.get("provenance") or {}).get("machine") or {}
    return m.get("cpu", "?") + (f" ({', '.join(m['bf16_flags'])})" if m.get("bf16_flags") else "")


def _at(recs: list[dict], kind: str, steps: int) -> list[dict]:
    """The fp32-product re-evaluations of ``steps``-step runs in folders ``{kind}-*``."""
    return [r for r in recs if str(r.get("run_dir", "")).startswith(f"{kind}-") and r["steps"] == steps
            and not bf16(r)]


def _nest(recs: list[dict]) -> dict[str, dict[float, dict[int, dict]]]:
    out: dict = {}
    for r in recs:
        out.setdefault(r["run"], {}).setdefault(lr_key(r["lr"]), {})[r["seed"]] = r
    return out


def counted() -> dict[str, dict[float, dict[int, dict]]]:
    """``{row: {lr: {seed: reeval record}}}`` of table:frontier-20's FR rows on the second host kind:
    their runs at a revision whose numbers equal 57db80f's there (``COUNTED_REVS``, folders ``lh-*``)
    and study one-revision-amd's runs (folders ``ra-*``), on ``COUNTED_HOST`` only."""
    labels = {r.label for r in FR}
    fr = [r for r in _at(R.reeval_records(), TWENTY_TOKENS.kind, TWENTY_TOKENS.steps)
          if r["model"].get("width") == 128 and r["run"] in labels]
    amd = _at(jsonl(Path(R.DOCS).joinpath(*AMD_REEVAL)), ONE_REVISION_AMD.kind, ONE_REVISION_AMD.steps)
    keep = [r for r in fr + amd if str((r.get("provenance") or {}).get("git_rev", ""))[:7] in COUNTED_REVS
            and host_kind(r) == COUNTED_HOST]
    return _nest(keep)


def amd_reference() -> dict[float, dict[int, dict]]:
    """Muon's runs on the second host kind (study host-check, seeds 0-2; one-revision-amd-seeds, 3-4),
    ``{lr: {seed: reeval record}}``."""
    recs = (_at(jsonl(Path(R.DOCS).joinpath(*HK_REEVAL)), HOST_CHECK.kind, HOST_CHECK.steps)
            + _at(jsonl(Path(R.DOCS).joinpath(*AMD_REEVAL)), ONE_REVISION_AMD.kind, ONE_REVISION_AMD.steps))
    return _nest([r for r in recs if host_kind(r) == COUNTED_HOST]).get(REF, {})


def _records() -> list[dict]:
    path = Path(R.RECORDS) / f"{STUDY}.jsonl"
    return R.load(STUDY) if path.exists() else []


def _common() -> dict[str, dict[float, dict[int, dict]]]:
    """``{row: {lr: {seed: reeval record}}}`` of this study's runs (run folders ``rev-*``)."""
    return _nest(_at(reeval_records(), ONE_REVISION.kind, ONE_REVISION.steps))


def where(recs: list[dict]) -> tuple[list[str], list[str]]:
    """The revisions (short) and host CPUs the records ran at."""
    prov = [r.get("provenance") or {} for r in recs]
    revs = sorted({p.get("git_rev", "")[:7] for p in prov if p.get("git_rev")})
    return revs, sorted({host_kind(r) for r in recs})


def _row(row, by_lr: dict, ref: dict, ref_settled: bool, runs: dict, timed) -> tuple[str, list[dict]]:
    """One row of the table from its runs ``by_lr`` (``{lr: {seed: reeval}}``), its gap paired by seed
    with the reference runs ``ref`` (``{seed: reeval}``), its norms from the training records ``runs``."""
    choice = choose(by_lr)
    if choice.lr is None:
        return f"| {row.label} | `{row.spec}` | not run yet | | | | | | | |", []
    grid = ", ".join(f"{x:.3g}: {s[0]['common_val_loss']:.3f}" for x, s in sorted(by_lr.items()) if 0 in s)
    at = by_lr[choice.lr]
    used = [s[0] for s in by_lr.values() if 0 in s] + list(at.values())
    losses = {sd: at[sd]["common_val_loss"] for sd in sorted(at)}
    vals = list(losses.values())
    sd_txt = f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else ""
    per_seed = ", ".join(f"{v:.3f} (s{sd})" for sd, v in losses.items())
    gap = ""
    if row.label != REF:
        gaps = {sd: losses[sd] - ref[sd]["common_val_loss"] for sd in losses if sd in ref}
        if gaps:
            mean, text = verdict(gaps)
            gap = f"{mean:+.3f} ({', '.join(f'{g:+.3f}' for g in gaps.values())}), {text}"
            if not ref_settled or not choice.settled:
                gap += "; provisional: an lr not settled"
        else:
            gap = "—"
    recs = [runs[(row.label, choice.lr, sd)] for sd in at if (row.label, choice.lr, sd) in runs]
    used += recs
    key = TIMED_AS.get(row.spec, dict(FRONTIER_ROWS).get(row.label, row.spec))  # as table:frontier-20 times it
    step = "—" if timed is None or key not in timed["ratios"] else (
        "1.00" if key == OWNER else "{:.2f} [{:.2f}, {:.2f}]".format(timed["ratios"][key], *timed["ranges"][key]))
    ns = norm_stats(recs)
    norms = " | — | —" if ns is None else f" | {ns[0]:.2f} | {ns[1]:.2f}x ({ns[2]:.2f}x)"
    return (f"| {row.label} | `{row.spec}` | {grid} | {choice.cell()} | {per_seed} | "
            f"{statistics.fmean(vals):.3f}{sd_txt} ({len(vals)}) | {gap} | {step}{norms} |"), used


def _training_records(study: str) -> list[dict]:
    path = Path(R.RECORDS) / f"{study}.jsonl"
    return R.load(study) if path.exists() else []


def one_revision() -> tuple[str, list[dict]]:
    common = _common()
    runs = {(r["run"], lr_key(r["lr"]), r["seed"]): r for r in _records()}
    ref_choice = choose(common.get(REF, {}))
    ref = common.get(REF, {}).get(ref_choice.lr, {})
    lines = ["| row | spec | lrs run: seed-0 loss, common windows | best lr | seeds at best: loss | mean ± std (n) | "
             "gap to Muon, paired by seed | FSDP2 step / owner-compute Muon [min, max] | largest top singular value, end | "
             "growth: end / initial (end / halfway) |",
             "|" + "---|" * 10]
    timed = one_run()
    used: list[dict] = []
    first: list[dict] = []
    for row in ONE_REV:
        line, u = _row(row, common.get(row.label, {}), ref, ref_choice.settled, runs, timed)
        lines.append(line)
        first += u
    used += first
    # the second host kind: table:frontier-20's runs whose revision computes 57db80f's numbers there
    amd = counted()
    amd_ref_all = amd_reference()
    amd_ref = amd_ref_all.get(ref_choice.lr, {}) if ref_choice.lr is not None else {}
    second: list[dict] = []
    if amd:
        lines.append(f"| *{COUNTED_HOST}: runs at {', '.join(COUNTED_REVS)}; gaps to Muon's runs there "
                     f"(studies host-check and one-revision-amd-seeds, seeds {', '.join(map(str, sorted(amd_ref))) or 'none yet'})* |" + " |" * 9)
        fr_runs = {(r["run"], lr_key(r["lr"]), r["seed"]): r
                   for r in _training_records("long-horizon") + _training_records("one-revision-amd")
                   if str((r.get("provenance") or {}).get("git_rev", ""))[:7] in COUNTED_REVS and host_kind(r) == COUNTED_HOST}
        for row in FR + AMD_FORMS:  # the second Dobb form runs on this host kind only
            line, u = _row(row, amd.get(row.label, {}), amd_ref, ref_choice.settled, fr_runs, timed)
            lines.append(line)
            second += u
        second += list(amd_ref.values())
    used += second
    study = STUDIES[STUDY]
    revs, cpus = where(first)
    digests = sorted(p.name for p in Path(R.DOCS).joinpath(*DIGEST).glob("*.json") if p.stem[:7] in revs
                     and "amd" not in p.stem)  # the first section's host kind (Intel)
    text = "\n".join(lines) + "\n\n"
    text += (f"Study `{STUDY}`: {study.setting.steps} steps, width 128, 2 layers, fp32 products, seeds "
             f"{', '.join(map(str, study.seeds))} at each row's chosen lr; revision {', '.join(revs) or '—'} "
             f"(numerics digest: {', '.join(f'`docs/results/checks/numerics-digest/{d}`' for d in digests) or '—'}); "
             f"host {', '.join(cpus) or '—'}. Losses: the last checkpoint (step 8,000) on 2,048 common windows "
             f"(record `docs/results/{'/'.join(REEVAL[1:])}`); norms and training records: "
             f"`docs/results/records/{STUDY}.jsonl`; steps: "
             + ("not timed yet" if timed is None else f"`{timed['path']}`, one timing run (median over "
                f"{timed['repeats']} repeats, GPT-2 Small's first layer over 4 gloo ranks)") + ". A gap is beyond noise under a 95% paired t-test over the "
             "seeds, repeated over the seeds that did not choose the lr.\n")
    if amd:
        r2, c2 = where(second)
        text += (f"\nThe rows under *{COUNTED_HOST}* are `table:frontier-20`'s rows that ran every run on that host kind: "
                 f"their runs at revisions {', '.join(r2)} (hosts {', '.join(c2)}), which count at one revision because "
                 "there a94277a computes 57db80f's numbers bit for bit (a 40-step run of every row's command, "
                 "`docs/results/checks/same-numbers/a94277a-57db80f-amd-epyc.json`; numerics digest "
                 "`docs/results/checks/numerics-digest/a94277a-amd-epyc.json` against `57db80f-amd-epyc-decay-all.json`), "
                 "and the runs the rule still needed there, made at 57db80f (study `one-revision-amd`, record "
                 f"`docs/results/{'/'.join(AMD_REEVAL[1:])}`). Runs of other revisions (the rows' few runs at 1658d62 "
                 "and 452d6d9, not shown equal) are left out. Their gaps pair with Muon's runs on the same host kind at "
                 f"Muon's lr chosen above (`docs/results/{'/'.join(HK_REEVAL[1:])}`), never across hosts.\n")
    return text, used


TABLES = {"one-revision": one_revision}
