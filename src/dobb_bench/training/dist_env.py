"""The process layout of a run: a single process, or one rank of a torchrun DDP/FSDP job."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "setup_dist"]


@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    mode: str = "none"

    def all_mean(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def setup_dist(mode: str, device: str = "auto") -> DistEnv:
    """Joins the torchrun process group when ``mode`` is ddp/fsdp (gloo on CPU, nccl on GPU)."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if mode == "none" and world > 1:
        # Without a process group every torchrun process would be a "rank 0" training the whole
        # model and writing the same files.
        raise ValueError(f"torchrun started {world} processes but --dist is none: add --dist ddp or "
                         "--dist fsdp, or run without torchrun")
    if mode == "none":
        return DistEnv(device=torch.device(("cuda" if use_cuda else "cpu") if device == "auto" else device))
    if "RANK" not in os.environ:
        raise ValueError(f"--dist {mode} needs torchrun (e.g. torchrun --nproc_per_node=2 -m dobb_bench.cli ...)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), dev, mode)


def sync_device(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
