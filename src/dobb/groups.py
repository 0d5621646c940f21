"""Default split of a model's parameters between a matrix optimizer and AdamW.

The rule (Muon/Dion convention):
- matrix optimizer: the ``weight`` of every hidden linear layer: ``nn.Linear`` (stored
  ``(out, in)``) and the layers that store it transposed, ``(in, out)``: Hugging Face's ``Conv1D``
  (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``) and any module that declares
  ``dobb_transposed = True`` (an attribute of the class or the instance). Transposed weights get a
  group of their own with ``transposed=True``, which every optimizer of this package follows;
- expert stacks (MoE grouped experts, a 3-D ``(E, out, in)`` weight whose expert ``e`` computes
  ``x_e @ W[e].T`` for its routed rows): declared by the module that holds them, with
  ``dobb_experts = ("w1", "w2")`` (the names of its own parameters, a class or instance
  attribute), or by full name with ``param_groups(model, experts=["layers.0.moe.w1", ...])``. They
  go to the matrix group when the algorithm is ``"dobb"`` (Dobb optimizes them as ``E`` matrices;
  feed their routed rows with ``Dobb.capture`` or use ``source="grad_gram"``), to AdamW for the
  other algorithms (they update 2-D matrices only). Undeclared 3-D parameters go to AdamW;
- AdamW: everything else — embeddings (``nn.Embedding``), the output head, norms, biases, scalars,
  and parameters of other module types. ``nn.Conv2d`` weights ``(out, in, kh, kw)`` go to AdamW
  too: the statistic that describes them is the second moment of unfolded input patches
  (``in*kh*kw`` wide), which the capture hooks do not form, and the matrix optimizers update 2-D
  weights only.

A linear layer is the output head when its weight *is* an embedding's weight (tied head), when
its name is one of ``head_names`` (last dotted component), or when it is the model's last linear
layer and projects onto the largest embedding's vocabulary (``out_features == num_embeddings``).
Only the last one is tested for that: hidden layers can have the vocabulary's width (a byte-level
model of width 256), and position tables have the context's. Override with ``is_matrix``.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

DEFAULT_HEAD_NAMES = ("head", "lm_head", "output", "classifier", "out_proj_vocab")


def takes_expert_stacks(algorithm: str) -> bool:
    """Whether the optimizer of ``algorithm`` (a class' ``algorithm``) takes 3-D expert stacks: its
    class says so (``_expert_stacks``), as declared in ``dobb.registry``."""
    from .registry import OPTIMIZERS  # at call time: the registry imports every class, and a class may import this module

    return any(e.is_matrix and e.cls.algorithm == algorithm and e.cls._expert_stacks for e in OPTIMIZERS.values())


def is_expert_stack(name: str, module: nn.Module, p: nn.Parameter, experts=()) -> bool:
    """Whether ``p`` (full name ``name``, owned by ``module``) is a declared ``(E, out, in)`` expert stack."""
    own = name.rsplit(".", 1)[-1]
    return p.dim() == 3 and (own in tuple(getattr(module, "dobb_experts", ())) or name in experts)


def is_transposed_layer(module: nn.Module) -> bool:
    """Whether ``module.weight`` is stored ``(in, out)``: Hugging Face ``Conv1D`` or a declared layer."""
    if getattr(module, "dobb_transposed", False):
        return True
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed_layer(module)


def _out_features(module: nn.Module) -> int:
    w = module.weight
    return w.shape[1] if is_transposed_layer(module) else w.shape[0]


def transposed_parameters(model: nn.Module) -> set[int]:
    """``id``s of the weights of ``model``'s transposed layers (see ``is_transposed_layer``)."""
    return {id(m.weight) for m in model.modules()
            if is_transposed_layer(m) and isinstance(getattr(m, "weight", None), nn.Parameter)}


def split_parameters(model: nn.Module, *, head_names=DEFAULT_HEAD_NAMES,
                     is_matrix: Callable[[str, nn.Module, nn.Parameter], bool] | None = None,
                     experts=(), stacks: bool = True):
    """Returns ``(matrix, other)``: lists of ``(name, parameter)``; shared parameters appear once.

    ``experts``: full names of expert stacks besides those their modules declare (``dobb_experts``);
    ``stacks``: whether declared stacks go to ``matrix`` (the optimizer takes them) or to ``other``.
    """
    experts = set(experts)
    named = dict(model.named_parameters())
    for name in experts:
        if name not in named or named[name].dim() != 3:
            got = "no such parameter" if name not in named else f"shape {tuple(named[name].shape)}"
            raise ValueError(f"experts names {name!r}: an expert stack must be a 3-D (E, out, in) parameter ({got})")
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_weights = {id(m.weight) for m in embeddings}
    vocab = max((m.num_embeddings for m in embeddings), default=None)
    linears = [m for m in model.modules() if _is_linear(m)]
    last_linear = linears[-1] if linears else None

    def default_is_matrix(name: str, module: nn.Module, p: nn.Parameter) -> bool:
        if is_expert_stack(name, module, p, experts):
            return stacks
        if not _is_linear(module) or p is not module.weight or p.dim() != 2:
            return False
        if id(p) in embedding_weights or name.rsplit(".", 1)[0].rsplit(".", 1)[-1] in head_names:
            return False
        return not (module is last_linear and _out_features(module) == vocab)

    decide = is_matrix or default_is_matrix
    matrix, other, seen = [], [], set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            (matrix if decide(name, module, p) else other).append((name, p))
    return matrix, other


def param_groups(model: nn.Module, algorithm: str = "dobb", *, head_names=DEFAULT_HEAD_NAMES,
                 is_matrix: Callable[[str, nn.Module, nn.Parameter], bool] | None = None,
                 experts=(), decay_names=None, **matrix_overrides):
    """Param groups for any optimizer of this package: ``[{matrix group}, {"algorithm": "adamw"}]``,
    with a second matrix group (``transposed=True``) when the model has transposed layers.

    Parameters are given as ``(name, tensor)`` pairs so errors can name them. Extra keyword
    arguments become per-group overrides of the matrix groups (e.g. ``blocks=4``). ``experts``: full
    names of 3-D expert stacks besides those declared by ``dobb_experts`` (see the module docstring).
    ``decay_names``: names of the AdamW-part parameters that get weight decay (Hugging Face's
    ``Trainer.get_decay_parameter_names``); the others go to a second AdamW group with
    ``weight_decay=0``. ``None``: all of them decay. Matrices always decay (the paper's protocol).
    """
    matrix, other = split_parameters(model, head_names=head_names, is_matrix=is_matrix, experts=experts,
                                     stacks=takes_expert_stacks(algorithm))
    transposed = transposed_parameters(model)
    groups = []
    plain = [np for np in matrix if id(np[1]) not in transposed]
    flipped = [np for np in matrix if id(np[1]) in transposed]
    if plain:
        groups.append({"params": plain, "algorithm": algorithm, **matrix_overrides})
    if flipped:
        groups.append({"params": flipped, "algorithm": algorithm, **matrix_overrides, "transposed": True})
    if decay_names is None:
        decay_names = {name for name, _ in other}
    decay_names = set(decay_names)
    decayed = [np for np in other if np[0] in decay_names]
    if decayed:
        groups.append({"params": decayed, "algorithm": "adamw"})
    if len(decayed) < len(other):
        groups.append({"params": [np for np in other if np[0] not in decay_names], "algorithm": "adamw",
                       "weight_decay": 0.0})
    if not groups:
        raise ValueError("model has no trainable parameters")
    return groups
