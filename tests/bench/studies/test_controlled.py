"""``dobb-bench controlled``: the reported suboptimality against an independent float64 evaluation,
and the block structure the problems are built to expose (aligned blocks are free, misaligned cost)."""
from __future__ import annotations

import json

import pytest
import torch

from dobb_bench import cli
from dobb_bench.studies.controlled import make_problem, off_block_share, run_grid, train


def _independent_suboptimality(problem, w: torch.Tensor) -> float:
    """E[1/2 ||W x - y||^2] - min_W of it, from the generative model: a Cholesky factor of the
    covariance and the normal equations, never the module's trace formula or its stored optimum."""
    sigma, w_star, noise = problem.sigma_x, problem.w_star, problem.noise
    chol = torch.linalg.cholesky(sigma)
    cross = w_star @ sigma  # E[y x^T]
    w_opt = torch.linalg.solve(sigma, cross.T).T  # normal equations: W S = E[y x^T]

    def loss(v):
        return 0.5 * ((v.double() - w_star) @ chol).square().sum().item() + 0.5 * w_star.shape[0] * noise**2

    return loss(w) - loss(w_opt)


@pytest.mark.parametrize("kind", ["rotated", "misaligned", "lowrank"])
def test_reported_suboptimality_is_the_float64_loss_gap(kind):
    lines = []
    result = run_grid([kind], [("Dobb B=4", "dobb", {"blocks": 4}), ("AdamW", "adamw", {})], n=16, m=8,
                      steps=15, batch=32, seeds=(0, 1), grids={"default": (0.1, 0.3), "adamw": (0.1, 0.3)},
                      log=lines.append)
    prob = make_problem(kind, n=16, m=8)
    for row in result["rows"]:
        for seed, reported in zip(row["seeds"], row["suboptimality"]):
            _, w = train(prob, row["optimizer"], row["hparams"], row["lr"], steps=15, batch=32, seed=seed)
            assert reported == pytest.approx(_independent_suboptimality(prob, w), rel=1e-4)
        # the chosen lr is the grid's best on the selection seed
        assert row["grid"][str(row["lr"])] == min(v for v in row["grid"].values() if v is not None)
    assert result["problems"][kind]["initial_suboptimality"] == pytest.approx(
        _independent_suboptimality(prob, torch.zeros(8, 16)), rel=1e-9)


def test_off_block_share():
    aligned, misaligned = make_problem("aligned"), make_problem("misaligned")
    assert off_block_share(aligned.sigma_x, 4) == pytest.approx(0.0, abs=1e-12)  # 4 groups of 16
    assert off_block_share(aligned.sigma_x, 2) == pytest.approx(0.0, abs=1e-12)
    assert off_block_share(misaligned.sigma_x, 4) > 0.3
    # the two are the same covariance up to a permutation of the inputs
    assert torch.allclose(torch.linalg.eigvalsh(aligned.sigma_x), torch.linalg.eigvalsh(misaligned.sigma_x))


def test_blocks_cost_only_when_they_cut_correlations():
    """Block-diagonal aligned covariance: its eigenbasis is block-diagonal, so Dobb B=4 (exact block
    bases) matches B=1; rolled by half a block, B=4 cuts every group and falls behind B=1."""
    kw = dict(steps=150, batch=512, seed=0)
    hp = {"basis": "eigh"}
    ratios = {}
    for kind in ("aligned", "misaligned"):
        prob = make_problem(kind)
        best = {b: min(train(prob, "dobb", {**hp, "blocks": b}, lr, **kw)[0] for lr in (0.1, 0.3)) for b in (1, 4)}
        ratios[kind] = best[4] / best[1]
    assert 0.75 < ratios["aligned"] < 1.33, ratios
    assert ratios["misaligned"] > 1.5, ratios


def test_cli_writes_a_record(tmp_path, capsys):
    rec = tmp_path / "c.json"
    assert cli.main(["controlled", "--problems", "aligned", "--n", "8", "--m", "4", "--steps", "5",
                     "--batch", "8", "--seeds", "0", "--record", str(rec)]) == 0
    data = json.loads(rec.read_text())
    assert data["kind"] == "controlled" and {"git_rev", "git_dirty", "torch", "command"} <= set(data["provenance"])
    assert data["settings"]["steps"] == 5 and data["settings"]["seeds"] == [0]
    assert "| Dobb B=1 (8 wide) |" in capsys.readouterr().out
    assert cli.main(["controlled", "--problems", "nope"]) == 2
    assert cli.main(["controlled", "--steps", "0"]) == 2
