"""Hugging Face ``transformers``: Dobb (or any optimizer of this package) inside ``Trainer``.

Two ways, both resumable through the Trainer's own checkpoints (``optimizer.pt`` holds the full
optimizer state: momenta, block statistics and bases, step counters)::

    trainer = DobbTrainer(model=model, args=args, train_dataset=ds,
                          optimizer_name="dobb", optimizer_kwargs={"blocks": 4})

    opt = dobb.build_optimizer("dobb", model, lr=args.learning_rate, weight_decay=args.weight_decay,
                               decay_names=Trainer(model=model, args=args).get_decay_parameter_names(model))
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

``DobbTrainer`` takes ``lr`` and ``weight_decay`` from ``TrainingArguments`` and follows the
Trainer's weight-decay convention for the AdamW part (biases and norm weights get none); the
scheduler is the Trainer's own (``lr_scheduler_type``, warmup), which scales every group's lr.
Dobb reads layer inputs with forward hooks on the model it is given, so build it from the model
the Trainer trains (hooks stay on the inner modules when the Trainer wraps it in DDP).
"""
from __future__ import annotations

from typing import Any

from transformers import Trainer

from .. import registry
from ..factory import build_optimizer

__all__ = ["DobbTrainer"]


class DobbTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is one of this package's (Dobb by default).

    Args (besides the Trainer's own):
        optimizer_name: a name from ``dobb.OPTIMIZER_NAMES`` (built by ``dobb.build_optimizer``, the
            one builder: same names, hyperparameters and validation).
        optimizer_kwargs: hyperparameters for it (``blocks``, ``refresh_every``, ``tau``, ...);
            ``lr`` and ``weight_decay`` come from ``TrainingArguments``.
    """

    def __init__(self, *args, optimizer_name: str = "dobb", optimizer_kwargs: dict[str, Any] | None = None,
                 **kwargs):
        self.dobb_optimizer_name = optimizer_name
        self.dobb_optimizer_kwargs = dict(optimizer_kwargs or {})
        for key in ("lr", "weight_decay"):
            if key in self.dobb_optimizer_kwargs:
                raise ValueError(f"optimizer_kwargs must not set {key!r}: DobbTrainer takes it from TrainingArguments")
        registry.validate(optimizer_name, self.dobb_optimizer_kwargs)  # a typo fails here, not at train()
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            # the Trainer's decay rule for every optimizer, AdamW included (its own default)
            decay = self.get_decay_parameter_names(opt_model)
            self.optimizer = build_optimizer(self.dobb_optimizer_name, opt_model, lr=self.args.learning_rate,
                                             weight_decay=self.args.weight_decay,
                                             **{"decay_names": decay, **self.dobb_optimizer_kwargs})
        return self.optimizer
