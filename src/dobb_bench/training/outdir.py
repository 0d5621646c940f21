"""What ``--out`` already holds, and when a command may write there (no result is lost).

Why: ``train``, ``compare`` and ``sweep`` reuse a finished run found in ``--out`` and resume an
unfinished one; a careless rerun with one setting changed used to retrain in place and replace the
finished result without a word, and ``train --out <compare folder>`` replaced the compare's
``results.md``. Here every such case is refused with one line naming the folder, what differs and
the way out (another ``--out``, or ``--no-resume`` to replace on purpose).
"""
from __future__ import annotations

import json
from pathlib import Path

from dobb_bench.errors import CliError
from dobb_bench.training.train import METRICS_FILE


def read_final(run_dir: Path, expect: dict | None = None) -> dict | None:
    """The run's final record, or None; with ``expect``, only if it was made with those settings."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return None
    try:
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except ValueError:
        raise CliError(f"{path} is not JSON lines (damaged?); move it away, or use another --out") from None
    final = lines[-1] if lines and lines[-1].get("type") == "final" else None
    if final is not None and expect is not None:
        same = json.loads(json.dumps(expect)) == {k: final.get(k) for k in expect}
        return final if same else None
    return final


def _flat(d, pre: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{pre}{k}."))
        else:
            out[pre + k] = v
    return out


def finished_with(run_dir: Path, expect: dict) -> dict | None:
    """The finished run in ``run_dir`` if it was made with ``expect``'s settings; None if there is
    none; a CliError naming the differing settings if it was made with others (a finished result
    is never replaced by a different configuration without the user asking: --no-resume)."""
    final = read_final(run_dir)
    if final is None:
        return None
    want = _flat(json.loads(json.dumps(expect)))
    got = _flat({k: final.get(k) for k in expect})
    diff = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
    if not diff:
        return final
    shown = "; ".join(f"{k}: {got.get(k)!r} there, {want.get(k)!r} now" for k in diff[:4])
    more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
    raise CliError(f"{run_dir} holds a finished run with other settings ({shown}{more}); use --out <new "
                   "folder> to keep it, or --no-resume to retrain and replace it")


def check_out(out: Path, command: str) -> None:
    """Refuses an --out that would replace another command's results, and makes the folder (so a
    path under a file or without permission fails here, in one line, before any work)."""
    if command == "train" and ((out / "results.jsonl").exists() or (out / "runs").is_dir()):
        raise CliError(f"{out} is a compare/sweep output folder (results.jsonl, runs/); train would "
                       "replace its results.md: use another --out")
    if command != "train" and (out / METRICS_FILE).exists():
        raise CliError(f"{out} holds a train run ({METRICS_FILE}); {command} would mix its results with "
                       "it: use another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CliError(f"--out {out}: it or a folder above it is a file, not a folder; choose another "
                       "--out") from None
    except PermissionError as exc:
        raise CliError(f"--out {out}: {exc.strerror or 'permission denied'} ({exc.filename}); choose "
                       "another --out or fix its permissions") from None


def check_rows(out: Path, jobs) -> None:
    """A finished compare/sweep folder keeps its rows: ``results.md`` is rewritten only by a command
    that covers every (label, lr) it lists (more rows are fine: a finished run is reused)."""
    path = out / "results.jsonl"
    if not path.exists():
        return
    try:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except ValueError:
        raise CliError(f"{path} is not JSON lines (damaged?); move it away, or use another --out") from None
    have = {(r.get("run"), round(float(r.get("lr") or 0), 12)) for r in rows if r.get("type") == "final"}
    asked = {(s.label, round(lr, 12)) for s, lr in jobs}
    lost = sorted(f"{label} (lr {lr:.3g})" for label, lr in have - asked)
    if lost:
        raise CliError(f"{out} holds finished results for {', '.join(lost)}, which this command does not "
                       "run; its results.md would lose them: use --out <new folder>, name those runs too, "
                       "or --no-resume to replace the results")
