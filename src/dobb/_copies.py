"""How ``dobb._base.MatrixOptimizer`` carries a subclass' own attributes into a copy
(``copy.deepcopy``, ``pickle``): ``Copies``, its ``__getstate__``/``__setstate__``, and the objects
every attribute reduces to (what the copy must hold), so one mechanism serves both (deepcopy's memo
and pickle's both map the old parameters to the copy's).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

# The key under which __getstate__ passes a subclass' own attributes to a copy.
_OWN_ATTRIBUTES = "_matrix_optimizer_attributes"


class Copies:
    """``MatrixOptimizer``'s copies (a mixin before ``torch.optim.Optimizer``; it reads the class's
    ``_views``, ``_derived`` and ``_rebuild``)."""

    # torch.optim.Optimizer.__getstate__ keeps only defaults, state and param_groups, so a copy of
    # a subclass lost every attribute of its own and failed at its first step(). Here a copy keeps
    # them, as torch's copy keeps its state: copied with the parameters (a deepcopy of the
    # optimizer copies its parameters too, as torch's does; deepcopy((model, opt)) keeps them the
    # model's). Left out, as torch leaves them out: its hook registries; rebuilt: _views (views of
    # the weights, which a copy of a view would not share) and the subclass' caches (``_derived``,
    # rebuilt by ``_rebuild`` from the copy's param groups). An optimizer that holds a model (hooks
    # on its layers) or a process group is refused with a TypeError naming state_dict(): a copy
    # could not keep capturing for the original model, nor carry a process group.
    def __getstate__(self) -> dict[str, Any]:
        why = self._copy_refusal()
        if why is not None:
            raise TypeError(
                f"{type(self).__name__} cannot be copied or pickled: it holds {why}. Save opt.state_dict() "
                f"instead and load it with load_state_dict() into a new {type(self).__name__} built on the "
                f"(copied) model"
            )
        state = super().__getstate__()
        views = Views(list(self._views))
        # what an id may name: a parameter, or the transposed view of one (Dion's splits of a
        # transposed group are keyed by the view's id)
        by_id = {id(v): (p, views) for p, v in self._views.items()}
        by_id.update((id(p), (p, None)) for g in self.param_groups for p in g["params"])
        own = {}
        for key, value in vars(self).items():
            if key in state or key.startswith("_optimizer_") or key in self._derived:
                continue
            own[key] = views if key == "_views" else portable(value, by_id, type(self))
        state[_OWN_ATTRIBUTES] = own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict calls this too, with state and param_groups only
        own = state.pop(_OWN_ATTRIBUTES, None)
        super().__setstate__(state)
        if own is not None:
            self.__dict__.update(own)
            self._rebuild()

    def _copy_refusal(self) -> str | None:
        """Why this optimizer cannot be copied (``None``: it can): what it holds that a copy cannot
        carry (a model with hooks, hook handles, a process group), looked for two levels deep."""
        pg = getattr(torch.distributed, "ProcessGroup", None) if torch.distributed.is_available() else None
        kinds = [(torch.nn.Module, "a model ({}), whose layers it hooks"),
                 (torch.utils.hooks.RemovableHandle, "hook handles ({})")]
        if pg is not None:
            kinds.append((pg, "a process group ({})"))
        for key, value in vars(self).items():
            if key in ("state", "param_groups", "defaults") or key.startswith("_optimizer_") or key in self._derived:
                continue  # derived caches are not copied: the copy rebuilds them
            for item in shallow_items(value):
                for kind, what in kinds:
                    if isinstance(item, kind):
                        return what.format(repr(key))
        return None



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
