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
- ``nn.MultiheadAttention``'s input projections (every ``nn.Transformer`` layer's): its fused
  ``in_proj_weight`` ``(3E, E)`` (q, k and v stacked by rows, each ``x @ W_part.T``) and, when
  ``kdim``/``vdim`` differ from ``E``, its ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``
  go to the matrix update (its ``out_proj`` is an ``nn.Linear``). Where the algorithm cuts fused
  weights (its options have ``split_sizes``: Muon, CMuon, Owner Muon, Block Muon, NorMuon) the
  fused weights get a matrix group of their own with ``split_sizes=(E, E, E)``: q, k and v are
  updated as three matrices, exactly as three ``nn.Linear`` layers would be (a ``split_sizes``
  given to ``param_groups`` wins). The other algorithms update the fused weight as one
  ``(3E, E)`` matrix, as they do any fused q/k/v linear layer (GPT-2's ``c_attn``), and
  ``param_groups`` says so in a ``UserWarning`` naming every such parameter (``mha_warning``);
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

import warnings
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


MHA_PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def is_mha_projection(module: nn.Module, p: nn.Parameter) -> bool:
    """Whether ``p`` is an input projection of ``nn.MultiheadAttention`` ``module`` (stored
    ``(out, in)`` as ``nn.Linear``'s weight; ``in_proj_weight`` holds q, k, v stacked by rows)."""
    return isinstance(module, nn.MultiheadAttention) and p.dim() == 2 and any(
        getattr(module, k, None) is p for k in MHA_PROJECTIONS)


def fused_mha_weights(model: nn.Module) -> dict[int, int]:
    """``{id(in_proj_weight): E}`` for every ``nn.MultiheadAttention`` of ``model`` with a fused
    ``(3E, E)`` input projection."""
    return {id(m.in_proj_weight): m.embed_dim for m in model.modules()
            if isinstance(m, nn.MultiheadAttention) and isinstance(m.in_proj_weight, nn.Parameter)}


def takes_split(algorithm: str) -> bool:
    """Whether every optimizer class of ``algorithm`` cuts fused weights (``split_sizes`` among its
    options, see ``dobb.baselines.muon_family._split``)."""
    from .registry import OPTIMIZERS

    classes = [e.cls for e in OPTIMIZERS.values() if e.is_matrix and e.cls.algorithm == algorithm]
    return bool(classes) and all("split_sizes" in c.Options.names() for c in classes)


def mha_warning(names: list[str], algorithm: str) -> str:
    """The ``UserWarning`` of ``param_groups`` for fused q/k/v weights an algorithm cannot cut."""
    dobb_note = (" (Dobb's heads=<num_heads> cuts the output-side blocks of side='both' and norm='muon' "
                 "per head)") if algorithm == "dobb" else ""
    return (f"nn.MultiheadAttention's fused q/k/v projection(s) {', '.join(names)} go to the {algorithm!r} "
            f"matrix update as one (3E, E) matrix each: {algorithm!r} cannot cut q, k and v apart. To update "
            f"them as three matrices use 'muon', 'cmuon', 'block-muon' or 'normuon' (they get "
            f"split_sizes=(E, E, E)){dobb_note}; to keep them in AdamW (as before), pass an is_matrix that returns "
            f"False for them; to silence this, filter this UserWarning")


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
        if is_mha_projection(module, p):
            return True
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
    ``weight_decay=0``. ``None``: those of two or more dimensions decay (embeddings, the head),
    the 1-D and 0-D ones do not (biases, norm weights, scalars), as Hugging Face and nanoGPT do;
    pass every name (``[n for n, _ in model.named_parameters()]``) to decay them all, as before.
    Matrices always decay (the paper's protocol). ``nn.MultiheadAttention``'s fused q/k/v weights:
    see the module docstring (a group with ``split_sizes=(E, E, E)``, or a ``UserWarning``).
    """
    matrix, other = split_parameters(model, head_names=head_names, is_matrix=is_matrix, experts=experts,
                                     stacks=takes_expert_stacks(algorithm))
    transposed = transposed_parameters(model)
    fused = fused_mha_weights(model)
    fused_names = [name for name, p in matrix if id(p) in fused]
    split = fused_names and takes_split(algorithm) and "split_sizes" not in matrix_overrides
    if fused_names and not split and "split_sizes" not in matrix_overrides:
        warnings.warn(mha_warning(fused_names, algorithm), UserWarning, stacklevel=2)
    groups = []
    plain = [np for np in matrix if id(np[1]) not in transposed and not (split and id(np[1]) in fused)]
    flipped = [np for np in matrix if id(np[1]) in transposed]
    if plain:
        groups.append({"params": plain, "algorithm": algorithm, **matrix_overrides})
    if flipped:
        groups.append({"params": flipped, "algorithm": algorithm, **matrix_overrides, "transposed": True})
    if split:  # one group per width E: q, k and v of each fused weight updated as three matrices
        for width in dict.fromkeys(fused[id(p)] for name, p in matrix if id(p) in fused):
            params = [np for np in matrix if fused.get(id(np[1])) == width]
            groups.append({"params": params, "algorithm": algorithm, **matrix_overrides,
                           "split_sizes": (width,) * 3})
    if decay_names is None:
        decay_names = {name for name, p in other if p.dim() >= 2}
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
