"""One way to define a study: its rows, lrs, seeds, steps, model and eval windows, run in parts.

A ``Study`` declares what to run: its rows (label, optimizer spec, what runs it, a reference value
beside it), its ``Setting`` (model, steps, evals, product dtype), its seeds and lrs, the rule that
plans its runs and the records study they are collected into; ``dobb_bench.studies.catalog`` holds
every declared study. A ``RunsFolder`` (``runs_folder``) holds what has run (one ``--out`` folder
per run, ``{runs}/{kind}-{slug}-j{j}-s{seed}``, so a finished run is skipped and a killed one
resumes from its checkpoint, ``dobb-bench compare --checkpoint-every``); ``Driver`` runs the next
run the rule asks for on each of a few workers and re-evaluates every finished run on the common
windows (``scripts/reeval_windows.py``) before the rule looks at it again; ``collect`` adds the
finished runs to the study's records (``dobb_bench.reports.records.collect``).

The bracket-and-seed rule (``Study.rule == "bracket"``), written once here (``stages``):

1. each row at its centre lr at seed 0, then its lrs either side (``Study.lrs``);
2. while a row's best seed-0 lr sits at an edge of its finished lrs, the next lr out;
3. once bracketed: seed 1 at the best lr, and at each neighbour worse than the best by less than
   two standard errors of the window noise (paired over the common windows' groups), since one
   seed cannot tell those apart; the row's lr is then chosen on the mean of seeds 0 and 1;
4. the remaining seeds at the chosen lr.

A ``"fixed"`` study has no bracketing: each row at its declared seed-0 lrs, its later seeds at its
declared ``seeded`` lrs (an ablation at one lr; a grid that was run by hand, declared as it ran).

A best lr is judged on the common windows when every finished lr of the row has been
re-evaluated there (a 64-window eval moves the differences between lrs by about 0.01 nats), else
on the logged losses. ``paired_gap`` and ``beyond_noise`` are the paired t-test of the tables.
"""
from __future__ import annotations

import glob
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from dobb_bench.reports.tables import paired
from dobb_bench.studies.runs_folder import RunsFolder, slug

# ----------------------------------------------------------------------------- the paired t-test
# two-sided 95% quantiles of Student's t by degrees of freedom (a paired t-test on a few seeds)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def beyond_noise(mean: float, se: float, n: int) -> bool:
    """A 95% two-sided t-test over ``n`` paired differences: ``|mean| > t(n-1) * se``."""
    return abs(mean) > T95.get(n - 1, 1.96) * se


def paired_gap(vals: list, ref: list) -> tuple[float, list[float], bool] | None:
    """``vals - ref`` seed by seed (a seed gives both rows the same initial weights, data order and
    held-out windows, so the windows' sampling, most of a seed's spread, cancels): the mean, the
    per-seed gaps, and whether the mean is beyond paired noise, a 95% paired t-test (``|mean| >
    t(n-1) * std / sqrt(n)``). None with fewer than two seeds in common."""
    got = paired(vals, ref)
    if got is None:
        return None
    mean, se, d = got
    return mean, d, beyond_noise(mean, se, len(d))


def best_of(grid: Iterable[tuple[float, float]]) -> tuple[float | None, bool]:
    """The lr of the lowest loss among ``(lr, loss)`` and whether it is bracketed (a worse lr on
    each side); ``(None, False)`` for an empty grid. The tables' reading of a seed-0 grid."""
    grid = sorted(grid)
    if not grid:
        return None, False
    i = min(range(len(grid)), key=lambda k: grid[k][1])
    return grid[i][0], 0 < i < len(grid) - 1


# ----------------------------------------------------------------------------- the definition
REEVAL_WINDOWS = (2048, 12345)  # scripts/reeval_windows.py's defaults: --windows, --window-seed


def grid_lr(j: int) -> float:
    """The lr grid every study shares: 5e-3 times sqrt(2) to the ``j``."""
    return 5e-3 * 2 ** (j / 2)


def grid_index(lr: float) -> int:
    """The grid index of an lr on the grid (to 4 significant digits); ValueError off the grid."""
    j = round(2 * math.log2(lr / 5e-3))
    if f"{grid_lr(j):.4g}" != f"{lr:.4g}":
        raise ValueError(f"lr {lr!r} is not on the grid 5e-3 * 2 ** (j / 2)")
    return j


class Row(NamedTuple):
    """One row: its label (as it appears in records), its optimizer spec and the grid index its lrs
    start from (``j``: where an earlier study found its best; ``Study.shift`` moves it)."""
    label: str
    spec: str
    j: int
    centre: int | None = None  # where its lrs start when not ``j - Study.shift`` (say why at the row)
    lrs: tuple[int, ...] | None = None  # the grid indices it runs at seed 0, when not the study's
    seeded: tuple[int, ...] | None = None  # a fixed study: where its later seeds run (default ``lrs``)
    runner: str = "compare"  # what runs it: ``dobb-bench compare`` or a script of ``RUNNERS``
    paper: float | None = None  # a reference value shown beside it (the paper's loss), not a setting

    @property
    def around(self) -> int:
        """The index its finished lrs are looked for around (``Study.span`` either side)."""
        return self.j if self.centre is None else self.centre

    @property
    def slug(self) -> str:
        return slug(self.label)


# the scripts that ran rows outside ``dobb-bench compare`` (each writes OUT/runs/<label>/metrics.jsonl,
# no results.jsonl): SOAP and Newton-Muon before the registry had them, the peer packages' classes
RUNNERS = {"family-rows": "scripts/family_rows.py", "peer-soap": "scripts/peer_soap.py",
           "peer-dash": "scripts/peer_dash.py"}


def spec_parts(spec: str) -> tuple[str, str]:
    """A spec's optimizer name and its ``key=value:...`` text; a peer package's class is named
    ``peer:PACKAGE.CLASS`` (as its records name it)."""
    name, _, rest = spec.partition(":")
    if name == "peer":
        cls, _, rest = rest.partition(":")
        name = f"peer:{cls}"
    return name, rest


def runner_args(row: Row) -> list[str]:
    """How a script of ``RUNNERS`` is told the row (``compare`` takes ``--optimizers SPEC@LABEL``)."""
    name, hp = spec_parts(row.spec)
    if row.runner == "compare":
        return ["--optimizers", f"{row.spec}@{row.label}"]
    if row.runner == "family-rows":
        return ["--optimizer", name] + (["--hparams", hp] if hp else []) + ["--label", row.label]
    if row.runner == "peer-soap":
        return ["--package", name[len("peer:"):].split(".")[0]] + (["--hparams", hp] if hp else []) + ["--label", row.label]
    if row.runner == "peer-dash":
        size = dict(x.split("=", 1) for x in hp.split(":") if x).get("block_size", "128")
        return ["--block-size", size, "--label", row.label]
    raise ValueError(f"row {row.label!r}: no runner {row.runner!r} (compare or one of {', '.join(RUNNERS)})")


@dataclass(frozen=True)
class Setting:
    """The model, steps and eval of a study; ``kind`` prefixes its run folders."""
    kind: str
    steps: int
    eval_every: int
    width: int | None = None  # None: compare's default (128)
    layers: int = 2
    context: int = 64
    checkpoint_every: int | None = 500  # None: no checkpoints (the 800-step studies ran without)
    # fp32 products on every host: the studies' runs had them (their hosts had no native bf16, or
    # the flag), and compare's default rule would give bf16 where a host has it; None: the rule
    product_dtype: str | None = "float32"
    extra: tuple[str, ...] = ()  # further flags of compare's (and the scripts'): ("--micro-batches", "2")

    def flags(self) -> list[str]:
        """The flags ``dobb-bench compare`` shares with the scripts of ``RUNNERS``."""
        out = ["--layers", str(self.layers), "--context", str(self.context), "--no-progress"]
        if self.checkpoint_every is not None:
            out += ["--checkpoint-every", str(self.checkpoint_every)]
        if self.width is not None:
            out += ["--width", str(self.width)]
        return out + ["--steps", str(self.steps), "--eval-every", str(self.eval_every), *self.extra]

    def args(self, runner: str = "compare") -> list[str]:
        """The command less seed, lr, --out and the row: ``dobb-bench compare`` or a script of ``RUNNERS``."""
        if runner != "compare":
            return [sys.executable, RUNNERS[runner]] + self.flags()
        dtype = ["--product-dtype", self.product_dtype] if self.product_dtype else []
        return ["dobb-bench", "compare", "--jobs", "1"] + self.flags() + dtype


@dataclass(frozen=True)
class Study:
    """A study: rows at a setting, the seeds each row ends with, the lrs it starts from and the
    records study its runs are collected into. ``lrs``: grid offsets from each row's centre run at
    seed 0 first (the centre first, then the others in order), or grid lrs (values) to run for every
    row (a row's own ``lrs`` replace them). ``rule``: ``"bracket"`` (the bracket-and-seed rule) or
    ``"fixed"`` (no bracketing: the declared lrs and seeds). ``windows``: the common windows every
    finished run is re-evaluated on (``scripts/reeval_windows.py``), None for none. ``title`` and
    ``reference`` (a row label): how a table of the study heads itself and what it subtracts."""
    name: str
    setting: Setting
    rows: tuple[Row, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    shift: int = 0  # the centre is ``row.j - shift``
    lrs: tuple = (0, -1, 1)
    span: int = 6  # a row's finished lrs are looked for within ``row.around -+ span``
    records: str = "long-horizon"
    windows: tuple[int, int] | None = REEVAL_WINDOWS  # --windows, --window-seed of the re-evaluation
    rule: str = "bracket"
    title: str = ""
    reference: str | None = None
    # a fixed study whose runs are still landing (across sessions): a planned run with no record yet is
    # allowed by the catalog's check; a record outside the plan is not
    running: bool = False

    def centre(self, row: Row) -> int:
        return row.j - self.shift if row.centre is None else row.centre

    def first_lrs(self, row: Row) -> list[int]:
        """The grid indices a row runs at seed 0 before the rule looks at it."""
        if row.lrs is not None:
            return list(row.lrs)
        if all(isinstance(x, int) for x in self.lrs):
            return [self.centre(row) + d for d in self.lrs]
        return [grid_index(float(x)) for x in self.lrs]

    def planned(self, row: Row) -> list[tuple[int, int]]:
        """A fixed study's runs of a row, ``(j, seed)``: seed 0 at its lrs, the later seeds at its
        ``seeded`` lrs (its lrs when not given)."""
        seeded = self.first_lrs(row) if row.seeded is None else list(row.seeded)
        return ([(j, 0) for j in self.first_lrs(row)] if 0 in self.seeds else []) + [
            (j, sd) for sd in self.seeds if sd != 0 for j in seeded]

    def row(self, label: str) -> Row:
        return next(r for r in self.rows if r.label == label)


Task = tuple  # (kind, row, j, seed)
REPO = str(Path(__file__).resolve().parents[3])


# ----------------------------------------------------------------------------- the rule
def best_j(runs: RunsFolder, kind: str, row: Row, seed: int = 0, span: int = 6) -> tuple[list[int], int] | None:
    """A row's finished lr indices at ``seed`` and the best of them, judged on the common windows when
    every finished lr has been re-evaluated there, else on the logged losses; None when none has
    finished."""
    js = [j for j in range(row.around - span, row.around + span + 1) if runs.loss(kind, row.label, j, seed) is not None]
    if not js:
        return None
    c = [runs.common(kind, row.label, j, seed) for j in js]
    v = c if None not in c else [runs.loss(kind, row.label, j, seed) for j in js]
    return js, js[v.index(min(v))]


def edge(runs: RunsFolder, kind: str, row: Row, seed: int = 0, span: int = 6) -> int | None:
    """The next lr index out from a row's best finished lr when that lr is at an edge, else None."""
    got = best_j(runs, kind, row, seed, span)
    if got is None:
        return None
    js, best = got
    return best - 1 if best == min(js) else best + 1 if best == max(js) else None


def close_neighbours(runs: RunsFolder, kind: str, row: Row, best: int) -> list[int]:
    """The seed-0 neighbours of ``best`` (one grid step either side) worse than it by less than two
    standard errors of the window noise: their gap to the best, paired over the common windows'
    groups. A neighbour not re-evaluated yet is not called close."""
    ref = runs.groups(kind, row.label, best, 0)
    out = []
    for j in (best - 1, best + 1):
        mine = runs.groups(kind, row.label, j, 0)
        got = None if ref is None or mine is None else paired(mine, ref)
        if got is not None and got[0] < 2 * got[1]:
            out.append(j)
    return out


def _value(runs: RunsFolder, kind: str, label: str, j: int, seeds: Iterable[int]) -> list[float | None]:
    c = [runs.common(kind, label, j, sd) for sd in seeds]
    return c if None not in c else [runs.loss(kind, label, j, sd) for sd in seeds]


def chosen_j(runs: RunsFolder, kind: str, row: Row, span: int = 6) -> int | None:
    """The row's lr once bracketed at seed 0: its best, or, where neighbours are within the window
    noise of it, the one of them with the lowest mean over seeds 0 and 1 (on the common windows when
    all of them have been re-evaluated); None while not bracketed or while a seed-1 run is missing."""
    got = best_j(runs, kind, row, 0, span)
    if got is None or edge(runs, kind, row, 0, span) is not None:
        return None
    best = got[1]
    cands = [best] + close_neighbours(runs, kind, row, best)
    if len(cands) == 1:
        return best
    if any(runs.loss(kind, row.label, j, 1) is None for j in cands):
        return None
    c = [[runs.common(kind, row.label, j, sd) for sd in (0, 1)] for j in cands]
    if any(None in x for x in c):
        c = [[runs.loss(kind, row.label, j, sd) for sd in (0, 1)] for j in cands]
    means = [sum(x) / 2 for x in c]
    return cands[means.index(min(means))]


def stages(study: Study, runs: RunsFolder, rows: Iterable[Row] | None = None) -> list[list[Task]]:
    """The rule's runs in the order they are wanted, stage by stage; a stage is taken up only when the
    stages before it have nothing left to start."""
    rows = list(study.rows if rows is None else rows)
    kind, span = study.setting.kind, study.span
    later = [sd for sd in study.seeds if sd != 0]
    if study.rule == "fixed":  # no bracketing: seed 0 row by row, then each later seed row by row
        plan = {r.label: study.planned(r) for r in rows}
        return [[(kind, r, j, sd) for sd in [0] + later for r in rows for j, s in plan[r.label] if s == sd]]
    if study.rule != "bracket":
        raise ValueError(f"study {study.name!r}: no rule {study.rule!r} (bracket or fixed)")
    n = max((len(study.first_lrs(r)) for r in rows), default=0)
    first = [[(kind, r, j, 0) for r in rows for j in study.first_lrs(r)[:1]],
             [(kind, r, j, 0) for k in range(1, n) for r in rows for j in study.first_lrs(r)[k:k + 1]]]
    out = [(kind, r, e, 0) for r in rows if (e := edge(runs, kind, r, 0, span)) is not None]
    close: list[Task] = []
    if later:
        for r in rows:
            got = best_j(runs, kind, r, 0, span)
            if got is not None and edge(runs, kind, r, 0, span) is None:
                close += [(kind, r, j, 1 if 1 in later else later[0])
                          for j in [got[1]] + close_neighbours(runs, kind, r, got[1])]
    seeds = [(kind, r, j, sd) for sd in later for r in rows if (j := chosen_j(runs, kind, r, span)) is not None]
    return first + [out, close, seeds]


def plan_status(study: Study, runs: RunsFolder) -> list[dict]:
    """Per row: its finished seed-0 lrs with their losses, its best, whether bracketed, the chosen lr
    and the seeds finished there (what ``dobb-bench study NAME status`` prints)."""
    kind, out = study.setting.kind, []
    for r in study.rows:
        got = best_j(runs, kind, r, 0, study.span)
        js = got[0] if got else []
        ch = chosen_j(runs, kind, r, study.span)
        out.append({"row": r.label, "lrs": {j: _value(runs, kind, r.label, j, (0,))[0] for j in js},
                    "best": got[1] if got else None, "edge": edge(runs, kind, r, 0, study.span),
                    "chosen": ch,
                    "seeds": [sd for sd in study.seeds if ch is not None and runs.loss(kind, r.label, ch, sd) is not None]})
    return out


# ----------------------------------------------------------------------------- running
@dataclass
class Driver:
    """Runs tasks on ``workers`` threads: each pulls the next task (``pick(driver)``, under the lock)
    when its last one finished and was re-evaluated, so each choice sees every run finished by then.
    Runs left running by an earlier driver are adopted: waited for and re-evaluated, never doubled."""
    runs: RunsFolder
    worktree: str
    settings: dict  # kind -> Setting
    reeval_worktree: str | None = None
    workers: int = 2
    running: set = field(default_factory=set)  # every --out started by this driver or adopted
    active: set = field(default_factory=set)  # the --out folders being run or re-evaluated now
    started: dict = field(default_factory=dict)  # kind -> runs started
    lock: threading.Lock = field(default_factory=threading.Lock)
    wait_s: float = 30.0
    windows: tuple[int, int] | None = REEVAL_WINDOWS  # the re-evaluation's --windows, --window-seed; None: none

    def env(self, worktree: str | None = None) -> dict:
        return dict(os.environ, PYTHONPATH=f"{worktree or self.worktree}/src", OMP_NUM_THREADS="1")

    def command(self, task: Task) -> list[str]:
        kind, row, j, seed = task
        return self.settings[kind].args(row.runner) + ["--seed", str(seed), "--lr", repr(grid_lr(j)),
                                                       "--out", self.runs.out_dir(kind, row.label, j, seed)
                                                       ] + runner_args(row)

    def pending(self, tasks: Iterable[Task]) -> Task | None:
        """The first task neither finished nor started: marked started (call under the lock)."""
        for t in tasks:
            key = self.runs.out_dir(t[0], t[1].label, t[2], t[3])
            if key not in self.running and self.runs.loss(t[0], t[1].label, t[2], t[3]) is None:
                return t
        return None

    def first(self, stages: Iterable[Iterable[Task]]) -> Task | None:
        """The first pending task of the first stage that has one."""
        for stage in stages:
            t = self.pending(stage)
            if t is not None:
                return t
        return None

    def take(self, task: Task | None) -> Task | None:
        if task is not None:
            self.running.add(self.runs.out_dir(task[0], task[1].label, task[2], task[3]))
            self.started[task[0]] = self.started.get(task[0], 0) + 1
        return task

    def run(self, task: Task) -> None:
        kind, row, j, seed = task
        if self.runs.loss(kind, row.label, j, seed) is not None:
            return
        args = self.command(task)
        print(" ".join(args), flush=True)
        subprocess.run(args, cwd=self.worktree, env=self.env())
        print("done", kind, row.label, j, seed, self.runs.loss(kind, row.label, j, seed), flush=True)

    def reeval(self, d: str) -> None:
        """Re-evaluates a finished run on the common windows (``scripts/reeval_windows.py``)."""
        if self.windows is not None and os.path.exists(d + "/results.jsonl"):
            re_wt = self.reeval_worktree or self.worktree
            args = [sys.executable, "scripts/reeval_windows.py", d, "--out", f"{self.runs.root}/reeval-scratch.jsonl"]
            if tuple(self.windows) != REEVAL_WINDOWS:  # the script's defaults: the command of every run so far
                args += ["--windows", str(self.windows[0]), "--window-seed", str(self.windows[1])]
            subprocess.run(args, cwd=re_wt, env=self.env(re_wt))

    def alive(self, d: str) -> bool:
        return subprocess.run(["pgrep", "-f", "--", f"--out {d} "], capture_output=True).returncode == 0

    def left_running(self) -> list[str]:
        """The --out folders of compare runs under this runs folder that an earlier driver left running."""
        ps = subprocess.run(["pgrep", "-af", "--", f"--out {self.runs.root}/"], capture_output=True, text=True).stdout
        return sorted({w.split()[0] for w in ps.split("--out ")[1:]})

    def worker(self, pick: Callable, adopt: str | None = None) -> None:
        if adopt is not None:
            try:
                while self.alive(adopt):
                    time.sleep(self.wait_s)
                self.reeval(adopt)
            finally:
                with self.lock:
                    self.active.discard(adopt)
        while True:
            with self.lock:
                t = pick(self)
                if t is not None:
                    key = self.runs.out_dir(t[0], t[1].label, t[2], t[3])
                    self.active.add(key)
                busy = bool(self.active)
            if t is None:
                if not busy:  # nothing to start and nothing running that could unlock more
                    return
                time.sleep(self.wait_s)  # another worker's run may let the rule ask for more
                continue
            try:
                self.run(t)
                # re-evaluate on the common windows at once, so the next choice is judged there
                self.reeval(key)
            finally:
                with self.lock:
                    self.active.discard(key)

    def drive(self, pick: Callable) -> None:
        left = self.left_running()
        self.running.update(left)
        self.active.update(left[:self.workers])  # the adopted runs a worker waits for
        ts = [threading.Thread(target=self.worker, args=(pick, left[i] if i < len(left) else None))
              for i in range(self.workers)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("DRIVER_DONE", flush=True)


def rule(study: Study, rows: Iterable[Row] | None = None) -> Callable:
    """The pick of the bracket-and-seed rule over ``study``: the first pending task of the first stage
    that has one."""
    def pick(d: Driver) -> Task | None:
        return d.take(d.first(stages(study, d.runs, rows)))
    return pick


def collect(study: Study, runs: RunsFolder, records_dir=None) -> list[dict]:
    """Adds every finished run of ``study`` under ``runs`` to its records study."""
    from dobb_bench.reports import records as R
    new = []
    kind = study.setting.kind
    for r in study.rows:
        if study.rule == "fixed":
            tasks = study.planned(r)
        else:
            tasks = [(j, sd) for j in range(r.around - study.span, r.around + study.span + 1) for sd in study.seeds]
        for j, seed in tasks:
            d = runs.out_dir(kind, r.label, j, seed)
            if runs.loss(kind, r.label, j, seed) is not None and glob.glob(d + "/runs/*/metrics.jsonl"):
                new += R.collect(d, study.records, records_dir, runs=[r.label])
    return new
