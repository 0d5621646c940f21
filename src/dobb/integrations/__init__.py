"""Drop-in paths from the training stacks people use to ``dobb``'s optimizers.

Each submodule imports its stack lazily and only when imported itself, so ``import dobb`` never
needs transformers, Lightning or torchtitan:

- ``dobb.integrations.hf``: Hugging Face ``Trainer`` (``DobbTrainer``, ``build_optimizer``);
- ``dobb.integrations.lightning``: ``configure_optimizers`` for Lightning modules;
- ``dobb.integrations.torchtitan``: an optimizer factory for torchtitan's ``OptimizersContainer``
  and its FQN-keyed optimizer state.

See ``docs/integrations.md``.
"""
