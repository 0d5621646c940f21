"""``dobb-bench project``: the optimizer step at scale, from a model that can be checked.

Per rank and per ``optimizer.step()``, a method's time is the sum of six terms (no overlap):

- **HBM**: the bytes of every element-wise pass of the step (each kernel reads its inputs and
  writes its outputs in full), over the HBM bandwidth. Bytes an entry of this rank's shard, and
  an entry of the statistics or factors beside it, come from the same trace as the kernel counts
  (``dobb_bench.cost.kernels``, ``dobb_bench.cost.trace``): AdamW 80 (8 passes, weight decay
  on), Muon 70 (50 around its Newton-Schulz call, on every shard; 20 in it, where it runs), Dobb
  48 with bf16 products (plus its basis and, on a refresh, its statistic). A published benchmark's
  own loop states its bytes, counted from its source (``loop_bytes``, ``other_update``);
- **matmul**: the FLOPs of the products (``roofline.step_cost``: Newton-Schulz quintic
  ``steps (4 a^2 b + 2 a^3)``, Dobb's projections ``4 rows k s`` and its refresh ``2 k s^2 +
  B (4/3) s^3``) over a stated fraction of the dense peak of the dtype they run in (bf16:
  Newton-Schulz and Dobb's projections with a bf16 basis; fp32: Dobb's refresh, Dion);
- **link**: each method's step collectives (logical entries from ``dobb_bench.cost.payload``)
  as bytes on the wire per rank over the link the group crosses (NVLink inside a node; across
  nodes a ring runs one channel per network card, so its bus bandwidth is the group's ranks a
  node times the per-GPU link, at most NVLink; an all-to-all sends to its on-node and off-node
  peers at once);
- **latency**: a fixed time per collective;
- **launch**: a per-kernel cost times the kernels the step launches. The counts per matrix, per
  group and per extra shape are the library's own, from a trace of its step on the path a GPU
  step takes (``dobb_bench.cost.kernels``; in the inputs under ``kernels``); the AdamW part of every
  method (embeddings, norms, biases) is charged torch's single-tensor count, 8 kernels a tensor (a model
  choice: on CUDA, torch defaults DTensors to its foreach path, since ``torch.distributed.tensor``
  adds DTensor to ``torch.optim``'s foreach types; the per-kernel cost is fitted on an AdamW point,
  so it carries that path's cost per tensor); a published benchmark's own loop states its counts
  (``kernels_per_matrix``, ``other_update``);
- **QR**: a cost per Householder QR factorization (cuSOLVER runs each as a sequence of panel
  kernels; a batched call of ``b`` blocks is ``b`` of them): Dobb's refresh blocks, Dion's factor.

The per-kernel and per-QR costs are the model's only fitted constants, each fitted on one named
published point (``fit`` in the inputs; ``fit_constants``); every other calibration point is a
check the model was not fitted to.

Layouts: FSDP2 shards dim 0 over ``fs`` ranks; TP column-parallel shards the output axis, row-
parallel the input axis (``dobb_bench.cost.matrices``' split); ``dp`` replicas repeat the step.
Owner compute spreads whole matrices over the ``fs x tp`` ranks of one replica by the library's
greedy plan (``dobb.collectives.plan_owners`` on NS5 FLOPs); the busiest owner sets the step.
Dobb's blocks are cut at shard boundaries (the library's rule), so its block width is
``min(n / B, local width)``. Parameters that are not hidden matrices are AdamW's in every method. Calibration points model
what the published code ran (``projection_inputs.json``, each with its source): the paper's GPT-2
with its fused ``3d x d`` attention projection, its Dobb's products in fp32, MatrixFSDP's two
Newton-Schulz steps on a bf16 model, and its stock FSDP2-Muon as ``torch.optim.Muon`` on DTensors
(``dtensor-muon``).

Every input (peak rates, efficiencies, bandwidths, latencies, shapes, hyperparameters, kernel
counts, the published figures it is compared with) is in ``projection_inputs.json`` beside this
file, each with its source.
"""
from __future__ import annotations

import json
from pathlib import Path

from dobb_bench.cost.projection_model import *  # noqa: F401,F403  (public names stay importable here)
from dobb_bench.cost.projection_model import (INPUTS, RECORD, ROOT, Hardware, Layout, Matrix, add_cost,  # noqa: F401
                                              all_to_all_time, kernel_count, load_inputs, local_shape, ns_flops,
                                              value_of, zero_cost,
                                              model_matrices, other_tensors, ring_time, seconds)
from dobb_bench.cost.projection_costs import *  # noqa: F401,F403
from dobb_bench.cost.projection_costs import COSTS, NotProjected, owner_plan, project  # noqa: F401
from dobb_bench.cost.projection_record import *  # noqa: F401,F403
from dobb_bench.cost.projection_record import (TABLES, TERM_KEYS, build, calibration_markdown,  # noqa: F401
                                               fit_constants, plot, projection_markdown, short_ms)
from dobb_bench.cost.shapes import preset

# ----------------------------------------------------------------------------- the user's model
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "granite")


def config_spec(config: str, inputs: dict) -> dict:
    """A model spec from a named shape (the inputs' ``models``) or a Hugging Face ``config.json``."""
    if config in inputs["models"]:
        return inputs["models"][config]
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"--config {config!r} is neither a file nor a named shape ({', '.join(inputs['models'])})")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {config}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {config}: a JSON object is expected")
    kind = cfg.get("model_type")
    try:
        if kind == "gpt2":
            d = int(cfg["n_embd"])
            return {"kind": "gpt2", "width": d, "layers": int(cfg["n_layer"]), "ffn": int(cfg.get("n_inner") or 4 * d),
                    "vocab": int(cfg["vocab_size"]), "context": int(cfg.get("n_positions", 1024))}
        if kind in LLAMA_LIKE:
            heads = int(cfg["num_attention_heads"])
            spec = {"kind": "llama", "width": int(cfg["hidden_size"]), "layers": int(cfg["num_hidden_layers"]),
                    "heads": heads, "kv_heads": int(cfg.get("num_key_value_heads") or heads),
                    "ffn": int(cfg["intermediate_size"]), "vocab": int(cfg["vocab_size"]),
                    "tied": bool(cfg.get("tie_word_embeddings", False)), "qk_norm": kind == "qwen3",
                    "qkv_bias": kind == "qwen2"}  # Hugging Face's Qwen2Attention: q, k, v with biases, o without
            if cfg.get("head_dim"):
                spec["head_dim"] = int(cfg["head_dim"])
            return spec
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--config {config}: a {kind} config needs {exc} (an integer)") from None
    raise ValueError(f"--config {config}: model_type {kind!r} is not supported (gpt2, {', '.join(LLAMA_LIKE)})")


def call(name: str, **hp) -> str:
    """A row's name: the ``dobb.build_optimizer`` call that builds it (the model argument left out)."""
    return f"build_optimizer({name!r}" + "".join(f", {k}={v!r}" for k, v in hp.items()) + ")"


def user_rows(spec: dict, fs: int) -> list[tuple[str, str, dict]]:
    """``(row name, what it is, the projection's method)`` of every row ``project --config`` prices:
    the README's recommended optimizers (row-block Muon, Dobb-Muon and its per-head form, MuonBP,
    SOAP owner-computed) beside AdamW, owner-compute Muon and Dobb, each with the library's defaults
    (``dobb.registry.hparam_defaults``: refresh period, MuonBP's period, SOAP's precondition frequency
    and size limit) but the blocks; row blocks at the shard count ``fs`` (``blocks=<ranks>``), and
    Dobb's forms at ``B = fs`` and at the block width of their 20-tokens rows, 32 input columns
    (``B = width / 32``: width 128 in 4 blocks)."""
    import dobb.registry as reg
    from dobb.core.statistics import split_by_default

    dobb_hp, muonbp_hp, soap_hp = (reg.hparam_defaults(n) for n in ("dobb", "muonbp", "soap"))
    T = int(dobb_hp["refresh_every"])
    # the library's default refresh for a hook statistic: split over the statistic group, any device
    split = {"split_refresh": split_by_default(str(dobb_hp.get("source", "activation")))}
    shape = preset(spec["preset"]) if "preset" in spec else None  # a named GPT-2 shape (gpt2-xl)
    width = spec["width"] if shape is None else shape.width
    b32 = max(1, width // 32)
    heads = spec.get("heads") or (shape.heads if shape else max(1, width // 64))  # GPT-2: 64-wide heads
    rows = [
        (call("adamw"), "AdamW", {"kind": "adamw"}),
        (call("owner-muon"), "owner-compute Muon", {"kind": "owner-muon", "ns_bytes": 2}),
        (call("block-muon", axis=0, blocks=fs), "row-block Muon", {"kind": "row-block-muon", "blocks": fs}),
        (call("muonbp"), f"MuonBP P={muonbp_hp['period']}",
         {"kind": "muonbp", "period": int(muonbp_hp["period"]), "ns_bytes": 2}),
        (call("soap"), "SOAP, owner-computed", {"kind": "soap", "precondition_frequency": int(soap_hp["precondition_frequency"]),
                                                "max_precondition_dim": int(soap_hp["max_precondition_dim"])}),
        (call("dobb"), "Dobb B=1", {"kind": "dobb", "blocks": 1, "refresh_every": T, "kernels": "dobb-b1", **split}),
        (call("dobb", split_refresh=False), "Dobb B=1, every rank solving every block",
         {"kind": "dobb", "blocks": 1, "refresh_every": T, "kernels": "dobb-b1", "split_refresh": False}),
        (call("dobb", blocks=4), "Dobb B=4", {"kind": "dobb", "blocks": 4, "refresh_every": T, "kernels": "dobb-b4", **split}),
    ]
    forms = [(fs, "B = shards")] + ([(b32, "32 input columns")] if b32 != fs else [])
    for b, why in forms:
        if b not in (1, 4):  # those are the rows above
            rows.append((call("dobb", blocks=b), f"Dobb B={b} ({why})",
                         {"kind": "dobb", "blocks": b, "refresh_every": T, "kernels": "dobb-b4", **split}))
    for b, why in forms:
        for h in (None, heads):
            hp = {"blocks": b, "out_blocks": fs, **({"heads": h} if h else {})}
            rows.append((call("dobb-muon", **hp), f"Dobb-Muon B={b} ({why}) Bo={fs}" + (" per head" if h else ""),
                         {"kind": "dobb-muon", "refresh_every": T, **hp, **split}))
    rows += [
        (call("dion2", fraction=0.25, select="shard"), "Dion2 1/4 per shard", {"kind": "dion2-shard", "fraction": 0.25}),
        (call("dobb", side="both", out_blocks=4), "two-sided Dobb B=1 Bo=4",
         {"kind": "dobb-both", "blocks": 1, "out_blocks": 4, "refresh_every": T, "kernels": "dobb-both"}),
    ]
    return rows


def user_projection(spec: dict, gpus: int, tp: int, dtype: str, mfu: float, tokens: int, inputs: dict,
                    hardware: str = "h100-sxm") -> dict:
    """Every method's projected step on ``gpus`` ranks (FSDP ``gpus / tp`` x TP ``tp``), and its share
    of a training step whose forward and backward take ``6 params tokens / (gpus peak mfu)``."""
    if gpus < 1 or tp < 1 or gpus % tp:
        raise ValueError(f"--gpus {gpus} must be a positive multiple of --tp {tp}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu} must be in (0, 1]")
    if tokens < 1:
        raise ValueError(f"--tokens {tokens} must be positive")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"--dtype {dtype!r}: bf16 or fp32")
    if hardware not in inputs["hardware"]:
        raise ValueError(f"--hardware {hardware!r}: one of {', '.join(inputs['hardware'])}")
    bad = [k for k in ("width", "layers", "heads", "kv_heads", "ffn", "vocab", "head_dim")
           if k in spec and not (isinstance(spec[k], int) and spec[k] >= 1)]
    if bad:
        raise ValueError(f"the model's {', '.join(bad)} must be positive integers")
    if spec["kind"] == "llama" and (spec["width"] % spec["heads"] and not spec.get("head_dim")):
        raise ValueError("hidden_size must be a multiple of num_attention_heads (or give head_dim)")
    mats, other = model_matrices(spec)
    tensors = other_tensors(spec)
    fitted = fit_constants(inputs)
    hw = Hardware.from_inputs(inputs["hardware"][hardware], fitted)
    if dtype == "fp32":  # products in fp32 at its peak; NS5 operands move as 4 bytes
        hw = hw.with_(bf16_flops=hw.fp32_flops, bf16_eff=hw.fp32_eff)
    lay = Layout(gpus // tp, tp, 1)
    params = sum(x.m * x.n for x in mats) + other
    fwd_bwd_ms = 1e3 * 6 * params * tokens / (gpus * value_of(inputs["hardware"][hardware]["bf16_flops"]) * mfu)
    rows = []
    for label, what, method in user_rows(spec, lay.fs):
        m = dict(method, ns_bytes=4) if dtype == "fp32" and "ns_bytes" in method else method
        try:
            res = project(m, mats, other, lay, hw, True, inputs["kernels"]["methods"], tensors)
        except (NotProjected, KeyError) as exc:
            why = str(exc) if isinstance(exc, NotProjected) else f"no traced step {exc} in the inputs"
            rows.append({"method": label, "what": what, "kind": m["kind"], "not_projected": why})
            continue
        extra = {"stat_sync": True} if m["kind"].startswith("dobb") else {}
        steady = COSTS[m["kind"]](mats, lay, hw, m, inputs["kernels"]["methods"], **extra)["steady"]
        rows.append({"method": label, "what": what, "kind": m["kind"], **res,
                     "per_step_communication": steady["link_s"] + steady["latency_s"] > 0,
                     "share": res["amortized_ms"] / (fwd_bwd_ms + res["amortized_ms"])})
    return {"params": params, "matrices": len(mats), "other_tensors": tensors, "layout": {"fs": lay.fs, "tp": tp},
            "fwd_bwd_ms": fwd_bwd_ms, "fitted": fitted, "hardware": hardware, "rows": rows,
            "efficiency": {"bf16": hw.bf16_eff, "fp32": hw.fp32_eff}}


def inputs_fit(args) -> list[dict]:
    return load_inputs(args.inputs).get("fit", []) or [{"case": "the inputs", "published": "fixed"}]


def cheapest_line(rows: list[dict]) -> str:
    """The table's closing line: the row with the least amortized step among the projected rows, and
    the least among those whose steady step sends nothing (no per-step communication) where another."""
    done = [r for r in rows if "amortized_ms" in r]
    if not done:
        return "Cheapest: no row could be projected."
    low = min(done, key=lambda r: r["amortized_ms"])
    text = f"Cheapest at this scale: {low['method']} ({low['what']}), {short_ms(low['amortized_ms'])} ms amortized"
    quiet = [r for r in done if not r["per_step_communication"]]
    if quiet and low["per_step_communication"]:
        q = min(quiet, key=lambda r: r["amortized_ms"])
        text += (f"; among rows with no per-step communication: {q['method']} ({q['what']}), "
                 f"{short_ms(q['amortized_ms'])} ms")
    elif quiet:
        text += ", a row with no per-step communication"
    return text + "."


def user_text(res: dict, args) -> str:
    hw = res["hardware"]
    fit = res["fitted"]
    out = [f"{args.config}: {res['params'] / 1e9:.3g}B parameters, {res['matrices']} hidden matrices, "
           f"{res['other_tensors']} other tensors (AdamW); {args.gpus} x {hw}, FSDP {res['layout']['fs']} x TP {args.tp}",
           "", "| method | what | steady ms | periodic ms | amortized ms | HBM / matmul / link / latency / launch / QR ms "
           f"| share of a training step at MFU {args.mfu:g} |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "not_projected" in r:
            out.append(f"| {r['method']} | {r['what']} | not projected: {r['not_projected']} | | | | |")
            continue
        per = "—" if r["periodic_ms"] is None else short_ms(r["periodic_ms"]) + f" (every {r['every']})"
        terms = " / ".join(short_ms(r[k]) for k in TERM_KEYS)
        out.append(f"| {r['method']} | {r['what']} | {short_ms(r['steady_ms'])} | {per} | {short_ms(r['amortized_ms'])} "
                   f"| {terms} | {100 * r['share']:.2g}% |")
    out += ["", cheapest_line(res["rows"])]
    out += ["", "Assumptions:",
            f"- per rank, per optimizer.step(); the six terms add (no overlap); a periodic step (Dobb's refresh, "
            f"MuonBP's owner-compute full step, SOAP's basis refresh) amortized over its period (every N);",
            "- Dobb-Muon: three products with the input-side basis, NS5 on each row block (cut at shard boundaries), "
            "Dobb's refresh; SOAP: owner compute as owner-compute Muon (fp32 all-to-alls), four fp32 products a "
            "preconditioned side a step, a side over max_precondition_dim unpreconditioned; split_refresh: each "
            "block's solve on one rank of the statistic group, bases broadcast in bf16;",
            f"- {hw}: the datasheet rates in src/dobb_bench/cost/projection_inputs.json; products in {args.dtype} at "
            f"{100 * res['efficiency'][args.dtype]:.0f}% of peak (Dobb's refresh and Dion in fp32 at "
            f"{100 * res['efficiency']['fp32']:.0f}%);",
            f"- {1e6 * fit.get('kernel_s', 0):.3g} us a kernel and {1e6 * fit.get('qr_s', 0):.3g} us a QR "
            f"factorization, fitted on {'; '.join(f['case'] + ': ' + f['published'] for f in inputs_fit(args))}; "
            f"kernel counts and element-wise bytes from "
            f"a trace of the library's own step (dobb_bench.cost.kernels), eager, no torch.compile;",
            f"- FSDP2 over {res['layout']['fs']} ranks (dim 0), TP {args.tp} inside a node; owner-compute Muon on the "
            f"library's greedy owner plan (the busiest owner sets the time); Dobb's statistic all-reduce in the "
            f"refresh step; non-matrix parameters are AdamW's in every method;",
            f"- training step: forward + backward = 6 x {res['params'] / 1e9:.3g}B x {args.tokens} tokens / "
            f"({args.gpus} GPUs x bf16 peak x MFU {args.mfu:g}) = {short_ms(res['fwd_bwd_ms'])} ms; share = step / "
            f"(forward-backward + step);",
            "- the model's error on published steps: docs/results.md, table:projected-calibration."]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- command
def cmd_project(args) -> int:
    from dobb_bench.provenance import provenance

    inputs = load_inputs(args.inputs)
    if args.config is not None:
        if args.gpus is None:
            raise ValueError("--config needs --gpus N (the ranks to project on)")
        res = user_projection(config_spec(args.config, inputs), args.gpus, args.tp, args.dtype, args.mfu,
                              args.tokens, inputs, args.hardware)
        print(user_text(res, args), end="")
        return 0
    if args.gpus is not None:
        raise ValueError("--gpus goes with --config (a Hugging Face config.json or a named shape)")
    rec = build(inputs)
    rec["inputs"] = inputs
    rec["inputs_path"] = str(Path(args.inputs).resolve().relative_to(ROOT)) if Path(args.inputs).resolve().is_relative_to(ROOT) else str(args.inputs)
    rec["provenance"] = provenance(getattr(args, "argv", None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "projection.json").write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    if not args.no_plot:
        plot(rec, out / "projected_step.png")
    text = projection_markdown(rec) + "\n" + calibration_markdown(rec)
    (out / "projection.md").write_text(text)
    print(text, end="")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("project", help="model the optimizer step at scale (H100; GPT-2 XL, Llama-3-8B, or --config)")
    p.add_argument("--inputs", default=str(INPUTS), help="inputs JSON (default: the committed one beside the module)")
    p.add_argument("--out", default=str(RECORD.parent), help="folder for projection.json/.md and the plot")
    p.add_argument("--no-plot", action="store_true", help="write the record without projected_step.png")
    p.add_argument("--config", default=None,
                   help="a Hugging Face config.json or a named shape (gpt2-xl, llama3-8b, ...): print every method's "
                        "projected step for that model instead of writing the record")
    p.add_argument("--gpus", type=int, default=None, help="ranks (with --config; FSDP over gpus / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with --config)")
    p.add_argument("--dtype", default="bf16", help="dtype of the products: bf16 (default) or fp32")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilization of forward and backward (0.4)")
    p.add_argument("--tokens", type=int, default=2 ** 21, help="tokens a training step, all ranks (2^21)")
    p.add_argument("--hardware", default="h100-sxm", help="hardware entry of the inputs (h100-sxm)")
    p.set_defaults(func=cmd_project)
