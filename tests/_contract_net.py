"""The model and helpers of the torch.optim contract tests (``test_base.py``: the shared
``MatrixOptimizer``; ``test_copies.py``: deepcopy and pickle), for every optimizer of
``dobb.build_optimizer``."""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

import dobb
from dobb.factory import OPTIMIZER_NAMES

# the registry grows during development: every name is covered without editing this file
MATRIX_NAMES = [n for n in OPTIMIZER_NAMES if n != "adamw"]
V, D = 24, 12


class Transposed(nn.Module):
    """A layer storing its weight (in, out), as Hugging Face's Conv1D: a transposed=True group."""
    dobb_transposed = True

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))

    def forward(self, x):
        return x @ self.weight


class Net(nn.Module):
    """Embedding, two hidden matrices (one stored transposed), a head; optionally a sparse
    embedding gradient, a complex gain in the AdamW part, or a complex hidden matrix."""

    def __init__(self, sparse=False, complex_gain=False, complex_matrix=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, sparse=sparse)
        self.hidden = nn.Linear(D, D, dtype=torch.complex64 if complex_matrix else None)
        self.mid = Transposed(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.gain = nn.Parameter(torch.randn(D, dtype=torch.complex64)) if complex_gain else None

    def forward(self, tokens):
        h = self.emb(tokens)
        if self.gain is not None:  # a gradient with a nonzero imaginary part reaches the gain
            z = h * self.gain
            h = h + z.real + z.imag
        h = torch.relu(self.hidden(h))
        h = torch.relu(self.mid(h))
        return self.head(self.norm(h))


def batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g)


def backward(model, t):
    x, y = batch(t)
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        backward(model, t)
        opt.step()


def build(name, model, **kw):
    return dobb.build_optimizer(name, model, lr=0.01, weight_decay=0.1, **kw)


def snapshot(model, opt):
    """Every weight and every optimizer state tensor, cloned."""
    weights = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
             for st in opt.state_dict()["state"].values() for v in st.values()]
    return weights, state


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def holds_model(opt):
    """Whether the optimizer keeps a model (hooks on its layers: Dobb, Newton-Muon)."""
    return any(isinstance(v, nn.Module) for v in vars(opt).values())
