"""``eigh_every = k``: the warm refresh (one ``qr(A Q)`` power step from the previous basis) with an
exact ``eigh`` on every ``k``-th refresh of a matrix, against a float64 dense reference written here.
Bases are compared up to the sign of each column."""
from __future__ import annotations

import pytest
import torch

from dobb import Dobb


def _reference_bases(grads, k, decay=0.9):
    out, a, q = [], None, None
    for t, g in enumerate(grads):  # refresh_every=1: every step refreshes; t = refreshes before this one
        new = g.T @ g / g.shape[0]
        a = new if a is None else decay * a + (1 - decay) * new
        if t == 0 or (k and t % k == 0):
            q = torch.linalg.eigh(a).eigenvectors.flip(-1)
        else:
            q = torch.linalg.qr(a @ q).Q
        out.append(q)
    return out


def _signs_fixed(q, ref):
    return q * torch.sign(torch.diagonal(q.T @ ref))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_bases_match_reference(k):
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(20, 8, generator=gen, dtype=torch.float64) for _ in range(7)]
    p = torch.nn.Parameter(torch.zeros(20, 8, dtype=torch.float64))
    opt = Dobb([p], lr=0.01, source="grad_gram", refresh_every=1, eigh_every=k, basis_dtype=torch.float64,
               stat_dtype=torch.float64, stagger=False)
    for g, ref in zip(grads, _reference_bases(grads, k)):
        p.grad = g.clone()
        opt.step()
        q = opt.state[p]["basis"]
        torch.testing.assert_close(_signs_fixed(q, ref), ref, rtol=0, atol=1e-9)


def test_periodic_eigh_differs_from_warm_refresh():
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(20, 8, generator=gen, dtype=torch.float64) for _ in range(4)]
    warm, exact = _reference_bases(grads, 0)[3], _reference_bases(grads, 3)[3]
    assert (_signs_fixed(warm, exact) - exact).abs().max() > 1e-3


def test_negative_is_a_value_error():
    with pytest.raises(ValueError, match="eigh_every"):
        Dobb([torch.nn.Parameter(torch.randn(4, 4))], lr=0.1, source="grad_gram", eigh_every=-2)
