"""Measured collectives and bytes per optimizer step under FSDP2, next to Tables 3/7's derived counts.

Why: the paper's communication claims (Dobb issues nothing in its step; Dobb-ell2 O(n); Muon O(mn);
Dion O(r(m+n)); the statistic sync n^2/B per refresh) are checked here by counting what each
optimizer really sends: every collective is caught by ``dobb.meter.PayloadMeter``. Launch::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/payload_fsdp.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 scripts/payload_fsdp.py

Model: the benchmark GPT (``dobb_bench.model``, preset ``tiny`` unless ``--preset``), float32,
``fully_shard`` on every block and the root (FSDP2 default ``Shard(0)``: the output axis ``m`` of
every matrix is sharded). Per optimizer, on rank 0: the first ``step()`` (a refresh step for Dobb)
and the next one (a non-refresh step), and the statistic reductions Dobb's capture hooks launch in
forward/backward of the refresh step. "derived" columns: ``dobb_bench.payload`` (leading logical
entries x 4 bytes); measured bytes are logical sizes (the gathered matrix for an all-gather, the
reduced tensor for an all-reduce; see ``dobb.meter``). FSDP's own all-gathers/reduce-scatters are
outside ``step()`` and not counted. Dion runs its distributed step (partial sums of ``B Q`` and
``B^T P``, see ``dobb/baselines/dion.py``), so its measured bytes are what that step sends; the
derived column is Table 3's ``r(m+n)``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dobb
from dobb.meter import PayloadMeter
from dobb_bench import payload as P
from dobb_bench.model import GPT, config_from_preset

DEFAULT_SPECS = ("adamw", "dobb", "dobb-l2", "dobb-g", "dobb-g-l2", "dobb:source=grad_gram", "muon",
                 "dion:rank_fraction=1", "dion:rank_fraction=1/4", "dion:rank_fraction=1/16",
                 "dion:rank_fraction=1/4,qr=rcqr",
                 "block-muon:axis=0", "block-muon:axis=1", "torch-muon")


def build(spec: str, model, blocks: int):
    name, hp = P.parse_spec(spec)
    if name == "torch-muon":  # torch.optim.Muon through DTensor op dispatch (no DTensor code of its own)
        return torch.optim.Muon(_hidden_matrices(model), lr=1e-3, adjust_lr_fn="match_rms_adamw"), {}
    if name.startswith("dobb") or name == "block-muon":
        hp.setdefault("blocks", blocks)
    if name.startswith("dobb"):
        hp.setdefault("check_finite", False)
    if name != "adamw":  # dobb.param_groups' split must be the matrix set the derived column counts
        matrices = {id(p) for g in dobb.param_groups(model, algorithm=name) if g["algorithm"] != "adamw"
                    for _, p in g["params"]}
        if matrices != {id(p) for p in _hidden_matrices(model)}:
            raise RuntimeError("dobb.param_groups no longer picks exactly the blocks' Linear weights")
    opt = dobb.build_optimizer(name, model, lr=1e-3, weight_decay=0.0, **hp)
    return opt, hp


def measure(spec: str, args, batches) -> dict:
    torch.manual_seed(0)
    model = GPT(config_from_preset(args.preset, layers=args.layers), seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    try:
        opt, hp = build(spec, model, args.blocks)
    except (ValueError, RuntimeError, TypeError) as exc:
        return {"spec": spec, "skipped": f"{type(exc).__name__}: {exc}"}
    out = {"spec": spec}
    for which, (idx, tgt) in zip(("step", "next_step"), batches):
        with PayloadMeter() as fb:
            _, loss = model(idx, tgt)
            loss.backward()
        with PayloadMeter() as st:
            opt.step()
        opt.zero_grad()
        out[which] = {"collectives": st.collectives, "bytes": st.bytes,
                      "by_op": {k: v.count for k, v in st.by_op.items()}}
        if which == "step":
            stat = fb.kind("stat")
            out["capture_stat"] = {"collectives": stat.count, "bytes": stat.bytes}
    shapes = [tuple(p.shape) for p in _hidden_matrices(model)]
    name = P.parse_spec(spec)[0]
    if name != "torch-muon":
        world = dist.get_world_size()
        out["derived_bytes"] = 4 * sum(P.payload_entries(name, m, n, hp, sharded="output", shards=world)
                                       for m, n in shapes)
        out["derived_stat_bytes"] = 4 * sum(P.dp_stat_entries(name, m, n, hp) for m, n in shapes)
    out["matrices"] = len(shapes)
    return out


def _hidden_matrices(model):
    """The matrices every matrix optimizer here updates (``dobb.param_groups``' rule on this GPT)."""
    return [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]


def markdown(results: list[dict], args, world: int) -> str:
    cfg = config_from_preset(args.preset, layers=args.layers)
    lines = [f"FSDP2 Shard(0) over {world} ranks (gloo, CPU), GPT preset {args.preset} ({cfg.layers} layers, "
             f"width {cfg.width}), B = {args.blocks}, rank 0, bytes are logical (fp32 = 4 bytes/entry)", "",
             "| optimizer | step: collectives | step: bytes | next step: collectives | next step: bytes "
             "| derived bytes/step (T3/T7) | capture stat: collectives | capture stat: bytes | derived stat bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['spec']} | skipped: {r['skipped'][:80]} |||||||")
            continue
        st, nx, cap = r["step"], r["next_step"], r.get("capture_stat", {})
        derived = r.get("derived_bytes")
        dstat = r.get("derived_stat_bytes")
        lines.append(f"| {r['spec']} | {st['collectives']} | {st['bytes']} | {nx['collectives']} | {nx['bytes']} | "
                     f"{'–' if derived is None else f'{derived:.0f}'} | {cap.get('collectives', 0)} | "
                     f"{cap.get('bytes', 0)} | {'–' if dstat is None else f'{dstat:.0f}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--optimizers", nargs="*", default=list(DEFAULT_SPECS))
    ap.add_argument("--json", default=None, help="also write the raw results here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config_from_preset(args.preset, layers=args.layers)
    gen = torch.Generator().manual_seed(1)
    rows = 2  # sequences per rank
    batches = []
    for _ in range(2):
        idx = torch.randint(cfg.vocab_size, (world * rows, cfg.seq_len), generator=gen)
        tgt = torch.randint(cfg.vocab_size, (world * rows, cfg.seq_len), generator=gen)
        batches.append((idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]))
    results = [measure(spec, args, batches) for spec in args.optimizers]
    if rank == 0:
        print(markdown(results, args, world), end="")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()  # no rank tears gloo down while a peer still finishes (seen: rare abort at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
