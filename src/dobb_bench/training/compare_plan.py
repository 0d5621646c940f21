"""``compare``'s default rows and its expected duration, said before it starts (issue 53, item 10).

**The default rows.** The README's recommended rows (row-block Muon, Dobb-Muon B=4 Bo=4, MuonBP,
SOAP) beside AdamW, Muon, Dion and Dobb, each with the hyperparameters of the committed runs that
chose its recorded best lr (``row_settings.RECORDED_BEST_LR``), so every default row runs at its
own recorded best lr. A row without a recorded lr grid is not a default; named with
``--optimizers`` it still runs, at the shared lr, and ``compare`` says so before it starts.

**The expected duration.** Per run, ``steps x (the rest of a training step + the row's optimizer
step)``, in ms a step, from the committed records of the main job's setting
(``docs/results/records/*.jsonl``: 2 layers, width 128, context 64, 16 x 64 tokens a step,
an eval every 50 steps of 64 windows), read at call time:

- the row's optimizer step: the median ``opt_ms_per_step`` of the records of its spec (name and
  hyperparameters after the registry's defaults, the dtype keys left out: ``row_settings.spec_key``);
- the rest (forward, backward, evals, the data): the median over the records run two at a time
  (``--jobs 2``, compare's default) of ``train_wall_s / steps - opt_ms_per_step``.

Another model or batch than the records', or a spec without records, is timed here instead: a few
training steps of that row on the real model, in this process (evals not counted). The runs are
then laid on ``--jobs`` slots in the order ``run_many`` starts them (Newton-Schulz rows first, each
run to the first free slot); the longest slot is the expected duration (a child's start-up, some
seconds a run, is not counted). The records were measured on a shared 2-core AMD EPYC host, medians
over loaded and quiet runs: a guide, not a promise.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dobb_bench.specs import OptimizerSpec
from dobb_bench.training import row_settings

# (spec, label): each spec is the one its recorded lr's runs ran (row_settings.RECORDED_BEST_LR's
# entry; the records' *_dtype keys are the product-dtype rule's); the labels are the records'
# run labels less their "-fp32".
DEFAULT_ROWS = (
    ("adamw", "AdamW"),                                          # lr-grid, headline: 0.00354
    ("muon", "Muon"),                                            # own-lr (Muon-fp32): 0.01
    ("dion:rank_fraction=1/16", "Dion rho=1/16"),                # own-lr: 0.0141 (edge of its grid)
    ("block-muon:axis=0:blocks=4", "Row-block Muon R=4"),        # shard-local: 0.01
    ("dobb-muon:blocks=4:out_blocks=4", "Dobb-Muon B=4 Bo=4"),  # dobb-forms (fp32 products): 0.02
    ("muonbp:axis=0:blocks=4:period=10", "MuonBP R=4 P=10"),     # shard-local: 0.04
    ("soap", "SOAP"),                                            # family-soap: 0.01
    ("dobb:blocks=1", "Dobb B=1"),                               # own-lr: 0.005
    ("dobb:blocks=4", "Dobb B=4"),                               # own-lr: 0.00354
)
DEFAULT_COMPARE = ",".join(f"{s}@{label}" for s, label in DEFAULT_ROWS)
BUDGET_S = 600.0  # the main job's budget: 10 minutes with the install on 2 cores
# the Newton-Schulz rows run_many starts first (their step is the dearest on a CPU)
NS_FIRST = ("muon", "block-muon", "pr-muon", "dion2")
_PROBE_STEPS = (2, 3)  # warm-up, timed


@dataclass(frozen=True)
class Estimate:
    seconds: float
    source: str  # where the figure comes from, said beside it


def _records_dir() -> Path:
    from dobb_bench.reports import records as R

    return Path(R.RECORDS)


def _setting(model: dict, train: dict) -> tuple:
    """What must match for a record's step time to stand for a run (everything but its length)."""
    return (tuple(sorted(model.items())), train.get("batch_size"), train.get("micro_batches", 1),
            train.get("seq_len"), train.get("eval_every"), train.get("eval_seqs"))


def load_step_records(records_dir: Path | None = None) -> list[dict]:
    """Every committed run record with a step time: {setting, key, opt_ms, rest_ms, two}."""
    out = []
    for path in sorted(Path(records_dir or _records_dir()).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if not all(r.get(k) for k in ("train_wall_s", "opt_ms_per_step", "steps", "model", "train")):
                continue
            key = row_settings.spec_key(r["optimizer"], r.get("hparams") or {})
            if key is None:
                continue
            opt = r["opt_ms_per_step"]
            command = ((r.get("provenance") or {}).get("command") or "")
            out.append({"setting": _setting(r["model"], r["train"]), "key": key, "opt_ms": opt,
                        "rest_ms": 1e3 * r["train_wall_s"] / r["steps"] - opt, "two": "--jobs 2" in command})
    return out


def record_estimate(spec: OptimizerSpec, model: dict, train: dict, steps: int,
                    recs: list[dict]) -> Estimate | None:
    """``steps x (rest + the row's optimizer step)`` from the records of this setting, or None."""
    setting = _setting(model, train)
    here = [r for r in recs if r["setting"] == setting]
    key = row_settings.spec_key(spec.name, spec.hparams)
    mine = [r["opt_ms"] for r in here if r["key"] == key]
    rest = [r["rest_ms"] for r in here if r["two"]] or [r["rest_ms"] for r in here]
    if key is None or not mine or not rest:
        return None
    opt, other = statistics.median(mine), statistics.median(rest)
    return Estimate(steps * (opt + other) / 1e3,
                    f"records: {opt:.1f} ms optimizer step (median of {len(mine)}) + {other:.1f} ms the rest")


def probe_estimate(spec: OptimizerSpec, lr: float, weight_decay: float, model_cfg, batch_size: int,
                   seq_len: int | None, steps: int, factory, device: str = "cpu") -> Estimate:
    """A few training steps of this row on the real model, timed here; ``steps`` times the mean."""
    from dobb_bench.training.model import GPT

    dev = torch.device(row_settings.device_kind(device))
    torch.manual_seed(0)
    model = GPT(model_cfg).to(dev)
    opt = factory(spec.name, spec.hparams, lr, weight_decay, model)
    n = seq_len or model_cfg.seq_len
    x = torch.randint(0, model_cfg.vocab_size, (batch_size, n + 1), device=dev)
    warm, timed = _PROBE_STEPS
    try:
        for i in range(warm + timed):
            if i == warm:
                t0 = time.perf_counter()
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda" and i == warm - 1:
                torch.cuda.synchronize(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        per = (time.perf_counter() - t0) / timed
    finally:
        getattr(opt, "remove_hooks", lambda: None)()
    return Estimate(steps * per, f"timed here on {dev.type}: {1e3 * per:.0f} ms a training step over {timed} steps, evals not counted")


def schedule(jobs: list[tuple[OptimizerSpec, float]], seconds: list[float], slots: int) -> float:
    """The longest slot when ``jobs`` go ``slots`` at a time in run_many's order (Newton-Schulz
    rows first, the spec order otherwise; each run to the first free slot)."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0].name not in NS_FIRST)
    free = [0.0] * max(1, slots)
    for i in order:
        k = min(range(len(free)), key=free.__getitem__)
        free[k] += seconds[i]
    return max(free)


def estimate_jobs(jobs, model_cfg, train_cfg, factory, recs: list[dict] | None = None) -> list[Estimate]:
    """One estimate per (spec, lr) job: from the records where they hold this setting, else timed."""
    from dataclasses import asdict

    recs = load_step_records() if recs is None else recs
    model, train = model_cfg.to_dict(), asdict(train_cfg)
    out, cache = [], {}
    for spec, lr in jobs:
        est = record_estimate(spec, model, train, train_cfg.steps, recs)
        if est is None:
            if spec.label not in cache:
                cache[spec.label] = probe_estimate(spec, lr, train_cfg.weight_decay, model_cfg, train_cfg.batch_size,
                                                   train_cfg.seq_len, train_cfg.steps, factory, train_cfg.device)
            est = cache[spec.label]
        out.append(est)
    return out


def duration_text(jobs, estimates: list[Estimate], slots: int) -> str:
    """The lines compare prints before it starts: the expected duration and each run's estimate."""
    total = schedule(jobs, [e.seconds for e in estimates], slots)
    lines = [f"compare: {len(jobs)} runs, {slots} at a time; expected duration about {total:.0f} s "
             f"({total / 60:.1f} min; runs already finished in --out are reused and take no time):"]
    lines += [f"  {spec.label} lr={lr:.3g}: about {e.seconds:.0f} s ({e.source})"
              for (spec, lr), e in zip(jobs, estimates)]
    if total > BUDGET_S:
        lines.append(f"  (more than the main job's {BUDGET_S / 60:.0f}-minute budget on 2 cores)")
    return "\n".join(lines)


def shared_lr_warnings(specs, lr_source: dict) -> list[str]:
    """One line per row with no recorded lr grid: it runs at the shared lr, not its own best."""
    return [f"compare: note: {s.label!r} has no recorded lr grid in the committed records; it runs at the "
            f"shared lr {row_settings.SHARED_LR:.3g} (AdamW's best), not at a best lr of its own (--lr-grid tunes it)"
            for s in specs if lr_source[s.label].startswith("shared lr")]
