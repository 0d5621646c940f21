"""Muon under the shared update-scale protocol, with AdamW groups in the same optimizer.

Step for a matrix ``W`` (``m x n``), exactly ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``
when ``tau = 0.2`` and Newton-Schulz runs in bf16 as torch's does (``ns_dtype="bfloat16"``, or
``"auto"`` on a device with native bf16; tests compare weights bitwise after several steps):

1. ``buf <- buf + (1 - mu) (G - buf)`` (torch's EMA momentum; the paper's ``mu M + G`` (docs/algorithm.md) differs by
   the constant factor ``1 - mu``, which orthogonalization removes);
2. ``U = G + mu (buf - G)`` with Nesterov (default, as torch), else ``U = buf``;
3. ``O = NS5(U)`` (``||O||_F^2 ~ min(m, n)``, Table 9);
4. ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``.

``_MuonFamily`` holds steps 1, 2 and 4 for every baseline built on Muon's momentum (PR-Muon,
Block Muon); subclasses only say how ``U`` becomes a direction (``_directions``).

``split_sizes`` / ``num_heads`` (Muon, Block Muon, NorMuon; see ``_split``) cut a fused weight
(Q/K/V, per head) into parts that are orthogonalized and scaled as separate matrices (CMuon).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._base import MatrixOptimizer, _name_of
from .._hparams import Rule, ScaledOptions, boolean, integer, numbers_tuple, one_of, option, positive, unit_interval
from ..layout import to_local
from ..functional import cpu_native
from . import _common as C
from ._split import SplitOptions, row_parts, row_tiles, tiled_directions
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_METHODS, NS_STEPS, orthogonalize

NS_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "float64": torch.float64}


def _ns_dtype_ok(dt) -> bool:
    return (isinstance(dt, str) and (dt == "auto" or dt in NS_DTYPES)) or dt in NS_DTYPES.values()


@dataclass(frozen=True, kw_only=True)
class NSOptions:
    """The Newton-Schulz options (Muon's family, Dion2, Dion3)."""
    ns_coefficients: tuple[float, float, float] = option(NS_COEFFICIENTS, numbers_tuple(3, "three numbers (a, b, c)"))
    ns_steps: int = option(NS_STEPS, integer(1, 99))
    eps: float = option(NS_EPS, positive)
    ns_method: str = option("standard", one_of(*NS_METHODS))
    ns_dtype: str | torch.dtype = option("auto", Rule(
        _ns_dtype_ok, f"be 'auto' or one of {tuple(NS_DTYPES)} (or the torch dtype)"))


@dataclass(frozen=True, kw_only=True)
class MuonOptions(ScaledOptions, NSOptions):
    """Muon's momentum and Newton-Schulz options, shared by the Muon family."""
    momentum: float = option(0.95, unit_interval)
    nesterov: bool = option(True, boolean)


# Block Muon's and MuonBP's block axis
AXIS = Rule(lambda v: v in (0, 1) and not isinstance(v, bool), "be 0 (row blocks) or 1 (column blocks)")


@dataclass(frozen=True, kw_only=True)
class MuonSplitOptions(MuonOptions, SplitOptions):
    """Muon's options with the fused-weight split (Muon, CMuon, NorMuon, Block Muon)."""


def resolve_ns_dtype(ns_dtype: "str | torch.dtype", device: "torch.device | str" = "cpu") -> torch.dtype:
    """The dtype Newton-Schulz runs in for ``ns_dtype`` on ``device``.

    ``"auto"`` (the default): bf16 where the device multiplies bf16 natively (accelerators; CPUs with
    AVX512-BF16/AMX, as oneDNN reports it), fp32 on other CPUs, where torch emulates bf16 products in
    a scalar loop many times slower than fp32 (docs/timing.md). A name or a dtype is taken as given
    on every device, so a test or a user can force either path anywhere.
    """
    if isinstance(ns_dtype, str) and ns_dtype != "auto":
        return NS_DTYPES[ns_dtype]
    if isinstance(ns_dtype, torch.dtype):
        return ns_dtype
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_native(torch.bfloat16) else torch.float32


def ns_options(group: dict[str, Any]) -> dict[str, Any]:
    """``orthogonalize`` keyword arguments of a group (``ns_dtype`` a name, ``"auto"`` or a dtype)."""
    device = group["params"][0].device if group.get("params") else "cpu"
    return dict(method=group["ns_method"], dtype=resolve_ns_dtype(group["ns_dtype"], device))


class _MuonFamily(MatrixOptimizer):
    """Muon's momentum and protocol; subclasses implement ``_directions``."""

    Options = MuonOptions
    _uses_step = False  # whether the state carries a step counter (schedules)

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        if "split_sizes" in self.matrix_defaults:
            for i, p in enumerate(group["params"]):
                try:
                    row_parts(p.shape, group["split_sizes"], group["num_heads"])
                except ValueError as exc:
                    raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None

    @staticmethod
    def _row_parts(group: dict[str, Any], p: Tensor) -> list[int] | None:
        """Row sizes of ``p``'s parts under the group's split (``None``: whole)."""
        return row_parts(p.shape, group.get("split_sizes"), group.get("num_heads"))

    def _ns(self, group: dict[str, Any]):
        """The group's NS5 as a function of a list of matrices."""
        return lambda mats: orthogonalize(mats, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                          **ns_options(group))

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if self._uses_step:
                    state["step"] = 0

    def _matrix_step(self, group: dict[str, Any], active: list[Tensor]) -> None:
        states = [self.state[p] for p in active]
        grads = [to_local(p.grad) for p in active]
        bufs = [to_local(s["momentum"]) for s in states]
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        u = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        params = [to_local(p) for p in active]
        targets, updates, scales = self._directions(group, active, states, params, u)
        C.apply_protocol(params, targets, updates, scales, group["lr"], group["weight_decay"])
        if self._uses_step:
            for s in states:
                s["step"] += 1

    def _orthogonalize(self, group: dict, active: list[Tensor], u: list[Tensor]) -> list[Tensor]:
        """NS5 of each full matrix (sharded ones are gathered), returned as local shards."""
        full = [C.gather_full(t, p) for t, p in zip(u, active)]
        outs = orthogonalize(full, group["ns_coefficients"], group["ns_steps"], group["eps"],
                             **ns_options(group))
        return [C.local_slice(o, p) for o, p in zip(outs, active)]

    def _directions(self, group: dict, active: list[Tensor], states: list[dict], params: list[Tensor],
                    u: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[float]]:
        """Returns ``(targets, updates, scales)`` for ``apply_protocol``."""
        raise NotImplementedError


class Muon(_MuonFamily):
    """Muon (momentum orthogonalized by Newton–Schulz) for hidden matrices, AdamW for the rest.

    Args: ``lr``, ``weight_decay``, ``tau`` (update scale ``tau*sqrt(max(m, n))``, 0.2 = torch's
    ``match_rms_adamw``), ``momentum`` (0.95), ``nesterov`` (True), ``ns_coefficients``,
    ``ns_steps`` (5), ``eps`` (1e-7), ``ns_method`` (``"standard"`` NS5 or ``"gram"``: the same
    iteration on the short side's Gram matrix, fewer FLOPs on non-square matrices; see
    ``gram_ns``), ``ns_dtype`` (``"auto"``: bf16 where the device has native bf16 products, as torch's
    Muon always does, fp32 on CPUs without them; ``"float64"`` for exact comparisons),
    ``adamw_betas``, ``adamw_eps``; ``split_sizes`` and ``num_heads`` (``None``: CMuon's split of
    fused weights, see ``_split``; ``split_sizes="qkv"`` cuts every ``3n x n`` matrix in three).
    """

    algorithm = "muon"
    Options = MuonSplitOptions

    def _directions(self, group, active, states, params, u):
        if group["split_sizes"] is None and group["num_heads"] is None:
            outs = self._orthogonalize(group, active, u)  # (OwnerMuon routes this one)
            return params, outs, [C.update_scale(*p.shape, group["tau"]) for p in active]
        # Whole matrices are one tile each (gathered when sharded); all tiles go to one batched NS5.
        plans = [(row_tiles(self._row_parts(group, p)), False) for p in active]
        return tiled_directions(group, active, params, u, plans, self._ns(group))
