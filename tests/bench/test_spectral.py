"""dobb_bench.spectral (command), spectral_tables and spectral_run: the constructions and updates
behind Tables 1-2 and Figure 2, checked against closed forms and direct float64 computations; the
CLI's outputs and errors (a checkpoint that would run code is refused); tiny end-to-end runs."""
import math

import pytest
import torch

from dobb_bench import metrics
from dobb_bench import spectral_run as R
from dobb_bench import spectral_tables as S
from dobb_bench.cli import main

F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_power_profile_reproduces_paper_table1a_Y_column():
    # orthogonality of U diag(s) V^T depends only on s: sum(s) / (sqrt(k) ||s||), no SVD needed
    for t, (paper_y, _) in S.PAPER_1A.items():
        s = metrics.spectrum_with_effective_rank(768, t)
        assert float(s.sum() / (math.sqrt(768) * s.norm())) == pytest.approx(paper_y, abs=6e-4)


def test_table1a_rows_match_their_spectrum():
    rows = S.table1a(size=48, seeds=1, targets=(0.5,))
    s = metrics.spectrum_with_effective_rank(48, 0.5)
    assert rows[0]["Y"] == pytest.approx(float(s.sum() / (math.sqrt(48) * s.norm())), rel=1e-9)
    assert rows[0]["Y"] < rows[0]["sign(Y)"] < 1  # sign spreads the spectrum (the paper's point)
    assert rows[0]["paper Y"] == 0.412


def test_factor_has_exact_second_moment():
    Z = S.factor_with_second_moment(12, 40, 0.3, _gen())
    assert metrics.effective_rank_of_psd(Z @ Z.T / 40) == pytest.approx(0.3, rel=1e-6)
    with pytest.raises(ValueError, match="tokens"):
        S.factor_with_second_moment(12, 5, 0.3, _gen())


def test_dobb_direction_in_standard_basis_is_sign_and_column_l2():
    # A diagonal with distinct entries: eigenbasis = +-e_j, so the update is sign(U) (resp. U with
    # unit columns) whatever the eigenvector signs; the 1/sqrt(m) of the sign normalization included
    U = torch.randn(6, 8, generator=_gen(), dtype=F64)
    A = torch.diag(torch.arange(1, 9, dtype=F64))
    for B in (1, 2, 4):
        assert torch.allclose(S.dobb_direction(U, A, B, "sign"), torch.sign(U) / math.sqrt(6), atol=1e-12)
        assert torch.allclose(S.dobb_direction(U, A, B, "l2"), U / U.norm(dim=0), atol=1e-12)


def test_dobb_direction_blocks_against_dense_reference():
    m, n, B = 5, 9, 3
    U = torch.randn(m, n, generator=_gen(1), dtype=F64)
    X = torch.randn(n, 30, generator=_gen(2), dtype=F64)
    A = X @ X.T / 30
    expected = torch.zeros(m, n, dtype=F64)
    for b in range(B):  # blocks of 3 columns: eigh of the diagonal block, sign, reconstruct
        sl = slice(3 * b, 3 * b + 3)
        Q = torch.linalg.eigh(A[sl, sl]).eigenvectors
        expected[:, sl] = torch.sign(U[:, sl] @ Q) @ Q.T / math.sqrt(m)
    assert torch.allclose(S.dobb_direction(U, A, B), expected, atol=1e-10)


@pytest.mark.parametrize("shape,rank", [((10, 10), 10), ((12, 8), 2), ((8, 12), 1)])
def test_dion_direction_rank_and_norm(shape, rank):
    M = torch.randn(*shape, generator=_gen(3), dtype=F64)
    O = S.dion_direction(M, rank, _gen(4))
    assert torch.linalg.matrix_rank(O) == rank
    assert float(O.square().sum()) == pytest.approx(rank, rel=1e-10)  # ||O||_F^2 = r (SPEC 2)
    assert metrics.orthogonality(O) <= math.sqrt(rank / min(shape)) + 1e-12
    if rank == 1:
        assert metrics.orthogonality(O) == pytest.approx(1 / math.sqrt(min(shape)))


def test_table2_rows_orders_block_and_rank():
    pairs = []
    for seed in range(2):
        X = S.factor_with_second_moment(32, 64, 0.3, _gen(seed))
        D = S.factor_with_second_moment(32, 64, 0.3, _gen(seed + 10))
        pairs.append((D @ X.T, X @ X.T / 64))
    rows = S.table2_rows(pairs, blocks=(1, 4))
    assert [r["B"] for r in rows] == [1, 4]
    assert rows[1]["Dion"] <= 0.5 + 1e-9 < rows[1]["Dobb"]  # rank 8 of 32 caps Dion at sqrt(1/4)
    with pytest.raises(ValueError, match="stats"):
        S.table2_rows([])


def test_capture_matches_direct_second_moments():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    cap = R.SecondMomentCapture({"0": net[0], "2": net[2]})
    x = torch.randn(4, 6, 5)
    cap.enabled = True
    net(x).square().sum().backward()
    got = cap.moments()
    # reference: the same forward by hand, output gradients from autograd
    h = net[0](x)
    y = net[2](torch.tanh(h))
    gh, gy = torch.autograd.grad(y.square().sum(), (h, y))
    xf, hf = x.reshape(-1, 5).double(), torch.tanh(h).reshape(-1, 7).double()
    assert torch.allclose(got["0"]["A"], xf.T @ xf / 24, atol=1e-6)
    assert torch.allclose(got["2"]["A"], hf.T @ hf / 24, atol=1e-6)
    assert torch.allclose(got["0"]["G"], gh.reshape(-1, 7).double().T @ gh.reshape(-1, 7).double() / 24, atol=1e-5)
    assert torch.allclose(got["2"]["G"], gy.reshape(-1, 3).double().T @ gy.reshape(-1, 3).double() / 24, atol=1e-5)
    cap.enabled = False
    cap.reset()
    net(x).sum().backward()
    assert cap.moments() == {}
    cap.remove()


def test_spectrum_rows_split_qkv_and_stability():
    A = torch.eye(4, dtype=F64)
    G = torch.block_diag(torch.eye(2), torch.diag(torch.tensor([1.0, 0.0])), torch.zeros(2, 2) + 1).double()
    rows = S.spectrum_rows({"blocks.1.attn.qkv": {"A": A, "G": G}}, 0.5)
    got = {(r["stat"], r["type"]): r["erank %"] for r in rows}
    assert got == pytest.approx({("A", "attn.qkv"): 100.0, ("G", "attn.q"): 100.0,
                                 ("G", "attn.k"): 50.0, ("G", "attn.v"): 50.0})
    assert all(r["layer"] == 1 for r in rows)
    rows2 = [dict(r, fraction=1.0, **{"erank %": r["erank %"] - (3.0 if r["type"] == "attn.k" else 0)}) for r in rows]
    s = S.stability(rows + rows2, since=0.5)
    assert s["pp"] == pytest.approx(3.0) and s["curve"] == "G/attn.k/1"


def test_hidden_linears_skip_tied_head_even_when_sizes_collide():
    from dobb_bench.model import GPT, config_from_preset

    model = GPT(config_from_preset("tiny", vocab_size=256))  # width 64 = seq_len, fc out 256 = vocab
    names = list(R.hidden_linears(model))
    assert len(names) == 2 * 4 and "head" not in names and "blocks.0.mlp.fc" in names


@pytest.fixture
def tiny_data(tmp_path, monkeypatch):
    import dobb_bench.data as data

    monkeypatch.setattr(data, "DEFAULT_CACHE", tmp_path / "cache")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600)))
    return str(text)


def test_table2_training_and_checkpoint(tiny_data, tmp_path):
    rows, info = R.table2_from_training("tiny", steps=3, optimizer="adamw", batch_size=4, data=tiny_data, blocks=(1, 4))
    assert info["matrices"] == 2 * 6 and len(rows) == 2  # qkv counted as q, k, v
    from dobb_bench.model import GPT, config_from_preset

    model = GPT(config_from_preset("tiny", vocab_size=256))
    ckpt = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "config": model.config.to_dict()}, ckpt)
    rows, info = R.table2_from_training(checkpoint=ckpt, batch_size=4, data=tiny_data, blocks=(2,), probe_steps=2)
    assert 0 < rows[0]["Dobb"] <= 1 and rows[0]["paper Dobb"] is None
    assert info["momentum"].startswith("rebuilt")  # no optimizer state in this checkpoint


@pytest.mark.parametrize("name,key", [("dobb", "momentum"), ("adamw", "exp_avg")])
def test_checkpoint_momentum_is_the_optimizers_own(name, key, tiny_data):
    # the harness saves optimizer.state_dict() (integer ids); names are recovered from the order in
    # which build_optimizer lists parameters, checked here against the live optimizer's state
    import dobb
    from dobb_bench.model import GPT, config_from_preset

    model = GPT(config_from_preset("tiny", vocab_size=256))
    opt = dobb.build_optimizer(name, model, lr=1e-3, weight_decay=0.0)
    _, sampler = R.setup_run("tiny", tiny_data, 4, 0)
    R.train(model, sampler, opt, 2)
    ckpt = {"fingerprint": {"model": model.config.to_dict(), "optimizer": name},
            "model": model.state_dict(), "optimizer": opt.state_dict()}
    got = R.checkpoint_momentum(ckpt, model)
    assert set(got) == set(R.hidden_linears(model))
    for lname, lin in R.hidden_linears(model).items():
        assert torch.equal(got[lname], opt.state[lin.weight][key].double())
    ckpt["optimizer"]["state"] = {}
    assert R.checkpoint_momentum(ckpt, model) is None


class _Payload:
    """Unpickling this runs code (writes a marker file): what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_with_code_is_refused_and_a_real_one_loads(capsys, tmp_path, tiny_data):
    import dobb
    from dobb_bench.model import GPT, config_from_preset

    model = GPT(config_from_preset("tiny", vocab_size=256))
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "config": model.config.to_dict(), "x": _Payload(marker)}, evil)
    assert main(["orthogonality", "--table", "2", "--checkpoint", str(evil), "--data", tiny_data]) == 2
    err = capsys.readouterr().err
    assert "refusing to load checkpoint" in err and "could run code" in err and err.count("\n") == 1
    assert not marker.exists()
    # a real checkpoint (Dobb's state_dict holds torch dtypes among its hyperparameters) loads
    opt = dobb.build_optimizer("dobb", model, lr=1e-3, weight_decay=0.0)
    _, sampler = R.setup_run("tiny", tiny_data, 4, 0)
    R.train(model, sampler, opt, 2)
    good = tmp_path / "good.pt"
    torch.save({"fingerprint": {"model": model.config.to_dict(), "optimizer": "dobb"},
                "model": model.state_dict(), "optimizer": opt.state_dict()}, good)
    loaded, _, momentum = R.load_checkpoint(good, tiny_data, 4, 0)
    assert torch.equal(loaded.state_dict()["blocks.0.mlp.fc.weight"], model.state_dict()["blocks.0.mlp.fc.weight"])
    lin = R.hidden_linears(model)["blocks.0.mlp.fc"]
    assert torch.equal(momentum["blocks.0.mlp.fc"], opt.state[lin.weight]["momentum"].double())


def test_cli_tables_and_errors(capsys, tmp_path, tiny_data):
    assert main(["orthogonality", "--table", "1a", "--size", "32", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 80% |" in out and "0.736" in out
    assert main(["orthogonality", "--table", "1b", "--size", "24", "--seeds", "1"]) == 0
    assert "column l2" in capsys.readouterr().out
    for argv, msg in ((["--table", "3"], "unknown table"),
                      (["--table", "2", "--checkpoint", str(tmp_path / "none.pt")], "does not exist"),
                      (["--table", "1a", "--size", "0"], "--size"),
                      (["--table", "2", "--blocks", "1,x"], "--blocks")):
        assert main(["orthogonality", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1
    bad = tmp_path / "bad.pt"
    torch.save({"weights": {}}, bad)
    assert main(["orthogonality", "--table", "2", "--checkpoint", str(bad)]) == 2
    assert "must hold 'model'" in capsys.readouterr().err


def test_cli_spectrum_end_to_end(capsys, tmp_path, tiny_data):
    out = tmp_path / "spec"
    argv = ["spectrum", "--preset", "tiny", "--steps", "4", "--optimizer", "adamw", "--batch-size", "4",
            "--probe-batches", "1", "--data", tiny_data, "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| >= 50% |" in text and "attn.v" in text
    assert (out / "spectrum_A.png").stat().st_size > 0 and (out / "spectrum_G.png").exists()
    assert main(["spectrum", "--from-json", str(out / "spectrum.json")]) == 0
    assert "| >= 50% |" in capsys.readouterr().out
    assert main(["spectrum", "--fractions", "50,150"]) == 2
    assert main(["spectrum", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_table1b_sign_and_l2_do_not_depend_on_activation_spectrum():
    # C = D X^T Q = D V_X S_X: both normalizations cancel the positive column scaling S_X, so only
    # the raw gradient's orthogonality sees the activation effective rank (see docs/spectral.md)
    a = S.table1b(size=16, seeds=1, targets=(0.3,), act_target=0.15, tokens=32)[0]
    b = S.table1b(size=16, seeds=1, targets=(0.3,), act_target=0.8, tokens=32)[0]
    assert a["Dobb (sign)"] == pytest.approx(b["Dobb (sign)"], abs=1e-9)
    assert a["column l2"] == pytest.approx(b["column l2"], abs=1e-9)
    assert a["G"] < b["G"]
