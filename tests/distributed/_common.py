"""Shared pieces of the distributed tests: a tiny float64 model, data, a training loop, a reference.

Why float64 everywhere (parameters, statistics, bases): Dobb's sign normalization is discontinuous,
so a sharded run can only be compared with a single-process run if rounding differences (the order
of a reduction) stay far below the size of any coefficient; in float64 they do.
"""
from __future__ import annotations

import contextlib
import dataclasses
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dobb.core.optimizer as dobb_module
from _compare import max_diff  # noqa: F401  (the suite's one comparison helper, re-exported for the workers)
from dobb import Dobb
from dobb.meter import PayloadMeter

D, H, OUT, N = 16, 32, 8, 8  # input width, hidden width, outputs, global batch rows
STEPS, REFRESH, BLOCKS = 4, 2, 4
SHAPES = {"fc1": (32, 16), "fc2": (16, 32), "head": (8, 16)}  # (m, n) of Net's matrices

VARIANTS = {
    "dobb": dict(norm="sign", side="input", source="activation"),
    "dobb-l2": dict(norm="l2", side="input", source="activation"),
    "dobb-g": dict(norm="sign", side="output", source="output_grad"),
    "dobb-g-l2": dict(norm="l2", side="output", source="output_grad"),
}


class Net(nn.Module):
    """``fc1`` (column-parallel under TP), ``fc2`` (row-parallel), a norm (AdamW) and a head."""

    def __init__(self, d=D, h=H, out=OUT, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(d, h, bias=False, dtype=torch.float64)
        self.fc2 = nn.Linear(h, d, bias=False, dtype=torch.float64)
        self.norm = nn.LayerNorm(d, dtype=torch.float64)
        self.head = nn.Linear(d, out, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)

    def forward(self, x):
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(x)))))

    matrices = ("fc1", "fc2", "head")


def data(steps=STEPS, rows=N, d=D, out=OUT, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d, generator=gen, dtype=torch.float64),
             torch.randn(rows, out, generator=gen, dtype=torch.float64)) for _ in range(steps)]


def groups(model, matrices=Net.matrices):
    mats = [getattr(model, m).weight for m in matrices]
    others = [p for p in model.parameters() if all(p is not q for q in mats)]
    return [{"params": mats}, {"params": others, "algorithm": "adamw"}]


def make_opt(model, variant, blocks=BLOCKS, matrices=Net.matrices, **kw):
    """Dobb on ``model``'s matrices; a DDP ``model`` is passed as is (its process group averages
    the statistics of plain parameters)."""
    # stagger off unless a test asks: the payload checks name the steps that refresh every matrix;
    # the unsplit refresh unless a test asks: the payload checks are Table 3's (the library's default
    # split, bitwise the same bases, adds its basis broadcasts: test_refresh_split_default.py)
    kw = {**VARIANTS[variant], "stagger": False, "split_refresh": False, **kw}
    inner = model.module if isinstance(model, DDP) else model
    return Dobb(groups(inner, matrices), model, lr=0.02, weight_decay=0.01, blocks=blocks, refresh_every=REFRESH,
                basis_dtype=torch.float64, stat_dtype=torch.float64, **kw)


def train(model, opt, batches, shard=(0, 1), meter=False):
    """Steps on rows ``[r*N/P, (r+1)*N/P)`` of each batch for ``shard = (r, P)``.

    Returns per step ``(collectives in step() other than Dobb's statistic and finiteness
    reductions, Dobb statistic entries (sums, counts and any finiteness flags folded in), all
    collectives in forward/backward, norm entries in step(), finiteness-only reductions)``.
    """
    r, p = shard
    log = []
    for x, y in batches:
        rows = x.shape[0] // p
        xs, ys = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
        with PayloadMeter() as fb:
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            loss.backward()
        with PayloadMeter() as st:
            opt.step()
        opt.zero_grad()
        own = st.kind("stat").count + st.kind("finite").count
        log.append((st.collectives - own, st.kind("stat").numel + fb.kind("stat").numel, fb.collectives,
                    st.kind("norm").numel, st.kind("finite").count))
    return log


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (collective for DTensors: call on all ranks)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def reference(variant, blocks=BLOCKS, model_fn=Net, batches=None, matrices=Net.matrices, steps=STEPS, **kw):
    """The single-process run on the whole batch (no statistic averaging)."""
    model = model_fn()
    opt = make_opt(model, variant, blocks, matrices, **{**kw, "stat_group": None})
    train(model, opt, batches if batches is not None else data(steps))
    return full_params(model)


def stats(opt) -> list[torch.Tensor]:
    """Every matrix's block statistic as a full tensor (collective for DTensors)."""
    out = []
    for p in opt.param_groups[0]["params"]:
        t = opt.state[p]["stat"]
        out.append((t.full_tensor() if hasattr(t, "full_tensor") else t).clone())
    return out


def reference_stats(variant, **kw) -> list[torch.Tensor]:
    model = Net()
    opt = make_opt(model, variant, **{**kw, "stat_group": None})
    train(model, opt, data())
    return stats(opt)


def partitions(opt) -> list[list[int]]:
    """The global block sizes of every matrix, in parameter order."""
    return [list(opt._plans[p].layout.global_sizes) for g in opt.param_groups if g["algorithm"] != "adamw"
            for p in g["params"]]


@contextlib.contextmanager
def fixed_partitions(sizes: list[list[int]]):
    """Build the next optimizer's matrices with these block sizes (in parameter order).

    A sharded axis is cut at its shard boundaries first (18 rows over 4 ranks, B=4: 5,5,5,3, where a
    single process would cut 5,5,4,4); the single-process reference must use the same blocks to be
    the same algorithm.
    """
    queue = [list(s) for s in sizes]
    original = dobb_module.layout_for

    def patched(param, side, blocks, stat_group="default"):
        layout = original(param, side, blocks, stat_group)
        mine = queue.pop(0)
        assert sum(mine) == layout.shape[layout.blocked_axis] and len(mine) == blocks
        return dataclasses.replace(layout, local_sizes=mine, global_sizes=mine)

    dobb_module.layout_for = patched
    try:
        yield
    finally:
        dobb_module.layout_for = original


def state_keys(opt) -> list:
    """Sorted (param index, key) pairs of the optimizer state, for cross-rank comparison."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return sorted((index[id(p)], k) for p, st in opt.state.items() for k in st)


def same_on_all_ranks(obj) -> bool:
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return all(o == objs[0] for o in objs)


def per_rank(ranks, key):
    """The value of one check on every rank; a string is a rank's error report, shown on failure."""
    for res in ranks:
        assert not isinstance(res[key], str), res[key]
    return [res[key] for res in ranks]


N_PARAMS = 6  # Net's parameters: one finiteness flag each


def stat_entries(side, flags=N_PARAMS):
    """Table 3's excluded term, ``k^2 / B`` per matrix (k = blocked axis length), plus one token
    count per matrix and the finiteness flags folded into the same reduction (0 when not folded)."""
    return sum((n if side == "input" else m) ** 2 // BLOCKS + 1 for m, n in SHAPES.values()) + flags


def checker(results: dict):
    """``check(key, fn, *args)`` stores ``fn(*args)`` under ``key``, or the traceback of its failure
    (reported by the test that reads the key, so one failing check does not hide the others)."""
    def check(key, fn, *args, **kw):
        try:
            results[key] = fn(*args, **kw)
        except Exception:
            results[key] = traceback.format_exc()
    return check


def run_variant(rank, world, variant, wrap, shard, **kw):
    """Train ``wrap(Net())`` with Dobb and compare it with the single-process reference."""
    model = wrap(Net())
    inner = model.module if isinstance(model, DDP) else model
    opt = make_opt(model, variant, **kw)
    log = train(model, opt, data(), shard)
    stat_diff = max_diff(stats(opt), reference_stats(variant, **kw))
    return {"diff": max_diff(full_params(inner), reference(variant, **kw)), "log": log, "stat_diff": stat_diff,
            "placements": [tuple(getattr(s["stat"], "placements", ())) for s in (opt.state[p] for p in opt.param_groups[0]["params"])],
            "same_keys": same_on_all_ranks(state_keys(opt))}


def plain_and_sharded(cls, kw, w, grads, mesh, placement):
    """``cls`` on a plain parameter and on its DTensor placed by ``placement``, stepped on the same
    gradients (lr 0.1, weight decay 0.1): ``(plain, sharded, plain optimizer, sharded optimizer)``."""
    from torch.distributed.tensor import distribute_tensor

    a, b = nn.Parameter(w.clone()), nn.Parameter(distribute_tensor(w.clone(), mesh, [placement]))
    oa, ob = cls([a], lr=0.1, weight_decay=0.1, **kw), cls([b], lr=0.1, weight_decay=0.1, **kw)
    for g in grads:
        a.grad, b.grad = g.clone(), distribute_tensor(g.clone(), mesh, [placement])
        oa.step()
        ob.step()
    return a, b, oa, ob


# ----- synthetic DTensor problems (the sharded-baseline tests) ---------------------------------------
def weights_and_grads(shape, seed: int, steps: int):
    """A float64 weight and ``steps`` gradients of ``shape`` from ``seed`` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)])


def sharded_problem(mesh, cases, steps: int):
    """Parameters and per-step gradients for ``cases`` (``(shape, shard dim)``; case ``i`` seeded
    ``i``), each a DTensor sharded along its dim over the 1-D ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor
    params, grads = [], []
    for i, (shape, dim) in enumerate(cases):
        w, gs = weights_and_grads(shape, i, steps)
        params.append(nn.Parameter(distribute_tensor(w, mesh, [Shard(dim)], src_data_rank=None)))
        grads.append([distribute_tensor(g, mesh, [Shard(dim)], src_data_rank=None) for g in gs])
    return params, grads


def exchange(meter) -> list:
    """The records of ``meter`` less the finiteness check's all-reduce (kind ``"finite"``: every
    optimizer's ``nonfinite="raise"``, one float per parameter, checked in test_safety_sharded.py):
    the optimizer's own exchange, which the payload tests derive."""
    return [r for r in meter.records if r.kind != "finite"]


def metered_steps(opt, params, grads):
    """Steps ``opt`` through every gradient; per step ``(collectives, bytes, ops)`` of the payload meter,
    less the finiteness check's own all-reduce (kind ``"finite"``: ``nonfinite="raise"``, one float per
    parameter; tests/distributed/test_safety_sharded.py checks it), so the optimizer's exchange is counted."""
    log = []
    for t in range(len(grads[0]) if grads else 0):
        for p, gs in zip(params, grads):
            p.grad = gs[t]
        with PayloadMeter() as m:
            opt.step()
        records = exchange(m)
        log.append((len(records), sum(r.bytes for r in records), [r.op for r in records]))
    return log


def fsdp_net(mesh) -> nn.Module:
    """``Net`` under FSDP2: each matrix's layer, then the whole model, ``fully_shard``-ed on ``mesh``."""
    from torch.distributed.fsdp import fully_shard
    model = Net()
    for name in Net.matrices:
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def metered_train(model, opt, batches, shard, metered):
    """``train``'s row split of each batch, with ``metered(opt)`` (which steps) logged per step."""
    r, p = shard
    log = []
    for x, y in batches:
        rows = x.shape[0] // p
        torch.nn.functional.mse_loss(model(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows]).backward()
        log.append(metered(opt))
        opt.zero_grad()
    return log
