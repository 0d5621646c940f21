"""``dobb-bench ablate STUDY``: the paper's ablations (Tables 11-19) and our own choices, at CPU scale.

Every study is declared in ``dobb_bench.studies.catalog`` (``ablate-STUDY``: a fixed study, its rows
the optimizer specs with the paper's GPT-2 Small value beside each, its reference row and title);
this command runs its rows in process at the scale its flags give (model, steps, lr, ``--seeds``),
through compare's runner (``run_many``), where ``dobb-bench study ablate-STUDY run`` runs the
declared setting one ``dobb-bench compare`` at a time. Runs are cached in ``--out`` by label, so a
spec shared by several studies (the principal Dobb) trains once. ``--jobs 2`` runs two specs at a
time (one thread each), which is what a 2-core machine can hold.

Paper values are final validation losses on OpenWebText (nats/token, GPT-2 tokenizer); ours are
nats/token on byte-level CPython sources, so only the *differences* between rows compare.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from dobb_bench.errors import CliError
from dobb_bench.specs import parse_spec
from dobb_bench.studies.catalog import ABLATIONS, STUDIES
from dobb_bench.studies.define import Study
from dobb_bench.training.commands_train import run_many, validate_spec
from dobb_bench.training.run_args import add_common_args, run_configs


def study(name: str) -> Study:
    """The declared ablation ``name`` (``catalog.STUDIES["ablate-" + name]``)."""
    return STUDIES[f"ablate-{name}"]


def run_study(name: str, args) -> str:
    st = study(name)
    title, ref_label = st.title, st.reference
    model_cfg, train_cfg, corpus_info = run_configs(args)
    seeds = list(range(args.seed, args.seed + args.seeds))
    specs = [parse_spec(f"{r.spec}@{r.label}") for r in st.rows]
    for spec in specs:
        validate_spec(spec, model_cfg)  # on the real model's widths, not a probe's
    out = Path(args.out or "bench-out/ablate")
    # the declaration's plan at these seeds (a fixed study: one lr a row, here the flags' --lr)
    plan = replace(st, seeds=tuple(seeds))
    jobs = [(spec, seed) for row, spec in zip(st.rows, specs) for _, seed in plan.planned(row)]

    def one(job):
        spec, seed = job
        seed_out = out / f"seed{seed}"
        return spec.label, run_many([(spec, train_cfg.lr)], args, model_cfg, replace(train_cfg, seed=seed),
                                    corpus_info, seed_out)[0]

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, jobs))
    losses: dict[str, list[float]] = {}
    for label, final in results:
        loss = final.get("final_val_loss")
        losses.setdefault(label, []).append(float("nan") if loss is None else loss)
    paper = {r.label: r.paper for r in st.rows}
    ref_paper = paper.get(ref_label)
    ref_ours = statistics.mean(losses[ref_label])
    lines = [f"### {title}", "", f"{model_cfg.layers}/{model_cfg.width}/{model_cfg.heads} model, {train_cfg.steps} steps, "
             f"{train_cfg.batch_size} x {model_cfg.seq_len} tokens/step, {train_cfg.micro_batches} micro-batch(es), "
             f"lr {train_cfg.lr:.3g}, seeds {seeds}. Delta = row minus `{ref_label}`.", "",
             "| setting | paper loss | paper delta | our loss (nats/byte) | our delta | seed spread |",
             "|---|---|---|---|---|---|"]
    for label, vals in losses.items():
        p = paper.get(label)
        mean = statistics.mean(vals)
        spread = f"{max(vals) - min(vals):.4f}" if len(vals) > 1 else "-"
        pd = f"{p - ref_paper:+.3f}" if p is not None and ref_paper is not None else "-"
        lines.append(f"| {label} | {p if p is not None else '-'} | {pd} | {mean:.4f} | {mean - ref_ours:+.4f} | {spread} |")
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    with open(out / f"{name}.json", "w") as f:
        json.dump({"study": name, "losses": losses, "paper": paper, "reference": ref_label}, f, indent=1)
    return text


def cmd_ablate(args) -> int:
    names = list(ABLATIONS) if args.study == "all" else args.study.split(",")
    bad = [n for n in names if n not in ABLATIONS]
    if bad:
        raise CliError(f"unknown study {bad[0]!r}; choose from {', '.join(ABLATIONS)} or all")
    if args.jobs < 1 or args.seeds < 1:
        raise CliError("--jobs and --seeds must be positive integers")
    t0 = time.perf_counter()
    for name in names:
        print(run_study(name, args), flush=True)
    print(f"ablate: {len(names)} studies in {time.perf_counter() - t0:.0f} s")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("ablate", help="the paper's ablations (Tables 11-19) and our choices")
    p.add_argument("study", help=f"one of {', '.join(ABLATIONS)}, a comma list, or all")
    p.add_argument("--seeds", type=int, default=1, help="seeds per setting (from --seed)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one child process per run (default on CPU without torchrun)")
    add_common_args(p)
    p.set_defaults(func=cmd_ablate)
