"""The one comparison helper of the test suite: largest absolute difference between two results.

Results may be tensors (plain or DTensor: compared as full tensors, so call it on every rank for
DTensors), lists/tuples of them or dicts of them with the same keys.
"""
from __future__ import annotations

import torch

from dobb.layout import is_dtensor  # the library's one DTensor test


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def max_diff(a, b) -> float:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), (len(a), len(b))
        return max((max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    a, b = full(a), full(b)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_close(a, b, tol: float) -> None:
    diff = max_diff(a, b)
    assert diff <= tol, f"max abs difference {diff:.3e} > {tol:.1e}"
