"""Run and capture code of the spectral experiments: second-moment capture hooks, a plain
training loop on the harness' GPT, and the momentum/statistics of Table 2 from a run or from a
``dobb-bench train`` checkpoint (loaded with ``weights_only=True``: a checkpoint is data, never code).

The tensors go to ``dobb_bench.spectral.spectral_tables``; the command is ``dobb_bench.spectral.commands``.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch

import dobb

from dobb_bench.errors import CliError
from dobb_bench.specs import recorded_adamw_part
from dobb_bench.spectral.spectral_tables import F64, spectrum_rows, table2_rows


class SecondMomentCapture:
    """Accumulates, while ``enabled``, the activation second moment x^T x / N (input of each
    ``nn.Linear``, n x n) and the output-gradient second moment g^T g / N (m x m) in float64.

    A forward hook sees the input; it registers a tensor hook on the output so the backward pass
    delivers g = dLoss/dOutput. Hooks, not optimizer internals, so any optimizer can drive training.
    """

    def __init__(self, modules: dict):
        self.modules, self.enabled = dict(modules), False
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()]
        self.reset()

    def reset(self):
        self.sums = {name: {"A": 0.0, "G": 0.0, "nA": 0, "nG": 0} for name in self.modules}

    def _hook(self, name):
        def fwd(module, inputs, output):
            if not self.enabled:
                return
            s = self.sums[name]
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(F64)
            s["A"], s["nA"] = s["A"] + x.T @ x, s["nA"] + x.shape[0]
            if output.requires_grad:
                def bwd(g):
                    g = g.detach().reshape(-1, g.shape[-1]).to(F64)
                    s["G"], s["nG"] = s["G"] + g.T @ g, s["nG"] + g.shape[0]
                output.register_hook(bwd)
        return fwd

    def moments(self) -> dict:
        """name -> {"A": n x n, "G": m x m (absent without a backward pass)}."""
        out = {}
        for name, s in self.sums.items():
            if s["nA"]:
                out[name] = {"A": s["A"] / s["nA"], **({"G": s["G"] / s["nG"]} if s["nG"] else {})}
        return out

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


def hidden_linears(model) -> dict:
    """name -> nn.Linear for every hidden matrix: all ``nn.Linear`` layers except an output head
    (a weight shared with an embedding, or a module named ``head``/``lm_head``). Decided here by
    module type and name, not by shape, so a width equal to the context or vocabulary is no issue."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in tied
            and name.rsplit(".", 1)[-1] not in ("head", "lm_head")}


def make_optimizer(name: str, model, lr: float, weight_decay: float):
    """``dobb`` (Dobb on the matrices of ``hidden_linears``, AdamW on the rest) or ``adamw`` built
    here; any other name through ``dobb.build_optimizer``. The explicit split keeps these runs
    independent of the library's shape-based default split."""
    if name == "dobb":
        ids = {id(m.weight) for m in hidden_linears(model).values()}
        groups = dobb.param_groups(model, is_matrix=lambda _n, _m, p: id(p) in ids,
                                   **recorded_adamw_part("dobb", model))
        return dobb.Dobb(groups, model, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    return dobb.build_optimizer(name, model, lr=lr, weight_decay=weight_decay, **recorded_adamw_part(name, model))


def setup_run(preset: str, data, batch_size: int, seed: int):
    """Model (from dobb_bench.training.model) and the deterministic batch sampler (dobb_bench.training.data)."""
    from dobb_bench.training.data import BatchSampler, load_corpus
    from dobb_bench.training.model import GPT, config_from_preset

    corpus = load_corpus(data)
    cfg = config_from_preset(preset, vocab_size=corpus.vocab_size)
    model = GPT(cfg, seed=seed)
    return model, BatchSampler(corpus.train, cfg.seq_len, batch_size, seed)


def _loss(model, sampler, step: int):
    x, y = sampler.micro_batch(step, 0, 1)
    return model(x, y)[1]


def train(model, sampler, optimizer, stop: int, start: int = 0, on_step=None) -> list[float]:
    """Plain loop over steps ``start+1 .. stop``: forward, backward, ``on_step(step)`` (gradients
    present), optimizer step. Returns the training losses."""
    losses = []
    model.train()
    for step in range(start + 1, stop + 1):
        loss = _loss(model, sampler, step)
        loss.backward()
        if on_step is not None:
            on_step(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def probe_moments(model, sampler, capture: SecondMomentCapture, batches: int, first_step: int) -> dict:
    """Second moments averaged over ``batches`` forward+backward passes at the current weights
    (no optimizer step; gradients are discarded). The same probe batches are used at every
    fraction, so changes across fractions come from the weights only. (An optimizer with its own
    capture hooks, such as Dobb, may take its next statistic from a probe batch instead of the next
    training batch: another random batch of the same data, so the run is not biased.)"""
    capture.reset()
    capture.enabled = True
    try:
        for k in range(batches):
            _loss(model, sampler, first_step + k).backward()
    finally:
        capture.enabled = False
        model.zero_grad(set_to_none=True)
    return capture.moments()


def run_spectrum(preset="small-cpu", steps=400, fractions=(0.25, 0.5, 0.75, 1.0), optimizer="dobb",
                 lr=2.5e-3, weight_decay=0.1, batch_size=16, probe_batches=4, seed=0, data=None):
    """Figure 2: train, and at each fraction of ``steps`` measure the effective rank of every hidden
    layer's activation (A) and output-gradient (G) second moments. Returns (rows, losses)."""
    model, sampler = setup_run(preset, data, batch_size, seed)
    capture = SecondMomentCapture(hidden_linears(model))
    opt = make_optimizer(optimizer, model, lr, weight_decay)
    at = {max(1, round(f * steps)): f for f in fractions}
    if len(at) < len(set(fractions)):
        raise ValueError(f"steps={steps} is too few to measure at {len(set(fractions))} distinct fractions")
    rows, losses, done = [], [], 0
    for stop in sorted(at):
        losses += train(model, sampler, opt, stop, start=done)
        done = stop
        rows += spectrum_rows(probe_moments(model, sampler, capture, probe_batches, 10**6), at[stop])
    capture.remove()
    return rows, losses


# ----- Table 2 sources
class MomentumAndStats:
    """``on_step`` callback: the Muon/Dobb momentum M <- mu M + grad of every hidden matrix and an
    EMA of its activation second moment captured at every step (the paper's Table 2 setting).
    Kept here, not read from optimizer state, so any optimizer (or none) can produce it."""

    def __init__(self, model, mu: float = 0.95, decay: float = 0.9):
        self.linears = hidden_linears(model)
        self.capture = SecondMomentCapture(self.linears)
        self.capture.enabled = True
        self.mu, self.decay, self.M, self.A = mu, decay, {}, {}

    def __call__(self, step: int):
        for name, st in self.capture.moments().items():
            self.A[name] = st["A"] if name not in self.A else self.decay * self.A[name] + (1 - self.decay) * st["A"]
        self.capture.reset()
        for name, lin in self.linears.items():
            g = lin.weight.grad.detach().to(F64)
            self.M[name] = g if name not in self.M else self.mu * self.M[name] + g

    def pairs(self, split_qkv: bool = True) -> list:
        """(momentum, A) per matrix; a fused qkv weight counts as its three d x n row blocks, as
        the paper's 72 matrices of GPT-2 Small (12 layers x q, k, v, proj, fc, proj) do."""
        out = []
        for name, Mom in self.M.items():
            parts = Mom.chunk(3, 0) if split_qkv and name.endswith("qkv") and Mom.shape[0] % 3 == 0 else [Mom]
            out += [(p, self.A[name]) for p in parts]
        return out

    def close(self):
        self.capture.remove()


def table2_from_training(preset="small-cpu", steps=300, optimizer="dobb", lr=2.5e-3, weight_decay=0.1,
                         batch_size=16, seed=0, data=None, blocks=(1, 4, 16), checkpoint=None,
                         probe_steps=20):
    """Table 2 on a model of this harness. Returns (rows, info).

    Without ``checkpoint``: ``preset`` is trained ``steps`` steps with ``optimizer``; the momentum
    and the activation statistics (captured at every step) of the last step are used.
    With ``checkpoint`` (``dobb-bench train``'s ``checkpoint.pt`` or its run folder): the weights
    are loaded, the activation statistics are captured over ``probe_steps`` batches at those fixed
    weights, and the momentum is the checkpoint's own optimizer state when it has one per hidden
    matrix (``momentum``, ``momentum_buffer`` or AdamW's ``exp_avg``; the metric is scale-free),
    else it is rebuilt from the ``probe_steps`` gradients."""
    saved = None
    if checkpoint is not None:
        model, sampler, saved = load_checkpoint(checkpoint, data, batch_size, seed)
        opt, stop, start = _NoStep(), 10**6 + probe_steps, 10**6
    else:
        model, sampler = setup_run(preset, data, batch_size, seed)
        opt, stop, start = make_optimizer(optimizer, model, lr, weight_decay), steps, 0
    track = MomentumAndStats(model)
    losses = train(model, sampler, opt, stop, start=start, on_step=track)
    track.close()
    if saved is not None:
        track.M = saved
    pairs = track.pairs()
    rows = table2_rows(pairs, blocks, seed)
    shapes = sorted({tuple(M.shape) for M, _ in pairs})
    momentum = ("trained run" if checkpoint is None else "checkpoint optimizer state" if saved is not None
                else f"rebuilt from {probe_steps} gradients at the checkpoint")
    return rows, {"matrices": len(pairs), "shapes": shapes, "final loss": losses[-1], "momentum": momentum}


class _NoStep:
    """Stands in for an optimizer when the weights must stay those of the checkpoint."""

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def load_checkpoint(path, data, batch_size: int, seed: int):
    """(model, sampler, momentum or None) from a ``dobb-bench train`` checkpoint: a ``torch.save``d
    dict with the model ``state_dict`` under ``model`` and the ``ModelConfig`` fields under
    ``fingerprint.model`` (or ``config``)."""
    from dobb_bench.training.data import BatchSampler, load_corpus
    from dobb_bench.training.model import GPT, ModelConfig

    path = Path(path)
    if path.is_dir():
        if (path / "checkpoint_dcp").exists() and not (path / "checkpoint.pt").exists():
            raise CliError(f"{path} holds a sharded (FSDP/DCP) checkpoint; only checkpoint.pt files are supported")
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise CliError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused a class: unpickling it could run code
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CliError(f"refusing to load checkpoint {path}: it holds objects other than tensors and plain "
                       f"types, and unpickling it could run code from the file ({reason})") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(f"cannot read checkpoint {path}: {reason}") from None
    ckpt = ckpt if isinstance(ckpt, dict) else {}
    cfg = ckpt.get("config") or (ckpt.get("fingerprint") or {}).get("model")
    if not isinstance(cfg, dict) or "model" not in ckpt:
        raise CliError(f"checkpoint {path} must hold 'model' (state_dict) and 'fingerprint.model' or 'config' "
                       "(ModelConfig fields)")
    model = GPT(ModelConfig(**{k: v for k, v in cfg.items() if k in ModelConfig.__dataclass_fields__}))
    model.load_state_dict(ckpt["model"])
    corpus = load_corpus(data)
    if corpus.vocab_size > model.config.vocab_size:
        raise CliError(f"corpus vocabulary {corpus.vocab_size} exceeds the checkpoint's {model.config.vocab_size}")
    sampler = BatchSampler(corpus.train, model.config.seq_len, batch_size, seed)
    return model, sampler, checkpoint_momentum(ckpt, model)


def checkpoint_momentum(ckpt: dict, model) -> dict | None:
    """Momentum per hidden matrix from the checkpoint's optimizer state, or None. Parameters are
    matched by the order in which ``dobb.build_optimizer`` lists them (``param_groups`` order, or
    ``model.parameters()`` for AdamW); any missing buffer or shape mismatch gives None."""
    opt = ckpt.get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt:
        return None
    if (ckpt.get("fingerprint") or {}).get("optimizer") == "adamw":
        order = [name for name, _ in model.named_parameters()]
    else:
        order = [name for g in dobb.param_groups(model, **recorded_adamw_part("dobb", model)) for name, _ in g["params"]]
    ids = [i for g in opt["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        return None
    state = {name: opt["state"].get(i, {}) for name, i in zip(order, ids)}
    out = {}
    for name, lin in hidden_linears(model).items():
        st = state.get(name + ".weight", {})
        buf = next((st[k] for k in ("momentum", "momentum_buffer", "exp_avg") if k in st), None)
        if buf is None or tuple(buf.shape) != tuple(lin.weight.shape):
            return None
        out[name] = buf.detach().to(F64)
    return out
