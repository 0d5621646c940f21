"""``dobb-bench payload``: the derived cross-shard payload per optimizer (Tables 3, 7; Figure 1)
and, with ``--measure``, the bytes the payload meter counts in a small FSDP2 run next to it.

The derivation is ``dobb_bench.cost.payload``; the measured run is ``dobb-bench timing``'s runner on
``--measure-fs`` spawned gloo CPU processes.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from dobb_bench.cost import payload as P
from dobb_bench.cost.shapes import matrix_shapes, preset
from dobb_bench.cost.timing_report import jsonable
from dobb_bench.cost.timing_run import TimingConfig, run_timing
from dobb_bench.errors import CliError
from dobb_bench.specs import parse_spec

DEFAULT_PAYLOAD_OPTIMIZERS = (
    "adamw", "muon", "dion:rank_fraction=1", "dion:rank_fraction=1/4", "dion:rank_fraction=1/16", "rmnp",
    "pr-muon", "block-muon", "dion2", "dobb:blocks=16", "dobb-l2:blocks=16", "dobb-g:blocks=16",
    "dobb-g-l2:blocks=16", "owner-muon", "owner-placement", "normuon", "dion3", "muonbp", "dion2:select=shard",
)


def payload_rows(specs: list[str], shapes, sharded: str, shards: int) -> dict:
    """Per distinct shape and per optimizer: derived entries; plus the aggregate ratio to Muon."""
    parsed = []
    for text in specs:
        spec = parse_spec(text)
        P.canonical_name(spec.name)
        parsed.append((spec.text, spec.name, spec.hparams))
    counts: dict[tuple[int, int], int] = {}
    for _, shape in shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    rows = []
    for spec, name, hp in parsed:
        per_shape = {f"{m}x{n}": P.payload_entries(name, m, n, hp, sharded=sharded, shards=shards) for (m, n) in counts}
        rows.append({"optimizer": spec, "per_matrix": per_shape,
                     "relative_to_muon": P.relative_payload(name, hp, shapes, sharded=sharded, shards=shards),
                     "dp_stat_per_refresh": sum(P.dp_stat_entries(name, m, n, hp) * c for (m, n), c in counts.items()),
                     "dp_basis_per_refresh": sum(P.dp_basis_entries(name, m, n, hp) * c for (m, n), c in counts.items())})
    return {"shapes": {f"{m}x{n}": c for (m, n), c in counts.items()}, "rows": rows}


def payload_markdown(table: dict, title: str) -> str:
    shapes = list(table["shapes"])
    # split_refresh's basis broadcast gets a column only where a row has one (tables before it unchanged)
    split = any(r.get("dp_basis_per_refresh") for r in table["rows"])
    head = (["optimizer"] + [f"{s} (x{table['shapes'][s]})" for s in shapes] + ["aggregate / Muon mn", "DP stat sync per refresh"]
            + (["DP basis broadcast per refresh"] if split else []))
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table["rows"]:
        lines.append("| " + " | ".join([r["optimizer"]] + [f"{r['per_matrix'][s]:.4g}" for s in shapes]
                                       + [f"{r['relative_to_muon']:.4f}", f"{r['dp_stat_per_refresh']:.4g}"]
                                       + ([f"{r.get('dp_basis_per_refresh', 0):.4g}"] if split else [])) + " |")
    return "\n".join(lines) + "\n"


def _measure_worker(rank: int, world: int, port: int, cfg_dict: dict, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run_timing(TimingConfig(**cfg_dict))
        if rank == 0:
            Path(result_path).write_text(json.dumps(jsonable(result)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure_label(spec: str) -> str:
    """The timing label of a payload spec (``adamw`` is timed as ``torch-adamw``)."""
    name, _, rest = spec.partition(":")
    return {"adamw": "torch-adamw"}.get(name.strip().lower(), name.strip().lower()) + (":" + rest if rest else "")


def run_spawned(cfg: dict, world: int) -> dict:
    """``run_timing(TimingConfig(**cfg))`` on ``world`` spawned gloo CPU processes; rank 0's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_measure_worker, args=(world, _free_port(), cfg, path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


def measure_fsdp_payload(specs: list[str], preset_name: str, layers: str, fs: int, fused_qkv: bool = False) -> dict:
    """A small FSDP2 run (gloo, ``fs`` CPU processes): metered collectives/bytes per optimizer."""
    # a placement (owner-placement) is no optimizer: nothing to run, its step exchanges nothing
    names = [_measure_label(spec) for spec in specs if parse_spec(spec).name not in P.PLACEMENT_NAMES]
    return run_spawned(dict(preset=preset_name, layers=layers, fused_qkv=fused_qkv, optimizers=tuple(names),
                            repeats=1, warmup=1, fs=fs, meter=True, log=False, threads=1, blocks=fs,
                            refresh_every=3), fs)


def cmd_payload(args) -> int:
    shapes = matrix_shapes(args.preset, args.layers, args.fused_qkv)
    specs = list(args.optimizers)
    table = payload_rows(specs, shapes, args.sharded, args.shards)
    title = (f"Derived optimizer-specific cross-shard payload, logical entries per matrix per step: GPT-2 "
             f"{preset(args.preset).name} ({len(shapes)} matrices), {args.sharded} axis sharded over "
             f"{args.shards} devices (Tables 3, 7; Figure 1 uses output/FSDP, 4)")
    text = payload_markdown(table, title)
    measured = None
    if args.measure:
        mshapes = matrix_shapes(args.measure_preset, args.measure_layers, args.fused_qkv)
        mtable = payload_rows(specs, mshapes, "output", args.measure_fs)
        measured = measure_fsdp_payload(specs, args.measure_preset, args.measure_layers, args.measure_fs,
                                        args.fused_qkv)
        text += "\n" + _measured_markdown(mtable, measured, args, mshapes)
    else:
        text += "\n(measured bytes: add --measure for a small FSDP2 run with the payload meter)\n"
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "payload.md").write_text(text)
        (out / "payload.json").write_text(json.dumps(jsonable({"derived": table, "measured": measured}), indent=1))
    return 0


def _measured_markdown(mtable: dict, measured: dict, args, mshapes) -> str:
    lines = [f"Measured with the payload meter: GPT-2 {args.measure_preset} layers {args.measure_layers} "
             f"({len(mshapes)} matrices), FSDP2 FS={args.measure_fs} on CPU (gloo), rank 0, one optimizer.step() "
             "(PR-Muon: a full step); Dobb: a refresh step (T and B from the spec, else T = 3, B = FS) and the next "
             "step; its statistic mean (tagged 'stat') counts in the capture pass or the refresh step, wherever the "
             "library takes it. Derived bytes = entries x 4 (fp32); the meter counts each collective's logical "
             "tensor (constant collective factors omitted, as in Table 3).", "",
             "| optimizer | derived entries (all matrices) | derived bytes | measured collectives | measured bytes "
             "| next-step bytes | derived stat bytes per refresh | measured stat bytes per refresh "
             "| implementation note |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_label = {s["label"]: s for s in measured["summaries"]}
    for row in mtable["rows"]:
        spec = parse_spec(row["optimizer"])
        name, hp = spec.name, spec.hparams
        total = sum(P.payload_entries(name, m, n, hp, sharded="output", shards=args.measure_fs) for _, (m, n) in mshapes)
        if name in P.PLACEMENT_NAMES:
            fb = sum(P.forward_backward_entries(name, m, n, shards=args.measure_fs) for _, (m, n) in mshapes)
            lines.append(f"| {row['optimizer']} | {total:.4g} | {total * 4:.4g} | not run | | | | | a placement, "
                         f"not an optimizer: {fb:.4g} entries move in forward/backward instead |")
            continue
        s = by_label[_measure_label(row["optimizer"])]
        stat = sum(P.dp_stat_entries(name, m, n, {"blocks": args.measure_fs, **hp}) for _, (m, n) in mshapes) * 4
        if "skipped" in s:
            lines.append(f"| {row['optimizer']} | {total:.4g} | {total * 4:.4g} | skipped | {s['skipped']} | | | | |")
            continue
        mt = s.get("metered") or {}
        st, nx, cap = mt.get("step", {}), mt.get("next_step", {}), mt.get("capture_stat", {})
        stat_measured = cap.get("bytes", 0) + st.get("stat_bytes", 0) if cap or st.get("stat_bytes") else "–"
        note = "gathers whole matrices" if st.get("bytes") and st["bytes"] > 2 * total * 4 + stat else ""
        if name == "owner-muon":  # all-to-all inputs differ per rank; the meter reports rank 0's
            note = ("rank 0's share (its shards + the matrices it owns), summed over ranks = derived; "
                    "sent in ns_dtype (bf16 by default: 2 bytes an entry)")
        lines.append(f"| {row['optimizer']} | {total:.4g} | {total * 4:.4g} | {st.get('collectives', '–')} | "
                     f"{st.get('bytes', '–')} | {nx.get('bytes', '–')} | {stat:.4g} | {stat_measured} | {note} |")
    return "\n".join(lines) + "\n"


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("payload", help="derived cross-shard payload per matrix (Tables 3, 7; Figure 1)")
    p.add_argument("--preset", default="xl", help="GPT-2 size (default xl, Figure 1's)")
    p.add_argument("--layers", default=None, help="all (default), K or a:b")
    p.add_argument("--fused-qkv", action="store_true", help="one 3d x d qkv matrix instead of q, k, v")
    p.add_argument("--sharded", choices=("output", "input"), default="output",
                   help="sharded axis: output (rows; FSDP2, column-parallel TP; default) or input")
    p.add_argument("--shards", type=int, default=4, help="shard count (default 4, Figure 1's FS)")
    p.add_argument("--optimizers", nargs="+", default=list(DEFAULT_PAYLOAD_OPTIMIZERS), help="specs NAME[:key=value...] (dobb_bench.specs)")
    p.add_argument("--measure", action="store_true", help="also meter a small FSDP2 run (CPU, gloo processes)")
    p.add_argument("--measure-preset", default="small", help="with --measure: GPT-2 size of the metered run (default small)")
    p.add_argument("--measure-layers", default="1", help="with --measure: its layers, K or a:b (default 1)")
    p.add_argument("--measure-fs", type=int, default=2, help="with --measure: its FSDP2 ranks, >= 2 (default 2)")
    p.add_argument("--out", default=None, help="folder for payload.md and payload.json")
    p.set_defaults(func=_checked_payload)


def _checked_payload(args) -> int:
    if args.shards < 1:
        raise CliError(f"--shards must be >= 1, got {args.shards}")
    if args.measure_fs < 2:
        raise CliError(f"--measure-fs must be >= 2, got {args.measure_fs}")
    return cmd_payload(args)
