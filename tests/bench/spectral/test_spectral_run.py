"""dobb_bench.spectral.spectral_run: second-moment capture against direct computation, the
hidden-layer choice, training runs and their checkpoints (a checkpoint that would run code is refused)."""
import pytest
import torch

from dobb_bench.cli import main
from dobb_bench.spectral import spectral_run as R


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


def test_hidden_linears_skip_tied_head_even_when_sizes_collide():
    from dobb_bench.training.model import GPT, config_from_preset

    model = GPT(config_from_preset("tiny", vocab_size=256))  # width 64 = seq_len, fc out 256 = vocab
    names = list(R.hidden_linears(model))
    assert len(names) == 2 * 4 and "head" not in names and "blocks.0.mlp.fc" in names


def test_table2_training_and_checkpoint(tiny_data, tmp_path):
    rows, info = R.table2_from_training("tiny", steps=3, optimizer="adamw", batch_size=4, data=tiny_data, blocks=(1, 4))
    assert info["matrices"] == 2 * 6 and len(rows) == 2  # qkv counted as q, k, v
    from dobb_bench.training.model import GPT, config_from_preset

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
    from dobb_bench.training.model import GPT, config_from_preset

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
    from dobb_bench.training.model import GPT, config_from_preset

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
