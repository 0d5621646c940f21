"""Expert stacks: a 3-D parameter ``(E, out, in)`` (grouped MoE experts) optimized as ``E`` matrices.

Expert ``e`` computes ``x_e @ W[e].T`` for the tokens ``x_e`` routed to it. Dobb gives it what a
2-D ``(out, in)`` parameter gets, with a leading expert axis on the state: ``momentum`` is
``(E, out, in)``, ``stat`` and ``basis`` are ``(E, k, s_max)`` (each expert's row-stacked blocks,
see ``functional``), ``captures`` is a list with one counter per expert. Every expert has the same
block partition, so its equal-size blocks join one batched ``bmm``/QR/``eigh`` call over all
experts (``E * count`` blocks); no step loops over experts in Python.

Statistics: from ``Dobb.capture`` (the rows routed to each expert: an expert's statistic is the
mean over its own rows, and an expert that got no row in a refresh keeps its statistic and basis)
or ``source="grad_gram"`` (``G_e^T G_e / out`` per expert). Forward hooks cannot see the routing
and never capture for a stack.

Sharding (FSDP2 ``fully_shard``): only the expert axis may be sharded (``Shard(0)``, whole
experts per rank); any other placement would split an expert and is refused. When the expert
shards sit on data-parallel ranks, every rank captures all ``E`` experts (its tokens are routed to
all of them), the token-weighted sums are reduced over the statistic group, and each rank keeps its
own experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import functional as F
from ._dtensor import is_dtensor, to_local
from .layout import MatrixLayout, plain_features

__all__ = ["ExpertLayout", "expert_layout", "expert_parts", "stack_gram_statistic", "apply_stack", "refresh_stack"]


@dataclass
class ExpertLayout(MatrixLayout):
    """``MatrixLayout`` of one expert (``shape``, blocks) plus where the stack's experts are.

    ``experts``: the global ``E``; ``local_experts`` from ``expert_start`` are held by this rank;
    ``span_start``/``span_count``: the experts whose statistics this rank captures and reduces
    (all of them when the expert shards sit on data-parallel ranks, else its own).
    """

    experts: int = 1
    local_experts: int = 1
    expert_start: int = 0
    span_count: int | None = None  # ``span_start`` (inherited) is the first captured expert
    mesh: object = None
    state_placements: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        if self.span_count is None:
            self.span_start, self.span_count = self.expert_start, self.local_experts

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return to_local(t)

    @property
    def capture_shape(self) -> tuple[int, int, int]:
        return (self.span_count, sum(self.local_sizes), self.state_cols)

    @property
    def span_offset(self) -> int:
        """Index of the first local expert within the captured span."""
        return self.expert_start - self.span_start

    def capture_features(self, x: torch.Tensor) -> torch.Tensor:
        x = plain_features(x)
        if x.shape[-1] != self.shape[self.blocked_axis]:
            raise ValueError(f"captured features have last dimension {x.shape[-1]}, but each expert's input axis "
                             f"has length {self.shape[self.blocked_axis]}")
        return x

    def stat_to_state(self, stat: torch.Tensor) -> torch.Tensor:
        """Captured ``(span_count, k, s)`` statistics -> this rank's ``(local_experts, k, s)``."""
        return stat[self.span_offset : self.span_offset + self.local_experts]

    def new_block_state(self, dtype: torch.dtype, identity: bool, like: torch.Tensor) -> torch.Tensor:
        k, s, device = sum(self.local_sizes), self.state_cols, to_local(like).device
        if identity:
            one = F.identity_blocks(self.local_sizes, dtype=dtype, device=device)
            local = one.expand(self.local_experts, -1, -1).clone()
        else:
            local = torch.zeros(self.local_experts, k, s, dtype=dtype, device=device)
        if self.mesh is None:
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.state_placements, run_check=False,
                                  shape=torch.Size((self.experts, k, s)), stride=(k * s, s, 1))

    def mean(self, sums: torch.Tensor, totals: list[float]):
        """Per-expert means of reduced ``sums`` over ``totals`` rows: ``(local stat, has_rows per
        span expert)``, or None when no expert of the span got a row."""
        has = [t > 0 for t in totals]
        if not any(has):
            return None
        denom = torch.tensor([t if t > 0 else 1.0 for t in totals], dtype=sums.dtype, device=sums.device)
        return self.stat_to_state(sums / denom.view(-1, 1, 1)), has

    def mean_on_device(self, sums: torch.Tensor, totals: torch.Tensor):
        """``mean`` with the reduced ``totals`` left on the device (no host read): ``(local stat,
        has-rows per span expert as a bool tensor)``."""
        return self.stat_to_state(sums / totals.clamp_min(1).view(-1, 1, 1)), totals > 0


def expert_layout(param: torch.Tensor, side: str, blocks: int, stat_group=None) -> ExpertLayout:
    """The layout of a 3-D ``(E, out, in)`` stack (plain, or a DTensor sharded on the expert axis)."""
    E, m, n = (int(s) for s in param.shape)
    axis = 1 if side == "input" else 0
    sizes = F.block_sizes((m, n)[axis], blocks)
    if not is_dtensor(param):
        return ExpertLayout((m, n), (m, n), axis, sizes, 0, None if stat_group == "default" else stat_group,
                            None, experts=E, local_experts=E)
    from torch.distributed.tensor import Shard

    from .sharding import _resolve_stat_group, chunk_sizes

    mesh, placements = param.device_mesh, tuple(param.placements)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the parameter's device mesh")
    shard_dims = []
    for d, pl in enumerate(placements):
        if pl.is_replicate():
            continue
        if type(pl) is Shard and pl.dim % 3 == 0:
            shard_dims.append(d)
            continue
        raise ValueError(
            f"placement {pl} on mesh dim {d} would split the experts of this (E, out, in) = {(E, m, n)} stack; "
            f"Dobb needs whole experts per rank: shard the expert axis only (Shard(0), fully_shard's default)"
        )
    if len(shard_dims) > 1:
        raise ValueError(f"the expert axis is sharded over mesh dims {shard_dims}; Dobb supports one")
    E_local = int(param.to_local().shape[0])
    d_b = shard_dims[0] if shard_dims else None
    start = sum(chunk_sizes(E, mesh.size(d_b))[: coord[d_b]]) if d_b is not None else 0
    stat_dims, group = _resolve_stat_group(mesh, stat_group, d_b)
    span_start, span_count = (0, E) if d_b is None or d_b in stat_dims else (start, E_local)
    return ExpertLayout((m, n), (m, n), axis, sizes, 0, group, None, experts=E, local_experts=E_local,
                        expert_start=start, span_start=span_start, span_count=span_count, mesh=mesh,
                        state_placements=placements)


def stack_gram_statistic(grad_local: torch.Tensor, layout: ExpertLayout, dtype=torch.float32) -> torch.Tensor:
    """``grad_gram`` per expert: diagonal blocks of ``G_e^T G_e / out`` (input side) or
    ``G_e G_e^T / in`` (output side), ``(local_experts, k, s)``; all experts in one ``bmm`` per run."""
    g = grad_local if layout.blocked_axis == 1 else grad_local.transpose(1, 2)
    E, rows, k = g.shape
    out = g.new_zeros(E, k, layout.state_cols, dtype=dtype)
    with torch.autocast(device_type=g.device.type, enabled=False):
        for run in F.block_runs(layout.local_sizes):
            xs = (g[:, :, run.start : run.stop].to(dtype).reshape(E, rows, run.count, run.size)
                  .transpose(1, 2).reshape(E * run.count, rows, run.size))
            blocks = torch.bmm(xs.transpose(1, 2), xs).view(E, run.count, run.size, run.size)
            out[:, run.start : run.stop, : run.size].view(E, run.count, run.size, run.size).copy_(blocks)
    return out.div_(layout.rows)


def stack_block_view(stacked: torch.Tensor, run: F.BlockRun) -> torch.Tensor:
    """``(E, count, size, size)`` view of a run in ``(E, k, s_max)`` block state."""
    return stacked[:, run.start : run.stop, : run.size].reshape(stacked.shape[0], run.count, run.size, run.size)


def apply_stack(layout: ExpertLayout, basis: torch.Tensor, ut: torch.Tensor, pt: torch.Tensor, norm: str,
                factor: float, dtype: torch.dtype) -> None:
    """``W_e[:, b] += factor * normalize(U_e[:, b] Q_eb) Q_eb^T`` for every expert and block: one
    ``bmm`` pair per run of equal blocks, over all local experts."""
    uo, po = (ut, pt) if layout.blocked_axis == 1 else (ut.transpose(1, 2), pt.transpose(1, 2))
    E, r = uo.shape[0], uo.shape[1]
    if E == 0:
        return
    for run in F.block_runs(layout.local_sizes):
        c_, s_ = run.count, run.size
        ub = uo[:, :, run.start : run.stop].to(dtype).reshape(E, r, c_, s_).transpose(1, 2).reshape(E * c_, r, s_)
        q = stack_block_view(basis, run).reshape(E * c_, s_, s_).to(dtype)
        o = torch.bmm(F.block_coefficients(ub, q, norm), q.transpose(1, 2))
        po[:, :, run.start : run.stop].view(E, r, c_, s_).add_(o.view(E, c_, r, s_).transpose(1, 2), alpha=factor)


def refresh_stack(state: dict, layout: ExpertLayout, new: torch.Tensor, has, due: list[bool],
                  group: dict, add) -> None:
    """The statistic update of a stack's refresh, per expert as for a matrix of its own: experts of
    the span that are ``due`` and ``has`` rows count a capture; the local ones among them fold ``new``
    (``(local_experts, k, s)``) into their statistic (copy on the first capture, else the EMA) and
    queue their blocks through ``add((size, exact), a, q0, put)`` for the batched basis refresh
    (``put(q)`` stores the new bases). The others keep statistic and basis.

    ``has`` is a list of bools, or a bool tensor on the device (every expert already has a
    statistic, and no host read was made): then every due expert counts a capture and the
    keep-or-update choice per expert is a ``torch.where``."""
    lo, E = layout.span_offset, layout.local_experts
    captures = state["captures"]
    keep = None
    if isinstance(has, torch.Tensor):
        keep, has = has[lo : lo + E], [True] * len(captures)
    first = [captures[lo + i] == 0 for i in range(E)]
    mine = [due[lo + i] and has[lo + i] for i in range(E)]
    for j in range(len(captures)):
        if due[j] and has[j]:
            captures[j] += 1
    if not any(mine):
        return
    stat, basis = layout.local(state["stat"]), layout.local(state["basis"])
    new = new.to(stat.dtype)
    first_t = torch.tensor(first, device=stat.device).view(-1, 1, 1)
    merged = torch.where(first_t, new, stat.lerp(new, 1.0 - group["stat_decay"]))
    if keep is not None:
        merged = torch.where(keep.view(-1, 1, 1), merged, stat)
    chosen = [i for i in range(E) if mine[i]]
    if len(chosen) == E:
        stat.copy_(merged)
    else:
        idx = torch.tensor(chosen, device=stat.device)
        stat.index_copy_(0, idx, merged.index_select(0, idx))
    for exact in (True, False):
        sel = [i for i in chosen if (group["basis"] == "eigh" or (first[i] and group["init_basis"] == "eigh")) == exact]
        if not sel:
            continue
        idx = None if len(sel) == E else torch.tensor(sel, device=stat.device)
        for run in F.block_runs(layout.local_sizes):
            sv, bv = stack_block_view(stat, run), stack_block_view(basis, run)
            a = (sv if idx is None else sv.index_select(0, idx)).reshape(-1, run.size, run.size)
            q0 = (bv if idx is None else bv.index_select(0, idx)).reshape(-1, run.size, run.size)
            k4 = None if keep is None else (keep if idx is None else keep.index_select(0, idx)).view(-1, 1, 1, 1)
            if idx is None:
                def put(q, bv=bv, k4=k4):
                    q = q.view(bv.shape)
                    bv.copy_(q if k4 is None else torch.where(k4, q, bv))
            else:
                def put(q, bv=bv, idx=idx, k4=k4):
                    q = q.reshape(len(idx), *bv.shape[1:]).to(bv.dtype)
                    bv.index_copy_(0, idx, q if k4 is None else torch.where(k4, q, bv.index_select(0, idx)))
            add((run.size, exact), a, q0, put)


def expert_parts(features, expert, E: int, n: int, name: str) -> list[tuple[int, torch.Tensor]]:
    """``Dobb.capture``'s features for a stack as ``[(expert, rows)]``; a ValueError naming the
    parameter and the expected shapes otherwise."""
    usage = (f"{name} is an expert stack of {E} experts with input axis {n}: pass a list of {E} tensors "
             f"(expert e's routed rows, shape (..., {n})) or one tensor (..., {n}) with expert=<0..{E - 1}>")
    if expert is not None:
        if not isinstance(features, torch.Tensor) or isinstance(expert, bool) or not isinstance(expert, int) \
                or not 0 <= expert < E:
            raise ValueError(f"capture: got expert={expert!r} and {type(features).__name__}; {usage}")
        parts = [(expert, features)]
    elif isinstance(features, (list, tuple)) and len(features) == E:
        parts = list(enumerate(features))
    else:
        got = (f"a tensor of shape {tuple(features.shape)} without expert=" if isinstance(features, torch.Tensor)
               else f"{type(features).__name__} of length {len(features)}" if isinstance(features, (list, tuple))
               else type(features).__name__)
        raise ValueError(f"capture: got {got}; {usage}")
    for e, x in parts:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != n:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"capture: expert {e}'s features have shape {shape}; {usage}")
    return parts
