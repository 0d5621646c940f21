"""Layouts of DTensor parameters (FSDP2, tensor parallel, FSDP x TP): all placement knowledge.

Why this module exists: Dobb's update is shard-local exactly when every block of the blocked axis
lies within one shard (docs/algorithm.md; the paper's Table 3). ``dtensor_layout`` reads a DTensor's mesh and
placements once, at optimizer construction, and turns them into a ``MatrixLayout``:

- the blocked axis may be sharded over at most one mesh dim (plain ``Shard``, ``torch.chunk``
  sizes, uneven and empty shards allowed); ``block_sizes`` cuts it at the shard boundaries, or
  raises the ``ValueError`` that lists the ``blocks`` values that work;
- the other axis may be sharded any way (``Shard``, ``_StridedShard``, over several mesh dims):
  those mesh dims form ``l2_group``, the ranks whose coefficient column norms Dobb-ell2 sums
  (Table 7's ``O(n)``) and whose gradient-Gram partial sums ``source="grad_gram"`` adds;
- statistics are averaged over the *data-parallel* mesh dims (ranks that see different data):
  by default every dim whose name does not contain ``"tp"`` (unnamed dims count as data-parallel,
  as in ``fully_shard``'s default mesh); ``stat_group`` overrides this with mesh dim names/indices,
  a ``ProcessGroup`` or ``None``;
- block state (``stat``, ``basis``; row-stacked ``(k, s_max)``) is a DTensor on the same mesh:
  ``Shard(0)`` over the mesh dim that shards the blocked axis, ``Replicate`` elsewhere, so DCP
  reshards it with the weight and every rank holds the same keys.

Anything the update cannot serve from local data (``Partial``, a ``_StridedShard`` or two mesh
dims on the blocked axis, a block straddling a shard, a ``stat_group`` mixing ranks that hold
different blocks) is a ``ValueError`` here, never a silent gather or a hang later.

The baselines' placement knowledge lives here too: ``gather_full`` / ``local_slice`` (the
all-gather Muon-type directions pay, and the way back to the local shard), ``rows_are_local``, and
``axis_split``: the ``AxisSplit`` of a matrix (which mesh dim splits each axis, this rank's offsets,
the process groups) through which Dion sums its ``O(r(m+n))`` partial products across shards.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ._torch_private import strided_shard_type
from .collectives import all_reduce_sum_
from .functional import block_sizes, identity_blocks
from .layout import MatrixLayout, is_dtensor, to_local

__all__ = ["DTensorLayout", "dtensor_layout", "data_parallel_dims", "chunk_sizes", "mesh_group", "AxisSplit", "axis_split",
           "gather_full", "local_slice", "rows_are_local", "row_wise", "replicate_like", "shard_count",
           "local_shapes", "per_shard_state", "axis_shard_counts"]

def chunk_sizes(length: int, parts: int) -> list[int]:
    """Shard lengths of an axis split ``torch.chunk``-style (DTensor ``Shard``): trailing shards may
    be shorter or empty (18 over 4 -> 5, 5, 5, 3; 2 over 4 -> 1, 1, 0, 0)."""
    chunk = -(-length // parts)
    return [max(0, min(chunk, length - i * chunk)) for i in range(parts)]


def axis_shard_counts(param: torch.Tensor) -> tuple[int, int]:
    """For each matrix axis of a 2-D DTensor (rows, columns): 1 when the axis is whole on every rank
    (replicated, or over mesh dims of size 1), the number of non-empty ``torch.chunk`` shards when one
    mesh dim cuts it with a plain ``Shard`` (a block count that many times over keeps every block
    within one shard, ``block_sizes``), 0 when it is cut otherwise (``_StridedShard``, several mesh
    dims: no block count keeps blocks within shards). Read from the mesh and placements alone: the
    same on every rank, no communication."""
    if param.dim() != 2:
        raise ValueError(f"axis_shard_counts takes a 2-D parameter, got shape {tuple(param.shape)}")
    mesh = param.device_mesh
    dims: list[list[int]] = [[], []]
    strided = [False, False]
    for d, pl in enumerate(param.placements):
        if pl.is_replicate() or mesh.size(d) == 1 or not (pl.is_shard() or isinstance(pl, strided_shard_type())):
            continue  # Partial: the layouts refuse it with their own message
        axis = pl.dim % 2
        dims[axis].append(d)
        strided[axis] |= type(pl) is not Shard
    counts = []
    for axis in (0, 1):
        if not dims[axis]:
            counts.append(1)
        elif len(dims[axis]) > 1 or strided[axis]:
            counts.append(0)
        else:
            sizes = chunk_sizes(int(param.shape[axis]), mesh.size(dims[axis][0]))
            counts.append(sum(1 for n in sizes if n > 0))
    return counts[0], counts[1]


def data_parallel_dims(mesh) -> tuple[int, ...]:
    """Mesh dims whose ranks see different data: names without ``"tp"``; unnamed dims all count."""
    names = mesh.mesh_dim_names
    if names is None:
        return tuple(range(mesh.ndim))
    return tuple(i for i, name in enumerate(names) if "tp" not in name.lower())


def _line_ranks(mesh, dims: tuple[int, ...]) -> set[int]:
    """Global ranks of the sub-mesh through this rank's coordinate that varies ``dims``."""
    coord = mesh.get_coordinate()
    grid = mesh.mesh
    index = [slice(None) if d in dims else coord[d] for d in range(mesh.ndim)]
    return {int(r) for r in grid[tuple(index)].flatten().tolist()}


def _group_over(mesh, dims: tuple[int, ...]):
    """Process group over the mesh dims ``dims`` (None when empty or of size 1)."""
    dims = tuple(d for d in sorted(dims) if mesh.size(d) > 1)
    if not dims:
        return None
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"reducing over several mesh dims {dims} needs a mesh with mesh_dim_names (to flatten "
            f"them); name the mesh dims or pass stat_group=<ProcessGroup>"
        )
    # The root mesh keeps its flattened meshes (``_flatten_mapping``), so the group lives and dies
    # with the mesh; flattening the same dims again returns the same mesh.
    return mesh[tuple(names[d] for d in dims)]._flatten().get_group()


def mesh_group(mesh):
    """A process group over every rank of ``mesh`` (None for a single rank)."""
    if mesh.size() == 1:
        return None
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if set(mesh.mesh.flatten().tolist()) == set(range(dist.get_world_size())):
        return dist.group.WORLD
    return _group_over(mesh, tuple(range(mesh.ndim)))


def _dim_index(mesh, d) -> int:
    names = mesh.mesh_dim_names or ()
    if isinstance(d, str):
        if d not in names:
            raise ValueError(f"stat_group names mesh dim {d!r}, but the parameter's mesh has dims {names}")
        return names.index(d)
    if isinstance(d, int) and not isinstance(d, bool) and 0 <= d < mesh.ndim:
        return d
    raise ValueError(f"stat_group entry {d!r} is neither a mesh dim name nor an index below {mesh.ndim}")


@dataclass
class DTensorLayout(MatrixLayout):
    """``MatrixLayout`` of a DTensor parameter; see the module docstring for the rules.

    Extra fields: ``mesh``; ``state_placements`` (for the row-stacked block state); ``s_max``
    (the global largest block: the column count of the block state on every rank, so the shards
    form one ``(k, s_max)`` DTensor). ``span_sizes`` is the whole axis when the shards of the
    blocked axis are spread over data-parallel ranks: each rank then captures all blocks, the
    averaged statistic is sliced to the local rows.
    """

    mesh: object = None
    state_placements: tuple = ()
    s_max: int = 1

    @property
    def state_cols(self) -> int:
        return self.s_max

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return to_local(t)

    def new_block_state(self, dtype: torch.dtype, identity: bool, like: torch.Tensor) -> torch.Tensor:
        k_local, device = self.local_blocked_len, self.local(like).device
        if identity and self.local_sizes:
            local = identity_blocks(self.local_sizes, dtype=dtype, device=device)
            local = torch.nn.functional.pad(local, (0, self.s_max - local.shape[1]))
        else:
            local = torch.zeros(k_local, self.s_max, dtype=dtype, device=device)
        k = self.shape[self.blocked_axis]
        return DTensor.from_local(local, self.mesh, self.state_placements, run_check=False,
                                  shape=torch.Size((k, self.s_max)), stride=(self.s_max, 1))


def dtensor_layout(param: torch.Tensor, side: str, blocks: int, stat_group="default") -> DTensorLayout:
    """The ``DTensorLayout`` of a 2-D DTensor parameter, or a ``ValueError`` saying why none works."""
    if side not in ("input", "output"):
        raise ValueError(f"side must be 'input' or 'output', got {side!r}")
    mesh, placements = param.device_mesh, tuple(param.placements)
    shape = tuple(int(s) for s in param.shape)
    local_shape = tuple(int(s) for s in param.to_local().shape)
    axis = 1 if side == "input" else 0
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the parameter's device mesh")

    blocked_dims, other_dims = [], []
    for d, pl in enumerate(placements):
        if isinstance(pl, Partial) or pl.is_partial():
            raise ValueError(
                f"Partial placement {pl} on mesh dim {d}: the parameter is an unreduced sum; Dobb needs "
                f"its values (redistribute it to Shard/Replicate first)"
            )
        if pl.is_replicate():
            continue
        if not (pl.is_shard() or isinstance(pl, strided_shard_type())):
            raise ValueError(f"unsupported placement {pl} on mesh dim {d}")
        dim = pl.dim % 2
        if dim != axis:
            other_dims.append(d)  # any sharding of the other axis is fine (its l2 group sums norms)
        elif type(pl) is not Shard:
            raise ValueError(
                f"placement {pl} shards the blocked axis (dim {axis}) in strides: Dobb's blocks are "
                f"contiguous and must lie within one shard. Under FSDP x TP shard the other axis with "
                f"FSDP (fully_shard(..., shard_placement_fn=lambda p: Shard({1 - axis})))"
                f" or block the other side"
            )
        else:
            blocked_dims.append(d)
    if len(blocked_dims) > 1:
        raise ValueError(
            f"the blocked axis (dim {axis}) is sharded over mesh dims {blocked_dims}; Dobb supports one "
            f"sharding mesh dim on the blocked axis (shard the other axis with one of them)"
        )

    length = shape[axis]
    if blocked_dims:
        d_b = blocked_dims[0]
        shard_sizes = chunk_sizes(length, mesh.size(d_b))
        me = coord[d_b]
        local_start = sum(shard_sizes[:me])
        if shard_sizes[me] != local_shape[axis]:
            raise ValueError(
                f"local shard of length {local_shape[axis]} on the blocked axis does not follow torch.chunk "
                f"sizes {shard_sizes}; Dobb cannot tell where its blocks are"
            )
    else:
        d_b, shard_sizes, local_start = None, None, 0
    global_sizes = block_sizes(length, blocks, shard_sizes)
    starts = list(itertools.accumulate([0, *global_sizes[:-1]]))
    local_sizes = [s for s, a in zip(global_sizes, starts) if local_start <= a < local_start + local_shape[axis]]

    stat_dims, group = _resolve_stat_group(mesh, stat_group, d_b)
    if d_b is not None and d_b in stat_dims:
        # The shards of the blocked axis sit on ranks with different data: each rank captures the
        # whole axis (its activations are unsharded), the mean is taken over all of it, and the
        # local rows are kept. Payload: the full n^2/B statistic, as under plain data parallelism.
        span_start, span_sizes = 0, global_sizes
    else:
        span_start, span_sizes = local_start, None

    state_placements = tuple(Shard(0) if d == d_b else Replicate() for d in range(mesh.ndim))
    return DTensorLayout(
        shape=shape, local_shape=local_shape, blocked_axis=axis, local_sizes=local_sizes,
        local_start=local_start, stat_group=group, l2_group=_group_over(mesh, tuple(other_dims)),
        global_sizes=global_sizes, mesh=mesh, state_placements=state_placements,
        s_max=max(global_sizes), span_start=span_start, span_sizes=span_sizes,
    )


def _resolve_stat_group(mesh, stat_group, d_b):
    """``(data-parallel mesh dims, process group)`` for the statistic mean; see the module docstring."""
    if isinstance(stat_group, dist.ProcessGroup):
        ranks = set(dist.get_process_group_ranks(stat_group))
        for dims in _dim_subsets(mesh.ndim):  # a group that is a set of mesh dims is treated as those dims
            if _line_ranks(mesh, dims) == ranks:
                return dims, stat_group if len(ranks) > 1 else None
        if d_b is not None and (_line_ranks(mesh, (d_b,)) & ranks) - {dist.get_rank()}:
            raise ValueError(
                "stat_group holds ranks with different blocks of the blocked axis (mesh dim "
                f"{d_b}); averaging their statistics would mix blocks. Pass mesh dim names instead"
            )
        return (), stat_group
    if stat_group == "default":
        dims = data_parallel_dims(mesh)
    elif stat_group is None:
        dims = ()
    elif isinstance(stat_group, (str, int)):
        dims = (_dim_index(mesh, stat_group),)
    elif isinstance(stat_group, (tuple, list)):
        dims = tuple(sorted({_dim_index(mesh, d) for d in stat_group}))
    else:
        raise ValueError(
            f"stat_group must be 'default', None, a ProcessGroup or mesh dim name(s)/index(es), got {stat_group!r}"
        )
    return dims, _group_over(mesh, dims)


def _dim_subsets(ndim: int):
    for r in range(ndim + 1):
        yield from itertools.combinations(range(ndim), r)


# ----------------------------------------------------------------------------- baselines' helpers
def gather_full(local_t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Full matrix from this rank's shard ``local_t`` of a tensor laid out like ``like``.

    The direction of Muon, Dion2, PR-Muon and RMNP couples the whole matrix, so a sharded
    parameter pays this all-gather (the communication Table 3 charges them); plain tensors pass.
    """
    if not is_dtensor(like):
        return local_t
    d = DTensor.from_local(local_t, like.device_mesh, like.placements, shape=like.shape,
                           stride=like.stride(), run_check=False)
    return d.full_tensor()


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full (replicated) tensor, laid out like ``like``; no communication."""
    if not is_dtensor(like):
        return full
    mesh = like.device_mesh
    d = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return d.redistribute(mesh, like.placements).to_local()


def rows_are_local(like: torch.Tensor) -> bool:
    """Whether every rank holds whole rows (plain tensor, or sharded only along dim 0)."""
    if not is_dtensor(like):
        return True
    return all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in like.placements)


def row_wise(fn, local_t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise function: locally when rows are whole on this rank, else on the gathered
    matrix (columns sharded: row norms span ranks)."""
    if rows_are_local(like):
        return fn(local_t)
    return local_slice(fn(gather_full(local_t, like)), like)


def replicate_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) as a DTensor replicated over ``like``'s mesh."""
    mesh = like.device_mesh
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=full.shape, stride=full.stride())


def shard_count(like: torch.Tensor) -> int:
    """How many different shards ``like`` has: the product of the sizes of the mesh dims that shard
    it (1 for a plain tensor or a replicated DTensor)."""
    if not is_dtensor(like):
        return 1
    mesh, n = like.device_mesh, 1
    for d, pl in enumerate(like.placements):
        if pl.is_shard():
            n *= mesh.size(d)
    return n


def local_shapes(like: torch.Tensor) -> list[tuple[int, ...]]:
    """Every local shape a rank can hold of ``like`` (``torch.chunk`` sizes of each sharded axis; an
    axis sharded over several mesh dims is split by their product). Pure: the same on every rank."""
    if not is_dtensor(like):
        return [tuple(int(s) for s in like.shape)]
    parts = [1] * like.dim()
    for d, pl in enumerate(like.placements):
        if pl.is_shard():
            parts[pl.dim % like.dim()] *= like.device_mesh.size(d)
    lengths = [sorted(set(chunk_sizes(int(n), k))) for n, k in zip(like.shape, parts)]
    return [tuple(c) for c in itertools.product(*lengths)]


def per_shard_state(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """State that each shard of ``like`` keeps for itself (a partial sum, factors of tiles cut
    within the shard), as one DTensor: the shards' ``local`` tensors (the same shape on every rank:
    pad to the largest) stacked along dim 0, ``Shard(0)`` over every mesh dim that shards ``like``
    and ``Replicate`` elsewhere. A plain ``like`` returns ``local``.

    Why not a plain tensor per rank: ``torch.distributed.checkpoint`` takes a plain tensor for a
    replicated one and saves a single rank's copy, so every other rank would resume with it. Its
    global shape counts the shards, so a checkpoint of another sharding does not load into it
    (``dobb.resume.check_resume`` says so before anything loads)."""
    if not is_dtensor(like):
        return local
    mesh = like.device_mesh
    placements = [Shard(0) if pl.is_shard() else Replicate() for pl in like.placements]
    shape = torch.Size((local.shape[0] * shard_count(like), *local.shape[1:]))
    stride = tuple(int(x) for x in torch.empty(shape, device="meta").stride())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@dataclass
class AxisSplit:
    """How the two axes of a 2-D DTensor are split across ranks, for updates that sum partial
    products over the ranks holding other parts of an axis (Dion's ``O(r(m+n))`` exchange).

    ``mesh_dims[a]``: the mesh dim whose plain ``Shard`` splits axis ``a`` (``torch.chunk`` sizes,
    uneven and empty shards allowed), or None; ``starts[a]``: the global index of this rank's first
    entry on axis ``a``; ``groups[a]``: the process group of that mesh dim (None when the axis is
    whole, or the mesh dim has size 1). ``signature`` is the same on every rank, so optimizers can
    batch matrices by it without the ranks disagreeing on the order of collectives.
    """

    shape: tuple[int, int]
    local_shape: tuple[int, int]
    mesh: object
    mesh_dims: tuple
    starts: tuple[int, int]
    groups: tuple
    signature: tuple

    def all_reduce_sum_(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        """Sum of ``t`` over the ranks holding the other parts of ``axis`` (in place when
        contiguous); no collective when the axis is whole."""
        group = self.groups[axis]
        if group is None:
            return t
        return all_reduce_sum_(t.contiguous(), group, "partial")

    def gather_along(self, t: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
        """``t``, whose dimension ``dim`` holds this rank's part of ``axis``, completed to the whole
        axis: a zero-padded sum over the axis' group (one all-reduce of the logical full size,
        uneven and empty shards included). No collective when the axis is whole."""
        group = self.groups[axis]
        if group is None:
            return t
        shape = list(t.shape)
        shape[dim] = self.shape[axis]
        full = t.new_zeros(shape)
        full.narrow(dim, self.starts[axis], self.local_shape[axis]).copy_(t)
        return all_reduce_sum_(full, group, "partial")

    def narrow_along(self, full: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
        """This rank's part of ``axis`` from a tensor whose dimension ``dim`` spans the whole axis."""
        if self.mesh_dims[axis] is None:
            return full
        return full.narrow(dim, self.starts[axis], self.local_shape[axis])

    def state_along(self, full: torch.Tensor, axis: int) -> torch.Tensor:
        """A state tensor whose dim 0 runs along the weight's ``axis`` (e.g. Dion's ``Q``), from its
        full value (the same on every rank): a DTensor on the weight's mesh, ``Shard(0)`` over the
        mesh dim that splits ``axis`` and ``Replicate`` elsewhere, so DCP reshards it with the weight."""
        d_axis = self.mesh_dims[axis]
        placements = [Shard(0) if d == d_axis else Replicate() for d in range(self.mesh.ndim)]
        local = self.narrow_along(full, axis, 0).clone()
        return DTensor.from_local(local, self.mesh, placements, run_check=False,
                                  shape=full.shape, stride=full.stride())


def axis_split(param: torch.Tensor) -> AxisSplit:
    """The ``AxisSplit`` of a 2-D DTensor, or a ``ValueError`` saying why partial sums cannot serve it
    (``Partial``, ``_StridedShard``, an axis split over two mesh dims, a non-chunk local shape)."""
    if not is_dtensor(param):
        raise ValueError(f"axis_split needs a DTensor parameter, got a {type(param).__name__}")
    mesh, placements = param.device_mesh, tuple(param.placements)
    shape = tuple(int(s) for s in param.shape)
    local_shape = tuple(int(s) for s in param.to_local().shape)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the parameter's device mesh")
    dims: list[int | None] = [None, None]
    for d, pl in enumerate(placements):
        if pl.is_replicate():
            continue
        if type(pl) is not Shard:
            raise ValueError(f"placement {pl} on mesh dim {d} (only Shard and Replicate are split by axis)")
        axis = pl.dim % 2
        if dims[axis] is not None:
            raise ValueError(f"axis {axis} is split over mesh dims {dims[axis]} and {d}")
        dims[axis] = d
    starts, groups = [0, 0], [None, None]
    for axis, d in enumerate(dims):
        if d is None:
            continue
        sizes = chunk_sizes(shape[axis], mesh.size(d))
        if sizes[coord[d]] != local_shape[axis]:
            raise ValueError(
                f"local length {local_shape[axis]} of axis {axis} does not follow torch.chunk sizes {sizes}"
            )
        starts[axis] = sum(sizes[: coord[d]])
        groups[axis] = mesh.get_group(d) if mesh.size(d) > 1 else None
    signature = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), tuple(dims))
    return AxisSplit(shape=shape, local_shape=local_shape, mesh=mesh, mesh_dims=tuple(dims),
                     starts=tuple(starts), groups=tuple(groups), signature=signature)
