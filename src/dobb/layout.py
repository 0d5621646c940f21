"""Where a matrix's blocks are: ``MatrixLayout`` (plain tensors; DTensor layouts extend it in
``sharding``, Dobb's expert stacks in ``dobb.core.experts``), the captured-feature checks that go
with it, and the package's one DTensor test and unwrap (``is_dtensor``, ``to_local``).

The optimizers ask ``placement.layout_for`` for a layout per matrix parameter and then work on
local tensors only (``layout.local(t)``); the math in ``functional`` never sees a DTensor.

Every layout describes a *stack* of matrices with the same blocks: a 2-D parameter is a stack of
one, an expert stack ``(E, out, in)`` one of ``E``. ``stacked(t)`` gives the local tensor with the
leading stack dim; ``stack_span`` matrices have their statistic captured, reduced and counted on
this rank (``stack_local`` of them held here, from ``stack_offset`` within the span). Dobb's step
works on that one form; only the layouts know which parameters are 2-D.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .functional import block_sizes, identity_blocks

__all__ = ["local_nonfinite", "MatrixLayout", "ReducedStat", "plain_features", "plain_layout", "is_dtensor", "is_dtensor_type",
           "to_local"]


# ----------------------------------------------------------------------------- the DTensor test
# By type name and not ``isinstance``: importing ``torch.distributed.tensor`` takes seconds, and a
# single-device user never needs it. Modules that build DTensors (``sharding``) import it themselves.
def is_dtensor_type(cls: type) -> bool:
    """Whether ``cls`` is ``torch.distributed.tensor.DTensor`` (a dispatch mode's ``types``)."""
    return cls.__name__ == "DTensor"


def is_dtensor(t) -> bool:
    return is_dtensor_type(type(t))


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view sharing storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


# ----------------------------------------------------------------------------- layouts


@dataclass
class ReducedStat:
    """A statistic every rank of its group agreed on, for one layout's stack.

    ``mean``: ``(stack_local, k_local, state_cols)``, the new statistic of each local matrix.
    ``seen``: per matrix of the captured span, whether it counts a capture (some rank saw a row).
    ``keep``: None when ``seen`` was decided on the host; else bool ``(stack_span,)`` on the device,
    False where no rank saw a row (that matrix keeps statistic and basis; ``seen`` is then all True:
    the capture counts, as the host did not look).
    """

    mean: torch.Tensor
    seen: list[bool]
    keep: torch.Tensor | None = None


@dataclass
class MatrixLayout:
    """How one ``m x n`` matrix parameter is laid out, and where its blocks are.

    ``blocked_axis`` is 1 for input-side blocks (Dobb) and 0 for output-side blocks (Dobb-G).
    ``local_sizes`` are the sizes of the blocks held locally, in order; ``local_start`` is the
    global index of the first local entry of the blocked axis.
    """

    shape: tuple[int, int]
    local_shape: tuple[int, int]
    blocked_axis: int
    local_sizes: list[int]
    local_start: int = 0
    # Group over which captured statistics are averaged (ranks that see different data), or None.
    stat_group: object | None = None
    # Group of ranks holding other rows of the same columns (input side) whose column norms must be
    # summed for ell2 normalization, or None when rows are not sharded.
    l2_group: object | None = None
    # Block sizes of the whole axis, identical on every rank (schedules derived from block sizes,
    # e.g. ``stagger``, must agree across ranks or their collectives would not match); None -> local.
    global_sizes: list[int] | None = None
    # The part of the blocked axis whose statistics this rank captures and reduces: None -> its own
    # blocks; else blocks ``span_sizes`` from ``span_start`` (the whole axis when the shards of the
    # blocked axis are spread over data-parallel ranks, see ``sharding``).
    span_start: int = 0
    span_sizes: list[int] | None = None

    def __post_init__(self):
        if self.global_sizes is None:
            self.global_sizes = list(self.local_sizes)

    @property
    def rows(self) -> int:
        """Global length of the axis that is not blocked (sign normalization divides by its root)."""
        return self.shape[1 - self.blocked_axis]

    @property
    def local_blocked_len(self) -> int:
        return self.local_shape[self.blocked_axis]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # ---------------------------------------------------------------- the stack view (see module doc)
    @property
    def stack_size(self) -> int:
        """Matrices in the whole stack (all ranks)."""
        return 1

    @property
    def stack_local(self) -> int:
        return 1

    @property
    def stack_span(self) -> int:
        return 1

    @property
    def stack_offset(self) -> int:
        return 0

    @property
    def routed(self) -> bool:
        """Whether the matrices' input rows are routed (an expert stack): forward hooks cannot see
        them, only ``Dobb.capture`` can."""
        return False

    def stacked(self, t: torch.Tensor) -> torch.Tensor:
        """The local tensor with the leading stack dim: ``(1, ...)`` for a matrix."""
        return self.local(t).unsqueeze(0)

    def mean(self, sums: torch.Tensor, totals: list[float]) -> ReducedStat:
        """Reduced captured ``sums`` over ``totals`` rows (known on the host) as the local statistic."""
        total = totals[0]
        return ReducedStat(self.stat_to_state(sums / total if total else sums).unsqueeze(0), [total > 0])

    def mean_on_device(self, sums: torch.Tensor, totals: torch.Tensor) -> ReducedStat:
        """``mean`` with the reduced row ``totals`` left on the device (no host read)."""
        return ReducedStat(self.stat_to_state(sums / totals.clamp_min(1)).unsqueeze(0), [True], totals > 0)

    @property
    def state_cols(self) -> int:
        """Columns of the local row-stacked block state (the largest block)."""
        return max(self.local_sizes) if self.local_sizes else 1

    @property
    def capture_sizes(self) -> list[int]:
        """Block sizes of the statistic this rank captures and reduces (see ``span_sizes``)."""
        return self.local_sizes if self.span_sizes is None else self.span_sizes

    @property
    def capture_shape(self) -> tuple[int, int]:
        """Shape of the captured (span) sums: row-stacked blocks, or ``(0, state_cols)`` when empty."""
        sizes = self.capture_sizes
        return (sum(sizes), max(sizes)) if sizes else (0, self.state_cols)

    def capture_features(self, x: torch.Tensor) -> torch.Tensor:
        """Features for the captured span: the local blocks, or the whole axis (``span_sizes``)."""
        x = plain_features(x)
        if self.span_sizes is None:
            return self.local_features(x)
        if x.shape[-1] != self.shape[self.blocked_axis]:
            raise ValueError(
                f"captured features have last dimension {x.shape[-1]}, but this layout averages the "
                f"statistic of the whole axis ({self.shape[self.blocked_axis]}) over ranks that hold "
                f"different blocks; pass Dobb(stat_group=...) without the mesh dims that shard it"
            )
        return x

    def stat_to_state(self, stat: torch.Tensor) -> torch.Tensor:
        """A captured (span) statistic ``(k_span, s)`` -> the local block-state shape ``(k_local, state_cols)``."""
        if self.span_sizes is not None:
            lo = self.local_start - self.span_start
            stat = stat[lo : lo + self.local_blocked_len]
        return self.pad_state_cols(stat)

    def pad_state_cols(self, stat: torch.Tensor) -> torch.Tensor:
        """Zero-pad a local ``(..., k_local, s)`` block tensor to the state's ``state_cols`` columns."""
        pad = self.state_cols - stat.shape[-1]
        return torch.nn.functional.pad(stat, (0, pad)) if pad > 0 else stat

    def local_features(self, x: torch.Tensor) -> torch.Tensor:
        """Restrict captured features (last dim = blocked axis) to the locally held blocks.

        Activations arrive with the full axis under data parallelism and FSDP, and already local
        under row-wise tensor parallelism; both are accepted.
        """
        x = plain_features(x)
        k = x.shape[-1]
        if k == self.local_blocked_len:
            return x
        if k == self.shape[self.blocked_axis]:
            return x[..., self.local_start : self.local_start + self.local_blocked_len]
        raise ValueError(
            f"captured features have last dimension {k}, but the matrix's blocked axis has length "
            f"{self.shape[self.blocked_axis]} (local {self.local_blocked_len}): is the hook on the right layer?"
        )

    def new_block_state(self, dtype: torch.dtype, identity: bool, like: torch.Tensor) -> torch.Tensor:
        """Row-stacked block storage ``(k_local, s_max)`` (see ``functional``), zeros or identity."""
        k, s = self.local_blocked_len, max(self.local_sizes) if self.local_sizes else 1
        if identity and self.local_sizes:
            return identity_blocks(self.local_sizes, dtype=dtype, device=like.device)
        return torch.zeros(k, s, dtype=dtype, device=like.device)


def plain_features(x: torch.Tensor) -> torch.Tensor:
    """Captured features as a plain tensor: a DTensor input (tensor parallel layers see their input
    as a DTensor inside forward hooks) is replaced by its local shard, which holds whole rows."""
    if not is_dtensor(x):
        return x
    for pl in x.placements:
        if pl.is_partial() or (pl.is_shard() and pl.dim % x.dim() != x.dim() - 1):
            raise ValueError(
                f"captured features are a DTensor with placements {tuple(x.placements)}: Dobb needs every "
                f"token row whole and present (Replicate, or Shard(-1) on the feature dim)"
            )
    return x.to_local()


def plain_layout(param: torch.Tensor, side: str, blocks: int, stat_group=None) -> MatrixLayout:
    """The layout of a plain (unsharded) matrix parameter; validates its block partition.

    ``stat_group`` is already resolved (a ProcessGroup or None, see ``collectives.plain_stat_group``).
    """
    m, n = param.shape
    axis = 1 if side == "input" else 0
    sizes = block_sizes(param.shape[axis], blocks)
    return MatrixLayout((m, n), (m, n), axis, sizes, 0, stat_group, None)



# ----------------------------------------------------------------------------- gradient finiteness
_NARROW = (torch.float16, torch.bfloat16)  # summed in fp32: a sum in their own dtype overflows early


def local_nonfinite(params: list[torch.Tensor], foreach: bool | None = None) -> torch.Tensor | None:
    """1.0 for every parameter whose local gradient holds NaN/Inf, else 0.0 (no host sync). ``foreach``:
    the accelerators' grouped reduction (default: on every device but a CPU).

    All zeros when this rank holds no gradient at all: the flags still take part in the step's
    collective, so a rank whose layers all went unused issues the same reductions as the others."""
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    if not params:
        return None
    if not with_grad:
        return torch.zeros(len(params), dtype=torch.float32, device=to_local(params[0]).device)
    grads = [to_local(params[i].grad) for i in with_grad]
    if not (grads[0].device.type != "cpu" if foreach is None else foreach):
        # A sum is finite iff every entry is (NaN and opposite infinities give NaN), barring an overflow
        # of the sum itself: in fp32 at least, that needs an entry whose square (a norm's) would
        # overflow first. One read of each gradient, the cheapest reduction there is on a CPU, where
        # torch._foreach_norm is a loop over the tensors (and its max-norm is not vectorised).
        sums = torch.stack([g.sum(dtype=torch.float32 if g.dtype in _NARROW else None) for g in grads])
    else:
        # accelerators: the max-norm of every gradient in one multi-tensor kernel per dtype (a kernel per
        # gradient is a launch per matrix). Non-finite iff some entry is (torch propagates NaN through it,
        # as clip_grad_norm_ relies on); the sum's overflow, far past any real gradient, is not reported.
        sums = torch.stack(torch._foreach_norm(grads, float("inf")))
    # 0 * x is 0 for a finite x and NaN for NaN or an infinity: 1.0 where the reduction is not finite
    bad = sums.mul(0.0).ne_(0.0)
    bad = bad if bad.dtype == torch.float32 else bad.to(torch.float32)
    if len(with_grad) == len(params):
        return bad
    flags = torch.zeros(len(params), dtype=torch.float32, device=bad.device)
    flags[with_grad] = bad
    return flags
