"""Newton-Muon (Du & Su 2026): Muon on the gradient right-preconditioned by the inverse of the
layer's input-activation second moment.

Per matrix ``W`` (``m x n``, input ``x`` of width ``n``), with ``blocks`` equal diagonal blocks of
the input axis (1: the full ``n x n`` matrix):

    S_b <- d S_b + (1 - d) mean_i x_i[b] x_i[b]^T          # on refresh steps, fp32; d = stat_decay
    P_b  = (S_b + (damping * tr(S_b) / n_b + 1e-8) I)^{-1}  # Cholesky; P scaled so max diag(P) = 1
    G~   = [G[:, b] P_b]_b                                 # every step, before the momentum
    then Muon on G~: buf <- lerp(buf, G~, 1 - mu), U = lerp(G~, buf, mu) (Nesterov), O = NS5(U),
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O     # the shared update-scale protocol

The activations are read by Dobb's capture hooks (``dobb.capture.CaptureHooks``) in the forward
passes before a refresh step (the first micro-batch with ``capture="first"``), exactly as Dobb
reads its statistic. Refresh steps: the first step and every ``refresh_every`` steps after it
(and every step until a first statistic exists). The authors' code refreshes at steps ``T-1, 2T-1,
...`` and runs plain Muon until then; here the preconditioner acts from the first step, as Dobb's
basis does. Their statistic starts from ``1e-3 I``; ours from zero (the damping is relative to the
trace, so only the ratio matters). A factorization that fails keeps the identity.

Why ``P`` is scaled to a unit largest diagonal entry: orthogonalization ignores a common scale, so
this changes nothing in exact arithmetic, but it keeps the preconditioned gradients that the
momentum mixes across refreshes of one magnitude, and an isotropic statistic gives ``P = I``
exactly, so the step is then Muon's bit for bit (a test checks it).

Not supported (``ValueError``): sharded (DTensor) weights and data-parallel ranks with different
data (the statistic is not averaged across ranks, so replicas would drift); 3-D expert stacks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..._base import _name_of
from ...capture import CaptureHooks
from ...collectives import plain_stat_group
from ...layout import MatrixLayout, is_dtensor, plain_layout
from .. import _common as C
from ..._hparams import integer, one_of, option, positive, unit_interval
from .muon import MuonOptions, _MuonFamily

__all__ = ["NewtonMuon", "damped_inverse", "precondition"]



@dataclass(frozen=True, kw_only=True)
class NewtonMuonOptions(MuonOptions):
    refresh_every: int = option(64, integer(1))
    stat_decay: float = option(0.95, unit_interval)
    damping: float = option(0.2, positive)
    blocks: int = option(1, integer(1))
    capture: str = option("first", one_of("first", "all"))
_RIDGE_FLOOR = 1e-8  # the authors' absolute floor under the relative damping


# ----------------------------------------------------------------------------- pure math
def damped_inverse(stat: Tensor, damping: float, floor: float = _RIDGE_FLOOR) -> Tensor:
    """``(S + (damping * tr(S)/s + floor) I)^{-1}`` for a batch ``(K, s, s)`` of symmetric PSD
    blocks, by Cholesky; a block whose factorization fails gets the identity (no host read)."""
    s = stat.shape[-1]
    eye = torch.eye(s, dtype=stat.dtype, device=stat.device)
    ridge = damping * stat.diagonal(dim1=-2, dim2=-1).sum(-1) / s + floor
    damped = stat + ridge[:, None, None] * eye
    chol, info = torch.linalg.cholesky_ex(damped)
    inv = torch.cholesky_inverse(chol)
    return torch.where((info == 0)[:, None, None], inv, eye)


def unit_max_diagonal(inv: Tensor, blocks: int) -> Tensor:
    """Scale the ``blocks`` consecutive blocks of each matrix in ``inv`` (``(K*blocks, s, s)``) by
    one common factor per matrix, so that the largest diagonal entry of the matrix is 1."""
    k = inv.shape[0] // blocks
    top = inv.diagonal(dim1=-2, dim2=-1).reshape(k, -1).amax(-1)
    return inv / top.repeat_interleave(blocks)[:, None, None]


def precondition(g: Tensor, inv: Tensor) -> Tensor:
    """``[G_k[:, b] P_kb]_b`` for a batch ``g`` ``(k, m, n)`` and ``inv`` ``(k*B, n/B, n/B)`` (the
    ``B`` diagonal blocks of each matrix's preconditioner, in order); one ``bmm``."""
    k, m, n = g.shape
    s = inv.shape[-1]
    b = n // s
    blocks = g.reshape(k, m, b, s).permute(0, 2, 1, 3).reshape(k * b, m, s)
    out = torch.bmm(blocks, inv)
    return out.reshape(k, b, m, s).permute(0, 2, 1, 3).reshape(k, m, n)


def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- the optimizer
def _refuse_dtensors(params: list, names: dict | None) -> None:
    """``ValueError`` naming the first DTensor matrix (FSDP2, tensor parallel) among ``params``
    (tensors, ``(name, tensor)`` pairs or param group dicts); ``"adamw"`` groups may hold DTensors."""
    for i, item in enumerate(params):
        if isinstance(item, dict):
            if item.get("algorithm") == "adamw":
                continue
            _refuse_dtensors(item["params"], names)
            continue
        name, p = item if isinstance(item, tuple) else (None, item)
        if is_dtensor(p):
            name = name or _name_of(p, dict(names or {}), i)
            raise ValueError(
                f"{name} is a DTensor ({type(p).__name__} with placements {tuple(p.placements)}: FSDP2 or tensor "
                f"parallel): NewtonMuon computes on whole matrices and does not shard. Use it on plain weights "
                f"(one process), or pick an optimizer that shards (muon, owner-muon, dion, dobb)")


class NewtonMuon(_MuonFamily):
    """Newton-Muon for hidden matrices, AdamW for the rest (see the module docstring).

    Args: as ``Muon`` (``momentum``, ``nesterov``, ``ns_*``, ``eps``, ``tau``, ...), plus ``model``
    (the module whose layers own the matrices: hooks read their inputs), ``refresh_every`` (64),
    ``stat_decay`` (0.95: weight 0.05 for a new capture), ``damping`` (0.2, relative to the mean
    eigenvalue ``tr(S)/n_b``), ``blocks`` (1: full covariance; ``B`` equal diagonal blocks, must
    divide the input width), ``capture`` (``"first"`` micro-batch or ``"all"``), ``stat_group``
    (as ``Dobb``'s; only a single process or ``None`` is supported).
    """

    algorithm = "newton-muon"
    Options = NewtonMuonOptions
    _own_dtype_keys = ("stat", "precond")  # fp32 when a bf16 model resumes

    def __init__(self, params, model: nn.Module | None = None, *, lr: float, stat_group="default", **kwargs):
        self.model = model
        self._hooks: CaptureHooks | None = None
        self._constructed = False
        if model is None:
            raise ValueError("NewtonMuon reads layer inputs with hooks: pass model=<the nn.Module>")
        params = [params] if isinstance(params, torch.Tensor) else [
            dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
            if isinstance(g, dict) else g for g in params]
        _refuse_dtensors(params, kwargs.get("param_names"))  # before the plain-parameter checks below
        if plain_stat_group(model, stat_group) is not None:
            raise ValueError("NewtonMuon does not average its statistic across data-parallel ranks yet: "
                             "stat_group must resolve to None (a single process), or every rank's "
                             "preconditioner would differ")
        super().__init__(params, lr=lr, **kwargs)
        self._constructed = True
        self._install_hooks()

    # ------------------------------------------------------------------ set-up
    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        super()._check_matrix_group(group)
        for i, p in enumerate(group["params"]):
            name = _name_of(p, self._param_names, i)
            if is_dtensor(p):
                raise ValueError(f"{name} is a DTensor: NewtonMuon does not shard; use it on plain weights")
            n, b = p.shape[-1], group["blocks"]
            if n % b:
                valid = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"{name}: blocks={b} must divide the input axis ({n}); valid blocks: {valid}")

    def _group_plans(self, group: dict[str, Any]) -> list[MatrixLayout]:
        """Each matrix's layout: ``blocks`` equal blocks of its input axis (the hooks' statistic)."""
        return [plain_layout(p, "input", group["blocks"]) for p in group["params"]]

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        super()._init_matrix_state(group)
        b = group["blocks"]
        for p in group["params"]:
            st = self.state[p]
            if "precond" in st:
                continue
            s = p.shape[1] // b
            kw = dict(dtype=_state_dtype(p), device=p.device)
            st.update(step=0, captures=0, stat=torch.zeros(b, s, s, **kw),
                      precond=torch.eye(s, **kw).repeat(b, 1, 1))

    def _install_hooks(self) -> None:
        """One ``CaptureHooks`` over every matrix (keyed by the stored weight, as the hooks see the
        module's parameter; a transposed weight's layout is its logical ``(out, in)`` matrix's)."""
        watched = {}
        # a sparse embedding's weight: its input is token ids, not features, and its gradient is sparse,
        # which the step refuses naming the parameter (as every optimizer here does): not hooked, so the
        # forward pass does not fail first on the ids' width
        sparse = set() if self.model is None else {
            id(m.weight) for m in self.model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        for g in self.param_groups:
            if g["algorithm"] != self.algorithm:
                continue
            for p in g["params"]:
                if id(p) in sparse:
                    continue
                # what the hooks read of a group: the capture policy, the source and the sum dtype
                watched[p] = {"capture": g["capture"], "source": "activation", "stat_dtype": _state_dtype(p)}
        if self._hooks is not None:
            self._hooks.remove()
        layouts = {p: (self._plans[self._views.get(p, p)],) for p in watched}  # a transposed weight: its view's
        self._hooks = CaptureHooks(self.model, watched, layouts) if watched else None
        self._rearm()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._constructed:  # a group added after construction
            self._install_hooks()

    def remove_hooks(self) -> None:
        """Detach the capture hooks from the model (the preconditioners then stay as they are)."""
        if self._hooks is not None:
            self._hooks.remove()

    # ------------------------------------------------------------------ schedule
    def _due(self, st: dict, group: dict) -> bool:
        return st["captures"] == 0 or st["step"] % group["refresh_every"] == 0

    def _rearm(self) -> None:
        if self._hooks is None:
            return
        self._hooks.pending.clear()
        self._hooks.armed = {p for g in self.param_groups if g["algorithm"] == self.algorithm
                             for p in g["params"] if self._due(self.state[p], g)}

    def _after_step(self) -> None:
        self._rearm()

    def _skip_finish(self, flag, weights, tensors, skipped) -> None:
        """``nonfinite="skip"``: the step's counts come back (if it was skipped) only when its flag is
        read, at the next step, after the forward passes in between: the hooks are armed for both
        outcomes, also where the counts before this step say a refresh is due."""
        super()._skip_finish(flag, weights, tensors, skipped)
        if self._hooks is None:
            return
        for g in self.param_groups:
            if g["algorithm"] == self.algorithm:
                for p in g["params"]:
                    old = skipped.host.get(p, {})
                    if "step" in old and "captures" in old and self._due(old, g):
                        self._hooks.armed.add(p)

    def _after_load(self) -> None:
        self._install_hooks()  # the hooks read the rebuilt plans and the loaded groups; it rearms them:
        # a loaded step count moves the refresh schedule

    # ------------------------------------------------------------------ the step
    def _refresh(self, group: dict, active: list[Tensor]) -> None:
        """New statistics and preconditioners of the due matrices that captured rows, batched by
        block size."""
        real = {id(v): p for p, v in self._views.items()}  # transposed groups step on views
        buckets = defaultdict(list)
        for p in active:
            st = self.state[p]
            pending = self._hooks.pending.get(real.get(id(p), p)) if self._hooks is not None else None
            if not self._due(st, group) or pending is None or pending.count == 0:
                continue
            b, s, _ = st["stat"].shape
            mean = (pending.sums / pending.count).reshape(b, s, s).to(st["stat"].dtype)
            # EMA from zero (the first capture sets the scale, which the relative damping ignores)
            st["stat"].lerp_(mean, 1 - group["stat_decay"])
            st["captures"] += 1
            buckets[(s, st["stat"].dtype)].append(st)
        for states in buckets.values():
            stats = torch.cat([st["stat"] for st in states])
            inv = unit_max_diagonal(damped_inverse(stats, group["damping"]), group["blocks"])
            torch._foreach_copy_([st["precond"] for st in states], list(inv.split(group["blocks"])))

    @staticmethod
    def _preconditioned(active: list[Tensor], states: list[dict]) -> list[Tensor]:
        """``G P`` of every matrix, one ``bmm`` per (shape, blocks, dtype), in the gradient's dtype."""
        out: list[Tensor | None] = [None] * len(active)
        buckets = defaultdict(list)
        for i, (p, st) in enumerate(zip(active, states)):
            buckets[(tuple(p.shape), st["precond"].shape, st["precond"].dtype)].append(i)
        for (shape, pshape, dtype), idx in buckets.items():
            g = torch.stack([active[i].grad.to(dtype) for i in idx])
            inv = torch.cat([states[i]["precond"] for i in idx])
            res = precondition(g, inv)
            for i, r in zip(idx, res.unbind(0)):
                out[i] = r.to(active[i].grad.dtype)
        return out  # type: ignore[return-value]

    def _matrix_step(self, group: dict[str, Any], active: list[Tensor]) -> None:
        [p.grad for p in active]  # read before the state: see dobb._base.MatrixOptimizer._matrix_step
        self._refresh(group, active)
        states = [self.state[p] for p in active]
        grads = self._preconditioned(active, states)
        bufs = [s["momentum"] for s in states]
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        u = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        outs = self._orthogonalize(group, active, u)
        scales = [C.update_scale(*p.shape, group["tau"]) for p in active]
        C.apply_protocol(active, active, outs, scales, group["lr"], group["weight_decay"])
        for st in states:
            st["step"] += 1
