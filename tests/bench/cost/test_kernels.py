"""dobb_bench.cost.kernels and .trace: the kernel and byte rules against hand-counted calls, the
bytes an entry of AdamW's three paths and of one Dobb step by hand, the byte fit, the dispatch
rule against the profiler on the CPU path, and the committed counts (the projection's inputs)
against a fresh trace of the library's steps."""
import pytest
import torch

from dobb_bench.cost import kernels as K
from dobb_bench.cost import projection as PJ
from dobb_bench.cost import trace as TR


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


def _traced(fn, *shapes):
    """``fn`` on OnDevice tensors of ``shapes`` (fp32, made outside the recording): its ops."""
    with TR.tracing() as tr:
        ts = [TR.OnDevice(torch.ones(s)) for s in shapes]
        tr.recording = True
        fn(*ts)
        tr.recording = False
    return tr.ops


def test_trace_bytes_by_hand():
    # 4 x 4 fp32: 16 entries, 64 bytes a tensor
    one = lambda fn, *s: [(o.name, o.kind, o.read, o.written) for o in _traced(fn, *s)]  # noqa: E731
    assert one(lambda x: x.add_(1.0), (4, 4)) == [("add_", "kernel", 64, 64)]  # in place: read and write
    assert one(lambda x: x + x, (4, 4)) == [("add", "kernel", 64, 64)]  # a tensor read twice is read once
    assert one(lambda v, g: v.addcmul_(g, g), (4, 4), (4, 4)) == [("addcmul_", "kernel", 128, 64)]
    assert one(lambda d, s: d.copy_(s), (4, 4), (4, 4)) == [("copy_", "kernel", 64, 64)]  # overwritten, not read
    assert one(lambda d, s: torch._foreach_copy_([d], [s]), (4, 4), (4, 4)) == [("_foreach_copy_", "kernel", 64, 64)]
    assert one(lambda x: x.to(torch.bfloat16), (4, 4)) == [("_to_copy", "kernel", 64, 32)]
    assert one(lambda x, s: x / s.expand(4, 4), (4, 4), (4, 1)) == [("div", "kernel", 64 + 16, 64)]  # broadcast: 4 stored
    assert one(lambda x: x.sum(), (4, 4)) == [("sum", "kernel", 64, 4)]
    assert one(lambda a, b: torch._foreach_add_([a, b], 1.0), (4, 4), (4, 4)) == [("_foreach_add_", "kernel", 128, 128)]
    assert one(lambda x: x.t()[1:].unsqueeze(0).view(-1, 4), (4, 4)) == []  # views: no kernel, no bytes
    assert one(lambda x: x.t().reshape(-1), (4, 4)) == [("clone", "kernel", 64, 64)]  # a reshape that must copy
    assert [o.kind for o in _traced(lambda x: x @ x, (4, 4))] == ["product"]  # the FLOP term's, not HBM's
    host = torch.tensor(0.0)
    assert _traced(lambda x: host.add_(1.0), (4, 4)) == []  # a plain CPU tensor: host, not the device
    s = TR.summary(_traced(lambda x: (x.add_(1.0), x @ x, torch.linalg.qr(torch.stack([x, x]))), (4, 4)))
    # add_ 128; stack([x, x]) reads x once (64) and writes both copies (128); mm and qr are products
    assert (s["kernels"], s["matmuls"], s["qr"], s["bytes"]) == (4, 1, 2, 128 + 64 + 128)


def _per_op(label, shape=(8, 8)):
    """Bytes an entry of each element-wise op of ``label``'s steady step, per matrix (a bank of two)."""
    ops = K.step_ops(label, [shape] * 2)["steady"]
    e = 2 * shape[0] * shape[1]
    return [(o.name, (o.read + o.written) / e) for o in ops if o.kind == "kernel"], ops


def test_adamw_bytes_an_entry_foreach_single_tensor_and_fused_by_hand():
    # torch's AdamW with weight decay, fp32: decay p (r/w 8), m.lerp_(g) (12), v.mul_ (8), v.addcmul_(g, g) (12:
    # g read once), sqrt(v) (8), / bc2 (8), + eps (8), p.addcdiv_(m, denom) (16): 8 passes, 80 bytes an entry
    passes = [8, 12, 8, 12, 8, 8, 8, 16]
    single, ops = _per_op("adamw")
    assert [2 * b for _, b in single] == passes * 2  # one matrix (half the bank's entries) at a time, twice
    assert TR.summary(ops)["kernels"] == 2 * 8
    foreach, ops = _per_op("adamw-foreach")
    assert [b for _, b in foreach] == passes and TR.summary(ops)["kernels"] == 8  # the same passes, one op a list
    # fused: one kernel reads p, g, m, v and writes p, m, v once (28); its 0-d step counters add 8 bytes
    fused, ops = _per_op("adamw-fused")
    assert [n for n, _ in fused] == ["_fused_adamw_"] and fused[0][1] == pytest.approx(28, abs=8 / 128 + 1e-9)
    # compiled (an estimate): one fused chain, the same 28
    assert TR.compiled_bytes(K.step_ops("adamw", [(8, 8)] * 2)["steady"]) / 128 == 28


def test_one_dobb_step_bytes_by_hand():
    # Dobb, 2 blocks of 4 columns, two 8 x 8 matrices, a steady step on the GPU path (bf16 products).
    # Per matrix (E = 64 entries, fp32 weight, gradient, momentum): finiteness sum of g 4E + 4 (a 0-d
    # result), momentum lerp_ 12E, weight decay 8E, U's blocks of both matrices into one bf16 buffer by
    # one foreach copy 6E (fp32 read, bf16 written, not read), sign_ of the coefficients 4E (bf16), W += O
    # 10E (W r/w fp32, O bf16 read); and the bf16 bases (2 blocks 4 x 4 = 32 entries) concatenated: 4 x 32.
    # Shared: the two finiteness flags stacked, scaled and compared: 3 x (8 + 8).
    ops = K.step_ops("dobb-b4", [(8, 8)] * 2, blocks=2)["steady"]
    E, per_matrix = 64, 4 + 12 + 8 + 6 + 4 + 10
    assert TR.summary(ops)["bytes"] == 2 * (per_matrix * E + 4 + 4 * 32) + 3 * 16 == 5944
    assert per_matrix == 44
    assert [o.name for o in ops if o.kind == "product"] == ["bmm", "bmm"]  # projection and reconstruction


def test_bytes_fit_solves_bytes_an_entry_and_a_statistic_entry_by_hand():
    # Dobb B=4 on (48, 32), (64, 32), (48, 64): E = 1536, 2048, 3072; S = n^2 / 4 = 256, 256, 1024
    assert [K.stat_entries("dobb-b4", m, n) for m, n in K.BYTE_SHAPES] == [256, 256, 1024]
    per = [48 * 1536 + 4 * 256, 48 * 2048 + 4 * 256, 48 * 3072 + 4 * 1024]
    got = K.bytes_fit(per, "dobb-b4")
    assert got["bytes_per_entry"] == pytest.approx(48) and got["bytes_per_stat_entry"] == pytest.approx(4)
    assert got["bytes_fit_error"] == pytest.approx(0, abs=1e-12)
    # a method without statistics: bytes an entry from the first shape, the others checked
    got = K.bytes_fit([70 * 1536, 70 * 2048, 71 * 3072], "muon")
    assert got["bytes_per_entry"] == 70 and got["bytes_fit_error"] == pytest.approx(1 / 71)
    # Dion's factor is rank_fraction x the weight at every shape: its cases change the rank fraction
    assert [hp for _, hp in K.byte_cases("dion")] == [{}, {"rank_fraction": 0.125}, {}]
    assert K.stat_entries("dion", 48, 32) == 48 * 8 and K.stat_entries("dion", 48, 32, rank_fraction=0.125) == 48 * 4


def test_dispatch_rule_counts_the_profilers_kernels_on_the_cpu_path():
    # the same step, plain CPU tensors: the dispatch trace and the profiler's top-level aten ops agree,
    # except where the profiler is wrong for a GPU: it records tensor lists without shapes, so it
    # takes cat / stack of block statistics for 0-d host bookkeeping; and it counts torch's foreach
    # increment of AdamW's CPU step counters, which a GPU step does on the host
    for label in ("adamw", "muon", "row-block-muon", "dion", "dion2", "torch-muon-bf16"):
        prof = K.profiler_counts(label, [K.SHAPE] * 2)["steady"]["kernels"]
        assert TR.summary(K.step_ops(label, [K.SHAPE] * 2, on_device=False)["steady"])["kernels"] == prof, label
    disp = TR.summary(K.step_ops("dobb-b4", [K.SHAPE] * 2, on_device=False)["refresh"])
    prof = K.profiler_counts("dobb-b4", [K.SHAPE] * 2)["refresh"]
    assert disp["kernels"] - prof["kernels"] == disp["ops"]["aten::cat"] + disp["ops"]["aten::stack"]
    prof = K.profiler_counts("adamw-foreach", [K.SHAPE] * 2)["steady"]["kernels"]
    assert TR.summary(K.step_ops("adamw-foreach", [K.SHAPE] * 2, on_device=False)["steady"])["kernels"] == prof - 1


def test_gpu_path_differs_from_the_cpu_path_for_dobb():
    # on a CPU Dobb runs one call per matrix and factors with geqrf + householder_product; on the GPU path
    # it concatenates equal blocks across matrices and calls linalg.qr once
    gpu = TR.summary(K.step_ops("dobb-b4", [K.SHAPE] * 2)["refresh"])["ops"]
    cpu = TR.summary(K.step_ops("dobb-b4", [K.SHAPE] * 2, on_device=False)["refresh"])["ops"]
    assert "aten::linalg_qr" in gpu and "aten::geqrf" in cpu and "aten::geqrf" not in gpu
    assert gpu["aten::bmm"] < cpu["aten::bmm"]


def test_committed_counts_are_a_fresh_count():
    committed = PJ.load_inputs()["kernels"]
    fresh = K.count_all()
    assert fresh["weight_decay"] == committed["weight_decay"] and fresh["ns"]["bytes_per_entry"] == pytest.approx(
        committed["ns"]["bytes_per_entry"])
    assert set(fresh["methods"]) == set(committed["methods"])
    for label, entry in fresh["methods"].items():
        for part in ("steady", "refresh"):
            if part in entry:
                got, want = entry[part], committed["methods"][label][part]
                for key in ("per_matrix", "per_group", "per_shape", "qr_per_matrix"):
                    assert got[key] == want[key], (label, part, key)
                for key in ("bytes_per_entry", "bytes_per_stat_entry"):
                    assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-9), (label, part, key)
                assert got["bytes_fit_error"] < 0.01, (label, part)  # the two terms hold to 1% at the traced shapes
    m = committed["methods"]
    # AdamW's single-tensor path: 8 kernels a tensor (weight decay on), none shared; foreach: 8 a group
    assert m["adamw"]["steady"]["per_matrix"] == 8 and m["adamw-foreach"]["steady"]["per_group"] == 8
    # 80 bytes an entry on either path, 28 fused
    assert m["adamw"]["steady"]["bytes_per_entry"] == pytest.approx(80)
    assert m["adamw-foreach"]["steady"]["bytes_per_entry"] == pytest.approx(80)
    assert m["adamw-fused"]["steady"]["bytes_per_entry"] == pytest.approx(28, abs=0.01)
    # Muon: 70 an entry, 20 of them in the Newton-Schulz call (stack 8, to bf16 6, norm 2, divide 4)
    assert m["muon"]["steady"]["bytes_per_entry"] == pytest.approx(70, abs=0.05)
    assert m["muon"]["steady"]["ns_bytes_per_entry"] == pytest.approx(20, abs=0.05)
    # Dobb's refresh factors each block once: B = 4 blocks a matrix, 4 QR factorizations
    assert m["dobb-b4"]["refresh"]["qr_per_matrix"] == 4


def _gpt2_bank(layers, d=16):
    """A bank in a GPT-2 block's pattern (fused qkv, attention out, MLP in and out) of ``layers`` layers."""
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers


@pytest.mark.parametrize("label", ["dobb-b1", "dobb-b4", "dobb-both"])
def test_dobb_kernels_do_not_grow_with_depth(label):
    # issue 54 item 3: each element-wise pass and product once per group of equal matrices, so twice the
    # layers take at most 1.2x the kernels (docs/timing.md, "One kernel per shape group"). The refresh
    # step's one per-matrix pass left: the mean of the captured sums (a division by each matrix's own
    # row count; the CPU scalar division on a GPU multiplies by the reciprocal, a foreach one divides)
    two, four = (K.step_ops(label, _gpt2_bank(n)) for n in (2, 4))
    steady = [TR.summary(x["steady"])["kernels"] for x in (two, four)]
    assert steady[1] <= 1.2 * steady[0], steady
    refresh = [TR.summary(x["refresh"]) for x in (two, four)]
    sides = 2 if label == "dobb-both" else 1
    assert refresh[1]["kernels"] - refresh[0]["kernels"] == 8 * sides == refresh[1]["ops"]["aten::div"] - refresh[0][
        "ops"]["aten::div"]


@pytest.mark.parametrize("label", ["muon", "row-block-muon", "muonbp", "dion2", "dobb-muon"])
def test_muon_forms_kernels_do_not_grow_with_depth(label):
    # issue 54 item 3 for the Muon family, Dion2 and Dobb-Muon: one orthogonalize call over the equal
    # shapes of all matrices (row blocks), the casts and adds once per shape group, Dobb-Muon's
    # preconditioning stacked per equal matrices. Its refresh keeps Dobb's one per-matrix pass (above)
    two, four = (K.step_ops(label, _gpt2_bank(n)) for n in (2, 4))
    steady = [TR.summary(x["steady"])["kernels"] for x in (two, four)]
    assert steady[1] <= 1.2 * steady[0], steady
    if label == "dobb-muon":
        refresh = [TR.summary(x["refresh"]) for x in (two, four)]
        assert refresh[1]["kernels"] - refresh[0]["kernels"] == 8 == refresh[1]["ops"]["aten::div"] - refresh[0][
            "ops"]["aten::div"]
