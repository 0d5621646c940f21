"""Expert stacks: a 3-D parameter ``(E, out, in)`` (grouped MoE experts) optimized as ``E`` matrices.

Expert ``e`` computes ``x_e @ W[e].T`` for the tokens ``x_e`` routed to it. Dobb gives it what a
2-D ``(out, in)`` parameter gets: Dobb's step treats every matrix as a stack (a 2-D parameter is a
stack of one, see ``layout``), and ``ExpertLayout`` is the layout of a stack of ``E``. The state has
a leading expert axis: ``momentum`` is ``(E, out, in)``, ``stat`` and ``basis`` are ``(E, k, s_max)``
(each expert's row-stacked blocks, see ``functional``), ``captures`` has one counter per
expert (per side). Every expert has the same block partition, so its equal-size blocks join one batched
``bmm``/QR/``eigh`` call over all experts (``E * count`` blocks); only the two-sided
(``side="both"``) apply runs expert by expert.

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

from .. import functional as F
from ..layout import MatrixLayout, ReducedStat, is_dtensor, plain_features, to_local

__all__ = ["ExpertLayout", "expert_layout", "expert_parts"]


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

    # the stack view of ``MatrixLayout``: E experts
    @property
    def stack_size(self) -> int:
        return self.experts

    @property
    def stack_local(self) -> int:
        return self.local_experts

    @property
    def stack_span(self) -> int:
        return self.span_count

    @property
    def stack_offset(self) -> int:
        return self.span_offset

    @property
    def routed(self) -> bool:
        return True

    def stacked(self, t: torch.Tensor) -> torch.Tensor:
        return self.local(t)

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

    def mean(self, sums: torch.Tensor, totals: list[float]) -> ReducedStat:
        """Per-expert means of reduced ``sums`` over ``totals`` rows (an expert without rows divides by 1)."""
        denom = torch.tensor([t if t > 0 else 1.0 for t in totals], dtype=sums.dtype, device=sums.device)
        return ReducedStat(self.stat_to_state(sums / denom.view(-1, 1, 1)), [t > 0 for t in totals])

    def mean_on_device(self, sums: torch.Tensor, totals: torch.Tensor) -> ReducedStat:
        return ReducedStat(self.stat_to_state(sums / totals.clamp_min(1).view(-1, 1, 1)), [True] * self.span_count,
                           totals > 0)


def expert_layout(param: torch.Tensor, side: str, blocks: int, stat_group=None) -> ExpertLayout:
    """The layout of a 3-D ``(E, out, in)`` stack (plain, or a DTensor sharded on the expert axis)."""
    E, m, n = (int(s) for s in param.shape)
    axis = 1 if side == "input" else 0
    sizes = F.block_sizes((m, n)[axis], blocks)
    if not is_dtensor(param):
        return ExpertLayout((m, n), (m, n), axis, sizes, 0, None if stat_group == "default" else stat_group,
                            None, experts=E, local_experts=E)
    from torch.distributed.tensor import Shard

    from ..sharding import _resolve_stat_group, chunk_sizes

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
