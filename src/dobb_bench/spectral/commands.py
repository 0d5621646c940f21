"""``dobb-bench orthogonality`` (paper Tables 1 and 2) and ``dobb-bench spectrum`` (Figure 2).

The command only: the experiments are pure table functions in ``dobb_bench.spectral.spectral_tables`` and
run/capture code in ``dobb_bench.spectral.spectral_run``; this module checks arguments, prints markdown and
draws Figure 2's plots. See docs/spectral.md for the constructions and measured numbers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dobb_bench.errors import CliError
from dobb_bench.spectral.spectral_run import run_spectrum, table2_from_training
from dobb_bench.spectral.spectral_tables import markdown, spectrum_report, table1a, table1b


def plot_spectrum(rows: list[dict], out_dir: Path) -> list[Path]:
    """Figure 2 layout: one PNG per statistic, one panel per fraction, effective rank vs depth,
    one curve per matrix type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fractions = sorted({r["fraction"] for r in rows})
    for stat, label in (("A", "activation second moment A (% of n)"), ("G", "output-gradient second moment G (% of m)")):
        fig, axes = plt.subplots(1, len(fractions), figsize=(3.2 * len(fractions), 3), sharey=True, squeeze=False)
        for ax, f in zip(axes[0], fractions):
            sel = [r for r in rows if r["stat"] == stat and r["fraction"] == f]
            for typ in sorted({r["type"] for r in sel}):
                pts = sorted((r["layer"], r["erank %"]) for r in sel if r["type"] == typ)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=typ)
            ax.set_title(f"{round(100 * f)}% of training")
            ax.set_xlabel("layer")
        axes[0][0].set_ylabel("effective rank (%)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=7)
        fig.suptitle(label, fontsize=9)
        fig.tight_layout(rect=(0, 0, 0.9, 1))
        path = out_dir / f"spectrum_{stat}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{what} must be positive integers, got {text!r}")
    return vals


def _positive(args, *names):
    for n in names:
        if getattr(args, n) is not None and getattr(args, n) <= 0:
            raise CliError(f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}")


def _add_training_args(p, steps: int):
    p.add_argument("--preset", default="small-cpu", help="model preset of dobb_bench.training.model (default small-cpu)")
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--optimizer", default="dobb", help="optimizer that trains the model (default dobb)")
    p.add_argument("--lr", type=float, default=2.5e-3, help="default 2.5e-3 (paper grid j = -2)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (default 0.1)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per training step (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order (default 0)")
    p.add_argument("--data", default=None, help="corpus (default: the interpreter's stdlib sources)")


def cmd_orthogonality(args) -> int:
    table = args.table.lower()
    if table not in ("1a", "1b", "2"):
        raise CliError(f"unknown table {args.table!r}; choose 1a, 1b or 2")
    _positive(args, "size", "seeds", "tokens", "steps", "lr", "batch_size", "probe_steps")
    if args.size < 2:
        raise CliError(f"--size must be at least 2, got {args.size}")
    if args.checkpoint is not None and table != "2":
        raise CliError("--checkpoint applies to --table 2 only")
    if not 0 < args.act_erank <= 1:
        raise CliError(f"--act-erank must be in (0, 1], got {args.act_erank}")
    if table == "1a":
        rows = table1a(args.size, args.seeds, profile=args.profile)
        print(f"Table 1(a): {args.size}x{args.size} Y, {args.profile} singular values, mean of {args.seeds} seeds")
    elif table == "1b":
        rows = table1b(args.size, args.seeds, act_target=args.act_erank, tokens=args.tokens, profile=args.profile)
        print(f"Table 1(b): G = D X^T, {args.size}x{args.size}, N = {args.tokens or 4 * args.size} tokens, "
              f"activation effective rank {args.act_erank:.0%}, mean of {args.seeds} seeds "
              "(the paper's values for 1(b) are not in the available text)")
    else:
        blocks = _int_list(args.blocks, "--blocks")
        rows, info = table2_from_training(args.preset, args.steps, args.optimizer, args.lr, args.weight_decay,
                                          args.batch_size, args.seed, args.data, blocks, args.checkpoint,
                                          args.probe_steps)
        src = f"checkpoint {args.checkpoint}" if args.checkpoint else \
            f"preset {args.preset} trained {args.steps} steps with {args.optimizer}"
        print(f"Table 2: {src}; {info['matrices']} matrices {info['shapes']}; momentum from {info['momentum']}; "
              f"last train loss {info['final loss']:.3f}")
    print(markdown([{k: f"{v:.0%}" if k.startswith("erank") else v for k, v in r.items()} for r in rows]))
    return 0


def cmd_spectrum(args) -> int:
    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            raise CliError(f"--from-json file {path} does not exist")
        saved = json.loads(path.read_text())
        rows, losses, a = saved["rows"], saved["losses"], argparse.Namespace(**saved["args"])
        out = path.parent
    else:
        _positive(args, "steps", "lr", "batch_size", "probe_batches")
        fractions = [int(v) / 100 for v in _int_list(args.fractions, "--fractions")]
        if max(fractions) > 1:
            raise CliError(f"--fractions are percentages in 1..100, got {args.fractions!r}")
        rows, losses = run_spectrum(args.preset, args.steps, fractions, args.optimizer, args.lr, args.weight_decay,
                                    args.batch_size, args.probe_batches, args.seed, args.data)
        out, a = Path(args.out), args
        out.mkdir(parents=True, exist_ok=True)
        (out / "spectrum.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                                       "rows": rows, "losses": losses}, indent=1))
    pngs = plot_spectrum(rows, out)
    print(f"Figure 2: preset {a.preset}, {a.steps} steps of {a.optimizer} (lr {a.lr}), final train loss "
          f"{losses[-1]:.3f}; second moments averaged over {a.probe_batches} probe batches")
    print(spectrum_report(rows))
    print("wrote " + ", ".join(str(p) for p in [out / "spectrum.json", *pngs]))
    return 0


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("orthogonality", help="update orthogonality (paper Tables 1 and 2)")
    p.add_argument("--table", required=True, help="1a, 1b or 2")
    p.add_argument("--size", type=int, default=768, help="matrix size for Table 1 (default 768)")
    p.add_argument("--seeds", type=int, default=3, help="random draws averaged for Table 1 (default 3)")
    p.add_argument("--profile", choices=("power", "geometric"), default="power",
                   help="singular-value / eigenvalue profile of the constructions (default power)")
    p.add_argument("--tokens", type=int, default=None, help="Table 1(b) token count N (default 4 x size)")
    p.add_argument("--act-erank", type=float, default=0.15, help="Table 1(b) activation effective rank")
    p.add_argument("--checkpoint", default=None, help="Table 2: checkpoint.pt of dobb-bench train (or its --out folder); default: train --preset")
    p.add_argument("--blocks", default="1,4,16", help="Table 2 block counts (Dion rank min(m,n)/B)")
    p.add_argument("--probe-steps", type=int, default=20, help="Table 2 with --checkpoint: gradients in the momentum")
    _add_training_args(p, steps=300)
    p.set_defaults(func=cmd_orthogonality)

    p = subparsers.add_parser("spectrum", help="effective rank of captured second moments (paper Figure 2)")
    _add_training_args(p, steps=400)
    p.add_argument("--fractions", default="25,50,75,100", help="percentages of training to measure at")
    p.add_argument("--probe-batches", type=int, default=4, help="batches averaged per measurement")
    p.add_argument("--out", default="runs/spectrum", help="folder for spectrum.json and the PNGs")
    p.add_argument("--from-json", default=None, help="re-report (tables, changes, PNGs) a saved spectrum.json; no training")
    p.set_defaults(func=cmd_spectrum)
