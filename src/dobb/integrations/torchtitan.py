"""torchtitan: Dobb as an optimizer of ``OptimizersContainer``, with FQN-keyed state.

torchtitan builds param groups from regex patterns (``ParamGroupConfig``), adds ``param_names``
(FQNs) and ``fused``/``foreach`` to each, and calls the optimizer factory named by the group
with the list of groups. ``dobb_factory`` is such a factory: every incoming group is split into
its Dobb matrices (transposed ones, stored ``(in, out)``, in a ``transposed=True`` group) and the
rest (AdamW inside the same Dobb object, as ``dobb.param_groups`` decides), keeping each group's hyperparameters and ``param_names`` aligned with its params, so a
catch-all pattern ``".*"`` is enough. torchtitan's AdamW spellings ``betas``/``eps`` become
``adamw_betas``/``adamw_eps``, and its ``fused``/``foreach`` (torch's AdamW kernel flags, given to
every group) go to the AdamW groups, which honour them as ``torch.optim.AdamW`` does; Dobb's
matrix groups have one kernel and do not take them.

Dobb reads layer inputs with hooks, so the factory needs the model part; ``DobbOptimizersContainer``
(torchtitan installed) passes it::

    config = DobbOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="Dobb",
                         optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1, "blocks": 4})])
    optimizers = DobbOptimizersContainer(config, model_parts=[model])

Checkpoints: torchtitan's ``state_dict()`` / ``load_state_dict()`` (flat, FQN keyed) and
``torch.distributed.checkpoint.state_dict``'s ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (nested or ``flatten_optimizer_state_dict=True``) both restore Dobb's
full state; Dobb's state exists from construction, so torchtitan's zero-lr "create the state" step
is never needed (and, if taken, changes no weight and no statistic).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import Dobb
from ..groups import split_parameters, transposed_parameters

__all__ = ["dobb_factory", "DobbOptimizersContainer"]

_RENAMES = {"betas": "adamw_betas", "eps": "adamw_eps"}
# torch's AdamW kernel flags: honoured by the AdamW groups, not taken by the matrix groups
_ADAMW_ONLY = ("fused", "foreach")


def dobb_factory(param_groups: list[dict[str, Any]], *, model: nn.Module, **kwargs: Any) -> Dobb:
    """A ``Dobb`` over torchtitan-style ``param_groups`` of ``model`` (see the module docstring).

    ``kwargs`` are Dobb constructor arguments shared by all groups (``check_finite``,
    ``stat_group``, or defaults of any hyperparameter); each group's own keys win.
    """
    if not param_groups:
        raise ValueError("dobb_factory got no param groups")
    matrix_ids = {id(p) for _, p in split_parameters(model)[0]}
    transposed = transposed_parameters(model)
    groups = []
    for g in param_groups:
        g = {_RENAMES.get(k, k): v for k, v in g.items()}
        params = list(g.pop("params"))
        names = g.pop("param_names", None)
        if names is not None and len(names) != len(params):
            raise ValueError(f"param_names has {len(names)} entries for {len(params)} params")
        algorithm = g.pop("algorithm", None)
        kind = ["adamw" if id(p) not in matrix_ids else "transposed" if id(p) in transposed else "matrix"
                for p in params]
        for k in ("matrix", "transposed", "adamw"):
            idx = [i for i, ki in enumerate(kind) if ki == k]
            if not idx:
                continue
            sub = dict(g, params=[params[i] for i in idx])
            if k != "adamw":
                for key in _ADAMW_ONLY:
                    sub.pop(key, None)
            if names is not None:
                sub["param_names"] = [names[i] for i in idx]
            sub["algorithm"] = "adamw" if k == "adamw" else (algorithm or Dobb.algorithm)
            if k == "transposed":
                sub["transposed"] = True
            groups.append(sub)
    shared = {_RENAMES.get(k, k): v for k, v in kwargs.items()}
    for key in _ADAMW_ONLY:  # shared flags reach the AdamW groups only (a group's own value wins)
        if key in shared:
            value = shared.pop(key)
            for sub in groups:
                if sub["algorithm"] == "adamw":
                    sub.setdefault(key, value)
    lr = shared.pop("lr", groups[0].get("lr"))
    if lr is None:
        raise ValueError("dobb_factory needs lr: in every param group (torchtitan's optimizer_kwargs) or as a keyword")
    return Dobb(groups, model=model, lr=lr, **shared)


try:
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError:  # torchtitan not installed: the factory above still works on its own
    OptimizersContainer = None

if OptimizersContainer is not None:

    class DobbOptimizersContainer(OptimizersContainer):
        """torchtitan's ``OptimizersContainer`` that also knows ``optimizer_name="Dobb"``."""

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            """``OptimizersContainer.Config`` whose ``build(model_parts=...)`` makes this container."""

        def _build_param_groups(self, model, param_group_configs, impl_kwargs):
            self._dobb_model_part = model  # the part whose groups are built next (one factory call each)
            return OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)

        def _resolve_optimizer_factory(self, name: str):
            if name == "Dobb":
                return functools.partial(dobb_factory, model=self._dobb_model_part)
            return OptimizersContainer._resolve_optimizer_factory(name)
else:

    class DobbOptimizersContainer:  # noqa: D101 - placeholder that explains what is missing
        def __init__(self, *args, **kwargs):
            raise ImportError("DobbOptimizersContainer needs torchtitan (pip install torchtitan); "
                              "dobb_factory works without it")
