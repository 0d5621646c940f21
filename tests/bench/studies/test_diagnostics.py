"""Diagnostics of dobb_bench.studies.diagnostics against independent float64 references, and the facts the
micro-batch explanation rests on: a split batch gives the same gradient, and ``capture="all"`` the
same statistic, as one micro-batch (up to rounding); ``capture="first"`` reads the first part only."""
from __future__ import annotations

import math

import pytest
import torch

import dobb
from dobb import functional as F
from dobb_bench import cli
from dobb_bench.studies.diagnostics import StepDiagnostics, basis_angle, sign_flip_fraction
from dobb_bench.training.model import GPT, ModelConfig

CFG = ModelConfig(layers=1, width=32, heads=2, seq_len=16, vocab_size=64)


def _rot(theta: float) -> torch.Tensor:
    c, s = math.cos(theta), math.sin(theta)
    return torch.tensor([[c, -s], [s, c]], dtype=torch.float64)


def test_basis_angle_of_known_rotations():
    eye = torch.eye(2, dtype=torch.float64)
    angles = basis_angle(torch.stack([eye, eye]), torch.stack([_rot(math.radians(30)), _rot(math.radians(-10))]))
    assert torch.allclose(angles, torch.tensor([30.0, 10.0], dtype=torch.float64), atol=1e-9)
    # column order and signs leave the sign update unchanged: no angle
    perm = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    assert basis_angle(eye[None], perm[None]).item() == pytest.approx(0.0, abs=1e-6)


def test_sign_flip_fraction():
    assert sign_flip_fraction(torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([2.0, 1.0, -1.0, 0.1])) == 0.5


def _batch(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n, CFG.seq_len + 1), generator=g)


def _one_matrix_model(d=16, h=24, vocab=32):
    torch.manual_seed(0)
    # one hidden nn.Linear (the last one projects onto the vocabulary: the head, AdamW's)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, d), torch.nn.Linear(d, h, bias=False), torch.nn.GELU(),
                               torch.nn.Linear(h, vocab))


def test_diagnostics_match_float64_reference():
    model = _one_matrix_model()
    w = model[1].weight
    lr, wd = 0.05, 0.5  # a large decay: forgetting to undo it would change the cosine
    opt = dobb.Dobb(dobb.param_groups(model), model, lr=lr, weight_decay=wd, blocks=2, refresh_every=2,
                    basis_dtype=torch.float64, stat_dtype=torch.float64)
    diag = StepDiagnostics.attach(opt, model)
    sizes = F.block_sizes(w.shape[1], 2)
    g = torch.Generator().manual_seed(1)
    prev = None
    for step in range(5):
        x = torch.randint(0, 32, (64,), generator=g)
        before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[w].items()}
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), (x * 7 + 3) % 32).backward()
        grad = w.grad.double().clone()
        opt.step()
        st, rec = opt.state[w], diag.records[step]
        o = F.direction(st["momentum"].double(), st["basis"], sizes, "sign")
        assert rec["update_grad_cos"] == pytest.approx((o.flatten() @ grad.flatten() / (o.norm() * grad.norm())).item(),
                                                       abs=1e-6)  # fp32 weights

        def coef(u, q):
            return torch.cat([u[:, :8].double() @ q[:8, :8], u[:, 8:].double() @ q[8:16, :8]], dim=1)

        if step > 0:
            flips = (torch.sign(coef(st["momentum"], st["basis"])) != torch.sign(coef(before["momentum"], st["basis"])))
            assert rec["momentum_flips"] == pytest.approx(flips.double().mean().item(), abs=1e-12)
        assert rec["refresh"] == (step in (2, 4))  # step 0 initialises: nothing to compare with
        if rec["refresh"]:
            assert rec["stat_change"] == pytest.approx(((st["stat"] - prev).norm() / prev.norm()).item(), rel=1e-9)
            old_c = coef(st["momentum"], before["basis"])
            assert rec["basis_flips"] == pytest.approx(
                (torch.sign(coef(st["momentum"], st["basis"])) != torch.sign(old_c)).double().mean().item(), abs=1e-12)
            cos = torch.stack([before["basis"][:8, :8].T @ st["basis"][:8, :8],
                               before["basis"][8:, :8].T @ st["basis"][8:, :8]]).abs().amax(dim=1)
            assert rec["basis_angle_deg"] == pytest.approx(torch.rad2deg(torch.arccos(cos.clamp(max=1))).mean().item(),
                                                           abs=1e-6)
        prev = st["stat"].clone()
    summary = diag.summary(skip=1)
    assert summary["refreshes"] == 2
    diag.detach()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), x).backward()
    opt.step()
    assert len(diag.records) == 5  # detached: no more records


def _grads_and_stats(micro: int, capture: str, first_only_inputs=None):
    model = GPT(CFG, seed=0)
    opt = dobb.Dobb(dobb.param_groups(model), model, lr=1e-3, blocks=4, capture=capture,
                    stat_dtype=torch.float64)
    layer = model.blocks[0].mlp.fc
    seen = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().double().reshape(-1, a[0].shape[-1])))
    tokens = _batch(3)
    opt.zero_grad(set_to_none=True)
    for part in tokens.chunk(micro):
        _, loss = model(part[:, :-1], part[:, 1:])
        (loss / micro).backward()
    grad = layer.weight.grad.double().clone()
    opt.step()
    handle.remove()
    return grad, opt.state[layer.weight]["stat"].double(), seen


def test_micro_batch_split_changes_only_what_capture_first_reads():
    g1, a1, _ = _grads_and_stats(1, "first")
    g2, a2_all, _ = _grads_and_stats(2, "all")
    _, a2_first, seen = _grads_and_stats(2, "first")
    # the optimizer sees the same gradient, up to rounding
    assert (g2 - g1).norm() <= 1e-5 * g1.norm()
    # capture="all" with two micro-batches: the same statistic as one micro-batch
    assert (a2_all - a1).norm() <= 1e-5 * a1.norm()
    # capture="first": the diagonal blocks of X^T X / N over the first micro-batch only
    x = seen[0]
    full = x.T @ x / x.shape[0]
    s = x.shape[1] // 4
    ref = torch.cat([full[b * s:(b + 1) * s, b * s:(b + 1) * s] for b in range(4)])
    assert torch.allclose(a2_first, ref, rtol=1e-9, atol=1e-12)
    assert (a2_first - a1).norm() > 1e-3 * a1.norm()  # and that is a different statistic


def test_microbatch_cli_rejects_bad_input(capsys):
    assert cli.main(["microbatch", "--capture", "some"]) == 2
    assert cli.main(["microbatch", "--micro-batches", "3"]) == 2  # does not divide the batch
    assert cli.main(["microbatch", "--optimizer", "dobb:blocks=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3


def test_twin_table_finds_the_first_diverging_step():
    from dobb_bench.studies.diagnostics import twin_table

    base = {"label": "Dobb B=16", "micro_batches": 1, "capture": "first", "seed": 0,
            "train_losses": [3.0, 2.9, 2.8, 2.7, 2.6], "final_val_loss": 2.6}
    twin = dict(base, micro_batches=2, capture="all", train_losses=[3.0, 2.9, 2.8005, 2.72, 2.4],
                final_val_loss=2.45)
    other_seed = dict(twin, seed=1)  # no one-micro-batch run with seed 1: not listed
    row = [x for x in twin_table([base, twin, other_seed]).splitlines() if x.startswith("| Dobb")]
    assert row == ["| Dobb B=16 | 2 | all | 0 | 4 | 4 | 5 | -0.1500 |"]


def test_capture_grid_only_for_optimizers_that_take_a_capture_option():
    """The micro-batch grid varies ``capture`` for optimizers whose hyperparameters include it
    (dobb.valid_hparams: Dobb and its presets), and gives the others one cell per split."""
    from dobb_bench.specs import parse_spec
    from dobb_bench.studies.diagnostics import _cells

    specs = [parse_spec("dobb-g:blocks=2"), parse_spec("muon")]
    cells = [(s.name, m, cap) for s, m, cap, _ in _cells(specs, [1, 2], ["first", "all"], [0])]
    assert cells == [("dobb-g", 1, "first"), ("dobb-g", 2, "first"), ("dobb-g", 2, "all"),
                     ("muon", 1, None), ("muon", 2, None)]
    assert ["capture" in dobb.valid_hparams(n) for n in ("dobb-g", "muon")] == [True, False]
