"""dobb._torch_private: every private torch API the package uses still exists with the signature we
call it with and behaves as we rely on, so a torch release that changes one fails here, by name."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import dobb
from dobb import _torch_private as P


def test_adamw_init_group_fills_what_torchs_own_adamw_fills():
    """``AdamW._init_group`` called with a foreign ``self`` (a dobb optimizer): the same signature,
    and the same tensors, in the same order, as ``torch.optim.AdamW`` gathers for itself."""
    names = list(inspect.signature(torch.optim.AdamW._init_group).parameters)
    assert names[:2] == ["self", "group"] and len(names) == 8, names
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    model[1].bias.grad = None  # a parameter without a gradient is left out
    ours = dobb.Muon([{"params": list(model.parameters()), "algorithm": "adamw"}], lr=0.1)
    theirs = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():  # the same state objects, so the lists can be compared by identity
        theirs.state[p] = ours.state[p]
    flags = dict(amsgrad=False, maximize=False, foreach=True, capturable=False, differentiable=False, fused=False)
    a: tuple[list, ...] = ([], [], [], [], [], [])
    b: tuple[list, ...] = ([], [], [], [], [], [])
    has_complex = P.adamw_init_group(ours, dict(ours.param_groups[0], **flags), *a)
    torch.optim.AdamW._init_group(theirs, dict(theirs.param_groups[0], **flags), *b)
    assert has_complex is False
    assert [[id(t) for t in lst] for lst in a] == [[id(t) for t in lst] for lst in b]
    assert len(a[0]) == 3 and all(x.grad is g for x, g in zip(a[0], a[1]))


def test_fused_adamw_devices():
    devices = P.fused_adamw_devices()
    assert isinstance(devices, list) and "cuda" in devices and all(isinstance(d, str) for d in devices)


def test_current_graph_task_id_is_minus_one_outside_backward_only():
    assert P.current_graph_task_id() == -1
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(P.current_graph_task_id()))
    y.sum().backward()
    assert seen and seen[0] != -1 and isinstance(seen[0], int)


def test_dispatch_mode_sees_aten_ops_and_higher_order_operators_are_a_class():
    assert inspect.isclass(P.HigherOrderOperator)
    assert isinstance(torch.ops.higher_order.cond, P.HigherOrderOperator)
    ops = []

    class Record(P.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) * 3
    assert torch.ops.aten.mul.Tensor in ops


def test_tree_flatten():
    leaves, spec = P.tree_flatten({"a": [1, (2, torch.zeros(1))], "b": 3})
    assert leaves[:2] == [1, 2] and isinstance(leaves[2], torch.Tensor) and leaves[3] == 3


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without Muon (< 2.9)")
def test_torch_newton_schulz_signature_and_orthogonalization():
    assert P.torch_newton_schulz is not None
    assert list(inspect.signature(P.torch_newton_schulz).parameters) == ["grad", "ns_coefficients", "ns_steps", "eps"]
    g = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    out = P.torch_newton_schulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert out.shape == g.shape and out.dtype == torch.bfloat16
    s = torch.linalg.svdvals(out.float())
    assert s.min() > 0.5 and s.max() < 1.3  # NS5's band around 1, not the input's spectrum


def test_mkldnn_native_reads_onednn():
    for name in ("_is_mkldnn_bf16_supported", "_is_mkldnn_fp16_supported"):
        assert isinstance(getattr(torch.ops.mkldnn, name)(), bool)  # raises on a torch without them
    assert P.mkldnn_native(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert P.mkldnn_native(torch.float32) is False


def test_strided_shard_type_is_the_placement_sharding_reads():
    """``_StridedShard`` is still the placement ``dobb.sharding`` tells apart by type (its
    ``is_shard()`` is not to be relied on) and reads ``.dim`` of, and the package imports it only
    through ``_torch_private``."""
    from pathlib import Path

    cls = P.strided_shard_type()
    x = cls(1, split_factor=2)
    assert cls.__name__ == "_StridedShard" and isinstance(x, cls) and x.dim == 1 and x.split_factor == 2
    src = Path(dobb.__file__).parent
    users = [p.name for p in src.rglob("*.py") if "import _StridedShard" in p.read_text() and p.name != "_torch_private.py"]
    assert users == []


def test_disable_dynamo_runs_eagerly_under_compile_and_imports_nothing_when_decorating():
    import subprocess
    import sys

    code = ("import sys\nfrom dobb._torch_private import disable_dynamo\n"
            "f = disable_dynamo(lambda x: x + 1)\nprint('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False"]
    from dobb._torch_private import disable_dynamo

    seen = []

    @disable_dynamo
    def eager(x):
        seen.append(torch.compiler.is_compiling())
        return x * 2

    out = torch.compile(lambda x: eager(x) + 1, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 3.0)) and seen == [False]
