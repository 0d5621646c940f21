"""A peer package's released SOAP in the bench's own training loop: the cross-check row beside ours.

Same model, data, seed, schedule, lr and weight decay as ``dobb-bench compare`` (its flags are
accepted here unchanged); the optimizer is ``pytorch_optimizer.SOAP`` or ``heavyball.SOAP`` over
**all** parameters (embedding, head, norms and biases included, as a user of the package would
run it), package defaults otherwise. The run lands in ``OUT/runs/<label>/metrics.jsonl``, so
``dobb-bench report --collect OUT --study NAME`` takes it like any compare run.

    PYTHONPATH=src python scripts/peer_soap.py --package pytorch_optimizer --out runs/family-soap-peer --seed 0
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from dobb_bench.provenance import provenance
from dobb_bench.training import commands_train as T
from dobb_bench.training.train import run_training

PACKAGES = {"pytorch_optimizer": "pytorch_optimizer.SOAP", "heavyball": "heavyball.SOAP"}


def make_factory(package: str, lr: float, weight_decay: float, extra: dict):
    def make(model):
        if package == "pytorch_optimizer":
            from pytorch_optimizer import SOAP
        else:
            from heavyball import SOAP
        return SOAP(model.parameters(), lr=lr, weight_decay=weight_decay, **extra)

    return make


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    T.add_common_args(p)
    p.add_argument("--package", choices=sorted(PACKAGES), default="pytorch_optimizer")
    p.add_argument("--label", help="run label (default: '<package>.SOAP all params')")
    p.add_argument("--hparams", default="", help="extra constructor keywords, key=value:key=value")
    args = p.parse_args(argv)
    args.argv = ["scripts/peer_soap.py", *(sys.argv[1:] if argv is None else argv)]
    model_cfg, train_cfg, (corpus, _) = T.run_configs(args)
    extra = T.parse_hparams([x for x in args.hparams.split(":") if x], "--hparams")
    label = args.label or f"{PACKAGES[args.package]} all params" + "".join(f" {k}={v}" for k, v in extra.items())
    lr = train_cfg.lr
    out = Path(args.out or "bench-out/peer-soap")
    meta = {"run": label, "optimizer": f"peer:{PACKAGES[args.package]}",
            "hparams": {k: str(v) for k, v in extra.items()}, "lr": lr,
            "weight_decay": train_cfg.weight_decay, "provenance": provenance(args.argv)}
    final = run_training(model_cfg, replace(train_cfg, lr=lr), corpus,
                         make_factory(args.package, lr, train_cfg.weight_decay, extra),
                         out_dir=out / "runs" / T.run_slug(label), meta=meta, progress=not args.no_progress,
                         resume=not args.no_resume, keep_checkpoint=False)
    print(f"{label}: final val loss {final.get('final_val_loss')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
