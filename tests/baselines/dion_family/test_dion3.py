"""dobb.baselines.dion_family.dion3: Dion3 (Dion2's row subset + NorMuon's per-neuron normalization) against its
float64 definition written out row by row, with the standard and the Gram Newton-Schulz."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _baseline_refs import ns5_reference, randn


def dion3_reference(grads, fraction, lr=0.1, wd=0.01, tau=0.2, mu=0.95, beta2=0.95, eps=1e-8):
    m, n = grads[0].shape
    k = max(1, round(fraction * m))
    w, mom, v = torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, n, dtype=torch.float64), [0.0] * m
    chosen = []
    for g in grads:
        b = mom + g
        l1 = [sum(abs(float(x)) for x in b[i]) for i in range(m)]
        rows = sorted(sorted(range(m), key=lambda i: -l1[i])[:k])
        chosen.append(rows)
        ok = ns5_reference(b[rows])
        scaled = []
        for j, i in enumerate(rows):
            v[i] = beta2 * v[i] + (1 - beta2) * sum(float(x) ** 2 for x in ok[j]) / n
            scaled.append(ok[j] / (math.sqrt(v[i]) + eps))
        scaled = torch.stack(scaled)
        scaled = scaled * ok.norm() / scaled.norm()
        o = torch.zeros(m, n, dtype=torch.float64)
        o[rows] = scaled
        mom = b.clone()
        mom[rows] = mu * b[rows]
        w = (1 - lr * wd) * w - lr * tau * math.sqrt(max(k, n)) * o
    return w, mom, torch.tensor(v, dtype=torch.float64), chosen


@pytest.mark.parametrize("shape,fraction", [((20, 12), 0.25), ((12, 30), 0.5), ((16, 16), 1.0)])
def test_dion3_matches_dense_reference(shape, fraction):
    from dobb.baselines import Dion3

    grads = [randn(*shape, seed=10 + s) * torch.linspace(0.2, 2, shape[0], dtype=torch.float64)[:, None]
             for s in range(4)]
    w = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = Dion3([w], lr=0.1, weight_decay=0.01, fraction=fraction, ns_dtype="float64")
    for g in grads:
        w.grad = g.clone()
        opt.step()
    ref_w, ref_m, ref_v, chosen = dion3_reference(grads, fraction)
    assert len({tuple(c) for c in chosen}) > 1 or fraction == 1.0  # the subset moves between steps
    assert (w.detach() - ref_w).abs().max().item() < 1e-12
    assert (opt.state[w]["momentum"] - ref_m).abs().max().item() < 1e-12
    assert (opt.state[w]["neuron_variance"] - ref_v).abs().max().item() < 1e-14
    gram = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = Dion3([gram], lr=0.1, weight_decay=0.01, fraction=fraction, ns_dtype="float64", ns_method="gram")
    for g in grads:
        gram.grad = g.clone()
        opt.step()
    assert (gram.detach() - ref_w).abs().max().item() < 1e-12
