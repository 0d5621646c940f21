"""``dobb._compiled``: one compiled version per pure function, made lazily, and the plain function
under a compile of the caller's own (so Dynamo inlines it instead of nesting a compiled region)."""
import os
import shutil

import pytest
import torch

from dobb import _compiled

INDUCTOR = pytest.mark.skipif(os.environ.get("DOBB_TEST_INDUCTOR") == "0" or shutil.which("g++") is None,
                              reason="Inductor's C++ compiler is not available (or DOBB_TEST_INDUCTOR=0)")


def _axpy(x, y):
    return x.mul(2.0).add_(y)


@INDUCTOR
def test_one_compiled_kernel_per_function_with_the_functions_numbers():
    k = _compiled.compiled(_axpy)
    assert k is not _axpy and _compiled.compiled(_axpy) is k  # made once, then cached
    x, y = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert torch.equal(k(x, y), _axpy(x, y))


def test_under_a_compile_of_the_callers_own_the_plain_function(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _compiled.compiled(_axpy) is _axpy
