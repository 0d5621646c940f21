"""dobb_bench.training.evaluate: the validation loss is the token-mean cross entropy over the eval
windows, computed here by hand; ``eval_weights`` reads the optimizer's own declaration."""
import numpy as np
import torch
import torch.nn.functional as F

from dobb_bench.training.data import eval_batches
from dobb_bench.training.dist_env import DistEnv
from dobb_bench.training.evaluate import eval_weights, evaluate
from dobb_bench.training.model import GPT


def test_evaluate_is_the_token_mean_cross_entropy(corpus, tiny_model_cfg):
    model = GPT(tiny_model_cfg, seed=0)
    seq_len = tiny_model_cfg.seq_len
    offsets = np.arange(0, 5 * seq_len, seq_len)
    got = evaluate(model, corpus, offsets, seq_len, 2, DistEnv())
    losses, tokens = [], 0
    with torch.no_grad():
        for x, y in eval_batches(corpus.val, offsets, seq_len, 3):  # another batching: the same mean
            logits, _ = model(x)
            losses.append(F.cross_entropy(logits.double().flatten(0, 1), y.flatten(), reduction="sum"))
            tokens += y.numel()
    assert abs(got - torch.stack(losses).sum().item() / tokens) < 1e-6
    assert model.training  # left in the mode it was in


def test_eval_weights():
    class Averaging:
        eval_weights = "iterate-ema"

    assert eval_weights(Averaging()) == "iterate-ema" and eval_weights(object()) == "raw"


def test_weight_norms_are_each_hidden_matrix_rms_and_top_singular_value(tiny_model_cfg):
    from dobb_bench.training.evaluate import weight_norms

    model = GPT(tiny_model_cfg, seed=0)
    with torch.no_grad():  # a known spectrum in one matrix: singular values 3, 2, 1, 0...
        w = model.blocks[0].mlp.fc.weight
        u, _ = torch.linalg.qr(torch.randn(w.shape[0], w.shape[1], dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(w.shape[1], w.shape[1], dtype=torch.float64))
        s = torch.zeros(w.shape[1], dtype=torch.float64)
        s[:3] = torch.tensor([3.0, 2.0, 1.0])
        w.copy_((u * s) @ v.T)
    got = weight_norms(model)
    hidden = {f"blocks.{n}": p for n, p in model.blocks.named_parameters() if p.ndim == 2}
    assert set(got["matrices"]) == set(hidden) and len(hidden) >= 4
    rms, top = got["matrices"]["blocks.0.mlp.fc.weight"]
    assert abs(top - 3.0) < 1e-5 and abs(rms - (14.0 / w.numel()) ** 0.5) < 1e-7
    for name, p in hidden.items():
        a = np.linalg.norm(p.detach().double().numpy(), 2)
        assert abs(got["matrices"][name][1] - a) < 1e-6 * a
    assert got["max_top_sv"] == max(v[1] for v in got["matrices"].values())
    assert got["max_rms"] == max(v[0] for v in got["matrices"].values())
