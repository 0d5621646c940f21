"""The library's own compiled kernels: ``compile=True`` (a group option of Dobb and of every optimizer
that runs Newton-Schulz, ``NSOptions``).

``compiled(fn)`` is what a step with ``compile=True`` calls for the pure function ``fn``:
``torch.compile(fn)``, made once per function (cached here) and compiled by Inductor at its first
call, per shape. With ``compile=False`` the step calls ``fn`` itself and never reaches this module
(an eager step reads no more files than before). What is compiled is a pure kernel of the step
(Newton-Schulz, Dobb's project-sign-reconstruct of a group, Dobb-Muon's preconditioning): never the
user's ``opt.step``, whose frame Dynamo would trace and guard on every call (the optimizer's Python:
its plans, schedule and state dicts), which made a compiled Dobb step slower than eager
(docs/integrations.md, "torch.compile"). A kernel's guards read only its tensors' shapes, strides and
dtypes and its few static arguments.

- ``dynamic=False``: the shapes a kernel sees are those of the model's matrices and blocks, fixed for
  a run; a specialized graph is the fastest, and each new shape compiles once. Values that change
  per step (a scheduled lr, a bias correction) are passed as tensors, never as Python floats, which
  ``dynamic=False`` would bake into the graph (one recompilation per value).
- ``recompile_limit``/``isolate_recompiles``: one graph per distinct shape group of a model, counted
  per kernel and apart from the user's own compiled code (Dynamo's limit, 8, is per code object and
  shared by every ``torch.compile`` of the same function).
- Under a compile of the user's own (``torch.compile(opt.step)``) the plain function is returned,
  so Dynamo traces it into the user's graph instead of nesting a compiled region in it.

Nothing here imports Dynamo: ``torch.compile`` is first called at the first step with
``compile=True`` (``import dobb`` loads no Dynamo; ``tests/test_torch_private.py``).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

__all__ = ["compiled", "RECOMPILE_LIMIT"]

# distinct (shape, dtype) groups a kernel may compile for; past it Dynamo runs the kernel eagerly
RECOMPILE_LIMIT = 64

_F = TypeVar("_F", bound=Callable)
_KERNELS: dict[Callable, Callable] = {}


def compiled(fn: _F) -> _F:
    """``fn`` compiled (made once per ``fn``, compiled at its first call per shape), or ``fn`` itself
    inside a region Dynamo is already compiling."""
    if torch.compiler.is_compiling():
        return fn
    compiled = _KERNELS.get(fn)
    if compiled is None:
        compiled = _KERNELS[fn] = torch.compile(fn, dynamic=False, recompile_limit=RECOMPILE_LIMIT,
                                                isolate_recompiles=True)
    return compiled  # type: ignore[return-value]
