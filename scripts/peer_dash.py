"""The authors' DASH (``ista-daslab-optimizers``' ``DashGpu``) in the bench's own training loop: the
cross-check row beside our ``dash``.

Same model, data, seed, schedule, lr and weight decay as ``dobb-bench compare`` (its flags are
accepted here unchanged) and the same split as our row: the hidden matrices of
``dobb.param_groups(model)`` go to the package's ``DashGpu`` (DASH's defaults, ``--block-size``),
embeddings, head, norms and biases to ``torch.optim.AdamW`` with betas (0.9, 0.95), as every matrix
optimizer of this package does. The package needs one side of every matrix divisible by the block
size, so its default 1024 does not run on the width-128 model: 128 (the row ``DASH 128``) does.

On CPU only the package's ``dash`` subpackage is loaded (its top-level ``__init__`` imports
optimizers built on CUDA extensions); its two Triton kernel modules, unused on the fp32 path, are
replaced by stubs that raise if called, and ``wandb`` (logging) by an empty module when missing.
The run lands in ``OUT/runs/<label>/metrics.jsonl`` for ``dobb-bench report --collect OUT``.

    PYTHONPATH=src python scripts/peer_dash.py --out runs/family-dash-peer --seed 0 --block-size 128
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import types
from dataclasses import replace
from pathlib import Path

import torch

import dobb
from dobb_bench.provenance import provenance
from dobb_bench.training import commands_train as T
from dobb_bench.training.train import run_training


def _triton_only(*args, **kwargs):
    raise RuntimeError("a Triton kernel of ista-daslab-optimizers was called on CPU")


def load_dash_package():
    spec = importlib.util.find_spec("ista_daslab_optimizers")
    if spec is None:
        raise SystemExit("ista-daslab-optimizers is not installed: pip install --no-deps ista-daslab-optimizers==1.1.15")
    pkg = types.ModuleType("ista_daslab_optimizers")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["ista_daslab_optimizers"] = pkg
    for name, kernels in (("utils.triton_kernels", ("update_dash_preconditioner",)),
                          ("utils.newton_schulz_triton", ("ns_line_1", "ns_line_2"))):
        stub = types.ModuleType(f"ista_daslab_optimizers.{name}")
        for k in kernels:
            setattr(stub, k, _triton_only)
        sys.modules[stub.__name__] = stub
    if importlib.util.find_spec("wandb") is None:
        sys.modules["wandb"] = types.ModuleType("wandb")
    return importlib.import_module("ista_daslab_optimizers.dash")


class _Pair(torch.optim.Optimizer):
    """``DashGpu`` for the matrices and ``AdamW`` for the rest behind one optimizer object: their
    param group dicts are shared, so the scheduler's lr reaches both (``DashGpu`` reads its first
    group's lr at every step)."""

    def __init__(self, dash, adamw):
        self.parts = (dash, adamw)
        super().__init__([p for o in self.parts for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in self.parts for g in o.param_groups]

    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):  # for the record's state size: AdamW's state and DASH's stacked buffers
        dash = self.parts[0].dash_processor_2d
        bufs = [t for h in (dash.G, dash.LR, dash.invLR, dash.A, dash.Pshmp, dash.tildeG) if h is not None
                for t in h._state.values()]
        return {"state": {"adamw": self.parts[1].state_dict()["state"], "dash": {i: t for i, t in enumerate(bufs)}},
                "param_groups": []}


def make_factory(D, lr: float, weight_decay: float, block_size: int):
    def make(model):
        groups = dobb.param_groups(model, algorithm="dash")
        mats = [p for g in groups if g["algorithm"] != "adamw" for _, p in g["params"]]
        rest = [{"params": [p for _, p in g["params"]], "weight_decay": g.get("weight_decay", weight_decay)}
                for g in groups if g["algorithm"] == "adamw"]
        dash = D.DashGpu([{"params": mats}], lr=lr, weight_decay=weight_decay,
                         config=D.DashConfig(block_size=block_size))
        return _Pair(dash, torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), eps=1e-8))

    return make


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    T.add_common_args(p)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--label", help="run label (default: 'DASH package B=<block size>')")
    args = p.parse_args(argv)
    args.argv = ["scripts/peer_dash.py", *(sys.argv[1:] if argv is None else argv)]
    D = load_dash_package()
    model_cfg, train_cfg, (corpus, _) = T.run_configs(args)
    label = args.label or f"DASH package {args.block_size}"
    lr = train_cfg.lr
    out = Path(args.out or "bench-out/peer-dash")
    meta = {"run": label, "optimizer": "peer:ista_daslab_optimizers.DashGpu",
            "hparams": {"block_size": str(args.block_size)}, "lr": lr,
            "weight_decay": train_cfg.weight_decay, "provenance": provenance(args.argv)}
    final = run_training(model_cfg, replace(train_cfg, lr=lr), corpus,
                         make_factory(D, lr, train_cfg.weight_decay, args.block_size),
                         out_dir=out / "runs" / T.run_slug(label), meta=meta, progress=not args.no_progress,
                         resume=not args.no_resume, keep_checkpoint=False)
    print(f"{label}: final val loss {final.get('final_val_loss')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
