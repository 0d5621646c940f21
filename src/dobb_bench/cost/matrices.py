"""GPT-2 matrix sets as modules for the optimizer benchmarks, and their distributed layouts.

``MatrixBank``: one bias-free ``nn.Linear`` per matrix of a set (``dobb_bench.cost.shapes``), with
synthetic gradients and a capture pass (what Dobb's hooks read). ``DistContext``: the DP x FS x TP
layout under ``torchrun`` (or spawned gloo processes) that shards a bank with FSDP2 / tensor
parallelism, so an optimizer sees the same placements it would see in a model.
"""
from __future__ import annotations

import math
import os

import torch
from torch import nn

from dobb_bench.errors import CliError

COLWISE = ("q", "k", "v", "qkv", "fc")  # output axis sharded under TP (column parallel)


def _generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


# where each matrix of ``shapes.layer_shapes`` sits in a GPT-2-like block, and the name it takes there
_ROLE = {"q": ("attn", "q"), "k": ("attn", "k"), "v": ("attn", "v"), "qkv": ("attn", "qkv"),
         "o": ("attn", "o_proj"), "fc": ("mlp", "fc"), "proj": ("mlp", "proj")}


def _named_tree(names: list[str], layers: nn.ModuleList) -> nn.Module:
    """``layers`` (in order) under nested names: ``h3.fc`` -> ``h3.mlp.fc``; unknown roles stay flat."""
    root = nn.ModuleDict()
    for name, lin in zip(names, layers):
        block, role = name.split(".", 1) if "." in name else ("", name)
        path = ([block] if block else []) + list(_ROLE.get(role, (role,)))
        node = root
        for part in path[:-1]:
            if part not in node:
                node[part] = nn.ModuleDict()
            node = node[part]
        node[path[-1]] = lin
    return root


class MatrixBank:
    """One bias-free ``nn.Linear`` per matrix of the set (weights ``m x n``), optionally sharded."""

    def __init__(self, shapes, device, dtype, seed: int = 0, tokens: int = 16, dist_ctx=None):
        # Built and initialized on the device itself (no default init, no host copy): GPT-2 XL's
        # 1.5B entries would take tens of seconds through the CPU.
        gen = _generator(device, seed)
        self.names = [name for name, _ in shapes]
        self.module = nn.ModuleList()
        for _, (m, n) in shapes:
            lin = torch.nn.utils.skip_init(nn.Linear, n, m, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                lin.weight.normal_(0.0, 1.0 / math.sqrt(n), generator=gen)
            self.module.append(lin)
        # the same layers under GPT-2-like names (h0.attn.q, h0.attn.o_proj, h0.mlp.fc, ...), the
        # module the optimizers get: options that find attention matrices by name (``heads``) work
        self.model = _named_tree(self.names, self.module)
        self.device, self.dtype, self.tokens, self.dist = device, dtype, tokens, dist_ctx
        self._inputs: dict[int, torch.Tensor] = {}
        if dist_ctx is not None:
            dist_ctx.shard(self)

    def parameters(self):
        return list(self.module.parameters())

    def synthetic_grads(self, seed: int = 1) -> None:
        gen = _generator(self.device, seed)
        for p in self.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype).mul_(1e-2)

    def _x(self, n: int) -> torch.Tensor:
        if n not in self._inputs:
            gen = _generator(self.device, 1000 + n)
            self._inputs[n] = torch.randn(self.tokens, n, generator=gen, device=self.device, dtype=self.dtype)
        return self._inputs[n]

    def capture_pass(self, backward: bool, accumulate: bool) -> None:
        """Run every layer on ``tokens`` rows so capture hooks fire; ``backward`` also propagates
        an output gradient (Dobb-G's statistic). ``accumulate``: ``loss.backward()`` (gradients
        land in ``.grad``, needed under FSDP2); else ``autograd.grad`` leaves ``.grad`` alone."""
        with torch.enable_grad():
            for lin in self.module:
                y = lin(self._x(lin.in_features))
                if accumulate:
                    y.backward(torch.ones_like(y) / y.numel())
                elif backward:
                    torch.autograd.grad(y, lin.weight, torch.ones_like(y) / y.numel())


class DistContext:
    """DP x FS x TP layout under torchrun (or a spawned gloo group): mesh ``("dp", "fs", "tp")``.

    TP: ``q, k, v, qkv, fc`` column-parallel (output axis sharded), ``o, proj`` row-parallel
    (input axis sharded). FSDP2 (``fully_shard``) shards dim 0 over ``fs`` (HSDP over
    ``("dp", "fs")`` when ``dp > 1``). ``fs = tp = 1`` is plain data parallelism (replicated
    tensors; Dobb averages its statistics over the world).
    """

    def __init__(self, dp: int, fs: int, tp: int, device: str):
        import torch.distributed as dist

        self.dist = dist
        self.dp, self.fs, self.tp = dp, fs, tp
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if dp * fs * tp != self.world:
            raise CliError(f"--dp {dp} x --fs {fs} x --tp {tp} = {dp * fs * tp} processes, but the world size "
                           f"is {self.world}")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device, (dp, fs, tp), mesh_dim_names=("dp", "fs", "tp"))

    def shard(self, bank: MatrixBank) -> None:
        if self.tp > 1:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for name, lin in zip(bank.names, bank.module):
                style = (ColwiseParallel() if name.rsplit(".", 1)[-1] in COLWISE
                         else RowwiseParallel(input_layouts=Replicate()))
                parallelize_module(lin, self.mesh["tp"], style)
        if self.fs > 1 or (self.dp > 1 and self.tp > 1):
            from torch.distributed.fsdp import fully_shard

            mesh = self.mesh["dp", "fs"] if self.dp > 1 else self.mesh["fs"]
            for lin in bank.module:
                fully_shard(lin, mesh=mesh)

    @property
    def plain(self) -> bool:
        """Replicated plain tensors (pure data parallelism): no DTensor mesh to derive groups from."""
        return self.fs == 1 and self.tp == 1

    def shards(self, name: str) -> tuple[int, int]:
        """``(ranks splitting the rows, ranks splitting the columns)`` of a matrix of the set."""
        colwise = name.rsplit(".", 1)[-1] in COLWISE
        fsdp = self.fs if (self.fs > 1 or (self.dp > 1 and self.tp > 1)) else 1
        return (fsdp * (self.tp if colwise else 1), 1 if colwise else self.tp)

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, obj):
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


def init_distributed(dp: int, fs: int, tp: int, device: str) -> DistContext | None:
    import torch.distributed as dist

    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world_env > 1:
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if not dist.is_initialized():
        if dp * fs * tp != 1:
            raise CliError(f"--dp/--fs/--tp ask for {dp * fs * tp} processes: launch with "
                           f"torchrun --nproc_per_node {dp * fs * tp} -m dobb_bench.cli timing ...")
        return None
    return DistContext(dp, fs, tp, device)
