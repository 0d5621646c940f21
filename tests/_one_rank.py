"""A process group of one gloo rank inside the test process, for single-process tests of code that
needs a group or a device mesh (DTensors, tagged collectives). The multi-rank cases are in
``tests/distributed`` (spawned ranks); here the world is this process alone, so every collective is
an identity whose call, size and tag can still be observed."""
from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
