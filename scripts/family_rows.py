"""SOAP and Newton-Muon rows in the bench's own training loop, built from their classes as
``dobb.build_optimizer`` builds every matrix optimizer (``dobb.param_groups`` split: hidden matrices
to the class, embeddings/head/norms/biases to its AdamW part; ``model=`` for the hook reader).

Why a script beside ``dobb-bench compare``: the issue-24 runs started before the two names were in
the registry; the records are the same as compare's (``OUT/runs/<label>/metrics.jsonl``, the same
meta keys, collected with ``dobb-bench report --collect OUT --study NAME``). Flags are compare's.

    PYTHONPATH=src python scripts/family_rows.py --optimizer soap --hparams sides=input:blocks=4 \
        --label "SOAP one-sided B=4" --out runs/family-soap --seed 0
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dobb_bench.provenance import provenance
from dobb_bench.training import commands_train as T
from dobb_bench.training.train import run_training

NAMES = ("soap", "newton-muon")


def make_factory(name: str, lr: float, weight_decay: float, hparams: dict):
    def make(model):
        import dobb
        from dobb.baselines.muon_family.newton_muon import NewtonMuon
        from dobb.baselines.shampoo_family.soap import SOAP

        cls = SOAP if name == "soap" else NewtonMuon
        groups = dobb.param_groups(model, algorithm=cls.algorithm)
        extra = {"model": model} if cls is NewtonMuon else {}
        return cls(groups, lr=lr, weight_decay=weight_decay, **extra, **hparams)

    return make


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    T.add_common_args(p)
    p.add_argument("--optimizer", choices=NAMES, required=True)
    p.add_argument("--hparams", default="", help="key=value:key=value (compare's spec grammar)")
    p.add_argument("--label", required=True)
    args = p.parse_args(argv)
    args.argv = ["scripts/family_rows.py", *(sys.argv[1:] if argv is None else argv)]
    model_cfg, train_cfg, (corpus, _) = T.run_configs(args)
    hparams = T.parse_hparams([x for x in args.hparams.split(":") if x], "--hparams")
    lr = train_cfg.lr
    several_lrs = args.lr is not None  # a grid point: its folder names the lr, as compare's grid does
    out = Path(args.out or "bench-out/family")
    # one folder per (label, lr, seed): a later seed must not overwrite a finished run
    run_dir = out / "runs" / T.run_slug(args.label + (f"_lr{lr:.3g}" if several_lrs else "") + f"_s{train_cfg.seed}")
    meta = {"run": args.label, "optimizer": args.optimizer, "hparams": {k: str(v) for k, v in hparams.items()},
            "lr": lr, "weight_decay": train_cfg.weight_decay, "provenance": provenance(args.argv)}
    final = run_training(model_cfg, train_cfg, corpus, make_factory(args.optimizer, lr, train_cfg.weight_decay, hparams),
                         out_dir=run_dir, meta=meta, progress=not args.no_progress,
                         resume=not args.no_resume, keep_checkpoint=False)
    print(f"{args.label} lr {lr:.3g} seed {train_cfg.seed}: final val loss {final.get('final_val_loss')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
