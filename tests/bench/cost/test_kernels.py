"""dobb_bench.cost.kernels: the trace counter against hand-counted calls, and the committed counts
(the projection's inputs) against a fresh count of the library's steps."""
import torch

from dobb_bench.cost import kernels as K
from dobb_bench.cost import projection as PJ


def test_trace_counts_by_hand():
    x = torch.zeros(4, 4)
    step = torch.tensor(0.0)

    def fn():
        x.add_(1.0)          # 1 kernel
        x.view(-1).t()       # views: none
        torch.mm(x, x)       # 1 kernel, a matmul
        step.add_(1.0)       # a 0-d counter: host bookkeeping, none
        torch.geqrf(torch.randn(3, 4, 4))  # randn + geqrf: 2 kernels; 3 factorizations

    got = K.trace_counts(fn)
    assert got["kernels"] == 4
    assert got["matmuls"] == 1
    assert got["qr"] == 3


def test_foreach_is_one_kernel_for_the_list():
    xs = [torch.zeros(3) for _ in range(5)]
    assert K.trace_counts(lambda: torch._foreach_add_(xs, 1.0))["kernels"] == 1
    assert K.trace_counts(lambda: [x.add_(1.0) for x in xs])["kernels"] == 5


def test_committed_counts_are_a_fresh_count():
    committed = PJ.load_inputs()["kernels"]
    fresh = K.count_all()
    assert fresh["ns5"]["kernels"] == committed["ns5"]["kernels"]
    for label, entry in fresh["methods"].items():
        for part in ("steady", "refresh"):
            if part in entry:
                for key in ("per_matrix", "per_group", "per_shape", "qr_per_matrix"):
                    assert entry[part][key] == committed["methods"][label][part][key], (label, part, key)
    # AdamW's single-tensor path: 7 kernels a tensor, none shared; foreach: a fixed number a group
    assert committed["methods"]["adamw"]["steady"]["per_matrix"] == 7
    assert committed["methods"]["adamw-foreach"]["steady"]["per_matrix"] == 0
    # Dobb's refresh factors each block once: B = 4 blocks a matrix, 4 QR factorizations
    assert committed["methods"]["dobb-b4"]["refresh"]["qr_per_matrix"] == 4
