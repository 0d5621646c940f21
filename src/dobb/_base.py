"""Shared machinery of every matrix optimizer in this package.

A ``MatrixOptimizer`` holds two kinds of param groups, told apart by ``group["algorithm"]``:
``"adamw"`` groups run ``torch.optim.AdamW``'s own functional kernel (same state keys, same
numbers), every other group runs the subclass' matrix update under the shared update-scale
protocol ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O`` (paper Table 9).

Subclasses set ``algorithm`` (the name of their matrix groups), ``matrix_defaults`` (their
hyperparameters and defaults) and implement ``_matrix_step(group)``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

ADAMW_DEFAULTS = {"adamw_betas": (0.9, 0.95), "adamw_eps": 1e-8}


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _name_of(param: torch.Tensor, names: dict[int, str] | None, index: int) -> str:
    if names and id(param) in names:
        return names[id(param)]
    return f"parameter #{index} (shape {tuple(param.shape)})"


class MatrixOptimizer(torch.optim.Optimizer):
    algorithm: str = "matrix"
    matrix_defaults: dict[str, Any] = {}

    def __init__(self, params, *, lr: float, weight_decay: float = 0.0, tau: float = 0.2,
                 adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, param_names=None, **hparams):
        unknown = set(hparams) - set(self.matrix_defaults)
        if unknown:
            raise ValueError(
                f"{type(self).__name__} got unknown argument(s) {sorted(unknown)}; valid: "
                f"{sorted(['lr', 'weight_decay', 'tau', 'adamw_betas', 'adamw_eps', *self.matrix_defaults])}"
            )
        defaults = dict(self.matrix_defaults)
        defaults.update(hparams)
        defaults.update(lr=lr, weight_decay=weight_decay, tau=tau, adamw_betas=adamw_betas,
                        adamw_eps=adamw_eps, algorithm=self.algorithm)
        self._param_names: dict[int, str] = dict(param_names or {})
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = dict(param_group)
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        # Named parameters ((name, tensor) pairs) are accepted and remembered for error messages.
        if params and isinstance(params[0], tuple):
            for name, p in params:
                self._param_names[id(p)] = name
            params = [p for _, p in params]
        param_group["params"] = params
        unknown = set(param_group) - set(self.defaults) - {"params", "param_names", "initial_lr"}
        if unknown:
            raise ValueError(f"param group has unknown key(s) {sorted(unknown)}; valid: {sorted(self.defaults)}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._validate_group(group)
        if group["algorithm"] == "adamw":
            # Eager, identical on every rank: torch.distributed.checkpoint loads only into state
            # that exists, and every rank must hold the same keys.
            for p in group["params"]:
                self._init_adamw_state(p)

    def _validate_group(self, group: dict[str, Any]) -> None:
        for key in ("lr", "weight_decay"):
            value = group[key]
            if not isinstance(value, torch.Tensor) and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{key} must be a finite number >= 0, got {value}")
        if group["tau"] <= 0:
            raise ValueError(f"tau must be > 0, got {group['tau']}")
        b1, b2 = group["adamw_betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"adamw_betas must lie in [0, 1), got {group['adamw_betas']}")
        if group["adamw_eps"] <= 0:
            raise ValueError(f"adamw_eps must be > 0, got {group['adamw_eps']}")
        algo = group["algorithm"]
        if algo not in ("adamw", self.algorithm):
            raise ValueError(f"algorithm must be 'adamw' or {self.algorithm!r}, got {algo!r}")
        if algo == self.algorithm:
            for i, p in enumerate(group["params"]):
                if p.dim() != 2:
                    raise ValueError(
                        f"{_name_of(p, self._param_names, i)} is {p.dim()}-D; {type(self).__name__} "
                        f"updates 2-D matrices only: put it in an 'adamw' group (dobb.param_groups does this)"
                    )
            self._validate_matrix_group(group)

    def _validate_matrix_group(self, group: dict[str, Any]) -> None:
        """Subclasses check their own hyperparameters here (raise ValueError naming the argument)."""

    def _init_adamw_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:  # torch.optim.AdamW's keys and initial values
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_step()
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
        self._matrix_step_all([g for g in self.param_groups if g["algorithm"] != "adamw"])
        return loss

    def _before_step(self) -> None:
        """Hook run before any update (e.g. checks that must see every gradient first)."""

    def _matrix_step_all(self, groups: list[dict[str, Any]]) -> None:
        for group in groups:
            self._matrix_step(group)

    def _matrix_step(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_adamw_state(p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["adamw_betas"]
        # DTensor parameters go through the single-tensor path, as torch.optim.AdamW does.
        foreach = not any(_is_dtensor(p) for p in params)
        _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, amsgrad=False,
                     beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                     eps=group["adamw_eps"], maximize=False)

    def iter_matrix_params(self) -> Iterable[torch.Tensor]:
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                yield from group["params"]
