"""CLI subcommands ``train``, ``compare`` and ``sweep``: the project's main benchmark job.

``compare`` trains the same model on the same data with the same seed once per optimizer spec
(``NAME[:key=value[:key=value]][@Label]``, e.g. ``dobb:blocks=4`` or ``dion:rank_fraction=1/16``)
and writes JSON lines, a markdown table and PNG plots to ``--out``. On CPU each run executes in a
fresh child process (``--isolate``, the default there) so that its peak-memory figure (the
process's max RSS) belongs to that run alone; under ``torchrun`` runs execute in-process.

The flags every training command shares, and the configs they make, are ``run_args``'s (re-exported
here: the scripts that run rows outside compare take them as ``commands_train.add_common_args``).

Optimizers come only from ``dobb.build_optimizer(name, model, lr=, weight_decay=, **hparams)``.
Every spec is first built on one layer of the real model (same widths, so ``blocks`` is checked
against the matrices it will block), so an unknown name or a bad hyperparameter fails in a second
instead of after the runs before it.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import re
import time
from dataclasses import replace
from pathlib import Path

import torch

from dobb_bench.errors import CliError, Interrupted
from dobb_bench.provenance import provenance
from dobb_bench.reports import report
from dobb_bench.specs import OptimizerSpec, default_label, parse_hparams, parse_spec, refreshes  # noqa: F401 (re-exported)
from dobb_bench.training import children, compare_plan, row_settings
from dobb_bench.training.data import load_corpus
from dobb_bench.training.model import GPT, ModelConfig
from dobb_bench.training.outdir import check_out, check_rows, finished_with, read_final  # noqa: F401 (read_final re-exported)
from dobb_bench.training.run_args import add_common_args, grid_lr, run_configs  # noqa: F401 (re-exported)
from dobb_bench.training.train import METRICS_FILE, TrainConfig, run_training, setup_dist, write_jsonl

# The default rows: the README's recommended rows beside AdamW, Muon, Dion and Dobb, each at its own
# recorded best lr with the hyperparameters of the runs that chose it (compare_plan.DEFAULT_ROWS).
DEFAULT_COMPARE = compare_plan.DEFAULT_COMPARE
# ----- optimizer specs (the grammar: dobb_bench.specs) -----------------------------------------
def split_specs(text: str) -> list[str]:
    """Splits at commas outside parentheses (so ``adamw_betas=(0.9,0.99)`` stays whole)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([" and 1 or (-1 if ch in ")]" else 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in (s.strip() for s in parts) if p]


def make_optimizer(name: str, hparams: dict, lr: float, weight_decay: float, model):
    """Module-level (picklable) factory: ``functools.partial(make_optimizer, ...)(model)`` calls
    ``dobb.build_optimizer`` (the one builder) with the model last."""
    import dobb  # the library's public entry point is the only way optimizers are made

    from dobb_bench.specs import recorded_adamw_part, recorded_refresh

    return dobb.build_optimizer(name, model, lr=lr, weight_decay=weight_decay, **hparams,
                                **recorded_adamw_part(name, model, hparams), **recorded_refresh(name, hparams))


def run_hparams(spec: OptimizerSpec, steps: int) -> dict:
    """The spec's hyperparameters, plus ``total_steps=steps`` (the run's length) for an optimizer
    that takes it (SAMuon's gamma warmup spans a fraction of the run) when the spec leaves it out."""
    import dobb

    hp = dict(spec.hparams)
    if "total_steps" not in hp and "total_steps" in dobb.valid_hparams(spec.name):
        hp["total_steps"] = steps
    return hp


def validate_spec(spec: OptimizerSpec, model_cfg: ModelConfig | None = None) -> None:
    """Builds the optimizer on one layer of ``model_cfg`` (every layer has the same matrix shapes),
    or on a width-32 probe when no model is given yet."""
    cfg = replace(model_cfg, layers=1) if model_cfg is not None else ModelConfig(layers=1, width=32, heads=2,
                                                                                 seq_len=8)
    probe = GPT(cfg)
    try:
        opt = make_optimizer(spec.name, spec.hparams, 1e-3, 0.0, probe)
    except (ValueError, TypeError, KeyError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(f"optimizer {spec.label!r}: {msg}") from None
    getattr(opt, "remove_hooks", lambda: None)()


def run_slug(label: str) -> str:
    """A run label as its folder under ``OUT/runs/`` names it."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", label).strip("_") or "run"


def _out(args, command: str) -> Path:
    return Path(args.out or Path("bench-out") / command)


# ----- running ----------------------------------------------------------------------------------
def _run_one(spec: OptimizerSpec, lr: float, model_cfg, train_cfg, corpus, run_dir: Path, *,
             progress: bool, resume: bool, env=None, keep_checkpoint=True, stop_after=None,
             prov: dict | None = None) -> dict:
    hparams = run_hparams(spec, train_cfg.steps)
    meta = {"run": spec.label, "optimizer": spec.name, "hparams": {k: str(v) for k, v in hparams.items()},
            "lr": lr, "weight_decay": train_cfg.weight_decay,
            "provenance": prov}  # the parent's command line, not a spawned child's
    factory = functools.partial(make_optimizer, spec.name, hparams, lr, train_cfg.weight_decay)
    return run_training(model_cfg, replace(train_cfg, lr=lr), corpus, factory, out_dir=run_dir, meta=meta,
                        progress=progress, resume=resume, env=env, keep_checkpoint=keep_checkpoint,
                        stop_after=stop_after)


def _child(spec, lr, model_cfg, train_cfg, data_args, run_dir, progress, resume, threads, prov=None) -> int:
    torch.set_num_threads(threads)
    corpus = load_corpus(data_args.pop("data"), **data_args)
    final = _run_one(spec, lr, model_cfg, train_cfg, corpus, run_dir, progress=progress, resume=resume,
                     keep_checkpoint=False, prov=prov)
    return 130 if final["type"] == "interrupted" else 0  # stopped by SIGTERM, checkpoint saved


def _settings(spec: OptimizerSpec, lr: float, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    from dataclasses import asdict

    return {"optimizer": spec.name, "hparams": {k: str(v) for k, v in spec.hparams.items()}, "lr": lr,
            "model": model_cfg.to_dict(), "train": asdict(replace(train_cfg, lr=lr))}


def run_many(jobs: list[tuple[OptimizerSpec, float]], args, model_cfg, train_cfg, corpus_info, out: Path) -> list[dict]:
    """Runs every (spec, lr) job once; a finished run found in ``out`` is reused unless --no-resume.

    Isolated runs (one child process each) go ``--jobs`` at a time: on 2 cores two one-thread
    runs use the machine fully, and each child's max RSS is still its own.
    """
    corpus, data_args = corpus_info
    env = setup_dist(train_cfg.dist, train_cfg.device)
    isolate = args.isolate if args.isolate is not None else (env.world == 1 and env.device.type == "cpu")
    if getattr(args, "jobs", 1) < 1:
        raise CliError(f"--jobs must be a positive integer, got {args.jobs}")
    n_jobs = args.jobs if isolate and hasattr(args, "jobs") else 1
    progress, resume = not args.no_progress and n_jobs == 1, not args.no_resume
    prov = provenance(getattr(args, "argv", None))
    several = len(jobs) > len({j[0].label for j in jobs})
    todo, finals = [], [None] * len(jobs)
    for i, (spec, lr) in enumerate(jobs):
        run_dir = out / "runs" / run_slug(f"{spec.label}" + (f"_lr{lr:.3g}" if several else ""))
        expect = _settings(spec, lr, model_cfg, train_cfg)
        final = finished_with(run_dir, expect) if resume else None
        if final is not None:
            _done(finals, i, final, run_dir, jobs, env, 0.0)
        else:
            todo.append((i, spec, lr, run_dir, expect))
    if not isolate:
        for i, spec, lr, run_dir, _ in todo:
            t0 = time.perf_counter()
            final = _run_one(spec, lr, model_cfg, train_cfg, corpus, run_dir, progress=progress,
                             resume=resume, env=env, keep_checkpoint=False, prov=prov)
            final.pop("evals", None)
            if final["type"] == "interrupted":
                raise Interrupted(f"interrupted: run {spec.label!r} stopped after step {final['step']} with a "
                                  f"checkpoint in {run_dir}; finished runs are kept in {out / 'runs'}: rerun "
                                  "the same command to resume")
            _done(finals, i, final, run_dir, jobs, env, time.perf_counter() - t0)
        return finals
    # Newton-Schulz rows cost ~10x an AdamW step on CPU (bf16 matmuls; records' train_cpu_s):
    # starting them first keeps the two job slots balanced. Table order stays the spec order.
    todo.sort(key=lambda t: t[1].name not in compare_plan.NS_FIRST)  # compare_plan.schedule follows this order
    ctx, active = mp.get_context("spawn"), []
    try:
        while todo or active:
            while todo and len(active) < n_jobs:
                i, spec, lr, run_dir, expect = todo.pop(0)
                proc, pipe = children.start(ctx, _child, (spec, lr, model_cfg, train_cfg, dict(data_args), run_dir,
                                                          progress, resume, torch.get_num_threads(), prov))
                active.append((proc, pipe, i, spec, run_dir, expect, time.perf_counter()))
            done = next((item for item in active if not item[0].is_alive()), None)  # whichever ends first
            if done is None:
                time.sleep(0.5)
                continue
            proc, pipe, i, spec, run_dir, expect, t0 = done
            proc.join()
            active.remove(done)
            final = read_final(run_dir, expect)
            if proc.exitcode != 0 or final is None:
                why = children.message(pipe) or f"exit code {proc.exitcode}"
                raise CliError(f"run {spec.label!r} failed in its child process: {why}")
            _done(finals, i, final, run_dir, jobs, env, time.perf_counter() - t0)
    except KeyboardInterrupt:
        children.stop([a[0] for a in active])
        kept = sum(f is not None for f in finals)
        raise Interrupted(f"interrupted: {kept} of {len(jobs)} runs finished and kept in {out / 'runs'}; the "
                          f"{len(active)} running stopped with a checkpoint: rerun the same command to resume"
                          ) from None
    finally:
        children.stop([a[0] for a in active])
    return finals


def _done(finals, i, final, run_dir, jobs, env, seconds) -> None:
    final["run_dir"] = str(run_dir)
    finals[i] = final
    if env.rank == 0:
        spec, lr = jobs[i]
        loss = final.get("final_val_loss")
        print(f"[{sum(f is not None for f in finals)}/{len(jobs)}] {spec.label} lr={lr:.3g}: val loss "
              f"{'diverged' if loss is None or final.get('diverged') else f'{loss:.4f}'}, "
              f"{final['tokens_per_s']:.0f} tok/s, opt {final['opt_ms_per_step']:.2f} ms/step "
              f"({seconds:.1f} s)", flush=True)


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _close_dist() -> None:
    """Leaves the torchrun process group cleanly (no-op in a single process)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _finish(out: Path, finals: list[dict], model_cfg: ModelConfig, *, grid: bool, shared_lr: float | None,
            row_lrs: dict[str, float] | None = None, notes: tuple[str, ...] = ()) -> None:
    """Writes results.jsonl, results.md and the plots (rank 0 only). ``row_lrs``: each label's own lr
    (``compare``), in place of one ``shared_lr``; ``notes``: lines said under the table."""
    if not _rank0():
        return
    records = []
    for f in finals:
        path = Path(f["run_dir"]) / METRICS_FILE
        records += [json.loads(x) for x in path.read_text().splitlines() if x.strip()][:-1]
        records.append(f)
    write_jsonl(out / "results.jsonl", records)
    table = report.results_markdown(finals, grid=grid, shared_lr=shared_lr, row_lrs=row_lrs)
    notes = list(notes) + [report.plot_curves(records, out / "val_loss.png")]
    from dobb_bench.cost.payload import relative_payload  # the ratios the report presents

    shapes = [tuple(m.weight.shape) for blk in GPT(replace(model_cfg, layers=1)).blocks
              for m in blk.modules() if isinstance(m, torch.nn.Linear)] * model_cfg.layers
    notes.append(report.plot_payload(finals, shapes, out / "payload_vs_loss.png", payload=relative_payload))
    text = table + "\n" + "\n".join(f"- {n}" for n in notes if n) + "\n"
    if any(refreshes(f["optimizer"]) for f in finals):  # a Dobb row (dobb.registry): say where it lands
        text += "\n" + report.plain_summary(finals, shapes, payload=relative_payload)
    (out / "results.md").write_text(text)
    print("\n" + text)


def cmd_train(args) -> int:
    spec = OptimizerSpec(args.optimizer.lower(), parse_hparams(args.hp or [], "--hp"), "")
    spec = replace(spec, label=default_label(spec.name, spec.hparams))
    model_cfg, train_cfg, (corpus, _) = run_configs(args)
    validate_spec(spec, model_cfg)
    out = _out(args, "train")
    env = setup_dist(train_cfg.dist, train_cfg.device)
    check_out(out, "train")
    if not args.no_resume:
        finished_with(out, _settings(spec, train_cfg.lr, model_cfg, train_cfg))
    final = _run_one(spec, train_cfg.lr, model_cfg, train_cfg, corpus, out, progress=not args.no_progress,
                     resume=not args.no_resume, env=env, stop_after=args.stop_after,
                     prov=provenance(getattr(args, "argv", None)))
    final.pop("evals", None)
    if final.get("signal"):
        raise Interrupted(f"interrupted ({final['signal']}) after step {final['step']}, with a checkpoint in "
                          f"{out}: rerun the same command to resume")
    if final["type"] == "interrupted":
        if env.rank == 0:
            print(f"stopped after step {final['step']} with a checkpoint in {out}; rerun the same "
                  "command to resume")
        _close_dist()
        return 0
    final["run_dir"] = str(out)
    if env.rank == 0:
        text = report.results_markdown([final], grid=False, shared_lr=None)
        (out / "results.md").write_text(text)
        print(text)
    _close_dist()
    return 0


def cmd_compare(args) -> int:
    specs = [parse_spec(s) for s in split_specs(args.optimizers or DEFAULT_COMPARE)]
    if not specs:
        raise CliError("--optimizers is empty")
    if len({s.label for s in specs}) != len(specs):
        raise CliError("--optimizers has duplicate labels; add @Label to tell them apart")
    grid = [float(j) for j in _parse_grid(args.lr_grid)] if args.lr_grid else []
    model_cfg, train_cfg, corpus_info = run_configs(args)
    # one product dtype for every row (row_settings.product_dtype), so the step times compare alike
    dtype = (row_settings.product_dtype(train_cfg.device) if args.product_dtype == "rule"
             else getattr(torch, args.product_dtype))
    specs = [row_settings.with_product_dtype(s, dtype) for s in specs]
    for spec in specs:
        validate_spec(spec, model_cfg)
    # each row at its own recorded best lr (row_settings.RECORDED_BEST_LR) unless --lr is given
    row_lr, lr_source = row_settings.row_lrs(specs, args.lr)
    jobs = [(s, lr) for s in specs for lr in [row_lr[s.label]] + [
        x for x in map(grid_lr, grid) if abs(x - row_lr[s.label]) > 1e-12]]
    out = _out(args, "compare")
    if args.jobs < 1:
        raise CliError(f"--jobs must be a positive integer, got {args.jobs}")
    if _rank0():
        for line in compare_plan.shared_lr_warnings(specs, lr_source):
            print(line, flush=True)
        isolate = args.isolate if args.isolate is not None else (
            train_cfg.dist == "none" and row_settings.device_kind(train_cfg.device) == "cpu")
        slots = max(1, args.jobs) if isolate else 1
        estimates = compare_plan.estimate_jobs(jobs, model_cfg, train_cfg, make_optimizer)
        print(compare_plan.duration_text(jobs, estimates, slots), flush=True)
    if args.dry_run:
        return 0
    check_out(out, "compare")
    if not args.no_resume:
        check_rows(out, jobs)
    t0 = time.perf_counter()
    finals = run_many(jobs, args, model_cfg, train_cfg, corpus_info, out)
    _finish(out, finals, model_cfg, grid=bool(grid), shared_lr=None, row_lrs=row_lr,
            notes=_compare_notes(specs, row_lr, lr_source, dtype, args))
    if _rank0():
        print(f"compare: {len(jobs)} runs in {time.perf_counter() - t0:.0f} s; results in {out}")
    _close_dist()
    return 0


def _compare_notes(specs, row_lr: dict, lr_source: dict, dtype: torch.dtype, args) -> tuple[str, ...]:
    """The lines under compare's table: where each row's lr comes from, and the product dtype."""
    if args.lr is not None:
        lr_line = f"learning rate: every row at --lr {args.lr:.3g}"
    else:
        lr_line = (f"learning rate: each row at its own best lr in the committed records "
                   f"({row_settings.RECORDS_SETTING}; dobb_bench.training.row_settings): "
                   + "; ".join(f"{s.label} {row_lr[s.label]:.3g} ({lr_source[s.label]})" for s in specs)
                   + ". Pass --lr to put every row at one lr, --lr-grid to tune here")
    rule = ("the rule: bf16 where this device multiplies bf16 natively, fp32 elsewhere"
            if args.product_dtype == "rule" else "--product-dtype")
    has = [s.label for s in specs if any(k in s.hparams for k in row_settings.DTYPE_KEYS)]
    dtype_line = (f"product dtype: {row_settings.dtype_name(dtype)} ({rule}) for the matrix products of every "
                  f"row that has them ({', '.join(has) or 'none'}: Newton-Schulz, Dobb's projections), "
                  "so the optimizer step times compare like with like")
    return lr_line, dtype_line


def cmd_sweep(args) -> int:
    spec = parse_spec(args.optimizer + "".join(f":{h}" for h in args.hp or []))
    grid = _parse_grid(args.grid)
    model_cfg, train_cfg, corpus_info = run_configs(args)
    validate_spec(spec, model_cfg)
    out = _out(args, "sweep")
    jobs = [(spec, grid_lr(j)) for j in grid]
    check_out(out, "sweep")
    if not args.no_resume:
        check_rows(out, jobs)
    finals = run_many(jobs, args, model_cfg, train_cfg, corpus_info, out)
    _finish(out, finals, model_cfg, grid=True, shared_lr=None)
    _close_dist()
    return 0


def _parse_grid(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"malformed grid {text!r}: expected comma-separated numbers like -2,-1,0,1") from None
    if not values:
        raise CliError("the learning-rate grid is empty")
    return values


_NEGATIVE_LIST = re.compile(r"^-\d")


def _allow_negative_lists(p: argparse.ArgumentParser) -> None:
    """Lets ``--grid -2,-1,0,1`` parse: argparse would take ``-2,-1,0,1`` for an unknown flag.

    argparse decides with the parser's ``_negative_number_matcher``; widening it to
    any "-<digit>..." word is safe because no option of these parsers starts with a digit.
    """
    p._negative_number_matcher = _NEGATIVE_LIST


def add_parsers(sub) -> None:
    p = sub.add_parser("train", help="train one optimizer")
    p.add_argument("--optimizer", required=True, help="name for dobb.build_optimizer")
    p.add_argument("--hp", action="append", metavar="KEY=VALUE", help="optimizer hyperparameter (repeatable)")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after step N with a checkpoint (rerun without it to resume)")
    add_common_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="same model/data/seed, one run per optimizer (the main job)")
    p.add_argument("--optimizers", help=f"comma-separated NAME[:k=v...][@Label] (default: {DEFAULT_COMPARE})")
    p.add_argument("--lr-grid", help="also run each optimizer at lr_j = 5e-3*2**(j/2) for these j")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one child process per run (default on CPU without torchrun)")
    p.add_argument("--jobs", type=int, default=2, help="isolated runs at a time (default 2: two cores)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rows, their lrs and the expected duration, then stop without training")
    p.add_argument("--product-dtype", choices=("rule", "bfloat16", "float32"), default="rule",
                   help="dtype of every row's matrix products (Muon-family ns_dtype, Dobb's product_dtype) "
                        "unless its spec sets one; default 'rule': bf16 where the device runs it natively, "
                        "fp32 elsewhere")
    add_common_args(p)
    _allow_negative_lists(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="one optimizer over the paper's lr grid")
    p.add_argument("--optimizer", required=True, help="name for dobb.build_optimizer")
    p.add_argument("--hp", action="append", metavar="KEY=VALUE", help="optimizer hyperparameter (repeatable)")
    p.add_argument("--grid", default="-2,-1,0,1", help="grid indices j, lr_j = 5e-3*2**(j/2)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one child process per run (default on CPU without torchrun)")
    p.add_argument("--jobs", type=int, default=2, help="isolated runs at a time")
    add_common_args(p)
    _allow_negative_lists(p)
    p.set_defaults(func=cmd_sweep)
