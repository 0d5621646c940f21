"""FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on 2 and 4 gloo ranks:
the layers compute (and Dobb captures) in bf16, but the sharded weights, momenta, statistics and
the eigh/QR behind the bases stay float32. Reference: the float64 second moment of the very
activations each layer received, gathered from all ranks."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _compare import full  # noqa: E402
from _spawn import spawn  # noqa: E402

D, H, ROWS = 16, 32, 8  # rows per rank


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dobb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.LayerNorm(D), nn.Linear(D, 4))
    seen = {0: [], 2: []}  # inputs the hidden layers receive (the test's own hook, registered first)
    for i in seen:
        model[i].register_forward_hook(lambda m, a, o, i=i: seen[i].append((a[0].dtype, a[0].detach().double())))
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = dobb.Dobb(dobb.param_groups(model), model, lr=1e-2, weight_decay=0.1, blocks=2, refresh_every=1,
                    stat_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(world * ROWS, D, generator=g)[rank * ROWS:(rank + 1) * ROWS]
        for v in seen.values():
            v.clear()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    out = {"dtypes": set(), "checks": []}
    for i in seen:
        p = model[i].weight
        st = opt.state[p]
        for key in ("momentum", "stat"):
            out["dtypes"].add((key, st[key].dtype))
        out["dtypes"].add(("weight", p.dtype))
        dtype, xs = seen[i][-1]
        out["dtypes"].add(("input", dtype))
        # reference: float64 second moment of the bf16 inputs of the last step, over all ranks
        xs = xs.reshape(-1, xs.shape[-1])
        gram = xs.T @ xs
        dist.all_reduce(gram)
        ref = gram / (xs.shape[0] * world)
        stat = full(st["stat"])
        half = ref.shape[0] // 2
        blocks = torch.cat([ref[:half, :half], ref[half:, half:]])
        out["checks"].append(((stat.double() - blocks).abs().max().item(), blocks.abs().max().item()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_bf16_compute_keeps_float32_statistics(world):
    results = spawn(_worker, world)
    for r in results:
        assert r["dtypes"] == {("momentum", torch.float32), ("stat", torch.float32), ("weight", torch.float32),
                               ("input", torch.bfloat16)}
        for err, scale in r["checks"]:
            assert err < 1e-5 * scale, (err, scale)  # fp32 sums of bf16 inputs; a bf16 product: ~1e-2
