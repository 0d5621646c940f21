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
