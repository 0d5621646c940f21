"""How ``dobb._base.MatrixOptimizer`` carries a subclass' own attributes into a copy
(``copy.deepcopy``, ``pickle``): every object here reduces to what the copy must hold, so one
mechanism serves both (deepcopy's memo and pickle's both map the old parameters to the copy's).
"""
from __future__ import annotations

import importlib
import sys

import torch


def shallow_items(value, depth: int = 2):
    """``value`` and what it holds, ``depth`` levels down (container items, plain objects' attributes)."""
    yield value
    if depth == 0 or isinstance(value, (torch.Tensor, torch.nn.Module, str, bytes, type)):
        return
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    elif hasattr(value, "__dict__"):
        children = list(vars(value).values())
    else:
        return
    for child in children:
        yield from shallow_items(child, depth - 1)


def portable(value, by_id: dict[int, tuple], cls: type):
    """An attribute as a copy must receive it. A dict keyed by parameters or their transposed views,
    or by their ids (names for error messages; Dion's splits and Block Muon's layouts of a
    transposed group, keyed by the view), is carried as (param, views or None, by id, value)
    entries and rebuilt keyed by the copy's parameters or views; a module-level sentinel
    (``object()``) stays itself, as identity tests need."""
    if isinstance(value, dict) and value:
        entries = []
        for k, v in value.items():
            if type(k) is int and k in by_id:
                entries.append((*by_id[k], True, v))
            elif isinstance(k, torch.Tensor) and id(k) in by_id:
                entries.append((*by_id[id(k)], False, v))
            else:
                break
        else:
            return _Keyed(entries)
    if type(value) is object:
        for klass in cls.__mro__:
            module = sys.modules.get(klass.__module__)
            name = next((n for n, v in vars(module).items() if v is value), None) if module else None
            if name is not None:
                return _Global(module.__name__, name)
    return value


class _Keyed:
    def __init__(self, entries):
        self.entries = entries

    def __reduce__(self):  # deepcopy copies the entries' params (its memo: the copy's params)
        return _rebuild_keyed, (self.entries,)


def _rebuild_keyed(entries) -> dict:
    out = {}
    for p, views, by_id, v in entries:
        key = p if views is None else views[p]
        out[id(key) if by_id else key] = v
    return out


class Views:
    """The transposed views of ``_logical``, rebuilt on the copy's weights (one object: the copy's
    ``_views`` and the id-keyed dicts that name views see the same rebuilt views)."""

    def __init__(self, params):
        self.params = params

    def __reduce__(self):
        return _transposed_views, (self.params,)


def _transposed_views(params) -> dict:
    return {p: p.detach().t() for p in params}


class _Global:
    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __reduce__(self):
        return _global_value, (self.module, self.name)


def _global_value(module: str, name: str):
    return getattr(importlib.import_module(module), name)
