"""Default split of a model's parameters between a matrix optimizer and AdamW.

The rule (Muon/Dion convention):
- matrix optimizer: the ``weight`` of every ``nn.Linear`` that is a hidden layer;
- AdamW: everything else — embeddings (``nn.Embedding``), the output head, norms, biases, scalars,
  and 2-D parameters of other module types (e.g. Hugging Face ``Conv1D``, stored transposed).

An ``nn.Linear`` is the output head when its weight *is* an embedding's weight (tied head), when
its name is one of ``head_names`` (last dotted component), or when it is the model's last
``nn.Linear`` and projects onto the largest embedding's vocabulary (``out_features ==
num_embeddings``). Only the last Linear is tested for that: hidden layers can have the vocabulary's
width (a byte-level model of width 256), and position tables have the context's. Override with
``is_matrix``.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

DEFAULT_HEAD_NAMES = ("head", "lm_head", "output", "classifier", "out_proj_vocab")


def split_parameters(model: nn.Module, *, head_names=DEFAULT_HEAD_NAMES,
                     is_matrix: Callable[[str, nn.Module, nn.Parameter], bool] | None = None):
    """Returns ``(matrix, other)``: lists of ``(name, parameter)``; shared parameters appear once."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_weights = {id(m.weight) for m in embeddings}
    vocab = max((m.num_embeddings for m in embeddings), default=None)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    last_linear = linears[-1] if linears else None

    def default_is_matrix(name: str, module: nn.Module, p: nn.Parameter) -> bool:
        if not isinstance(module, nn.Linear) or p is not module.weight or p.dim() != 2:
            return False
        if id(p) in embedding_weights or name.rsplit(".", 1)[0].rsplit(".", 1)[-1] in head_names:
            return False
        return not (module is last_linear and module.out_features == vocab)

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
                 **matrix_overrides):
    """Param groups for any optimizer of this package: ``[{matrix group}, {"algorithm": "adamw"}]``.

    Parameters are given as ``(name, tensor)`` pairs so errors can name them. Extra keyword
    arguments become per-group overrides of the matrix group (e.g. ``blocks=4``).
    """
    matrix, other = split_parameters(model, head_names=head_names, is_matrix=is_matrix)
    groups = []
    if matrix:
        groups.append({"params": matrix, "algorithm": algorithm, **matrix_overrides})
    if other:
        groups.append({"params": other, "algorithm": "adamw"})
    if not groups:
        raise ValueError("model has no trainable parameters")
    return groups
