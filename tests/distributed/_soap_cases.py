"""The problems SOAP and SOAP-Muon are checked on over 2 and 4 gloo ranks (``test_soap_sharded``,
``test_soap_muon_sharded``), with their single-process references: one definition for both, since
SOAP-Muon is owner-computed on SOAP's path and must pass the same cases.

Synthetic DTensors: ``(shape, shard dim, group)``: three equal shapes, uneven and empty shards, a
side over ``max_precondition_dim`` (one-sided) and a ``blocks=2`` group. The model runs use square
16 x 16 matrices and 32 rows a batch: every Gram of the first step has full rank, so its eigenbases
are unique up to sign (which SOAP's update does not see). With a degenerate eigenspace (a
rank-deficient first statistic) the basis inside it, hence the run, would follow rounding: exact
equality is then only possible on bitwise equal gradients (the synthetic case). And ``eps=1e-4``
there (``MODEL_EPS``): with the default 1e-8, Adam's division by sqrt(V) + eps in the rotated space
amplifies rounding, so that inputs changed by 1e-15 (relative) move single-process SOAP itself by
about 6e-9 on this model; with 1e-4 by about 1e-12, so a 1e-10 tolerance still catches any error of
the exchanges (those are O(1e-2)). The synthetic case keeps the default: its gradients are bitwise
equal."""
from __future__ import annotations

from torch import nn

import _common as C
from _common import Net, data, full_params, train
from dobb.baselines.shampoo_family.soap import OWNED_KEYS

LR, WD = 0.02, 0.1
CASES = [((12, 20), 0, 0), ((12, 20), 0, 0), ((12, 20), 0, 0), ((18, 10), 0, 0), ((10, 18), 1, 0),
         ((2, 9), 0, 0), ((9, 2), 1, 0), ((30, 6), 0, 0), ((8, 12), 1, 1), ((6, 8), 0, 1)]
GROUP_OPTS = [dict(max_precondition_dim=24), dict(blocks=2)]
WIDTH, ROWS = 16, 32
MODEL_EPS = 1e-4


def square_net():
    return Net(d=WIDTH, h=WIDTH, out=WIDTH)


def batches(steps):
    return data(steps, rows=ROWS, d=WIDTH, out=WIDTH)


def fsdp_square(mesh):
    from torch.distributed.fsdp import fully_shard

    model = square_net()
    for name in Net.matrices:
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def case_groups(params):
    """``params`` (one per case) in the param groups of ``GROUP_OPTS``."""
    return [{"params": [p for p, (_, _, g) in zip(params, CASES) if g == k], **o} for k, o in enumerate(GROUP_OPTS)]


def reference_weights(cls, steps: int, **opts):
    """The synthetic cases' weights after ``steps`` steps of ``cls`` in one process."""
    params = [nn.Parameter(C.weights_and_grads(s, i, steps)[0]) for i, (s, _, _) in enumerate(CASES)]
    opt = cls(case_groups(params), lr=LR, weight_decay=WD, **opts)
    for t in range(steps):
        for i, (p, (s, _, _)) in enumerate(zip(params, CASES)):
            p.grad = C.weights_and_grads(s, i, steps)[1][t]
        opt.step()
    return [p.detach() for p in params]


def reference_model(cls, steps: int, **opts):
    """The square model's full weights after ``steps`` steps of ``cls`` in one process."""
    model = square_net()
    opt = cls(C.groups(model), lr=LR, weight_decay=WD, **opts)
    train(model, opt, batches(steps))
    return full_params(model)


def held(opt, params):
    """Entries of owner-held state on this rank, per matrix."""
    return [sum(opt.state[p][k].numel() for k in OWNED_KEYS) for p in params]
