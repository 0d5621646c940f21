"""``dobb-bench ablate STUDY``: the paper's ablations (Tables 11-19) and our own choices, at CPU scale.

Every study is a list of optimizer specs (the ``compare`` syntax) with the paper's GPT-2 Small value
beside each, run on the same model, data and seed. Runs are cached in ``--out`` by label, so a spec
shared by several studies (the principal Dobb) trains once. ``--jobs 2`` runs two specs at a time
(one thread each), which is what a 2-core machine can hold.

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
from dobb_bench.training.commands_train import add_common_args, run_configs, run_many, validate_spec

P = "dobb:blocks=1"  # the principal Dobb setting (B=1 is the paper's ablation reference)

# study -> (title, [(spec, paper Small loss or None)], reference spec for the delta column)
STUDIES: dict[str, tuple[str, list[tuple[str, float | None]], str]] = {
    "normalization": ("Table 11: sign (Dobb) vs column l2 (Dobb-l2)", [
        (P, 3.017), ("dobb-l2:blocks=1", 3.043), ("dobb:blocks=4", 3.024), ("dobb-l2:blocks=4", 3.037),
        ("dobb:blocks=16", 3.026), ("dobb-l2:blocks=16", 3.036)], P),
    "source": ("Table 13: second-moment source", [
        (P, 3.017), ("dobb:blocks=1:source=grad_gram@Gram input", 3.027),
        ("dobb:blocks=1:source=grad_gram:side=output@Gram output", 3.055), ("dobb-g:blocks=1", 3.071),
        ("dobb-l2:blocks=1", 3.043), ("dobb-l2:blocks=1:source=grad_gram@Gram input l2", 3.042)], P),
    "basis": ("Table 12: output-gradient basis (Dobb-G) and its l2 variant", [
        ("dobb-g:blocks=1", 3.071), ("dobb-g-l2:blocks=1", 3.077), ("dobb-g:blocks=4", 3.067),
        ("dobb-g-l2:blocks=4", 3.071), ("dobb-g:blocks=16", 3.076), ("dobb-g-l2:blocks=16", 3.075)],
        "dobb-g:blocks=1"),
    "refresh": ("Table 14: refresh period T", [
        ("dobb:blocks=1:refresh_every=1", 3.005), ("dobb:blocks=1:refresh_every=4", 3.014), (P, 3.017),
        ("dobb:blocks=1:refresh_every=16", 3.017), ("dobb:blocks=1:refresh_every=100", 3.015)], P),
    "ortho": ("Table 15: orthogonal-iteration steps k and exact eigh", [
        (P, 3.017), ("dobb:blocks=1:ortho_steps=2", 3.019), ("dobb:blocks=1:ortho_steps=3", 3.017),
        ("dobb:blocks=1:basis=eigh", 3.015)], P),
    "qr": ("Table 16: QR routine", [
        (P, 3.017), ("dobb:blocks=1:qr=cholesky", 3.016), ("dobb:blocks=4", 3.024),
        ("dobb:blocks=4:qr=cholesky", 3.022)], P),
    "capture": ("Table 17: capture policy (needs --micro-batches > 1)", [
        (P, 3.017), ("dobb:blocks=1:capture=all", 3.021), ("dobb-g:blocks=1", 3.071),
        ("dobb-g:blocks=1:capture=all", 3.071)], P),
    "precision": ("Table 18: statistic / basis precision", [
        ("dobb:blocks=1:stat_dtype=float32:basis_dtype=float32@fp32/fp32", 3.023), (P, 3.017),
        ("dobb:blocks=1:stat_dtype=bfloat16:basis_dtype=float32@bf16/fp32", 3.028),
        ("dobb:blocks=1:stat_dtype=bfloat16@bf16/bf16", 3.027)], P),
    "nesterov": ("Table 19: Nesterov momentum", [
        (P, 3.017), ("dobb:blocks=1:nesterov=true", 3.014), ("dobb:blocks=4", 3.024),
        ("dobb:blocks=4:nesterov=true", 3.023), ("dobb:blocks=16", 3.026), ("dobb:blocks=16:nesterov=true", 3.030),
        ("muon:nesterov=false", 3.004), ("muon", 3.004), ("rmnp", 3.083), ("rmnp:nesterov=true", 3.072)], P),
    "choices": ("Our choices (SPEC [choice]): statistic EMA decay, first basis, momentum", [
        ("dobb:blocks=4:stat_decay=0.0", None), ("dobb:blocks=4:stat_decay=0.5", None), ("dobb:blocks=4", None),
        ("dobb:blocks=4:stat_decay=0.99", None), ("dobb:blocks=4:init_basis=identity", None),
        ("dobb:blocks=4:momentum=0.9", None), ("dobb:blocks=4:momentum=0.98", None)], "dobb:blocks=4"),
    "blocks": ("Block count B at this width (Table 11's Dobb column)", [
        (P, 3.017), ("dobb:blocks=2", None), ("dobb:blocks=4", 3.024), ("dobb:blocks=8", None),
        ("dobb:blocks=16", 3.026)], P),
}


def _label(spec: str) -> str:
    return parse_spec(spec).label


def run_study(name: str, args) -> str:
    title, rows, ref = STUDIES[name]
    model_cfg, train_cfg, corpus_info = run_configs(args)
    seeds = list(range(args.seed, args.seed + args.seeds))
    specs = [parse_spec(s) for s, _ in rows]
    for spec in specs:
        validate_spec(spec, model_cfg)  # on the real model's widths, not a probe's
    out = Path(args.out or "bench-out/ablate")
    jobs = [(spec, seed) for spec in specs for seed in seeds]

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
    paper = {_label(s): v for s, v in rows}
    ref_label, ref_paper = _label(ref), dict(rows).get(ref)
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
    names = list(STUDIES) if args.study == "all" else args.study.split(",")
    bad = [n for n in names if n not in STUDIES]
    if bad:
        raise CliError(f"unknown study {bad[0]!r}; choose from {', '.join(STUDIES)} or all")
    if args.jobs < 1 or args.seeds < 1:
        raise CliError("--jobs and --seeds must be positive integers")
    t0 = time.perf_counter()
    for name in names:
        print(run_study(name, args), flush=True)
    print(f"ablate: {len(names)} studies in {time.perf_counter() - t0:.0f} s")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("ablate", help="the paper's ablations (Tables 11-19) and our choices")
    p.add_argument("study", help=f"one of {', '.join(STUDIES)}, a comma list, or all")
    p.add_argument("--seeds", type=int, default=1, help="seeds per setting (from --seed)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None)
    add_common_args(p)
    p.set_defaults(func=cmd_ablate)
